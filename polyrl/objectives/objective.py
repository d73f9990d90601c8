"""A method is data; ``policy_loss`` is the only place where its parts are composed.

``Method`` names one part of each kind with resolved parameters. ``build_method`` validates every
part against its registry when the method is built, so a misspelled or out-of-range setting fails
before any model is loaded. ``policy_loss`` calls ratio -> trust region -> corrections -> the 80/20 token mask ->
KL -> entropy bonus -> aggregation and contains no branch on a part's name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import torch
from torch import Tensor

from polyrl.objectives.method_checks import check_once, check_overrides, check_settings
from polyrl.objectives.regularisers import check_regularisers, high_entropy_mask
from polyrl.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    CORRECTIONS,
    FILTERS,
    KL,
    RATIOS,
    SHAPERS,
    TRUST_REGIONS,
    Part,
    PartError,
    PartLike,
    Registry,
    resolve_part,
)
from polyrl.types import LossInputs, LossOutput

Anchor = Literal["old", "rollout"]
KLPlacement = Literal["loss", "reward"]


@dataclass(frozen=True)
class Method:
    """One RL objective: a part of each kind plus a few composition settings."""

    name: str
    advantage: Part
    ratio: Part
    trust_region: Part
    aggregation: Part
    corrections: tuple[Part, ...] = ()
    kl: Part | None = None  # KL estimator; None = no KL term
    kl_coef: float = 0.0  # beta multiplying the KL estimator
    kl_placement: KLPlacement = "loss"  # "loss": added per token to the loss; "reward": subtracted from token rewards
    kl_target: float = 0.0  # adaptive beta (Ziegler et al.) toward this measured KL; 0 = fixed kl_coef
    kl_horizon: int = 10_000  # the adaptive controller's horizon H (sequences)
    entropy_coef: float = 0.0  # entropy bonus: loss -= coef * entropy per token (the start alpha when adaptive)
    entropy_target: float = 0.0  # adaptive alpha (Skywork-OR1) toward this entropy per token; 0 = fixed entropy_coef
    entropy_delta: float = 0.005  # the adaptive alpha's step per RL step
    entropy_coef_max: float = 0.0  # the adaptive alpha's ceiling (required with entropy_target)
    entropy_top: float = 0.0  # train only on the top fraction of loss tokens by entropy (80/20 rule); 0 = all
    shapers: tuple[Part, ...] = ()  # reward shapers, applied in order after scoring
    filters: tuple[Part, ...] = ()  # group/sample filters (dynamic sampling lives in rollout.collect)
    anchor: Anchor = "old"  # ratio denominator: recomputed pi_old, or the rollout engine's mu (DPPO family)
    ref_sync_every: int = 0  # Humanline: copy the policy into the reference every k steps (0 = never)
    paper: str = ""
    summary: str = ""

    @property
    def needs_values(self) -> bool:
        """True when the advantage estimator needs a critic's values (GAE presets)."""
        return "needs_values" in ADVANTAGES.spec(self.advantage.name).tags

    @property
    def needs_groups(self) -> bool:
        """True when the advantage estimator compares completions of the same prompt (group size >= 2)."""
        return "needs_groups" in ADVANTAGES.spec(self.advantage.name).tags

    @property
    def needs_topk(self) -> bool:
        """True when the trust region reads top-K support log-probs (TROLL, top-K DPPO)."""
        return "needs_topk" in TRUST_REGIONS.spec(self.trust_region.name).tags

    @property
    def entropy_grad(self) -> bool:
        """True when the loss differentiates the entropy (a fixed or adaptive bonus); else it is only a metric."""
        return self.entropy_coef > 0 or self.entropy_target > 0

    @property
    def zero_adv_rows_inert(self) -> bool:
        """True when a sequence whose advantages are all 0 gets no gradient and leaves the others' loss unchanged, so
        that the update may run such rows forward only; ``zero_adv_rows_active`` says why not."""
        return self.zero_adv_rows_active() is None

    def zero_adv_rows_active(self) -> str | None:
        """Why a sequence whose advantages are all 0 still matters to the gradient, in words; None when it does not."""
        tr = self.trust_region.name
        if "zero_adv_inert" not in TRUST_REGIONS.spec(tr).tags:
            return f"its trust region {tr!r} couples rows or gives A = 0 a gradient (no zero_adv_inert tag)"
        if self.kl is not None and self.kl_coef > 0 and self.kl_placement == "loss":
            return f"its KL term ({self.kl.name} x {self.kl_coef:g}) is in the loss"
        if self.entropy_grad:
            return "its entropy bonus gives every row a gradient"
        if self.entropy_top > 0:
            return f"entropy_top = {self.entropy_top:g} picks tokens by an entropy threshold over all the rows"
        return None

    @property
    def needs_ref(self) -> bool:
        """True when a reference model is scored: a KL term, Humanline syncing, or a trust region tagged
        ``needs_ref`` (the preference losses: DPO, KTO and their variants read pi_ref)."""
        return (self.kl is not None and self.kl_coef > 0 or self.ref_sync_every > 0
                or "needs_ref" in TRUST_REGIONS.spec(self.trust_region.name).tags)

    def parts(self) -> dict[str, Any]:
        """Plain description of every part (for `polyrl explain`, docs and JSON)."""
        return {
            "advantage": str(self.advantage),
            "ratio": str(self.ratio),
            "trust_region": str(self.trust_region),
            "aggregation": str(self.aggregation),
            "corrections": [str(c) for c in self.corrections],
            "kl": f"{self.kl} x {self.kl_coef:g} in {self.kl_placement}" if self.kl and self.kl_coef > 0 else "none",
            "kl_target": f"{self.kl_target:g} (horizon {self.kl_horizon})" if self.kl_target else "none",
            "entropy": (f"-{self.entropy_coef:g} x entropy" + (f", adaptive to {self.entropy_target:g} (step "
                        f"{self.entropy_delta:g}, max {self.entropy_coef_max:g})" if self.entropy_target else "")
                        if self.entropy_grad else "none"),
            "entropy_top": self.entropy_top or "all tokens",
            "shapers": [str(s) for s in self.shapers],
            "filters": [str(f) for f in self.filters],
            "anchor": self.anchor,
            "ref_sync_every": self.ref_sync_every,
        }


def build_method(
    name: str,
    *,
    advantage: PartLike,
    trust_region: PartLike,
    aggregation: PartLike,
    ratio: PartLike = "token",
    corrections: Sequence[PartLike] = (),
    kl: PartLike | None = None,
    kl_coef: float = 0.0,
    kl_placement: KLPlacement = "loss",
    kl_target: float = 0.0,
    kl_horizon: int = 10_000,
    entropy_coef: float = 0.0,
    entropy_target: float = 0.0,
    entropy_delta: float = 0.005,
    entropy_coef_max: float = 0.0,
    entropy_top: float = 0.0,
    shapers: Sequence[PartLike] = (),
    filters: Sequence[PartLike] = (),
    anchor: Anchor = "old",
    ref_sync_every: int = 0,
    paper: str = "",
    summary: str = "",
) -> Method:
    """Validate every part and return the Method (raises PartError with a one-line message)."""
    check_settings(name, kl, kl_coef, kl_placement, anchor, ref_sync_every)
    check_regularisers(name, kl is not None and kl_coef > 0, kl_target, kl_horizon, entropy_coef, entropy_target,
                        entropy_delta, entropy_coef_max, entropy_top)
    lists = {"correction": [resolve_part(CORRECTIONS, c) for c in corrections],
             "shaper": [resolve_part(SHAPERS, s) for s in shapers],
             "filter": [resolve_part(FILTERS, f) for f in filters]}
    check_once(name, lists)
    return Method(
        name=name,
        advantage=resolve_part(ADVANTAGES, advantage),
        ratio=resolve_part(RATIOS, ratio),
        trust_region=resolve_part(TRUST_REGIONS, trust_region),
        aggregation=resolve_part(AGGREGATIONS, aggregation),
        corrections=tuple(lists["correction"]),
        kl=None if kl is None else resolve_part(KL, kl),
        kl_coef=float(kl_coef),
        kl_placement=kl_placement,
        kl_target=float(kl_target),
        kl_horizon=kl_horizon, entropy_coef=float(entropy_coef), entropy_target=float(entropy_target),
        entropy_delta=float(entropy_delta), entropy_coef_max=float(entropy_coef_max), entropy_top=float(entropy_top),
        shapers=tuple(lists["shaper"]),
        filters=tuple(lists["filter"]),
        anchor=anchor,
        ref_sync_every=ref_sync_every,
        paper=paper,
        summary=summary,
    )


def override(method: Method, **changes: Any) -> Method:
    """Return ``method`` with parts replaced (e.g. ``trust_region="dppo_tv:delta=0.1"``), re-validated.

    Part-valued fields accept the same forms as ``build_method``; a part with the same name as the
    preset's keeps the preset's parameters unless overridden. Lists (corrections, shapers, filters)
    replace the preset's list.
    """
    single = {"advantage": ADVANTAGES, "ratio": RATIOS, "trust_region": TRUST_REGIONS, "aggregation": AGGREGATIONS}
    many = {"corrections": CORRECTIONS, "shapers": SHAPERS, "filters": FILTERS}
    out: dict[str, Any] = {}
    for key, value in changes.items():
        if key in single:
            out[key] = resolve_part(single[key], value, getattr(method, key))
        elif key in many:
            out[key] = tuple(resolve_part(many[key], v) for v in value)
        elif key == "kl":
            out[key] = None if value in (None, "none") else resolve_part(KL, value, method.kl)
        elif key in SETTINGS:
            out[key] = value
        else:
            raise PartError(f"cannot override {key!r}; allowed: {', '.join([*single, *many, 'kl', *SETTINGS])}")
    new = replace(method, **out)
    # Re-run the method-level checks on the combined result, then refuse an override it would not act on.
    composed = build_method(**{f.name: getattr(new, f.name) for f in fields(new)})
    check_overrides(composed, changes)
    return composed


SETTINGS = ("kl_coef", "kl_placement", "kl_target", "kl_horizon", "entropy_coef", "entropy_target", "entropy_delta",
            "entropy_coef_max", "entropy_top", "anchor", "ref_sync_every", "name")  # plain values ``override`` sets


def _call(registry: Registry, part: Part, *args: Any) -> Any:
    return registry.fn(part.name)(*args, **part.params)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Detached mean of ``x`` over ``mask`` (for metrics)."""
    x = torch.where(mask > 0, x.detach(), torch.zeros_like(x, dtype=x.dtype))
    return x.sum() / mask.sum().clamp_min(1.0)


def _entropy(inp: LossInputs, setting: str) -> Tensor:
    if inp.entropy is None:
        raise ValueError(f"{setting} needs LossInputs.entropy [B, T] (entropy per token, with gradient for a bonus)")
    return inp.entropy


def policy_loss(inp: LossInputs, method: Method) -> LossOutput:
    """Compose the method's parts into this micro-batch's loss (to be minimised) and metrics."""
    inp = inp.padding_zeroed()  # a nan or inf placed where mask == 0 reaches no part
    anchor_logp = inp.rollout_logp if method.anchor == "rollout" else inp.old_logp
    log_ratio = _call(RATIOS, method.ratio, inp.logp, anchor_logp, inp.mask, inp.segment_ids, inp.turn_ids)
    per_token, tr_metrics = _call(TRUST_REGIONS, method.trust_region, inp, log_ratio)
    surrogate = per_token
    metrics: dict[str, Tensor] = {f"objective/{k}": v.detach() for k, v in tr_metrics.items()}

    for corr in method.corrections:
        weight = _call(CORRECTIONS, corr, inp.old_logp, inp.rollout_logp, inp.mask, inp.adv).detach()
        per_token = per_token * weight
        metrics[f"correction/{corr.name}_weight"] = masked_mean(weight, inp.mask)
    if method.entropy_top > 0:  # the policy gradient only through the high-entropy minority (80/20 rule)
        keep = high_entropy_mask(_entropy(inp, "entropy_top"), inp.mask, method.entropy_top)
        per_token = per_token * keep
        metrics["objective/entropy_top_kept"] = masked_mean(keep, inp.mask)

    if method.kl is not None and method.kl_coef > 0 and method.kl_placement == "loss":
        if inp.ref_logp is None:
            raise ValueError(f"method {method.name!r} puts a KL term in the loss but LossInputs.ref_logp is None")
        kl = _call(KL, method.kl, inp.logp, inp.ref_logp, inp.old_logp)
        per_token = per_token + method.kl_coef * kl
        metrics["objective/kl"] = masked_mean(kl, inp.mask)
    if method.entropy_coef > 0:  # entropy bonus (verl entropy_coeff), aggregated like the policy loss
        per_token = per_token - method.entropy_coef * _entropy(inp, "entropy_coef")
        metrics["objective/entropy_bonus"] = method.entropy_coef * masked_mean(inp.entropy, inp.mask)
    if inp.sample_weight is not None:  # an importance-weighted batch (tree sampler, sampled roots)
        per_token = per_token * inp.sample_weight.to(per_token.dtype)[:, None]

    loss = _call(AGGREGATIONS, method.aggregation, per_token, inp.mask, inp.normalizer, inp.group_tokens)
    with torch.no_grad():
        lr = (inp.logp - inp.old_logp).clamp(-20, 20)
        metrics["objective/ratio_mean"] = masked_mean(lr.exp(), inp.mask)
        metrics["objective/approx_kl"] = masked_mean(lr.exp() - 1 - lr, inp.mask)  # k3 of pi_old vs pi_theta
        if inp.entropy is not None:
            metrics["objective/entropy"] = masked_mean(inp.entropy, inp.mask)
    return LossOutput(loss=loss, per_token_loss=per_token, metrics=metrics, surrogate=surrogate)


def zero_grad_by_quarter(surrogate: Tensor, logp: Tensor, mask: Tensor,
                         adv: Tensor) -> Tensor:
    """[2, 4]: (zero-gradient tokens, loss tokens with A != 0) per quarter of relative position in the response.

    A token whose surrogate gradient is exactly zero was clipped or masked by the trust region: the
    DPPO/CPPO diagnostic of *where* in a response the trust region binds. Only the small loss graph
    is differentiated (down to the log-probs), never the model.
    """
    (g,) = torch.autograd.grad(surrogate.sum(), logp, retain_graph=True, allow_unused=True)
    out = torch.zeros(2, 4)
    if g is None:
        return out
    lengths = mask.sum(-1, keepdim=True).clamp_min(1.0)
    pos = (torch.cumsum(mask, -1) - 1.0).clamp_min(0.0)
    quarter = torch.clamp((4.0 * pos / lengths).long(), max=3)
    real = (mask > 0) & (adv != 0)  # a zero advantage gives a zero gradient whatever the trust region does
    out[0].index_add_(0, quarter[real], ((g == 0) & real)[real].float())
    out[1].index_add_(0, quarter[real], torch.ones(int(real.sum())))
    return out


__all__ = ["Method", "build_method", "override", "policy_loss", "masked_mean", "zero_grad_by_quarter"]
