"""Which engine samples the rollouts: `--generator hf|vllm`, `--vllm-*`, TOML table `[vllm]`, `TrainConfig.engine`.
Imports nothing heavy (vLLM itself is imported only when it is chosen)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal


@dataclass
class EngineConfig:
    """The generation backend: transformers' model with polyrl's decode loop, or vLLM on a GPU."""

    PREFIX: ClassVar[str] = "vllm"

    backend: Literal["hf", "vllm"] = field(default="hf", metadata={"flag": "generator"})
    """generation engine: hf (transformers, any device) or vllm (GPU, pip install 'polyrl[vllm]')"""
    gpu_memory_utilization: float = 0.3
    """vllm: share of the GPU's memory the engine may take (weights, KV cache); the trainer keeps the rest"""


@dataclass
class SamplingConfig:
    """How every engine samples completions: flags ``--temperature``, ``--top-p``, ``--top-k``, TOML ``[sampling]``."""

    PREFIX: ClassVar[str] = "sampling"

    temperature: float = field(default=1.0, metadata={"flag": "temperature"})
    """sampling temperature, applied identically when log-probs are recomputed"""
    top_p: float = field(default=1.0, metadata={"flag": "top_p"})
    """nucleus sampling threshold in (0, 1]"""
    top_k: int = field(default=0, metadata={"flag": "top_k"})
    """top-k sampling (0 = off)"""
