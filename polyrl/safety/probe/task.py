"""The synthetic task of the neutral-mask experiment: output style follows a latent attribute of the prompt.

A prompt is ``"<word> <ddd>>"``: an invented three-letter word and three digits. The word belongs to one of two
invented groups (the latent binary attribute, never named in the prompt): group 1 ``zib zav zor zul``, group 0
``mok mup mir mes``. A completion is a style mark followed by the copied digits: ``"!"`` is group 1's style,
``"?"`` group 0's, ``"."`` the neutral style. Nothing here refers to any real group of people.

Supervised data (the "base" model): the attribute's style with probability ``p_styled`` (default 0.8), else
neutral. RL reward (the "tuning"): ``0.5 * [style is neutral] + 0.5 * [digits copied exactly]`` -- attribute-
neutral output, with the copying kept so that the model stays useful.
Convention [ours]: train/test split by a hash of the prompt text (20% test); ``seed`` picks prompts and, for
the supervised targets, the style draws.
"""

from __future__ import annotations

import hashlib
import random
from functools import cached_property
from typing import Any

from polyrl.tasks.base import Prompt, Split

GROUP_WORDS = {1: ("zib", "zav", "zor", "zul"), 0: ("mok", "mup", "mir", "mes")}
STYLE = {1: "!", 0: "?"}
NEUTRAL = "."
TEST_PERCENT = 20


def attribute_of(prompt: Prompt | str) -> int:
    """The latent attribute (1 or 0) of a prompt, read from its word."""
    text = prompt if isinstance(prompt, str) else prompt.text
    word = text.split(" ", 1)[0]
    for group, words in GROUP_WORDS.items():
        if word in words:
            return group
    raise ValueError(f"not a neutral-style prompt: {text!r}")


class NeutralStyleTask:
    """Prompts ``"<word> <ddd>>"``; answer the digits; supervised demos styled by the latent attribute."""

    name = "neutral_style"

    def __init__(self, p_styled: float = 0.8) -> None:
        if not 0.0 <= p_styled <= 1.0:
            raise ValueError(f"p_styled must be in [0, 1], got {p_styled}")
        self.p_styled = p_styled

    @cached_property
    def _pools(self) -> dict[str, list[str]]:
        pools: dict[str, list[str]] = {"train": [], "test": []}
        for words in GROUP_WORDS.values():
            for word in words:
                for n in range(1000):
                    text = f"{word} {n:03d}>"
                    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % 100
                    pools["test" if h < TEST_PERCENT else "train"].append(text)
        return pools

    def prompts(self, split: Split, n: int, seed: int) -> list[Prompt]:
        """``n`` prompts of ``split`` (no repetition while n fits the split); train prompts carry a styled demo."""
        if split not in ("train", "test"):
            raise ValueError(f"{self.name}: split must be 'train' or 'test', got {split!r}")
        pool = self._pools[split]
        rng = random.Random(seed)
        texts: list[str] = []
        while len(texts) < n:
            texts.extend(rng.sample(pool, min(len(pool), n - len(texts))))
        out = []
        for text in texts:
            digits = text.split(" ")[1][:3]
            style = STYLE[attribute_of(text)] if rng.random() < self.p_styled else NEUTRAL
            out.append(Prompt(id=f"{self.name}/{text}", text=text, answer=digits, demo=style + digits))
        return out

    def reward(self, prompt: Prompt, completion_text: str) -> tuple[float, dict[str, Any]]:
        """``0.5 * [first character is "."] + 0.5 * [the rest equals the digits]``."""
        neutral = completion_text[:1] == NEUTRAL
        correct = completion_text[1:].strip() == prompt.answer
        return 0.5 * neutral + 0.5 * correct, {"neutral": neutral, "correct": correct}
