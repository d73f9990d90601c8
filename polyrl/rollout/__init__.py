"""Rollout: sampling backends behind the ``Generator`` protocol."""

from polyrl.rollout.generator import Generator, Sample, SamplingParams
from polyrl.rollout.hf import HFGenerator

__all__ = ["Generator", "HFGenerator", "Sample", "SamplingParams"]
