"""Math word problems from a local JSONL or Parquet file, graded with math-verify.

The file is read with ``datasets`` (no hub access). The question column is the first of
``question``, ``problem``, ``prompt`` that exists (or ``prompt_key``), the answer column the first
of ``answer``, ``solution``, ``ground_truth`` (or ``answer_key``). A row goes to the test split when
a hash of its question falls in the first ``test_percent`` percent, so splits are disjoint and stable
when rows are added. The reward is 1.0 when math-verify finds the completion's answer equal to the
reference (numbers, fractions, LaTeX), else 0.0.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

from polyrl.tasks.base import Prompt, Split

QUESTION_KEYS = ("question", "problem", "prompt")
ANSWER_KEYS = ("answer", "solution", "ground_truth")


class MathTask:
    """Problems from a local file; reward by math-verify equivalence with the reference answer."""

    def __init__(self, data_file: str, *, prompt_key: str | None = None, answer_key: str | None = None,
                 template: str = "{question}\nAnswer: ", test_percent: int = 10) -> None:
        import datasets
        from datasets import load_dataset

        datasets.disable_progress_bars()  # a local file loads in milliseconds; no bars on stderr

        path = Path(data_file)
        if not path.is_file():
            raise FileNotFoundError(f"data_file {str(path)!r} does not exist")
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
        if kind is None:
            raise ValueError(f"data_file {str(path)!r}: use a .jsonl, .json or .parquet file")
        rows = load_dataset(kind, data_files=str(path), split="train")
        columns = list(rows.column_names)
        q = prompt_key or next((k for k in QUESTION_KEYS if k in columns), None)
        a = answer_key or next((k for k in ANSWER_KEYS if k in columns), None)
        for role, key, options in (("question", q, QUESTION_KEYS), ("answer", a, ANSWER_KEYS)):
            if key is None or key not in columns:
                raise ValueError(f"data_file {str(path)!r} has no {role} column "
                                 f"({key or ' or '.join(options)}); its columns: {', '.join(columns)}")
        self.name = "math"
        self.template = template
        self._pools: dict[str, list[Prompt]] = {"train": [], "test": []}
        for question, answer in zip(rows[q], rows[a]):
            pid = hashlib.sha256(str(question).encode()).hexdigest()
            split = "test" if int(pid[:8], 16) % 100 < test_percent else "train"
            self._pools[split].append(Prompt(id=f"math/{pid[:16]}", text=template.format(question=question),
                                             answer=str(answer)))
        if not self._pools["train"]:
            raise ValueError(f"data_file {str(path)!r} has no training rows")

    def prompts(self, split: Split, n: int, seed: int) -> list[Prompt]:
        """``n`` prompts of ``split``, shuffled by ``seed``, cycling through the split when n exceeds it."""
        pool = self._pools[split]
        if not pool:
            raise ValueError(f"math task: the {split} split is empty (too few rows for test_percent)")
        rng, out = random.Random(seed), []
        while len(out) < n:
            out.extend(rng.sample(pool, min(len(pool), n - len(out))))
        return out

    def reward(self, prompt: Prompt, completion_text: str) -> tuple[float, dict[str, Any]]:
        """1.0 when math-verify says the completion's final answer equals the reference."""
        from math_verify import parse, verify

        gold, pred = parse(prompt.answer), parse(completion_text)
        ok = bool(pred) and bool(verify(gold, pred))
        return (1.0 if ok else 0.0), {"parsed": [str(p) for p in pred][:2]}
