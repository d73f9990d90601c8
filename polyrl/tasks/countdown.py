"""Countdown: combine the given numbers with + - * / to reach the target.

Prompt ``"3 7 25 50:181="`` (numbers, then the target); the completion is an expression such as
``50*3+25+7-1`` ... The checker accepts *any* valid expression: integers only from the given
numbers, each used at most once (the classic game's rule; TinyZero's variant demands every number
exactly once -- set ``use_all=True``), operators + - * / and parentheses, evaluated exactly with
fractions so that division is checked without rounding.
"""

from __future__ import annotations

import ast
import hashlib
import random
from collections import Counter
from fractions import Fraction
from typing import Any

from polyrl.tasks.base import Prompt, Split

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


MAX_CHARS = 500  # the longest expression evaluated (see evaluate_expression)


class CountdownError(ValueError):
    """The completion is not a valid Countdown expression (the message says why)."""


def evaluate_expression(expr: str, numbers: list[int], *, use_all: bool = False) -> Fraction:
    """Evaluate ``expr`` exactly; raise CountdownError if it uses other numbers, repeats one or has other syntax.

    An expression over ``MAX_CHARS`` characters is refused before it is parsed: no Countdown answer needs that many,
    and deep nesting (a run of unary minus signs, "1+1+...") makes the parser and the evaluator recurse past
    Python's limit or run out of memory."""
    if len(expr.strip()) > MAX_CHARS:
        raise CountdownError(f"expression of {len(expr.strip())} characters; at most {MAX_CHARS}")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError, ValueError):  # ValueError: a null byte
        raise CountdownError(f"not an arithmetic expression: {expr[:60]!r}") from None
    used: list[int] = []

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise CountdownError("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise CountdownError(f"only integers, + - * / and parentheses are allowed, got {ast.dump(node)[:40]}")

    try:
        value = ev(tree.body)
    except RecursionError:
        raise CountdownError("expression nested too deeply") from None
    have, need = Counter(numbers), Counter(used)
    if any(need[n] > have[n] for n in need):
        raise CountdownError(f"uses numbers {sorted(used)} not available in {sorted(numbers)}")
    if use_all and need != have:
        raise CountdownError(f"must use every number exactly once: {sorted(numbers)}")
    return value


def _solvable_target(rng: random.Random, numbers: list[int]) -> int:
    """Build a random expression over a random subset of the numbers; its positive integer value is the target."""
    while True:
        pool = [Fraction(n) for n in rng.sample(numbers, rng.randint(2, len(numbers)))]
        while len(pool) > 1:
            a, b = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
            op = rng.choice("+-*/")
            if op == "/" and (b == 0 or (a / b).denominator != 1):
                op = "+"
            pool.append({"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a + b}[op])
        if pool[0] > 0 and pool[0].denominator == 1 and pool[0] < 1000:
            return int(pool[0])


class CountdownTask:
    """Reach the target with the given numbers; reward 1.0 for any valid expression that equals it."""

    def __init__(self, n_numbers: int = 3, max_number: int = 20, use_all: bool = False) -> None:
        if n_numbers < 2:
            raise ValueError(f"CountdownTask: n_numbers must be >= 2, got {n_numbers}")
        self.n_numbers, self.max_number, self.use_all = n_numbers, max_number, use_all
        self.name = "countdown"

    def _make(self, index: int) -> Prompt:
        rng = random.Random(f"countdown-{self.n_numbers}-{self.max_number}-{index}")
        numbers = [rng.randint(1, self.max_number) for _ in range(self.n_numbers)]
        target = _solvable_target(rng, numbers)
        text = " ".join(map(str, numbers)) + f":{target}="
        return Prompt(id=f"countdown/{text}", text=text, answer=str(target))

    @staticmethod
    def _split_of(prompt: Prompt) -> Split:
        return "test" if hashlib.sha256(prompt.id.encode()).digest()[0] < 26 else "train"  # ~10 % test

    def prompts(self, split: Split, n: int, seed: int) -> list[Prompt]:
        """Deterministic prompts of ``split`` (a hash of the prompt decides its split, so they never overlap)."""
        if split not in ("train", "test"):
            raise ValueError(f"countdown: split must be 'train' or 'test', got {split!r}")
        out, index = [], random.Random(seed).randrange(10**6)
        while len(out) < n:
            p = self._make(index)
            index += 1
            if self._split_of(p) == split:
                out.append(p)
        return out

    def reward(self, prompt: Prompt, completion_text: str) -> tuple[float, dict[str, Any]]:
        """1.0 if the completion is a valid expression over the prompt's numbers equal to the target."""
        numbers = [int(x) for x in prompt.text.split(":")[0].split()]
        try:
            value = evaluate_expression(completion_text, numbers, use_all=self.use_all)
        except CountdownError as e:
            return 0.0, {"valid": False, "error": str(e)}
        return (1.0 if value == int(prompt.answer) else 0.0), {"valid": True, "value": str(value)}
