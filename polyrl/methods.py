"""Named methods as presets: one short function each, with its paper and the spec's defaults.

A preset only *names parts*; the maths lives in ``polyrl.objectives``. Defaults follow
shared/spec/objectives-llm.md and methods-seedblog.md; where they are [unverified] there, the part's
docstring says what we assumed. Compose your own from the CLI (``--trust-region dppo_tv:delta_low=0.1``)
or with ``polyrl.objectives.override``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from polyrl import objectives, shaping  # noqa: F401  (imported to register every part)
from polyrl.objectives import Method, build_method, override
from polyrl.registry import Part, add_preset, unknown

PRESETS: dict[str, Callable[[], Method]] = {}


def preset(fn: Callable[[], Method]) -> Callable[[], Method]:
    """Register a preset under its function name; its docstring becomes the method's summary (``add_preset``: a
    name already taken is refused). ``check_presets`` builds a plugin's presets once every plugin has loaded (one
    may use another's parts)."""
    add_preset(PRESETS, fn)
    return fn


def check_presets() -> None:
    """Build every preset a plugin registered: a broken one is refused in one line naming it and its file (built
    lazily, it broke `polyrl methods`, `parts` and `docs` with a message naming neither), as is one that builds a
    method named otherwise (listed by `methods` under that name, unknown to `explain`)."""
    for build in PRESETS.values():
        if build.origin != __name__:
            build()  # a PartError names the preset and its file (registry.add_preset)


def get_method(name: str, **overrides: Any) -> Method:
    """Return preset ``name`` with optional part overrides, validated (raises PartError)."""
    if name not in PRESETS:
        raise unknown("method", name, PRESETS)
    method = PRESETS[name]()
    if not overrides:
        return method
    composed = override(method, **overrides)
    return replace(composed, name=composed_name(method, composed))


def composed_name(preset_method: Method, method: Method) -> str:
    """Label a preset with overrides by what changed: ``grpo+dppo_tv``, ``dapo+no_filters``, ``grpo+clip:eps_high=0.3``.

    A part replaced by another is named; one whose settings changed is written with them. The label names the run
    directory, the banner and ``summary.json``, so a composed method is never reported as its preset.
    """
    changed = []
    for kind in ("advantage", "ratio", "trust_region", "aggregation", "kl"):
        old, new = getattr(preset_method, kind), getattr(method, kind)
        if old == new:
            continue
        if new is None or old is None or old.name != new.name:
            changed.append(f"no_{kind}" if new is None else new.name)
        else:  # same part, other settings: name the ones that changed
            diff = {k: v for k, v in new.params.items() if old.params.get(k) != v}
            changed.append(str(Part(new.kind, new.name, diff)))
    for kind in ("corrections", "shapers", "filters"):
        old, new = getattr(preset_method, kind), getattr(method, kind)
        if old != new:
            changed.append("-".join(p.name for p in new) if new else f"no_{kind}")
    for key in ("kl_coef", "kl_placement", "anchor", "kl_target", "kl_horizon", "entropy_coef", "entropy_target",
                "entropy_delta", "entropy_coef_max", "entropy_top"):
        if getattr(preset_method, key) != getattr(method, key) and not (key == "kl_coef" and method.kl is None):
            changed.append(f"{key}={getattr(method, key)}")
    return "+".join([preset_method.name, *changed])


# --- REINFORCE family -------------------------------------------------------------------------


@preset
def reinforce() -> Method:
    """REINFORCE with a batch-mean baseline; score of a sequence = sum of token scores (Williams 1992)."""
    return build_method("reinforce", paper="https://doi.org/10.1007/BF00992696", advantage="reinforce",
              ratio="on_policy", trust_region="none", aggregation="seq_mean_token_sum")


@preset
def a2c() -> Method:
    """A2C as the special case of PPO with one epoch over one full batch (arXiv:2205.09123)."""
    return build_method("a2c", paper="https://arxiv.org/abs/2205.09123",
              advantage=("gae", {"gamma": 1.0, "lam": 1.0, "whiten": False}),
              ratio="on_policy", trust_region="none", aggregation="token_mean")


@preset
def rloo() -> Method:
    """REINFORCE leave-one-out with k1 KL in the reward (arXiv:2402.14740)."""
    return build_method("rloo", paper="https://arxiv.org/abs/2402.14740", advantage="rloo", ratio="on_policy",
              trust_region="none", aggregation="seq_mean_token_sum", kl="k1", kl_coef=0.03, kl_placement="reward")


@preset
def reinforce_pp() -> Method:
    """REINFORCE++: token returns with k1 KL in the reward, global whitening, PPO clip (arXiv:2501.03262).
    Token-mean aggregation, the frameworks' default [unverified]."""
    return build_method("reinforce_pp", paper="https://arxiv.org/abs/2501.03262", advantage="reinforce_pp",
              trust_region="clip", aggregation="token_mean", kl="k1", kl_coef=0.01, kl_placement="reward")


@preset
def reinforce_pp_baseline() -> Method:
    """REINFORCE++-baseline: group-centred then globally whitened, k2 KL in the loss (arXiv:2501.03262).
    Token-mean aggregation, the frameworks' default [unverified]."""
    return build_method("reinforce_pp_baseline", paper="https://arxiv.org/abs/2501.03262",
              advantage="reinforce_pp_baseline", trust_region="clip", aggregation="token_mean",
              kl="k2", kl_coef=1e-5)


@preset
def maxrl() -> Method:
    """MaxRL: advantages divided by the group mean (maximum-likelihood RL) (arXiv:2602.02710).
    Seq-mean-token-sum, which the estimator's unbiasedness needs; the authors' aggregation [unverified]."""
    return build_method("maxrl", paper="https://arxiv.org/abs/2602.02710", advantage="maxrl", trust_region="clip",
              aggregation="seq_mean_token_sum")


# --- PPO / GRPO family ------------------------------------------------------------------------


@preset
def ppo() -> Method:
    """PPO for RLHF: GAE with a critic, clipped surrogate, k1 KL in the reward (arXiv:1707.06347)."""
    return build_method("ppo", paper="https://arxiv.org/abs/1707.06347",
              advantage=("gae", {"gamma": 1.0, "lam": 0.95}), trust_region="clip", aggregation="token_mean",
              kl="k1", kl_coef=0.05, kl_placement="reward")


@preset
def grpo() -> Method:
    """GRPO: group z-score advantages, PPO clip, k3 KL in the loss (arXiv:2402.03300)."""
    return build_method("grpo", paper="https://arxiv.org/abs/2402.03300", advantage="grpo", trust_region="clip",
              aggregation="seq_mean_token_mean", kl="k3", kl_coef=0.04)


@preset
def dr_grpo() -> Method:
    """Dr. GRPO: no std division, no 1/|y|, constant-horizon normalisation (arXiv:2503.20783). Clip eps 0.2
    [unverified]."""
    return build_method("dr_grpo", paper="https://arxiv.org/abs/2503.20783", advantage="group_centered",
              trust_region="clip", aggregation="seq_mean_token_sum_norm")


@preset
def dapo() -> Method:
    """DAPO: clip-higher, token-mean, soft overlong punishment, dynamic sampling (arXiv:2503.14476)."""
    return build_method("dapo", paper="https://arxiv.org/abs/2503.14476", advantage="grpo",
              trust_region=("clip", {"eps_low": 0.2, "eps_high": 0.28}), aggregation="token_mean",
              shapers=["overlong_soft"], filters=["zero_variance"])


@preset
def cispo() -> Method:
    """CISPO: clipped, detached IS weight on a REINFORCE term; every token keeps a gradient (arXiv:2506.13585)."""
    return build_method("cispo", paper="https://arxiv.org/abs/2506.13585", advantage="grpo", trust_region="cispo",
              aggregation="token_mean")


@preset
def gspo() -> Method:
    """GSPO: sequence-level geometric-mean ratio with a tight clip (arXiv:2507.18071)."""
    return build_method("gspo", paper="https://arxiv.org/abs/2507.18071", advantage="grpo", ratio="sequence",
              trust_region=("clip", {"eps_low": 3e-4, "eps_high": 4e-4}), aggregation="seq_mean_token_mean")


@preset
def gspo_token() -> Method:
    """GSPO-token: sequence ratio value with per-token gradients (arXiv:2507.18071)."""
    return build_method("gspo_token", paper="https://arxiv.org/abs/2507.18071", advantage="grpo",
              ratio="sequence_token", trust_region=("clip", {"eps_low": 3e-4, "eps_high": 4e-4}),
              aggregation="seq_mean_token_mean")


@preset
def ce_gppo() -> Method:
    """CE-GPPO: gradient-preserving clipping with beta coefficients plus dynamic sampling (arXiv:2509.20712)."""
    return build_method("ce_gppo", paper="https://arxiv.org/abs/2509.20712", advantage="grpo",
              trust_region="ce_gppo", aggregation="token_mean", filters=["zero_variance"])


@preset
def pspo() -> Method:
    """PSPO: probability smoothing toward pi_old instead of clipping (arXiv:2509.21282). GRPO's
    seq-mean-token-mean aggregation, assumed [unverified]."""
    return build_method("pspo", paper="https://arxiv.org/abs/2509.21282", advantage="grpo", trust_region="pspo",
              aggregation="seq_mean_token_mean")


@preset
def sapo() -> Method:
    """SAPO: temperature-controlled sigmoid soft gate instead of a hard clip (arXiv:2511.20347)."""
    return build_method("sapo", paper="https://arxiv.org/abs/2511.20347", advantage="grpo", trust_region="sapo",
              aggregation="seq_mean_token_mean")


@preset
def bapo() -> Method:
    """BAPO: clip bounds searched per batch to balance positive and negative contributions (arXiv:2510.18927)."""
    return build_method("bapo", paper="https://arxiv.org/abs/2510.18927", advantage="grpo", trust_region="bapo",
              aggregation="token_mean")


@preset
def sspo() -> Method:
    """SSPO: sub-sentence ratios with entropy-adaptive clip bounds (arXiv:2511.04256) [assumed form]."""
    return build_method("sspo", paper="https://arxiv.org/abs/2511.04256", advantage="grpo", ratio="segment",
              trust_region="sspo_clip", aggregation="seq_mean_token_mean")


@preset
def troll() -> Method:
    """TROLL: KL trust-region projection on the top-K support instead of clipping (arXiv:2510.03817)."""
    return build_method("troll", paper="https://arxiv.org/abs/2510.03817", advantage="grpo", trust_region="troll",
              aggregation="seq_mean_token_mean")


@preset
def humanline_grpo() -> Method:
    """Humanline GRPO: log-ratio band against a reference synced every step, plus clip (arXiv:2509.24207)."""
    return build_method("humanline_grpo", paper="https://arxiv.org/abs/2509.24207", advantage="grpo",
              trust_region="humanline", aggregation="token_mean", kl="k3", kl_coef=0.01, ref_sync_every=1)


@preset
def gdpo() -> Method:
    """GDPO: per-reward-channel group normalisation, then batch standardisation (arXiv:2601.05242)."""
    return build_method("gdpo", paper="https://arxiv.org/abs/2601.05242", advantage="gdpo", trust_region="clip",
              aggregation="seq_mean_token_mean")


@preset
def scalerl() -> Method:
    """ScaleRL: CISPO-style truncated IS (cap 5) vs the generator, prompt-mean, ZVF and no-positive-resampling
    (arXiv:2510.13786)."""
    return build_method("scalerl", paper="https://arxiv.org/abs/2510.13786", advantage="group_centered_batch_std",
              trust_region=("cispo", {"eps_high": 4.0}), aggregation="prompt_mean", anchor="rollout",
              filters=["zero_variance", "no_positive_resampling"])


# --- Divergence trust regions (anchored to the rollout policy mu) -----------------------------


@preset
def dppo_tv() -> Method:
    """DPPO Binary-TV: mask tokens whose sampled-token probability moved more than delta (arXiv:2602.04879).
    GRPO group advantages [unverified: the script's estimator flag is not shown]."""
    return build_method("dppo_tv", paper="https://arxiv.org/abs/2602.04879", advantage="grpo",
              trust_region="dppo_tv", aggregation="token_mean", anchor="rollout")


@preset
def dppo_kl() -> Method:
    """DPPO Binary-KL: mask tokens whose binary KL to the rollout policy exceeds delta (arXiv:2602.04879).
    GRPO group advantages [unverified: the script's estimator flag is not shown]."""
    return build_method("dppo_kl", paper="https://arxiv.org/abs/2602.04879", advantage="grpo",
              trust_region="dppo_kl", aggregation="token_mean", anchor="rollout")


@preset
def cppo() -> Method:
    """CPPO: DPPO-TV mask with position weights and a cumulative prefix budget (arXiv:2606.10968)."""
    return build_method("cppo", paper="https://arxiv.org/abs/2606.10968", advantage="group_centered",
              trust_region="cppo", aggregation="seq_mean_token_sum_norm", anchor="rollout")


@preset
def drpo() -> Method:
    """DRPO: smooth Binary-TV regulariser replacing DPPO's hard mask (arXiv:2606.09821)."""
    return build_method("drpo", paper="https://arxiv.org/abs/2606.09821", advantage="group_centered",
              trust_region="drpo", aggregation="seq_mean_token_sum_norm", anchor="rollout")


# --- Critic-based and multi-turn --------------------------------------------------------------


@preset
def spo() -> Method:
    """SPO: quadratic ratio penalty in place of the clip, GAE advantages (arXiv:2401.16025)."""
    return build_method("spo", paper="https://arxiv.org/abs/2401.16025", advantage="gae", trust_region="spo",
              aggregation="token_mean")


@preset
def turn_ppo() -> Method:
    """Turn-PPO: turn-level geometric-mean ratios in the PPO clip, token GAE (arXiv:2511.20718). Token-mean
    aggregation [unverified]."""
    return build_method("turn_ppo", paper="https://arxiv.org/abs/2511.20718", advantage="gae", ratio="turn",
              trust_region="clip", aggregation="token_mean")


@preset
def s_ppo() -> Method:
    """S-PPO: token-level PPO with clipping-bias correction (arXiv:2511.20718) [assumed form]."""
    return build_method("s_ppo", paper="https://arxiv.org/abs/2511.20718", advantage="gae", trust_region="s_ppo",
              aggregation="token_mean")


@preset
def st_ppo() -> Method:
    """ST-PPO: turn-level ratios plus clipping-bias correction (arXiv:2511.20718) [assumed form]."""
    return build_method("st_ppo", paper="https://arxiv.org/abs/2511.20718", advantage="gae", ratio="turn",
              trust_region="s_ppo", aggregation="token_mean")


# --- the peers' presets (polyrl/presets/: verl, TRL and prime-rl names) ----------------------------------
def _register_peer_presets() -> None:
    import importlib

    from polyrl import presets

    for module in presets.MODULES:
        for fn in importlib.import_module(f"polyrl.presets.{module}").PRESETS:
            preset(fn)


_register_peer_presets()
