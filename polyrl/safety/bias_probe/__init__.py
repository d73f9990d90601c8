"""`polyrl safety bias-probe`: one-shot bias (spec §4, arXiv:2606.10931, "It Takes One to Bias Them All").

- ``theory``: the closed-form onset time of the Bernoulli policy-gradient flow (with and without GRPO's std
  normalisation), its ODE check, the finite-group expected drift, and the K-option softmax bandit simulation
  built from polyrl's advantage and loss parts;
- ``lm``: a tiny causal LM pretrained on synthetic multiple-choice QA with an "unknown" option, GRPO on one
  flipped example (``one_shot_probe``), transfer to held-out prompts sharing the feature, and a repair phase;
- ``command``: the CLI subcommand, the experiment, plots and the report.
"""

from __future__ import annotations

from polyrl.safety.bias_probe.command import add_parser, run_experiment
from polyrl.safety.bias_probe.theory import (
    bernoulli_pg_onset_ode,
    bernoulli_pg_onset_time,
    finite_group_onset_ode,
    grpo_expected_drift,
    simulate_bandit_onsets,
    softmax_effective_b,
)

__all__ = [
    "add_parser",
    "run_experiment",
    "bernoulli_pg_onset_time",
    "bernoulli_pg_onset_ode",
    "finite_group_onset_ode",
    "grpo_expected_drift",
    "simulate_bandit_onsets",
    "softmax_effective_b",
]
