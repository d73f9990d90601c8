"""Preference presets (TRL DPOTrainer/KTOTrainer/CPOTrainer, HALOs): the losses of ``objectives/preference.py``.

By default they train online: each prompt's group of the policy's own scored completions gives the preference
pairs (chosen = a higher group advantage, rejected = a lower one; see ``objectives/preference.py``). With
``--preference-file rows.jsonl`` they train offline on TRL's {"prompt", "chosen", "rejected"} rows, without
generation (``rollout/preference.py``). ``seq_mean_token_sum`` turns each sequence's loss into the papers' mean.
"""

from __future__ import annotations

from polyrl.objectives import Method, build_method

_AGG = "seq_mean_token_sum"


def dpo() -> Method:
    """DPO: -log sigmoid(beta (h_chosen - h_rejected)) on preference pairs, beta 0.1 (arXiv:2305.18290)."""
    return build_method("dpo", paper="https://arxiv.org/abs/2305.18290", advantage="grpo", trust_region="dpo",
                        aggregation=_AGG)


def ipo() -> Method:
    """IPO: squared distance of the token-averaged log-ratio margin to 1/(2 beta), beta 0.1 (arXiv:2310.12036)."""
    return build_method("ipo", paper="https://arxiv.org/abs/2310.12036", advantage="grpo", trust_region="ipo",
                        aggregation=_AGG)


def simpo() -> Method:
    """SimPO: length-normalised log-likelihood margin with target gamma and no reference (arXiv:2405.14734)."""
    return build_method("simpo", paper="https://arxiv.org/abs/2405.14734", advantage="grpo", trust_region="simpo",
                        aggregation=_AGG)


def kto() -> Method:
    """KTO: prospect-theory loss on desirable and undesirable completions, KL reference point (arXiv:2402.01306)."""
    return build_method("kto", paper="https://arxiv.org/abs/2402.01306", advantage="grpo", trust_region="kto",
                        aggregation=_AGG)


def humanline_dpo() -> Method:
    """Humanline DPO: DPO on per-token log-ratios clamped to a band, reference synced every step (arXiv:2509.24207)."""
    return build_method("humanline_dpo", paper="https://arxiv.org/abs/2509.24207", advantage="grpo",
                        trust_region="humanline_dpo", aggregation=_AGG, ref_sync_every=1)


def humanline_kto() -> Method:
    """Humanline KTO: KTO on per-token log-ratios clamped to a band, reference synced every step (arXiv:2509.24207)."""
    return build_method("humanline_kto", paper="https://arxiv.org/abs/2509.24207", advantage="grpo",
                        trust_region="humanline_kto", aggregation=_AGG, ref_sync_every=1)


PRESETS = (dpo, ipo, simpo, kto, humanline_dpo, humanline_kto)
