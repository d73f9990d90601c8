"""Registries of named parts, and the validation of their parameters.

A part is a pure function. Its *inputs* are positional parameters; its *settings* are keyword-only
parameters with defaults and type annotations. Registering is one decorator line::

    @TRUST_REGIONS.register("clip", paper="arXiv:1707.06347", ranges={"eps_low": ">=0"})
    def clip(inp, log_ratio, *, eps_low: float = 0.2, eps_high: float = 0.2): ...

``Registry.resolve(name, params)`` checks every setting against the signature: an unknown or
misspelled name, a wrong type or an out-of-range value raises ``PartError`` naming the part, the
parameter, the value and what is allowed. Nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import re
import sys
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from polyrl.plugins import FILE_MODULE_PREFIX


class PartError(ValueError):
    """A part name or parameter that cannot be used; the message is one line meant for users."""


@dataclass(frozen=True)
class Part:
    """A named part with its fully resolved parameters (defaults filled in)."""

    kind: str
    name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_fmt(v)}" for k, v in self.params.items())


def defined_in(fn: Callable[..., Any]) -> str:
    """Where ``fn`` was defined, for a message: a plugin file's path (its module's name is private), else the module."""
    module = sys.modules.get(fn.__module__)
    path = getattr(module, "__file__", None)
    return repr(path) if path and fn.__module__.startswith(FILE_MODULE_PREFIX) else fn.__module__


@dataclass(frozen=True)
class PartSpec:
    """A registered function plus what the registry knows about it."""

    kind: str
    name: str
    fn: Callable[..., Any]
    settings: Mapping[str, inspect.Parameter]
    types: Mapping[str, Any]
    ranges: Mapping[str, str]
    check: Callable[[dict[str, Any]], str | None] | None
    paper: str
    tags: frozenset[str]

    @property
    def summary(self) -> str:
        doc = inspect.getdoc(self.fn) or ""
        return doc.splitlines()[0] if doc else ""

    @property
    def defaults(self) -> dict[str, Any]:
        return {k: p.default for k, p in self.settings.items()}


_NUM = r"(-?[\d.e+-]+|-?inf)"
_RANGE = re.compile(rf"^(>=|>|<=|<)\s*{_NUM}$|^([\[(])\s*{_NUM}\s*,\s*{_NUM}\s*([\])])$")


def _in_range(value: float, rule: str) -> bool:
    m = _RANGE.match(rule.strip())
    if m is None:
        raise ValueError(f"bad range rule {rule!r}")
    if m.group(1):
        op, bound = m.group(1), float(m.group(2))
        return {">=": value >= bound, ">": value > bound, "<=": value <= bound, "<": value < bound}[op]
    lo, hi = float(m.group(4)), float(m.group(5))
    lo_ok = value >= lo if m.group(3) == "[" else value > lo
    hi_ok = value <= hi if m.group(6) == "]" else value < hi
    return lo_ok and hi_ok


def add_preset(table: dict[str, Callable[[], Any]], fn: Callable[[], Any], kind: str = "preset") -> None:
    """Put preset ``fn`` in ``table`` under its function name, its docstring the built method's summary.

    A name already taken is refused naming both places (a plugin's preset silently replaced a built-in one); the
    build refuses a method named otherwise than its preset (listed under one name, looked up under the other). The
    build function keeps where ``fn`` was defined as ``origin``.
    """
    name, where = fn.__name__, defined_in(fn)
    if name in table:
        raise PartError(f"{kind} {name!r} is registered twice, by {table[name].origin} and by {where}; give one of "
                        "them another name")
    summary = " ".join((fn.__doc__ or "").split())

    def build() -> Any:
        try:
            built = fn()
        except PartError as e:  # a plugin's preset: say which, and where (built-in ones always build)
            raise PartError(f"{kind} {name!r} ({where}): {e}") from None
        if built.name != name:
            raise PartError(f"{kind} {name!r} ({where}) builds a method named {built.name!r}; name it {name!r}, as "
                            "--method looks it up by the preset's name")
        return dataclasses.replace(built, summary=summary)

    build.__doc__, build.origin = fn.__doc__, where
    table[name] = build


def did_you_mean(name: str, options) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``options``, or an empty string."""
    near = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def unknown(what: str, name: str, options) -> PartError:
    """The one-line error for a name that is not registered: the nearest name and every allowed one."""
    return PartError(f"unknown {what} {name!r}{did_you_mean(name, options)}; allowed: {', '.join(sorted(options))}")


def _fmt(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(_fmt(a) for a in typing.get_args(tp))
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return " or ".join(_type_name(a) for a in args) + " or None"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any) -> Any:
    """Convert ``value`` (possibly a CLI string) to ``tp``; raise TypeError when it does not fit."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        raise TypeError
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            if type(None) in args:
                return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a)
            except TypeError:
                continue
        raise TypeError
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise TypeError
    if tp is int:
        if isinstance(value, bool):
            raise TypeError
        if isinstance(value, int):
            return value
        if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
            return int(value)
        raise TypeError
    if tp is float:
        if isinstance(value, bool):
            raise TypeError
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError as e:
                raise TypeError from e
        raise TypeError
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeError
    return value


class Registry:
    """Name -> part function, for one kind of part (advantage, trust_region, ...)."""

    def __init__(self, kind: str, positional: int, tagged: Mapping[str, int] | None = None):
        self.kind = kind
        self.positional = positional  # the positional arguments every call passes (the kind's signature)
        self.tagged = dict(tagged or {})  # tag -> the positional arguments a part with that tag is passed after them
        self._specs: dict[str, PartSpec] = {}

    def register(
        self,
        name: str,
        *,
        paper: str = "",
        ranges: Mapping[str, str] | None = None,
        check: Callable[[dict[str, Any]], str | None] | None = None,
        tags: tuple[str, ...] = (),
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Register ``fn`` under ``name``; keyword-only parameters become its validated settings."""

        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._specs:  # a plugin loads before the built-ins: name both, so the message names the plugin
                raise PartError(f"{self.kind} {name!r} is registered twice, by {defined_in(self._specs[name].fn)} "
                                f"and by {defined_in(fn)}; give one of them another name")
            sig = inspect.signature(fn)
            given = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            required = [p for p in given if p.default is p.empty]
            passed = self.positional + sum(self.tagged.get(t, 0) for t in tags)
            if not (len(required) <= passed
                    and (len(given) >= passed or any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()))):
                # a plugin's part with another signature failed with a TypeError deep in the first training step
                raise PartError(f"{self.kind} {name!r} ({defined_in(fn)}) takes {len(required)} to {len(given)} "
                                f"positional arguments; this {self.kind} is called with {passed} (see "
                                "polyrl/registry.py), settings keyword-only after *")
            bad_rule = next((r for r in (ranges or {}).values() if not _RANGE.match(str(r).strip())), None)
            if bad_rule is not None:
                raise PartError(f"{self.kind} {name!r} ({defined_in(fn)}): range rule {bad_rule!r} is not one of "
                                "'>=x', '>x', '<=x', '<x', '[a, b]', '(a, b)', '[a, b)', '(a, b]'")
            hints = typing.get_type_hints(fn)
            settings = {k: p for k, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
            for k, p in settings.items():
                if p.default is inspect.Parameter.empty:
                    raise ValueError(f"{self.kind} {name!r}: setting {k!r} needs a default")
                if k not in hints:
                    raise ValueError(f"{self.kind} {name!r}: setting {k!r} needs a type annotation")
            for k in ranges or {}:
                if k not in settings:
                    raise ValueError(f"{self.kind} {name!r}: range given for unknown setting {k!r}")
            self._specs[name] = PartSpec(
                kind=self.kind,
                name=name,
                fn=fn,
                settings=settings,
                types={k: hints[k] for k in settings},
                ranges=dict(ranges or {}),
                check=check,
                paper=paper,
                tags=frozenset(tags),
            )
            return fn

        return deco

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[PartSpec]:
        return iter(self._specs.values())

    def names(self) -> list[str]:
        return sorted(self._specs)

    def spec(self, name: str) -> PartSpec:
        if name not in self._specs:
            raise unknown(self.kind, name, self._specs)
        return self._specs[name]

    def fn(self, name: str) -> Callable[..., Any]:
        return self.spec(name).fn

    def resolve(self, name: str, params: Mapping[str, Any] | None = None) -> Part:
        """Validate ``params`` for part ``name`` and return the Part with all defaults filled in."""
        spec = self.spec(name)
        where = f"{self.kind} {name!r}"
        resolved = spec.defaults
        for key, raw in (params or {}).items():
            if key not in spec.settings:
                allowed = ", ".join(spec.settings) or "none"
                raise PartError(f"{where}: unknown parameter {key!r}{did_you_mean(key, spec.settings)}; "
                                f"allowed parameters: {allowed}")
            tp = spec.types[key]
            try:
                value = _coerce(raw, tp)
            except TypeError:
                raise PartError(f"{where}: parameter {key!r} = {_fmt(raw)} must be {_type_name(tp)}") from None
            if isinstance(value, float) and math.isnan(value):
                raise PartError(f"{where}: parameter {key!r} = nan is not allowed")
            resolved[key] = value
        for key, rule in spec.ranges.items():
            value = resolved[key]
            if value is not None and not _in_range(float(value), rule):
                raise PartError(f"{where}: parameter {key!r} = {_fmt(value)} is out of range; allowed: {rule}")
        if spec.check is not None:
            problem = spec.check(resolved)
            if problem:
                raise PartError(f"{where}: {problem}")
        return Part(self.kind, name, resolved)


PartLike = str | tuple[str, Mapping[str, Any]] | Part  # "clip:eps_high=0.28", ("clip", {...}) or a Part


def resolve_part(registry: Registry, spec: PartLike, base: Part | None = None) -> Part:
    """Turn a name, a ``name:k=v`` string, a (name, params) pair or a Part into a validated Part of ``registry``.

    When ``base`` has the same name, its parameters are kept and the new ones override them
    (``--trust-region clip:eps_high=0.3`` on DAPO keeps eps_low=0.2). Every family's method resolution
    (language-model presets, flow presets) goes through here.
    """
    if isinstance(spec, Part):
        if spec.kind != registry.kind:
            raise PartError(f"a {spec.kind} part ({spec.name!r}) was given where a {registry.kind} is expected")
        name, params = spec.name, dict(spec.params)
    elif isinstance(spec, str):
        name, params = parse_part(spec)
    else:
        name, params = spec[0], dict(spec[1])
    if base is not None and base.name == name:
        params = {**base.params, **params}
    return registry.resolve(name, params)


def parse_part(text: str) -> tuple[str, dict[str, str]]:
    """Parse ``name`` or ``name:key=value,key=value`` (the CLI override syntax) into name and raw params."""
    name, _, rest = text.strip().partition(":")
    params: dict[str, str] = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise PartError(f"cannot read {item!r} in {text!r}: write parameters as name:key=value,key=value")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":  # str(Part) quotes strings: 'sample'
                value = value[1:-1]
            if key.strip() in params:  # the later one silently won
                raise PartError(f"parameter {key.strip()!r} is given twice in {text!r}; give it once")
            params[key.strip()] = value
    if not name:
        raise PartError(f"empty part name in {text!r}")
    return name, params


# One registry per kind of part (ARCHITECTURE.md section 1). Signatures, tensors [B, T] unless noted:
# (rewards [B] | [B, C], group_ids [B], mask, values=None, token_rewards=None) -> adv [B] | [B, T]
# (rewards [B], group_ids [B], mask [B, T], values [B, T] | None, token_rewards [B, T] | None[, greedy or OTB inputs])
ADVANTAGES = Registry("advantage", 5, {"needs_greedy": 1, "needs_sum_pi_sq": 2})
RATIOS = Registry("ratio", 5)  # (logp, anchor_logp, mask, segment_ids, turn_ids) -> log_ratio [B, T]
TRUST_REGIONS = Registry("trust_region", 2)  # (LossInputs, log_ratio) -> (per_token_loss [B, T], metrics)
CORRECTIONS = Registry("correction", 4)  # (old_logp, rollout_logp, mask, adv) -> detached weights [B, T]
KL = Registry("kl", 3)  # (logp, ref_logp, old_logp) -> kl [B, T]
AGGREGATIONS = Registry("aggregation", 4)  # (per_token_loss, mask, Normalizer, group_tokens [B] | None) -> []
SHAPERS = Registry("shaper", 4)  # (rewards [B], lengths [B], truncated [B], max_new_tokens) -> rewards [B]
FILTERS = Registry("filter", 4)  # (rewards [B], group_ids [B], truncated [B], history) -> keep [B] bool

ALL_REGISTRIES = (ADVANTAGES, RATIOS, TRUST_REGIONS, CORRECTIONS, KL, AGGREGATIONS, SHAPERS, FILTERS)
