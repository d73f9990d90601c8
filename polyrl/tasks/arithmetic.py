"""Arithmetic tasks: ``digits``-digit addition, the demo task of the tiny model.

Prompt ``"12+34="``, answer ``"46"``. The reward is 1.0 when the completion, stripped of
surrounding whitespace, equals the answer exactly, else 0.0 (no partial credit, no parsing of
"the last number"). The completion text is what the generator returns: the decoded tokens up to,
not including, EOS.

Split convention: every pair of operands (a, b) with ``digits`` digits each belongs to exactly one
split, decided by a hash of the text "a+b" (about 10% test), so the splits are disjoint and
identical on every machine, Python version and seed; ``seed`` only chooses which prompts of the
split are returned and in which order.
"""

from __future__ import annotations

import hashlib
import random
from functools import cached_property
from typing import Any

from polyrl.tasks.base import Prompt, Split

TEST_PERCENT = 10  # share of operand pairs held out for evaluation


def _is_test(a: int, b: int) -> bool:
    digest = hashlib.sha256(f"{a}+{b}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < TEST_PERCENT


class AdditionTask:
    """Add two ``digits``-digit numbers: prompt "a+b=", answer str(a + b), reward exact match.

    ``digits`` may also be a tuple of sizes (``addition_mixed`` = (2, 3)): both operands of a prompt
    have the same size, and each size fills an equal share of the pool (900 pairs each, drawn with a
    fixed seed) -- a task of mixed difficulty, where a warm-started model solves some prompts reliably
    and fails others reliably (the tree sampler's benchmark).
    """

    exact_answer = True  # reward 1 exactly when the completion is the answer: the tree's likelihood predictor applies

    def __init__(self, digits: int | tuple[int, ...] = 2) -> None:
        sizes = (digits,) if isinstance(digits, int) else tuple(digits)
        if not sizes or min(sizes) < 1:
            raise ValueError(f"AdditionTask: digits must be >= 1, got {digits}")
        self.digits = sizes
        self.name = ("addition" if sizes == (2,) else f"addition{sizes[0]}" if len(sizes) == 1
                     else "addition_mixed" if sizes == (2, 3) else "addition" + "_".join(map(str, sizes)))

    @cached_property
    def _pools(self) -> dict[str, list[tuple[int, int]]]:
        pools: dict[str, list[tuple[int, int]]] = {"train": [], "test": []}
        for d in self.digits:
            low, high = 10 ** (d - 1), 10**d
            pairs = [(a, b) for a in range(low, high) for b in range(low, high)]
            if len(self.digits) > 1:  # equal shares: subsample large sizes deterministically
                pairs = random.Random(d).sample(pairs, min(len(pairs), 900))
            for a, b in pairs:
                pools["test" if _is_test(a, b) else "train"].append((a, b))
        return pools

    def prompts(self, split: Split, n: int, seed: int) -> list[Prompt]:
        """Return ``n`` prompts of ``split``: without repetition while ``n`` fits the split, then cycling
        through fresh shuffles of it."""
        if split not in ("train", "test"):
            raise ValueError(f"{self.name}: split must be 'train' or 'test', got {split!r}")
        if n < 0:
            raise ValueError(f"{self.name}: n must be >= 0, got {n}")
        pool = self._pools[split]
        rng = random.Random(seed)
        pairs: list[tuple[int, int]] = []
        while len(pairs) < n:
            pairs.extend(rng.sample(pool, min(len(pool), n - len(pairs))))
        return [Prompt(id=f"{self.name}/{a}+{b}", text=f"{a}+{b}=", answer=str(a + b)) for a, b in pairs]

    def reward(self, prompt: Prompt, completion_text: str) -> tuple[float, dict[str, Any]]:
        """Return 1.0 when ``completion_text.strip() == prompt.answer``, else 0.0."""
        correct = completion_text.strip() == prompt.answer
        return (1.0 if correct else 0.0), {"correct": correct}
