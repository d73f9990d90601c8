"""Presets built around the peers' regularisers: an adaptive KL coefficient, entropy bonuses, the 80/20 token mask."""

from __future__ import annotations

from polyrl.objectives import Method, build_method


def ppo_adaptive_kl() -> Method:
    """PPO whose reward KL coefficient adapts toward a target KL, verl AdaptiveKLController (arXiv:1909.08593)."""
    return build_method("ppo_adaptive_kl", paper="https://arxiv.org/abs/1909.08593",
                        advantage=("gae", {"gamma": 1.0, "lam": 0.95}), trust_region="clip", aggregation="token_mean",
                        kl="k1", kl_coef=0.05, kl_placement="reward", kl_target=0.1, kl_horizon=10_000)


def forking_tokens() -> Method:
    """DAPO trained only on the top 20% highest-entropy "forking" tokens (arXiv:2506.01939)."""
    return build_method("forking_tokens", paper="https://arxiv.org/abs/2506.01939", advantage="grpo",
                        trust_region=("clip", {"eps_low": 0.2, "eps_high": 0.28}), aggregation="token_mean",
                        shapers=["overlong_soft"], filters=["zero_variance"], entropy_top=0.2)


def grpo_entropy_bonus() -> Method:
    """GRPO with verl's fixed entropy bonus entropy_coeff = 0.001 and token-mean loss (arXiv:2402.03300)."""
    return build_method("grpo_entropy_bonus", paper="https://arxiv.org/abs/2402.03300", advantage="grpo",
                        trust_region="clip", aggregation="token_mean", entropy_coef=1e-3)


def grpo_adaptive_entropy() -> Method:
    """Token-mean GRPO without KL whose entropy bonus adapts toward a target entropy, Skywork-OR1 (arXiv:2505.22312).

    Skywork-OR1's adaptive entropy control: the coefficient steps by 0.005 toward entropy 0.2 per token, between 0
    and 0.005, and acts only while the entropy is at or below the target; zero-advantage groups are rejected. The
    report's multi-stage context lengths and its offline/online prompt filtering are data settings, not the method.
    """
    return build_method("grpo_adaptive_entropy", paper="https://arxiv.org/abs/2505.22312", advantage="grpo",
                        trust_region="clip", aggregation="token_mean", filters=["zero_variance"],
                        entropy_coef=0.0, entropy_target=0.2, entropy_delta=0.005, entropy_coef_max=0.005)


PRESETS = (ppo_adaptive_kl, forking_tokens, grpo_entropy_bonus, grpo_adaptive_entropy)
