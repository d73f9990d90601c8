"""Build-time checks of a method's settings that span its parts: each refuses, in one line naming the setting, a
value that is malformed or that the composed method would not act on (a setting is never silently ignored)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from polyrl.registry import TRUST_REGIONS, Part, PartError, PartLike


def check_settings(name: str, kl: PartLike | None, kl_coef: Any, kl_placement: Any, anchor: Any,
                   ref_sync_every: Any) -> None:
    """The plain settings of ``build_method``: types, ranges, and a coefficient that needs its estimator."""
    if not isinstance(kl_coef, (int, float)) or isinstance(kl_coef, bool) or not 0 <= kl_coef < math.inf:
        raise PartError(f"method {name!r}: kl_coef = {kl_coef!r} must be a finite number >= 0")
    if kl_placement not in ("loss", "reward"):
        raise PartError(f"method {name!r}: kl_placement = {kl_placement!r}; allowed: 'loss', 'reward'")
    if anchor not in ("old", "rollout"):
        raise PartError(f"method {name!r}: anchor = {anchor!r}; allowed: 'old', 'rollout'")
    if not isinstance(ref_sync_every, int) or ref_sync_every < 0:
        raise PartError(f"method {name!r}: ref_sync_every = {ref_sync_every!r} must be an integer >= 0")
    if kl_coef > 0 and kl is None:
        raise PartError(f"method {name!r}: kl_coef = {kl_coef} needs a KL estimator (kl=k1|k2|k3|...)")


def check_once(name: str, lists: Mapping[str, list[Part]]) -> None:
    """Refuse a part named twice in a list (corrections, shapers, filters): it would act twice (two importance
    weights multiplied, a reward shaped twice) and the second's metrics overwrite the first's."""
    for kind, parts in lists.items():
        names = [p.name for p in parts]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise PartError(f"method {name!r}: {kind} {twice!r} is given twice; each {kind} acts once (give it once, "
                            "with the settings you want)")


def moot_on_policy(trust_region: str) -> bool:
    """Whether ``trust_region`` gives exactly the plain policy gradient under the ``on_policy`` ratio (identically 1):
    those tagged ``vanilla_at_one`` that read nothing but the ratio, the advantage and the mask (a top-K trust region
    also compares the current and old policies' top-K; tests/test_contract.py checks each)."""
    tags = TRUST_REGIONS.spec(trust_region).tags
    return "vanilla_at_one" in tags and "needs_topk" not in tags


def check_overrides(method: Any, changes: Mapping[str, Any]) -> None:
    """Refuse an override of a preset that the composed ``method`` would not act on."""
    has_kl = method.kl is not None and method.kl_coef > 0
    if changes.get("kl") not in (None, "none") and not has_kl:
        raise PartError(f"method {method.name!r}: kl = {changes['kl']!r} has no effect with kl_coef = 0 "
                        "(give kl_coef > 0)")
    if changes.get("kl_placement", "loss") != "loss" and not has_kl:
        raise PartError(f"method {method.name!r}: kl_placement = {changes['kl_placement']!r} has no effect without "
                        "a KL term (kl=... with kl_coef > 0)")
    tr = method.trust_region.name
    if "ignores_ratio" in TRUST_REGIONS.spec(tr).tags:  # a preference loss reads log-probs, never the ratio
        given = [f"{k} = {changes[k]!r}" for k in ("ratio", "anchor") if k in changes]
        if given:
            raise PartError(f"method {method.name!r}: {' and '.join(given)} has no effect with trust_region {tr!r} "
                            "(its loss compares the policy's and the reference's log-probs, not a ratio)")
    if method.ratio.name != "on_policy":
        return
    if changes.get("anchor", "old") != "old":
        raise PartError(f"method {method.name!r}: anchor = {changes['anchor']!r} has no effect with ratio "
                        "'on_policy' (its ratio is identically 1, whatever the anchor)")
    tr = method.trust_region.name
    if "trust_region" in changes and tr != "none" and moot_on_policy(tr):
        raise PartError(f"method {method.name!r}: trust_region = {tr!r} has no effect with ratio 'on_policy' (its "
                        "ratio is identically 1, so the plain policy gradient results); use a ratio such as 'token'")
