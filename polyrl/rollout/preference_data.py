"""Offline preference data: `--preference-file`, TOML table `[preference]`, `TrainConfig.preference`.

A JSONL file of TRL's standard preference rows ``{"prompt": str, "chosen": str, "rejected": str}`` (other keys
are ignored). ``read_pairs`` refuses a bad row in one line naming the file, the row (1-based line) and the field;
``preference_problem`` refuses, in one line, the settings that a preference loss or the offline source makes moot
or breaks. Imports nothing heavy: the builder checks a file before any model is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class PreferenceConfig:
    """Offline preference training (``rollout.preference.PreferenceSource``)."""

    PREFIX: ClassVar[str] = "preference"

    file: str | None = field(default=None, metadata={"flag": "preference_file"})
    """train offline on a JSONL of TRL's {"prompt", "chosen", "rejected"} rows, prompts_per_step rows a step"""


class PreferenceRow(NamedTuple):
    prompt: str
    chosen: str
    rejected: str
    line: int = 0  # its line in the file (1-based), for messages


def read_pairs(path: str | Path) -> list[PreferenceRow]:
    """The rows of a preference JSONL file; a bad file or row is a one-line ValueError naming the row and field."""
    p = Path(path)
    where = f"preference_file = {str(p)!r}"
    try:
        # -sig: the byte-order mark some editors write; "\n", not splitlines(): JSON strings may hold U+2028, U+0085
        lines = p.read_text(encoding="utf-8-sig").split("\n")
    except FileNotFoundError:
        raise ValueError(f"{where} does not exist (allowed: a JSONL file of prompt/chosen/rejected rows)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where} cannot be read ({type(e).__name__}); allowed: a UTF-8 JSONL file") from None
    rows: list[PreferenceRow] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: row {n} is not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: row {n} is a {type(row).__name__}; allowed: an object with fields "
                             f"{', '.join(FIELDS)}")
        for name in FIELDS:
            value = row.get(name)
            if not isinstance(value, str) or (name != "prompt" and not value.strip()):
                got = "missing" if name not in row else f"{type(value).__name__} {value!r}"[:60]
                raise ValueError(f"{where}: row {n} field {name!r} is {got}; allowed: a "
                                 f"{'string' if name == 'prompt' else 'non-empty string'} (conversational rows "
                                 "are not supported)")
        if row["chosen"] == row["rejected"]:
            raise ValueError(f"{where}: row {n} field 'rejected' equals 'chosen'; allowed: two different completions")
        rows.append(PreferenceRow(row["prompt"], row["chosen"], row["rejected"], n))
    if not rows:
        raise ValueError(f"{where} has no rows; allowed: a JSONL file of prompt/chosen/rejected rows")
    return rows


# Settings the offline source never uses: it generates nothing and its rewards are the rows' labels.
_MOOT_OFFLINE = {
    "group_size": "each row is a group of two, chosen and rejected",
    "train_prompts": "the rows are the training data",
    "reward_funcs": "the rewards are the rows' labels (chosen 1, rejected 0)",
    "reward_weights": "the rewards are the rows' labels (chosen 1, rejected 0)",
    "rollout_workers": "nothing is generated for training",
    "async_staleness": "nothing is generated for training",
    "agency": "nothing is generated for training",
    "top_p": "a row's tokens outside the nucleus would have log-probability -inf",
    "top_k": "a row's tokens outside the top k would have log-probability -inf",
}


def preference_problem(method, given: Mapping[str, Any], defaults: Mapping[str, Any],
                       whole_groups: bool) -> str | None:
    """Why these flat settings cannot train ``method`` (one line), or None.

    ``whole_groups``: the method's loss couples the sequences of a group (a pairwise preference loss), so a
    group must lie in one micro-batch: the uniform sampler's groups are contiguous, a minibatch split shuffles.
    """
    file = given["preference_file"]
    group = 2 if file is not None else given["group_size"]
    if whole_groups:
        why = f"method {method.name!r} forms preference pairs within each group, so a group must lie in one micro-batch"
        if given["micro_batch_size"] % group:
            return (f"micro_batch_size = {given['micro_batch_size']} is not allowed: {why}; allowed: a multiple of "
                    f"the group size {group}")
        if given["minibatches"] != 1:
            return (f"minibatches = {given['minibatches']} is not allowed: {why} (a minibatch split shuffles "
                    "rows); allowed: 1")
        if given["sampler"] != "uniform":
            return f"sampler = {given['sampler']!r} is not allowed: {why}; allowed: 'uniform'"
    from polyrl.registry import ADVANTAGES, TRUST_REGIONS

    if "labels" in TRUST_REGIONS.spec(method.trust_region.name).tags and \
            "needs_groups" not in ADVANTAGES.spec(method.advantage.name).tags:
        allowed = ", ".join(n for n in ADVANTAGES.names() if "needs_groups" in ADVANTAGES.spec(n).tags)
        return (f"advantage = {method.advantage.name!r} is not allowed with trust region "
                f"{method.trust_region.name!r}: it reads each sequence's advantage as its preference label, which "
                f"only a group-relative estimator keeps in the order of the rewards; allowed: {allowed}")
    if file is None:
        return None
    for name, why in _MOOT_OFFLINE.items():
        if given[name] != defaults[name]:
            return f"{name} = {given[name]!r} has no effect with preference_file = {file!r} ({why}); drop it"
    if given["sampler"] != "uniform":
        return f"sampler = {given['sampler']!r} is not allowed with preference_file = {file!r}; allowed: 'uniform'"
    if method.corrections or method.anchor == "rollout" or method.filters or method.shapers:
        return (f"preference_file = {file!r} is not allowed with method {method.name!r}: offline rows have no "
                "rollout log-probs, no groups to filter and rewards that are their labels, which a shaper would "
                "change (allowed: a method without corrections, filters, shapers and anchor 'rollout', e.g. dpo, "
                "ipo, simpo, kto)")
    if given["temperature"] != 1.0:
        return (f"temperature = {given['temperature']!r} is not allowed with preference_file = {file!r}: a row's "
                "log-probs are of the model's own distribution, as in TRL's DPO (nothing is sampled); allowed: 1.0")
    try:
        read_pairs(file)
    except ValueError as e:
        return str(e)
    return None
