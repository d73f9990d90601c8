"""Math word problems from a local JSONL, JSON or Parquet file, graded with math-verify.

Accepted columns (documented here only; ``COLUMNS_HELP`` says it in one phrase for the CLI and README):
the question is the first of ``question``, ``problem``, ``prompt``, ``messages`` that the file has (or
``prompt_key``), the answer the first of ``answer``, ``solution``, ``ground_truth`` (or ``answer_key``); other
columns are ignored and duplicate questions are kept. A question that is a list is a chat conversation (as in
TRL's conversational format): non-empty ``{"role": ..., "content": ...}`` objects with text content, not ending
with an assistant turn; it is rendered by the run's chat template (``polyrl.tasks.chat``; plain text runs refuse
it), and a text question is ``template`` (``{question}\nAnswer: ``) in plain mode or one user message of that text
under a chat template. A ``.jsonl`` file holds one JSON object per line (blank lines are
skipped), a ``.json`` file either that or one JSON array of objects, a ``.parquet`` file one row per problem.

A row goes to the held-out (test) split when int(sha256(question)[:8], 16) % 100 < ``heldout_percent`` (a
conversation is hashed as its compact JSON list of {"role", "content"} objects), so
the splits are disjoint and stay stable when rows are added, but a small file can land no row in a split:
that is an error naming ``--heldout-percent``. Every problem with the file raises DataFileError, a ValueError
with a one-line message that starts with the file's name. The reward is 1.0 when math-verify finds the
completion's answer equal to the reference (numbers, fractions, LaTeX), else 0.0.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import random
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

from polyrl.tasks.base import Prompt, Split

QUESTION_KEYS = ("question", "problem", "prompt", "messages")
ANSWER_KEYS = ("answer", "solution", "ground_truth")
COLUMNS_HELP = (f"{QUESTION_KEYS[0]} (or {', '.join(QUESTION_KEYS[1:])}) and "
                f"{ANSWER_KEYS[0]} (or {', '.join(ANSWER_KEYS[1:])}) columns")
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false",
               type(None): "null"}



def data_file_path(data_file: str, heldout_percent: int, suffixes: tuple[str, ...], allowed: str) -> tuple[Path, str]:
    """The checked path of a task's data file and its label for messages (one-line errors otherwise)."""
    if isinstance(heldout_percent, bool) or not isinstance(heldout_percent, int) or not 0 <= heldout_percent <= 50:
        raise ValueError(f"heldout_percent (--heldout-percent) must be an integer from 0 to 50, "
                         f"got {heldout_percent!r}")
    path = Path(data_file)
    label = f"data_file {str(path)!r}"
    if not path.is_file():
        raise FileNotFoundError(f"{label} does not exist")
    if path.suffix not in suffixes:
        raise DataFileError(f"{label}: {allowed}")
    return path, label


def draw_split(pool: list[Prompt], n: int, seed: int, *, label: str, heldout_percent: int) -> list[Prompt]:
    """``n`` prompts of one split of a data file, shuffled by ``seed``, cycling through it when n exceeds it."""
    if not pool:  # only the held-out split at heldout_percent = 0: the tasks refuse other empty splits
        raise DataFileError(f"{label} has no held-out split (heldout_percent = {heldout_percent}): "
                            "evaluation needs --heldout-percent > 0")
    rng, out = random.Random(seed), []
    while len(out) < n:
        out.extend(rng.sample(pool, min(len(pool), n - len(out))))
    return out

def check_splits(pools: dict[str, list[Prompt]], rows: int, heldout_percent: int, *, label: str, key: str) -> None:
    """Refuse, in one line, a data file whose hash split leaves the training split (or a wanted held-out one) empty."""
    train, held = len(pools["train"]), len(pools["test"])
    if not train or (heldout_percent and not held):
        fix = (f"add rows (about {-(-100 // heldout_percent)} per held-out row) or raise --heldout-percent"
               if not held else "add rows or lower --heldout-percent")
        raise DataFileError(f"{label} has {rows} row{'s' * (rows != 1)}: {train} fall in the training split and "
                            f"{held} in the held-out split (heldout_percent = {heldout_percent}, chosen by a hash of "
                            f"the {key}): {fix}")


class DataFileError(ValueError):
    """A data file that cannot be used, with a one-line message starting ``data_file 'PATH'``."""


def _whole_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _json_rows(path: Path, label: str) -> list[tuple[str, dict]]:
    """(where, object) for each row of a JSON lines file or of a .json file holding one array."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: tolerate the byte-order mark some editors write
    except UnicodeDecodeError as e:
        raise DataFileError(f"{label} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataFileError(f"{label} cannot be read ({e.strerror})") from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataFileError(f"{label} line {e.lineno} is not valid JSON ({e.msg}: column {e.colno})") from None
        located = [(f"row {i}", item) for i, item in enumerate(items, 1)]
    else:
        located = []
        for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                if path.suffix == ".json" and _whole_object(text):  # a pretty-printed {"data": [...]} file
                    raise DataFileError(f"{label} holds one JSON object; a .json file must hold one array of "
                                        "objects (or one object per line), e.g. [{\"question\": ..., "
                                        "\"answer\": ...}, ...]") from None
                raise DataFileError(f"{label} line {lineno} is not valid JSON ({e.msg}: column {e.colno})") from None
            located.append((f"row {len(located) + 1} (line {lineno})", item))
    for where, item in located:
        if not isinstance(item, dict):
            raise DataFileError(f"{label} {where} is {_JSON_KINDS.get(type(item), 'a value')}, not a JSON object")
    return located


def _parquet_rows(path: Path, label: str) -> tuple[list[str], list[tuple[str, dict]]]:
    """The columns and (where, row) for each row of a Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]  # Arrow messages can run to many lines
        raise DataFileError(f"{label} is not a readable Parquet file ({reason})") from None
    return list(table.column_names), [(f"row {i}", row) for i, row in enumerate(table.to_pylist(), 1)]


def _messages_problem(messages: list) -> str | None:
    """What is wrong with a question given as chat messages, in a few words (None: nothing)."""
    if not messages:
        return "are an empty list"
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            return f"are not all objects (message {i} is {_JSON_KINDS.get(type(m), type(m).__name__)})"
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role.strip():
            return f"lack a role (message {i} has role {role!r}; e.g. system, user, assistant)"
        if not isinstance(content, str):
            return f"lack text content (message {i} has content {type(content).__name__}, not a string)"
    if not any(m["role"] == "user" for m in messages):
        return "have no user message"
    if messages[-1]["role"] == "assistant":
        return "end with an assistant message (the model writes the next assistant turn)"
    return None


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _split_hash(question: str | int | float | list) -> str:
    """What decides a row's split: its question with whitespace collapsed, and of a conversation its user turns
    alone, so that copies differing only there (a trailing space, another system prompt, plain text or a message)
    share a split; the raw text sent 519 of 523 such held-out questions into training too."""
    if isinstance(question, list):  # one user turn splits as the same question asked as plain text
        question = "\n".join(m["content"] for m in question if m["role"] == "user")
    return hashlib.sha256(" ".join(str(question).split()).encode()).hexdigest()


class MathTask:
    """Problems from a local file; reward by math-verify equivalence with the reference answer."""

    def __init__(self, data_file: str, *, prompt_key: str | None = None, answer_key: str | None = None,
                 template: str = "{question}\nAnswer: ", heldout_percent: int = 10) -> None:
        path, label = data_file_path(data_file, heldout_percent, (".jsonl", ".json", ".parquet"),
                                     "use a .jsonl, .json or .parquet file")
        if path.suffix == ".parquet":
            columns, rows = _parquet_rows(path, label)
            unit = "one row per problem"
        else:
            rows = _json_rows(path, label)
            columns = list(dict.fromkeys(k for _, row in rows for k in row))  # rows may differ in their keys
            unit = "one JSON object per line" + (" (or one JSON array of objects)" if path.suffix == ".json" else "")
        if not rows:
            raise DataFileError(f"{label} is empty: it needs {unit} with {COLUMNS_HELP}")

        keys = {}
        for role, key, options, flag in (("question", prompt_key, QUESTION_KEYS, "prompt_key"),
                                         ("answer", answer_key, ANSWER_KEYS, "answer_key")):
            keys[role] = key or next((k for k in options if k in columns), None)
            if keys[role] not in columns:
                accepted = f"{key!r}, set by {flag}" if key else f"{', '.join(options[:-1])} or {options[-1]}"
                shown = ", ".join(columns[:20]) + (f", ... ({len(columns) - 20} more)" if len(columns) > 20 else "")
                raise DataFileError(f"{label} has no {role} column ({accepted}); its columns: {shown or 'none'}")
        for where, row in rows:
            for role, key in keys.items():
                value = row.get(key)
                if value is None or (isinstance(value, str) and not value.strip()):
                    state = "missing" if key not in row else "null" if value is None else "empty"
                    raise DataFileError(f"{label} {where} has no {role} ({key!r} is {state})")
                if role == "question" and isinstance(value, list):
                    problem = _messages_problem(value) or \
                        next(("hold a lone surrogate escape" for m in value if not _utf8(m["content"])), None)
                    if problem:
                        raise DataFileError(f"{label} {where} has chat messages in {key!r} that {problem}")
                    continue
                if isinstance(value, bool) or not isinstance(value, str | int | float):
                    raise DataFileError(f"{label} {where} has a {type(value).__name__} in {key!r}; "
                                        f"the {role} must be text or a number" +
                                        (" (or a list of chat messages)" if role == "question" else ""))
                if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN/Infinity, a parquet NaN
                    raise DataFileError(f"{label} {where} has {value} in {key!r}; the {role} must be text or a "
                                        "finite number")
                if isinstance(value, str) and not _utf8(value):  # JSON's "\ud800": no text can hold it
                    raise DataFileError(f"{label} {where} has a lone surrogate escape in {key!r}; the {role} must "
                                        "be valid Unicode text")

        self.name = "math"
        self.template = template
        self.heldout_percent = heldout_percent
        self._label = label
        self._pools: dict[str, list[Prompt]] = {"train": [], "test": []}
        self.message_rows = 0  # rows whose question is a conversation: they need a chat template
        for _, row in rows:
            value, messages = row[keys["question"]], None
            if isinstance(value, list):
                messages = tuple((m["role"], m["content"]) for m in value)
                question = json.dumps([{"role": r, "content": c} for r, c in messages], ensure_ascii=False,
                                      separators=(",", ":"))
                text = next(c for r, c in reversed(messages) if r == "user")  # shown to reward functions
                self.message_rows += 1
            else:
                question = str(value)
                text = template.format(question=question)
            pid = hashlib.sha256(question.encode()).hexdigest()
            split = "test" if int(_split_hash(value)[:8], 16) % 100 < heldout_percent else "train"
            self._pools[split].append(Prompt(id=f"math/{pid[:16]}", text=text, answer=_answer_text(row[keys["answer"]]),
                                             messages=messages))
        check_splits(self._pools, len(rows), heldout_percent, label=label, key="question")

    def split_size(self, split: Split) -> int:
        """How many distinct prompts ``split`` holds (the builder checks each against the model's context)."""
        return len(self._pools[split])

    def prompts(self, split: Split, n: int, seed: int) -> list[Prompt]:
        """``n`` prompts of ``split``, shuffled by ``seed``, cycling through the split when n exceeds it."""
        return draw_split(self._pools[split], n, seed, label=self._label, heldout_percent=self.heldout_percent)

    def reward(self, prompt: Prompt, completion_text: str) -> tuple[float, dict[str, Any]]:
        """1.0 when math-verify says the completion's final answer equals the reference."""
        from math_verify import parse, verify

        gold, pred = _gold(prompt.answer), parse(completion_text)
        ok = bool(pred) and bool(verify(gold, pred))
        bare = completion_text.strip()
        if not ok and _WORDS.fullmatch(bare):  # a word answer ("B", "Paris") is text: as maths, "eat" was "tea"
            ok = " ".join(bare.lower().split()) == " ".join(prompt.answer.lower().split())
        elif not ok and bare and len(bare) <= _BARE_MAX and "$" not in bare and "\\boxed" not in bare:
            pred = parse(f"${bare}$")  # a short bare answer read whole, as the reference is: "2\\sqrt{3}"
            ok = bool(pred) and bool(verify(gold, pred))
        return (1.0 if ok else 0.0), {"parsed": [str(p) for p in pred][:2]}


def _answer_text(value: Any) -> str:
    """A reference answer as text: a number in scientific notation, a JSON float or text like "1e-05", in positional
    notation (math-verify reads '1e-05' as 1, or as 1 * e - 5 once wrapped in $...$), anything else as str()."""
    if isinstance(value, float) and math.isfinite(value):
        return format(Decimal(repr(value)), "f")
    if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
        return format(Decimal(value.strip()), "f")
    return str(value)


_SCIENTIFIC = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")
_BARE_MAX = 64  # a completion at most this long, with no $...$ or \boxed{}, is also read whole as LaTeX
# Plain words closing an answer after a space ("5 dollars", "\\frac{1}{2} hours"): a unit. Letters right after a
# digit are algebra (2xy), and a math word (2 sin x) is none.
_TRAILING_WORDS = re.compile(r"(?<=[\d}.])\s+([A-Za-z]{3,}(?:\s+[A-Za-z]+)*)\s*$")
_MATH_WORDS = frozenset("sin cos tan cot sec csc sinh cosh tanh arcsin arccos arctan log ln exp sqrt pi mod max min "
                        "det lim and or".split())
_WORDS = re.compile(r"[A-Za-z]+(?: [A-Za-z]+)*")


@functools.lru_cache(maxsize=65536)
def _gold(answer: str) -> list:
    """The parsed reference. A data file's answer column is usually bare LaTeX (``2\\sqrt{3}``), which math-verify
    reads only inside $...$ or \\boxed{} (bare, it read 2, or nothing for ``\\sqrt{2}``): bare answers are wrapped.
    Plain words after a space are a unit: the value alone counts too (wrapped whole, ``5 dollars`` is the product
    5*d*o*l*...)."""
    from math_verify import parse

    if "$" in answer or "\\boxed" in answer:
        return parse(answer)
    whole = parse(f"${answer}$")
    unit = _TRAILING_WORDS.search(answer)
    if unit and answer[:unit.start()].strip() and not _MATH_WORDS & set(unit.group(1).lower().split()):
        return parse(f"${answer[:unit.start()].rstrip()}$") + whole  # the value, or the answer read whole
    return whole
