"""Toy tasks for flow policies: 2D mode selection (plain and conditional) and a point-mass reach task.

A task hands out one context per group (the analogue of a prompt, shared by the group's G samples)
and plays episodes with an ``act`` function that maps observations [E, C] (or None) to a sampler
``Trajectory`` of E actions. Bandit tasks are one-step episodes; ``reach`` runs ``horizon`` steps.
Rewards are per episode [E]; every action of an episode gets that episode's advantage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from polyrl.families.flow.policy import PretrainSettings, one_hot, ring_means
from polyrl.families.flow.sampler import Trajectory

Act = Callable[[Tensor | None, int], Trajectory]  # (observations [E, C] or None, E) -> Trajectory of E actions


def mode_reward(x: Tensor, centres: Tensor, width: float) -> Tensor:
    """max_j exp(-||x - c_j||^2 / (2 width^2)) over the rewarded centres; centres [K, D] or [E, K, D]. Returns [E]."""
    c = centres if centres.dim() == 3 else centres.unsqueeze(0)
    d2 = ((x.unsqueeze(1) - c) ** 2).sum(-1)
    return torch.exp(-d2.min(-1).values / (2 * width**2))


@dataclass
class ModeSelection:
    """Reward 2 of the 8 ring modes of the pretrained ``ring8`` policy (unconditional: no context)."""

    name: str = "ring_modes"
    target_label: str = "rewarded modes"
    rewarded: tuple[int, ...] = (0, 3)
    width: float = 0.4
    dim: int = 2
    context_dim: int = 0
    pretrain: PretrainSettings | None = field(default_factory=lambda: PretrainSettings(target="ring8"))

    def contexts(self, n_groups: int, generator: torch.Generator) -> Tensor | None:
        return None

    def episode(self, act: Act, contexts: Tensor | None, n: int,
                generator: torch.Generator) -> tuple[list[Trajectory], Tensor]:
        traj = act(None, n)
        return [traj], mode_reward(traj.samples, ring_means()[list(self.rewarded)], self.width)

    def modes(self, contexts: Tensor | None) -> Tensor:
        """Rewarded centres [K, 2] (for plots)."""
        return ring_means()[list(self.rewarded)]

    def points(self, traj: Trajectory, contexts: Tensor | None, horizon: int) -> Tensor:
        """Final samples [E, 2] (for scatter plots)."""
        return traj.samples


@dataclass
class ConditionalModeSelection:
    """Context c in {0..3} (one-hot) asks for modes c and c + 4 of the conditional ``ring8_cond`` policy."""

    name: str = "ring_modes_cond"
    target_label: str = "rewarded modes (by context colour)"
    width: float = 0.4
    dim: int = 2
    context_dim: int = 4
    pretrain: PretrainSettings | None = field(default_factory=lambda: PretrainSettings(target="ring8_cond"))

    def contexts(self, n_groups: int, generator: torch.Generator) -> Tensor:
        return one_hot(torch.randint(4, (n_groups,), generator=generator), 4)

    def modes(self, contexts: Tensor) -> Tensor:
        """Rewarded centres [E, 2, 2] of each episode's context."""
        c = contexts.argmax(-1)
        return ring_means()[torch.stack([c, c + 4], -1)]

    def points(self, traj: Trajectory, contexts: Tensor | None, horizon: int) -> Tensor:
        """Final samples [E, 2] (for scatter plots)."""
        return traj.samples

    def episode(self, act: Act, contexts: Tensor, n: int,
                generator: torch.Generator) -> tuple[list[Trajectory], Tensor]:
        traj = act(contexts, n)
        return [traj], mode_reward(traj.samples, self.modes(contexts), self.width)


@dataclass
class Reach:
    """Point mass: pos' = pos + step_size * clamp(a, -1, 1) for ``horizon`` steps; reward -mean_t ||pos_t - goal||.

    The observation (policy context) is (pos, goal - pos); start and goal are drawn per group from
    U[-1, 1]^2. There is no pretrained policy: FPO (or any flow method) trains from a random init.
    """

    name: str = "reach"
    target_label: str = "goal (points: final position - goal)"
    horizon: int = 5
    step_size: float = 0.4
    dim: int = 2
    context_dim: int = 4
    pretrain: PretrainSettings | None = None

    def contexts(self, n_groups: int, generator: torch.Generator) -> Tensor:
        return torch.rand(n_groups, 4, generator=generator) * 2 - 1  # (start, goal)

    def episode(self, act: Act, contexts: Tensor, n: int,
                generator: torch.Generator) -> tuple[list[Trajectory], Tensor]:
        pos, goal = contexts[:, :2].clone(), contexts[:, 2:]
        trajs, dist = [], []
        for _ in range(self.horizon):
            traj = act(torch.cat([pos, goal - pos], -1), n)
            pos = pos + self.step_size * traj.samples.clamp(-1, 1)
            trajs.append(traj)
            dist.append((pos - goal).norm(dim=-1))
        return trajs, -torch.stack(dist, -1).mean(-1)

    def modes(self, contexts: Tensor) -> Tensor:
        """The goal, relative to itself: the origin of the ``points`` plot."""
        return torch.zeros(1, 2)

    def points(self, traj: Trajectory, contexts: Tensor, horizon: int) -> Tensor:
        """Final position minus goal [E, 2], rebuilt from the (env step, episode)-ordered actions."""
        moves = traj.samples.clamp(-1, 1).reshape(horizon, contexts.shape[0], 2).sum(0)
        return contexts[:, :2] + self.step_size * moves - contexts[:, 2:]


TASKS: dict[str, Callable[[], ModeSelection | ConditionalModeSelection | Reach]] = {
    "ring_modes": ModeSelection,
    "ring_modes_cond": ConditionalModeSelection,
    "reach": Reach,
}


def get_task(name: str):
    """Build task ``name``; unknown names raise ValueError listing the allowed ones."""
    if name not in TASKS:
        raise ValueError(f"task = {name!r}; allowed: {', '.join(TASKS)}")
    return TASKS[name]()
