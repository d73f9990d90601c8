"""Presets built around an advantage baseline (polyrl/objectives/baselines.py, token_baseline.py): ReMax, OPO, GPG,
Pass@k training, OTB."""

from __future__ import annotations

from polyrl.objectives import Method, build_method


def remax() -> Method:
    """ReMax: REINFORCE with the reward of the prompt's greedy decode as baseline (arXiv:2310.10505)."""
    # The paper's loss: -sum_t log pi(y_t) (r - r_greedy), summed over each completion's tokens and averaged over
    # completions (seq_mean_token_sum), on-policy, no clip and no KL (verl's example adds k1 in the reward, 1e-3).
    return build_method("remax", paper="https://arxiv.org/abs/2310.10505", advantage="remax", ratio="on_policy",
                        trust_region="none", aggregation="seq_mean_token_sum")


def opo() -> Method:
    """OPO: exact on-policy REINFORCE with the length-weighted group mean reward as baseline (arXiv:2505.23585)."""
    # Token-mean aggregation (verl's default; the optimal baseline assumes a completion's gradient grows with its
    # length), no KL, no entropy bonus, one update per batch (ratio identically 1).
    return build_method("opo", paper="https://arxiv.org/abs/2505.23585", advantage="opo", ratio="on_policy",
                        trust_region="none", aggregation="token_mean")


def gpg() -> Method:
    """GPG: group-centred advantages rescaled by B/(B-M), plain -A log pi loss, no KL (arXiv:2504.02546)."""
    # Aggregation as the paper's objective: token mean within each prompt's group, then mean over prompts
    # (prompt_mean; verl's "gpg" loss uses token_mean). The paper's resampling below a valid-sample ratio is not
    # part of it (a zero_variance filter would make alpha 1).
    return build_method("gpg", paper="https://arxiv.org/abs/2504.02546", advantage="gpg", ratio="on_policy",
                        trust_region="none", aggregation="prompt_mean")


def passk() -> Method:
    """Pass@k training: analytical pass@k advantages (k = 4 of 8) with GRPO's clip, no KL (arXiv:2508.10751)."""
    return build_method("passk", paper="https://arxiv.org/abs/2508.10751", advantage=("passk", {"k": 4}),
                        trust_region="clip", aggregation="seq_mean_token_mean")



def otb() -> Method:
    """OTB: per-token group baseline weighted by realized energy (sum of 1 - 2 pi + sum pi^2) (arXiv:2602.07078)."""
    # verl's OTB recipe: adv_estimator=optimal_token_baseline with the default actor loss (PPO clip 0.2,
    # token-mean), no KL loss, no entropy bonus; pi and sum pi^2 come from the sampler here.
    return build_method("otb", paper="https://arxiv.org/abs/2602.07078", advantage="optimal_token_baseline",
                        trust_region="clip", aggregation="token_mean")


def otb_tir() -> Method:
    """TIR-OTB: OTB over policy tokens only, zero baseline on a lone longest tail (arXiv:2602.07078)."""
    # verl's tir_optimal_token_baseline (multi-turn tool use: environment tokens are skipped), same loss as otb.
    return build_method("otb_tir", paper="https://arxiv.org/abs/2602.07078",
                        advantage="tir_optimal_token_baseline", trust_region="clip", aggregation="token_mean")


PRESETS = (remax, opo, gpg, passk, otb, otb_tir)
