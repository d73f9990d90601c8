"""The task protocol: where prompts come from and how a completion is scored.

A task is a plain object with a ``name``, a ``prompts`` method that returns deterministic,
disjoint train and test splits, and a ``reward`` method that scores one completion. Rewards are
verifiable (computed by a program, never by a model) and come with a small ``info`` dict of
plain values for logging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

Split = Literal["train", "test"]


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task: a stable id, the text given to the model, and the reference answer.

    A prompt may be a conversation (``messages``, (role, content) pairs); a chat template then renders it, and
    ``rendered`` holds the text the model is conditioned on (``polyrl.tasks.chat``), special tokens included.
    """

    id: str  # stable across runs and machines, e.g. "addition/12+34"
    text: str  # the task's text: what the policy is conditioned on in plain mode, e.g. "12+34="
    answer: str  # the reference answer, e.g. "46"
    demo: str | None = None  # supervised warm-start target when it is not just the answer (tool transcripts)
    messages: tuple[tuple[str, str], ...] | None = None  # the prompt as chat turns; None: one user turn of text
    rendered: str | None = None  # set by a chat template (tasks.chat.PromptFormat); None: plain text

    @property
    def model_text(self) -> str:
        """The text the model is conditioned on: the rendered chat template, else the plain text."""
        return self.text if self.rendered is None else self.rendered


class Task(Protocol):
    """A verifiable task: deterministic prompt splits and a programmatic reward."""

    name: str

    def prompts(self, split: Split, n: int, seed: int) -> list[Prompt]:
        """Return ``n`` prompts of ``split``; the same (split, n, seed) always gives the same list."""
        ...

    def reward(self, prompt: Prompt, completion_text: str) -> tuple[float, dict[str, Any]]:
        """Score one completion (the text generated after the prompt) of ``prompt``."""
        ...


def held_out_prompts(task: Task, n: int, seed: int = 0) -> list[Prompt]:
    """The evaluation's prompts (``seed`` 0; the drift meter's probes draw with their own): ``n`` distinct ones of the
    task's held-out split. A task cycles through a split smaller than ``n``, and a generated one (countdown) can draw a
    prompt twice; greedy decoding gives a repeated prompt the same answer, so a repeat would only weigh some prompts
    more than others in the accuracy. Repeats are dropped and more are drawn (up to 8n) until there are ``n`` or the
    split has no more."""
    want = n
    while True:
        got = list(dict.fromkeys(task.prompts("test", want, seed=seed)))
        if len(got) >= n or want >= 8 * n:
            return got[:n]
        want *= 2
