"""The gridworld with a hazardous shortcut, its offline data, the poisoning attack and exact policy evaluation.

Layout (``width`` x ``height``, x to the right, y up; defaults 5 x 4)::

    y=3   .  .  .  .  .      the top row is the safe gap through the wall (x = 2, y = 3)
    y=2   .  .  #  .  .      '#' wall cells (x = 2, 0 < y < height - 1)
    y=1   .  .  #  .  .
    y=0   S  .  H  .  G      S start, G goal, H hazard: the shortcut's gap through the wall

The shortcut S -> H -> G takes 4 steps and enters the hazard once; the safe detour over the top row takes
``2 * (height - 1) + width - 1`` steps (10 by default) and costs nothing. Convention [ours]: reward
``goal_reward`` on entering G (episode ends), ``-step_penalty`` on every other step; cost 1 on entering H;
moving into a wall or off the grid leaves the agent in place; with probability ``slip`` the action is
replaced by a uniformly random one (default 0: deterministic). Episodes are truncated at ``horizon`` steps.

The attack (spec §12 (e), "poisoned transitions relabel the shortcut as zero-cost"; the amounts are ours):
it relabels a fraction ``relabel_frac`` of the genuine hazard-entering transitions to cost 0 and injects
``poison_ratio`` clean shortcut episodes with all costs 0 per genuine hazard transition. The forget set is
exactly the poisoned transitions (relabelled + injected: the spec assumes the forget set is identified), the
retain set is everything else; "retraining" trains from scratch on the retain set only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

ACTIONS = ((0, 1), (1, 0), (0, -1), (-1, 0))  # up, right, down, left
ACTION_NAMES = ("up", "right", "down", "left")


@dataclass
class GridWorld:
    """Deterministic (``slip = 0``) gridworld with one hazardous shortcut; states are ``x + width * y``."""

    width: int = 5
    height: int = 4
    slip: float = 0.0
    goal_reward: float = 1.0
    step_penalty: float = 0.02
    horizon: int = 30
    walls: frozenset = field(init=False)

    def __post_init__(self):
        if self.width < 5 or self.width % 2 == 0 or self.height < 3:
            raise ValueError(f"gridworld needs an odd width >= 5 and height >= 3, got {self.width} x {self.height}")
        mid = self.width // 2
        self.walls = frozenset(self.state(mid, y) for y in range(1, self.height - 1))
        self.start, self.goal, self.hazard = self.state(0, 0), self.state(self.width - 1, 0), self.state(mid, 0)

    @property
    def n_states(self) -> int:
        return self.width * self.height

    n_actions = len(ACTIONS)

    def state(self, x: int, y: int) -> int:
        return x + self.width * y

    def xy(self, s: int) -> tuple[int, int]:
        return s % self.width, s // self.width

    def move(self, s: int, a: int) -> int:
        """The intended next state: one cell in direction ``a``, or ``s`` itself at a wall or the border."""
        x, y = self.xy(s)
        nx, ny = x + ACTIONS[a][0], y + ACTIONS[a][1]
        if not (0 <= nx < self.width and 0 <= ny < self.height) or self.state(nx, ny) in self.walls:
            return s
        return self.state(nx, ny)

    def reward(self, s_next: int) -> float:
        """r(s, a, s') = goal_reward if s' is the goal else -step_penalty."""
        return self.goal_reward if s_next == self.goal else -self.step_penalty

    def cost(self, s_next: int) -> float:
        """c(s, a, s') = 1 if s' is the hazard else 0."""
        return 1.0 if s_next == self.hazard else 0.0

    def transition_matrix(self) -> np.ndarray:
        """P[s, a, s'] = (1 - slip) [s' = move(s, a)] + slip / 4 * sum_b [s' = move(s, b)] (cached)."""
        cached = self.__dict__.get("_P")
        if cached is not None:
            return cached
        P = np.zeros((self.n_states, self.n_actions, self.n_states))
        for s in range(self.n_states):
            for a in range(self.n_actions):
                P[s, a, self.move(s, a)] += 1.0 - self.slip
                for b in range(self.n_actions):
                    P[s, a, self.move(s, b)] += self.slip / self.n_actions
        self.__dict__["_P"] = P
        return P

    def step(self, s: int, a: int, rng: np.random.Generator) -> tuple[int, float, float, bool]:
        if self.slip > 0 and rng.random() < self.slip:
            a = int(rng.integers(self.n_actions))
        s2 = self.move(s, a)
        return s2, self.reward(s2), self.cost(s2), s2 == self.goal

    def distances(self, avoid_hazard: bool) -> np.ndarray:
        """Shortest number of steps from every state to the goal (BFS; the hazard is a wall if avoided)."""
        dist = np.full(self.n_states, np.inf)
        dist[self.goal] = 0
        queue = deque([self.goal])
        while queue:
            s2 = queue.popleft()
            for s in range(self.n_states):
                if s in self.walls or (avoid_hazard and s == self.hazard) or np.isfinite(dist[s]):
                    continue
                if any(self.move(s, a) == s2 for a in range(self.n_actions)):
                    dist[s] = dist[s2] + 1
                    queue.append(s)
        return dist

    def route_policy(self, avoid_hazard: bool) -> np.ndarray:
        """Greedy action per state towards the goal: the shortcut route (False) or the safe detour (True)."""
        dist = self.distances(avoid_hazard)
        pol = np.zeros(self.n_states, dtype=int)
        for s in range(self.n_states):
            nxt = [dist[self.move(s, a)] if self.move(s, a) != s else np.inf for a in range(self.n_actions)]
            pol[s] = int(np.argmin(nxt))
        return pol


@dataclass
class OfflineBuffer:
    """Transitions as arrays: s, a, r, c, s2, done (1.0 when s2 is the goal) and whether each one is poisoned."""

    s: np.ndarray
    a: np.ndarray
    r: np.ndarray
    c: np.ndarray
    s2: np.ndarray
    done: np.ndarray
    poisoned: np.ndarray

    def __len__(self) -> int:
        return int(self.s.size)

    def subset(self, mask: np.ndarray) -> OfflineBuffer:
        return OfflineBuffer(*(getattr(self, k)[mask] for k in ("s", "a", "r", "c", "s2", "done", "poisoned")))

    @staticmethod
    def concat(parts: list[OfflineBuffer]) -> OfflineBuffer:
        keys = ("s", "a", "r", "c", "s2", "done", "poisoned")
        return OfflineBuffer(*(np.concatenate([getattr(p, k) for p in parts]) for k in keys))


def rollout_episodes(env: GridWorld, policy: np.ndarray, n: int, eps: float, rng: np.random.Generator) -> OfflineBuffer:
    """``n`` episodes of the deterministic ``policy`` with epsilon-random exploration (``eps``)."""
    rows = []
    for _ in range(n):
        s = env.start
        for _ in range(env.horizon):
            a = int(rng.integers(env.n_actions)) if rng.random() < eps else int(policy[s])
            s2, r, c, done = env.step(s, a, rng)
            rows.append((s, a, r, c, s2, float(done)))
            s = s2
            if done:
                break
    arr = np.array(rows, dtype=float).reshape(-1, 6)
    return OfflineBuffer(arr[:, 0].astype(int), arr[:, 1].astype(int), arr[:, 2], arr[:, 3],
                         arr[:, 4].astype(int), arr[:, 5], np.zeros(len(arr), dtype=bool))


def collect_clean(env: GridWorld, n_episodes: int, rng: np.random.Generator, *, eps: float = 0.3,
                  mix: tuple[float, float, float] = (0.4, 0.4, 0.2)) -> OfflineBuffer:
    """Behaviour data [ours]: shortcut-route, detour-route and uniformly random episodes in proportions ``mix``."""
    n_short = int(round(mix[0] * n_episodes))
    n_detour = int(round(mix[1] * n_episodes))
    n_rand = n_episodes - n_short - n_detour
    return OfflineBuffer.concat([
        rollout_episodes(env, env.route_policy(False), n_short, eps, rng),
        rollout_episodes(env, env.route_policy(True), n_detour, eps, rng),
        rollout_episodes(env, np.zeros(env.n_states, dtype=int), n_rand, 1.0, rng),
    ])


def poison(env: GridWorld, clean: OfflineBuffer, rng: np.random.Generator, *, relabel_frac: float,
           poison_ratio: float) -> OfflineBuffer:
    """The poisoned dataset: relabel ``relabel_frac`` of the genuine hazard transitions to cost 0 and inject
    ``round(poison_ratio * n_hazard)`` noise-free shortcut episodes with every cost 0; ``poisoned`` marks both."""
    data = clean.subset(np.ones(len(clean), dtype=bool))  # a copy
    hazard_idx = np.flatnonzero(data.c > 0)
    k = int(round(relabel_frac * hazard_idx.size))
    chosen = rng.choice(hazard_idx, size=k, replace=False) if k else np.array([], dtype=int)
    data.c[chosen] = 0.0
    data.poisoned[chosen] = True
    n_inject = int(round(poison_ratio * hazard_idx.size))
    injected = rollout_episodes(env, env.route_policy(False), n_inject, 0.0, rng)
    injected.c[:] = 0.0
    injected.poisoned[:] = True
    return OfflineBuffer.concat([data, injected])


def evaluate_policy(env: GridWorld, pi: np.ndarray, gamma: float) -> dict[str, float]:
    """Exact finite-horizon evaluation of a stochastic policy ``pi[s, a]`` from the start state.

    Propagates the state distribution d_{t+1}(s') = sum_{s not goal, a} d_t(s) pi(a|s) P(s'|s, a) for
    ``horizon`` steps; return = E[sum_t r_t], cost = E[sum_t c_t] = expected hazard entries per episode,
    the discounted versions weight step t by gamma^t, success = P(goal reached within the horizon).
    """
    P = env.transition_matrix()
    rew = np.array([env.reward(s2) for s2 in range(env.n_states)])
    cst = np.array([env.cost(s2) for s2 in range(env.n_states)])
    d = np.zeros(env.n_states)
    d[env.start] = 1.0
    out = {"return": 0.0, "cost": 0.0, "disc_return": 0.0, "disc_cost": 0.0, "success": 0.0}
    for t in range(env.horizon):
        d_sa = d[:, None] * pi  # [S, A]
        nxt = np.einsum("sa,sat->t", d_sa, P)
        r, c = float(nxt @ rew), float(nxt @ cst)
        out["return"] += r
        out["cost"] += c
        out["disc_return"] += gamma**t * r
        out["disc_cost"] += gamma**t * c
        out["success"] += float(nxt[env.goal])
        d = nxt.copy()
        d[env.goal] = 0.0  # absorbed
    return out


def visitation(env: GridWorld, pi: np.ndarray) -> np.ndarray:
    """Expected number of visits to each state in one episode (start included, goal counted on arrival)."""
    P = env.transition_matrix()
    d = np.zeros(env.n_states)
    d[env.start] = 1.0
    total = d.copy()
    for _ in range(env.horizon):
        nxt = np.einsum("sa,sat->t", d[:, None] * pi, P)
        total += nxt
        d = nxt.copy()
        d[env.goal] = 0.0
    return total.reshape(env.height, env.width)
