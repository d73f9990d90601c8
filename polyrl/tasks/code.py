"""Python coding problems from a local JSONL (or JSON) file, graded by running test asserts in a sandbox.

Each row is one JSON object with ``prompt`` (the text given to the model, e.g. a signature and docstring
``def add(a, b):\\n    \"\"\"Return a + b.\"\"\"\\n``), ``tests`` (a string of Python statements, or a list of
strings) and optionally ``entry_point`` (the function the tests call); other keys are ignored. In a string,
every top-level ``assert`` is one test and other statements (imports, helpers) run, uncounted, before the
asserts that follow them; in a list, every item is one test. Every problem with the file raises
DataFileError: one line naming the file, the line and the field. The held-out split is chosen as in the math
task: a row is held out when int(sha256(prompt)[:8], 16) % 100 < ``heldout_percent``.

The completion is the code: the first ```python (or bare ```) fenced block when there is one, else the
whole completion. When that code defines the entry point (or, without one, any top-level function or class)
it runs alone; otherwise it is taken as the continuation of the prompt (a function body) and
prompt + code runs. The reward is the share of tests that pass, in [0, 1]: 0 for code that does not parse,
raises before the tests, or runs past a limit before any test passes. Execution is sandboxed (see
``polyrl.tasks.sandbox`` for the process, limits and audit hook); the tests are stored as the prompt's
``answer``, a JSON object ``{"tests": [...], "entry_point": ...}``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from typing import Any

from polyrl.tasks import sandbox
from polyrl.tasks.base import Prompt, Split
from polyrl.tasks.math import DataFileError, _json_rows, check_splits, data_file_path, draw_split

COLUMNS_HELP = "prompt and tests (a string of Python asserts or a list of them) columns, and an optional entry_point"
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def split_tests(source: str) -> list[str]:
    """The tests of a string of statements: each top-level assert, with the statements before it since the last."""
    tree = ast.parse(source)
    tests, setup = [], []
    for node in tree.body:
        segment = ast.get_source_segment(source, node) or ast.unparse(node)
        if isinstance(node, ast.Assert):
            tests.append("\n".join([*setup, segment]))
            setup = []
        else:
            setup.append(segment)
    return tests


def extract_code(completion: str) -> str:
    """The first fenced code block of ``completion`` (```python or ```), else the completion as it is."""
    match = _FENCE.search(completion)
    return match.group(1) if match else completion


def _defines(code: str, entry_point: str | None) -> bool | None:
    """Whether ``code`` defines ``entry_point`` (any function or class without one); None when it does not parse."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    return entry_point in names if entry_point else bool(names)


def program_for(prompt_text: str, completion: str, entry_point: str | None) -> str | None:
    """The program to run for ``completion``: its code alone or the prompt followed by it; None when neither parses."""
    code = extract_code(completion)
    alone = _defines(code, entry_point)
    if alone:
        return code
    joined = prompt_text + code
    if _defines(joined, entry_point) is not None:
        return joined
    return code if alone is not None else None


class CodeTask:
    """Problems from a local file; reward = share of the row's test asserts that pass in the sandbox."""

    def __init__(self, data_file: str, *, heldout_percent: int = 10, cpu_seconds: int = sandbox.CPU_SECONDS,
                 wall_seconds: float = sandbox.WALL_SECONDS, memory_bytes: int = sandbox.MEMORY_BYTES) -> None:
        path, label = data_file_path(data_file, heldout_percent, (".jsonl", ".json"),
                                     "the code task reads a .jsonl (or .json) file")
        rows = _json_rows(path, label)
        if not rows:
            raise DataFileError(f"{label} is empty: it needs one JSON object per line with {COLUMNS_HELP}")

        self.name = "code"
        self.heldout_percent = heldout_percent
        self.limits = dict(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds, memory_bytes=memory_bytes)
        self._label = label
        self._pools: dict[str, list[Prompt]] = {"train": [], "test": []}
        for where, row in rows:
            text = row.get("prompt")
            if not isinstance(text, str) or not text.strip():
                state = "missing" if "prompt" not in row else f"{type(text).__name__}" if not isinstance(text, str) \
                    else "empty"
                raise DataFileError(f"{label} {where} has no prompt ('prompt' is {state}; it must be text)")
            tests = self._tests(row, where)
            entry = row.get("entry_point")
            if entry is not None and (not isinstance(entry, str) or not entry.isidentifier()):
                raise DataFileError(f"{label} {where} has entry_point {entry!r}: it must be a Python name")
            pid = hashlib.sha256(text.encode()).hexdigest()
            split = "test" if int(pid[:8], 16) % 100 < heldout_percent else "train"
            self._pools[split].append(Prompt(id=f"code/{pid[:16]}", text=text,
                                             answer=json.dumps({"tests": tests, "entry_point": entry})))
        check_splits(self._pools, len(rows), heldout_percent, label=label, key="prompt")

    def _tests(self, row: dict, where: str) -> list[str]:
        """The row's tests as a list of sources, each of which parses; a DataFileError names what is wrong."""
        value = row.get("tests")
        if value is None or (isinstance(value, str | list) and not value):
            state = "missing" if "tests" not in row else "null" if value is None else "empty"
            raise DataFileError(f"{self._label} {where} has no tests ('tests' is {state})")
        if isinstance(value, str):
            try:
                tests = split_tests(value)
            except SyntaxError as e:
                raise DataFileError(f"{self._label} {where} has tests that are not valid Python "
                                    f"({e.msg}, line {e.lineno})") from None
            if not tests:
                raise DataFileError(f"{self._label} {where} has tests with no assert statement")
            return tests
        if not isinstance(value, list) or not all(isinstance(t, str) and t.strip() for t in value):
            raise DataFileError(f"{self._label} {where} has a {type(value).__name__} in 'tests'; it must be a "
                                "string of asserts or a list of non-empty strings")
        for i, test in enumerate(value):
            try:
                tree = ast.parse(test)
            except SyntaxError as e:
                raise DataFileError(f"{self._label} {where} has test {i} that is not valid Python "
                                    f"({e.msg}, line {e.lineno})") from None
            if not any(isinstance(node, ast.Assert) for node in ast.walk(tree)):  # it would pass whatever ran
                raise DataFileError(f"{self._label} {where} has test {i} with no assert statement ({test[:40]!r})")
        return list(value)

    def split_size(self, split: Split) -> int:
        """How many distinct prompts ``split`` holds (the builder checks each against the model's context)."""
        return len(self._pools[split])

    def prompts(self, split: Split, n: int, seed: int) -> list[Prompt]:
        """``n`` prompts of ``split``, shuffled by ``seed``, cycling through the split when n exceeds it."""
        return draw_split(self._pools[split], n, seed, label=self._label, heldout_percent=self.heldout_percent)

    def reward(self, prompt: Prompt, completion_text: str) -> tuple[float, dict[str, Any]]:
        """The share of the prompt's tests that pass when the completion's code runs in the sandbox."""
        spec = json.loads(prompt.answer)
        tests = spec["tests"]
        program = program_for(prompt.text, completion_text, spec.get("entry_point"))
        if program is None:
            return 0.0, {"passed": 0, "total": len(tests), "status": "syntax_error"}
        result = sandbox.run_tests(program, tests, **self.limits)
        info: dict[str, Any] = {"passed": result.passed, "total": result.total, "status": result.status}
        if result.error:
            info["error"] = result.error[:200]
        if result.failures:
            info["failure"] = result.failures[0][:200]  # the first failing test and why
        return result.fraction, info
