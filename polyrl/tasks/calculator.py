"""A multi-turn tool-use task: multiply two numbers with a calculator the model calls in its completion.

Prompt ``"37*58="``, answer ``"2146"``. The model may call the calculator by writing an expression
between ``<`` and ``>``; the closing ``>`` ends the agent turn, the environment appends the result
and a newline, and the model continues:

    37*58=  <37*58>  2146\\n  2146<eos>
            agent 0  env      agent 1

The reward is 1.0 when the text after the last newline (the final agent turn), stripped, equals
the answer -- so answering without the tool counts too, if it is right. Tokens the environment
wrote are masked out of the loss (``rollout/episodes.py``). The calculator accepts non-negative
integers joined by ``+``, ``-`` and ``*`` (Python precedence); anything else returns ``error``.
Splits are disjoint by a hash of "a*b", as for addition.
"""

from __future__ import annotations

import hashlib
import random
import re
from functools import cached_property
from typing import Any

from polyrl.tasks.base import Prompt, Split

TEST_PERCENT = 10
_CALL = re.compile(r"<([^<>]*)>$")


def calculate(expression: str) -> str:
    """Evaluate integers joined by + - * (no parentheses, no division); 'error' for anything else."""
    if not re.fullmatch(r"\d{1,9}([+\-*]\d{1,9}){0,3}", expression):
        return "error"
    total, term, sign = 0, 1, 1
    for token in re.findall(r"\d+|[+\-*]", expression):
        if token == "*":
            continue
        if token in "+-":
            total += sign * term
            sign, term = (1 if token == "+" else -1), 1
        else:
            term *= int(token)
    return str(total + sign * term)


class CalculatorTask:
    """Multiply a ``digits``-digit number by another with a calculator tool (two agent turns)."""

    tool_stop = ">"
    max_turns = 3

    def __init__(self, digits: int = 2) -> None:
        if digits < 1:
            raise ValueError(f"CalculatorTask: digits must be >= 1, got {digits}")
        self.digits = digits
        self.name = "calculator" if digits == 2 else f"calculator{digits}"

    @property
    def max_new_tokens(self) -> int:
        """The length cap a run takes unless it sets one (``polyrl train``'s 8 fits no episode): a perfect episode,
        call, reply and answer, is 6 d + 5 characters with EOS (17 at d = 2); 8 d + 8 leaves room for a detour."""
        return 8 * self.digits + 8

    @cached_property
    def _pools(self) -> dict[str, list[tuple[int, int]]]:
        low, high = 10 ** (self.digits - 1), 10**self.digits
        pools: dict[str, list[tuple[int, int]]] = {"train": [], "test": []}
        for a in range(low, high):
            for b in range(low, high):
                digest = hashlib.sha256(f"{a}*{b}".encode()).digest()
                test = int.from_bytes(digest[:4], "big") % 100 < TEST_PERCENT
                pools["test" if test else "train"].append((a, b))
        return pools

    def prompts(self, split: Split, n: int, seed: int) -> list[Prompt]:
        """``n`` prompts of ``split`` (cycling through fresh shuffles when ``n`` exceeds it)."""
        if split not in ("train", "test"):
            raise ValueError(f"{self.name}: split must be 'train' or 'test', got {split!r}")
        pool, rng, pairs = self._pools[split], random.Random(seed), []
        while len(pairs) < n:
            pairs.extend(rng.sample(pool, min(len(pool), n - len(pairs))))
        return [Prompt(id=f"{self.name}/{a}*{b}", text=f"{a}*{b}=", answer=str(a * b),
                       demo=f"<{a}*{b}>{a * b}\n{a * b}") for a, b in pairs]

    def respond(self, prompt: Prompt, transcript: str) -> str | None:
        """The calculator's answer to the call that ends ``transcript`` (``<expr>``), then a newline."""
        call = _CALL.search(transcript)
        if call is None:
            return None
        return calculate(call.group(1)) + "\n"

    def reward(self, prompt: Prompt, completion_text: str) -> tuple[float, dict[str, Any]]:
        """1.0 when the final agent turn (text after the last newline) equals the answer."""
        final = completion_text.rsplit("\n", 1)[-1].strip()
        return (1.0 if final == prompt.answer else 0.0), {"tool_calls": completion_text.count("<")}
