"""Presets built around the peers' trust regions (verl loss_mode, TRL loss_type): covariance and sequence weights."""

from __future__ import annotations

from polyrl.objectives import Method, build_method


def clip_cov() -> Method:
    """Clip-Cov: PPO clip plus no loss on a few tokens in a covariance band, verl clip_cov (arXiv:2505.22617)."""
    return build_method("clip_cov", paper="https://arxiv.org/abs/2505.22617", advantage="grpo",
                        trust_region="clip_cov", aggregation="token_mean")


def kl_cov() -> Method:
    """KL-Cov: |log-ratio| penalty on the top-covariance tokens, verl kl_cov (arXiv:2505.22617)."""
    return build_method("kl_cov", paper="https://arxiv.org/abs/2505.22617", advantage="grpo",
                        trust_region="kl_cov", aggregation="token_mean")


def gmpo() -> Method:
    """GMPO: geometric mean of sign-clipped token ratios per sequence, verl geo_mean (arXiv:2507.20673)."""
    return build_method("gmpo", paper="https://arxiv.org/abs/2507.20673", advantage="grpo",
                        trust_region="gmpo", aggregation="seq_mean_token_mean")


def luspo() -> Method:
    """LUSPO: GSPO's sequence ratio and clip with a length-weighted sequence sum, TRL luspo (arXiv:2602.05261)."""
    return build_method("luspo", paper="https://arxiv.org/abs/2602.05261", advantage="grpo", ratio="sequence",
                        trust_region=("clip", {"eps_low": 2e-3, "eps_high": 2.5e-3}),
                        aggregation="seq_mean_token_sum")


def vespo() -> Method:
    """VESPO: Gamma-kernel weight of the sequence ratio to the rollout policy, TRL vespo (arXiv:2602.10693)."""
    return build_method("vespo", paper="https://arxiv.org/abs/2602.10693", advantage="grpo", anchor="rollout",
                        trust_region="vespo", aggregation="token_mean")


def dro() -> Method:
    """DRO: REINFORCE with a quadratic log-ratio penalty, verl dro (arXiv:2405.19107)."""
    return build_method("dro", paper="https://arxiv.org/abs/2405.19107", advantage="grpo", trust_region="dro",
                        aggregation="token_mean")


PRESETS = (clip_cov, kl_cov, gmpo, luspo, vespo, dro)
