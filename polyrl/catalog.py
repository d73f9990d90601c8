"""Human- and machine-readable descriptions of presets and parts (CLI output and docs/methods.md)."""

from __future__ import annotations

from typing import Any

from polyrl.methods import PRESETS, get_method
from polyrl.objectives import Method
from polyrl.registry import ALL_REGISTRIES, Part, Registry

_PART_FIELDS = ("advantage", "ratio", "trust_region", "aggregation")
_LIST_FIELDS = ("corrections", "shapers", "filters")


def _registry(kind: str) -> Registry:
    return next(r for r in ALL_REGISTRIES if r.kind == kind)


def part_dict(part: Part) -> dict[str, Any]:
    """Name, parameters, the part's own defaults, its summary line and paper."""
    spec = _registry(part.kind).spec(part.name)
    return {
        "kind": part.kind,
        "name": part.name,
        "params": dict(part.params),
        "defaults": spec.defaults,
        "summary": spec.summary,
        "paper": spec.paper,
    }


def method_dict(method: Method) -> dict[str, Any]:
    """Everything about a resolved method, JSON-serialisable."""
    out: dict[str, Any] = {"name": method.name, "summary": method.summary, "paper": method.paper}
    for f in _PART_FIELDS:
        out[f] = part_dict(getattr(method, f))
    for f in _LIST_FIELDS:
        out[f] = [part_dict(p) for p in getattr(method, f)]
    out["kl"] = None if method.kl is None else {**part_dict(method.kl), "coef": method.kl_coef,
                                                "placement": method.kl_placement}
    out["anchor"] = method.anchor
    out["ref_sync_every"] = method.ref_sync_every
    out.update(regulariser_settings(method))
    out["needs_values"] = method.needs_values
    return out


REGULARISERS = ("kl_target", "kl_horizon", "entropy_coef", "entropy_target", "entropy_delta", "entropy_coef_max",
                "entropy_top")  # Method settings beside the parts (polyrl/objectives/regularisers.py, controller.py)


def regulariser_settings(method: Method) -> dict[str, float]:
    """The method's regulariser settings that are on (an adaptive coefficient, the entropy bonus, the 80/20 mask)."""
    out = {"kl_target": method.kl_target, "entropy_coef": method.entropy_coef,
           "entropy_target": method.entropy_target, "entropy_top": method.entropy_top}
    out = {k: v for k, v in out.items() if v}
    if method.kl_target:
        out["kl_horizon"] = method.kl_horizon
    if method.entropy_target:
        out.update(entropy_delta=method.entropy_delta, entropy_coef_max=method.entropy_coef_max)
    return out


def all_methods() -> list[Method]:
    return [get_method(name) for name in sorted(PRESETS)]


def _params_text(p: Part) -> str:
    """``name`` plus only the settings that differ from the part's defaults (compact table cells)."""
    defaults = _registry(p.kind).spec(p.name).defaults
    changed = {k: v for k, v in p.params.items() if v != defaults[k]}
    return p.name + (":" + ",".join(f"{k}={v}" for k, v in changed.items()) if changed else "")


def method_row(method: Method) -> dict[str, str]:
    """One line per column for tables: the parts with their non-empty parameters."""
    kl = ("none" if method.kl is None or method.kl_coef == 0
          else f"{_params_text(method.kl)} x {method.kl_coef:g} ({method.kl_placement})")
    extras = []
    if method.anchor != "old":
        extras.append(f"anchor={method.anchor}")
    if method.ref_sync_every:
        extras.append(f"ref_sync_every={method.ref_sync_every}")
    extras += [f"{k}={v:g}" for k, v in regulariser_settings(method).items()]
    return {
        "method": method.name,
        "advantage": _params_text(method.advantage),
        "ratio": _params_text(method.ratio),
        "trust_region": _params_text(method.trust_region),
        "aggregation": method.aggregation.name,
        "kl": kl,
        "shapers/filters/corrections": ", ".join(
            [_params_text(p) for p in (*method.shapers, *method.filters, *method.corrections)] + extras
        ) or "-",
    }


def method_row_compact(method: Method) -> dict[str, str]:
    """The `polyrl methods` table row that fits 100 columns: related parts share a column, one per line.

    Keys are the column headers. The other parts are the ratio when it is not the usual per-token one, then
    shapers, filters, corrections and non-default anchor / reference syncing.
    """
    row = method_row(method)
    other = [f"ratio={row['ratio']}"] if method.ratio.name != "token" else []
    if row["shapers/filters/corrections"] != "-":
        other.append(row["shapers/filters/corrections"])
    # A space after each comma lets the table wrap long parameter lists between settings, not inside names.
    trust_region = row["trust_region"].replace(",", ", ")
    return {
        "method": row["method"],
        "advantage\naggregation": f"{row['advantage']}\n{row['aggregation']}",
        "trust region\nKL": f"{trust_region}\n{'-' if row['kl'] == 'none' else row['kl']}",
        "other parts": ", ".join(other) or "-",
    }


def render_methods_markdown() -> str:
    """The generated docs/methods.md: every preset with its resolved parts, then every registered part."""
    lines = [
        "# Methods and parts",
        "",
        "Generated by `polyrl docs --write docs/methods.md` from `polyrl/methods.py` and the part",
        "registries; `tests/test_presets.py` fails when this file is stale. Do not edit by hand.",
        "",
        "## Presets",
        "",
    ]
    rows = [method_row(m) for m in all_methods()]
    cols = list(rows[0])
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        lines.append("| " + " | ".join(f"`{r[c]}`" if c != "method" else f"**{r[c]}**" for c in cols) + " |")
    lines += ["", "### Papers", ""]
    for m in all_methods():
        lines.append(f"- **{m.name}** — {m.summary} <{m.paper}>")
    lines += ["", "## Registered parts", ""]
    for reg in ALL_REGISTRIES:
        lines += [f"### {reg.kind}", "", "| name | settings (defaults) | paper | summary |", "|---|---|---|---|"]
        for spec in reg:
            settings = ", ".join(f"{k}={v!r}" for k, v in spec.defaults.items()) or "-"
            lines.append(f"| `{spec.name}` | {settings} | {spec.paper or '-'} | {spec.summary} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def explain_lines(method: Method) -> list[tuple[str, str, str, str]]:
    """(field, part with parameters, settings that differ from the part's defaults, summary + paper)."""
    out = []

    def add(field: str, part: Part | None, extra: str = "") -> None:
        if part is None:
            out.append((field, "none", "", ""))
            return
        d = part_dict(part)
        changed = ", ".join(f"{k}={v!r} (default {d['defaults'][k]!r})" for k, v in d["params"].items()
                            if v != d["defaults"][k])
        desc = d["summary"] + (f"  [{d['paper']}]" if d["paper"] else "")
        out.append((field, str(part) + extra, changed or "defaults", desc))

    for f in _PART_FIELDS:
        add(f, getattr(method, f))
    for f in _LIST_FIELDS:
        parts = getattr(method, f)
        if not parts:
            out.append((f, "none", "", ""))
        for p in parts:
            add(f, p)
    if method.kl is None or method.kl_coef == 0:
        add("kl", None)
    else:
        add("kl", method.kl, f"  x {method.kl_coef:g} in the {method.kl_placement}")
    out.append(("anchor", method.anchor, "", "ratio denominator: pi_old (recomputed) or mu (rollout engine)"))
    active = method.zero_adv_rows_active()
    out.append(("zero_adv_rows", "backward" if active else "forward only", "",
                f"rows whose advantages are all 0 keep the backward: {active}" if active else
                "rows whose advantages are all 0 get no gradient: they may skip the backward (--skip-zero-adv)"))
    if method.ref_sync_every:
        out.append(("ref_sync_every", str(method.ref_sync_every), "", "copy the policy into the reference"))
    for key, value in regulariser_settings(method).items():
        out.append((key, f"{value:g}", "", _REGULARISER_DOCS[key]))
    return out


_REGULARISER_DOCS = {
    "kl_target": "adaptive KL coefficient toward this KL (Ziegler et al., arXiv:1909.08593)",
    "kl_horizon": "the adaptive KL controller's horizon (sequences)",
    "entropy_coef": "entropy bonus: loss -= coef x entropy per token (the start coefficient when adaptive)",
    "entropy_target": "adaptive entropy coefficient toward this entropy (Skywork-OR1, arXiv:2505.22312)",
    "entropy_delta": "the adaptive entropy coefficient's step per RL step",
    "entropy_coef_max": "the adaptive entropy coefficient's ceiling",
    "entropy_top": "train only on this top fraction of loss tokens by entropy (80/20 rule, arXiv:2506.01939)",
}


__all__ = ["render_methods_markdown", "method_dict", "explain_lines", "all_methods", "method_row",
           "method_row_compact"]
