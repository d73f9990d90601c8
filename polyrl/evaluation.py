"""Held-out evaluation: one greedy completion (or tool episode) per test prompt, graded by the task's verifier.

``eval/accuracy`` is the acting system's: with agency transfer, the baseline/learner mixture at the
evaluated step's ``beta``; ``eval/learner_accuracy`` is then the learner alone. Given which prompts the
starting model solved, ``eval/retained`` is the share of them still solved (forgetting shows here) and
``eval/gained`` the share of the others now solved. Custom reward channels never enter: a reward
function can shape training, not move the held-out score.
"""

from __future__ import annotations

import numpy as np

from polyrl.rollout.agency.arbiter import AgencyArbiter
from polyrl.rollout.episodes import EpisodeRunner
from polyrl.rollout.generator import SamplingParams
from polyrl.rollout.score import succeeded
from polyrl.tasks.base import Prompt, Task


def greedy_rewards(runner: EpisodeRunner, task: Task, prompts: list[Prompt], max_new_tokens: int,
                   seed: int = 0) -> list[float]:
    """The task reward of one greedy completion (or tool episode) per prompt.

    Greedy tokens need no randomness, but agency transfer's coins (who acts) do: ``seed`` fixes them, so an
    evaluation of the baseline/learner mixture is the same in every run.
    """
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, seed=seed)
    samples = runner.sample(prompts, params)
    return [task.reward(prompts[s.prompt_index], s.text)[0] for s in sorted(samples, key=lambda s: s.prompt_index)]


class Evaluator:
    """Held-out evaluation of the acting system at a step (see the module docstring)."""

    def __init__(self, runner: EpisodeRunner, task: Task, prompts: list[Prompt], max_new_tokens: int,
                 arbiter: AgencyArbiter | None = None) -> None:
        self.runner, self.task, self.prompts, self.max_new_tokens = runner, task, prompts, max_new_tokens
        self.arbiter = arbiter

    def __call__(self, step: int, solved_before: list[bool] | None = None) -> tuple[dict[str, float], list[bool]]:
        """Metrics at ``step`` and which prompts were solved."""
        if self.arbiter is not None:
            self.arbiter.set_step(step)
        rewards = greedy_rewards(self.runner, self.task, self.prompts, self.max_new_tokens, seed=step)
        solved = [succeeded(r) for r in rewards]  # a score above 1/2, as everywhere (score.succeeded)
        out = {"eval/accuracy": float(np.mean(solved)), "eval/reward_mean": float(np.mean(rewards))}
        if solved_before is not None and len(solved_before) == len(rewards):
            for key, start in (("eval/retained", True), ("eval/gained", False)):
                if start in solved_before:
                    out[key] = float(np.mean([now for now, was in zip(solved, solved_before) if was == start]))
        if self.arbiter is not None:  # the standalone learner too
            beta, self.arbiter.beta = self.arbiter.beta, 0.0
            alone = greedy_rewards(self.runner, self.task, self.prompts, self.max_new_tokens, seed=step)
            out["eval/learner_accuracy"] = float(np.mean([succeeded(r) for r in alone]))
            out["eval/agency_beta"], self.arbiter.beta = beta, beta
        return out, solved

    @staticmethod
    def summary(metrics: dict[str, float]) -> dict[str, float]:
        """The final evaluation's entries of ``summary.json``: ``eval_after``, and with agency transfer the
        standalone learner's accuracy and the acting system's beta."""
        names = {"eval/accuracy": "eval_after", "eval/learner_accuracy": "learner_eval_after",
                 "eval/agency_beta": "agency_beta_after"}
        return {names[k]: v for k, v in metrics.items() if k in names}
