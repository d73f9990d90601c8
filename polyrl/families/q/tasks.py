"""The sample-based control task: a slippery gridworld with hand-written tile or one-hot features.

``Gridworld(size, slip)``: states are cells (row, col) of a size x size grid, numbered row * size + col; start
(0, 0), goal (size-1, size-1) is terminal. Actions up, right, down, left; with probability ``slip`` the action
is replaced by a uniformly random one; moving into the border leaves the cell unchanged. Reward 1 on
entering the goal, else 0. The model (P, R) is known, so a greedy policy's discounted return from the start
is computed exactly (``greedy_return``) and Q* by value iteration: evaluation has no sampling noise.

Features (``FeatureMap``s, per action blocks): ``onehot`` (tabular, d = S * 4) and ``tiles`` (two tilings of
2 x 2 tiles, the second offset by one cell, each tile feature 1/2; d = 4 * (tiles of both tilings)), a linear
function approximation where Q-learning's stability is not guaranteed. (gymnasium is not used: not installed.)
"""

from __future__ import annotations

import numpy as np

from polyrl.families.q.core import FeatureMap

MOVES = ((-1, 0), (0, 1), (1, 0), (0, -1))  # up, right, down, left
TASKS = ("gridworld",)
FEATURES = ("tiles", "onehot")


class Gridworld:
    """Slippery size x size gridworld; ``step`` samples, ``model`` gives (P [S, 4, S], R [S, 4], terminal [S])."""

    n_actions = 4

    def __init__(self, size: int = 6, slip: float = 0.1):
        self.size, self.slip = size, slip
        self.n_states = size * size
        self.start, self.goal = 0, self.n_states - 1

    def move(self, s: int, a: int) -> int:
        r, c = divmod(s, self.size)
        dr, dc = MOVES[a]
        r, c = min(max(r + dr, 0), self.size - 1), min(max(c + dc, 0), self.size - 1)
        return r * self.size + c

    def step(self, s: int, a: int, rng: np.random.Generator) -> tuple[int, float, bool]:
        if rng.random() < self.slip:
            a = int(rng.integers(self.n_actions))
        s2 = self.move(s, a)
        return s2, float(s2 == self.goal), s2 == self.goal

    def model(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if getattr(self, "_model", None) is None:
            self._model = self._build_model()
        return self._model

    def _build_model(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        S, nA = self.n_states, self.n_actions
        P, R = np.zeros((S, nA, S)), np.zeros((S, nA))
        for s in range(S):
            for a in range(nA):
                if s == self.goal:  # absorbing, no reward
                    P[s, a, s] = 1.0
                    continue
                for a2 in range(nA):
                    p = (1 - self.slip) * (a2 == a) + self.slip / nA
                    s2 = self.move(s, a2)
                    P[s, a, s2] += p
                    R[s, a] += p * float(s2 == self.goal)
        terminal = np.zeros(S, dtype=bool)
        terminal[self.goal] = True
        return P, R, terminal

    def optimal_q(self, gamma: float, iters: int = 2000) -> np.ndarray:
        P, R, terminal = self.model()
        q = np.zeros((self.n_states, self.n_actions))
        for _ in range(iters):
            v = np.where(terminal, 0.0, q.max(1))
            q = R + gamma * P @ v
        return q

    def greedy_return(self, q: np.ndarray, gamma: float) -> float:
        """Exact discounted return from the start of the greedy policy of q [S, 4] (ties to the lowest action)."""
        P, R, terminal = self.model()
        a = np.argmax(q, axis=1)
        idx = np.arange(self.n_states)
        Ppi, rpi = P[idx, a] * (~terminal)[:, None], R[idx, a] * (~terminal)
        v = np.linalg.solve(np.eye(self.n_states) - gamma * Ppi, rpi)
        return float(v[self.start])


class OneHotFeatures:
    """Tabular features: phi(s, a) = e_{(a, s)}."""

    def __init__(self, env: Gridworld):
        self.n_states, self.n_actions = env.n_states, env.n_actions
        self.dim = self.n_states * self.n_actions
        self._table = np.zeros((self.n_states, self.n_actions, self.dim))
        for s in range(self.n_states):
            for a in range(self.n_actions):
                self._table[s, a, a * self.n_states + s] = 1.0

    def __call__(self, state: int) -> np.ndarray:
        return self._table[state]


class TileFeatures:
    """Two tilings of width-2 tiles (offsets 0 and 1 cell), one block per action; each active tile is 1/2."""

    def __init__(self, env: Gridworld, width: int = 2):
        size, self.n_actions = env.size, env.n_actions
        per_tiling = []
        for off in (0, 1):
            n = (size - 1 + off) // width + 1
            per_tiling.append((off, n))
        sizes = [n * n for _, n in per_tiling]
        self.per_action = sum(sizes)
        self.dim = self.per_action * self.n_actions
        self._table = np.zeros((env.n_states, self.n_actions, self.dim))
        for s in range(env.n_states):
            r, c = divmod(s, size)
            base = 0
            for (off, n), k in zip(per_tiling, sizes):
                tile = ((r + off) // width) * n + (c + off) // width
                for a in range(self.n_actions):
                    self._table[s, a, a * self.per_action + base + tile] = 0.5
                base += k

    def __call__(self, state: int) -> np.ndarray:
        return self._table[state]


def make_task(task: str, size: int, slip: float, features: str) -> tuple[Gridworld, FeatureMap]:
    if task not in TASKS:
        raise ValueError(f"task = {task!r} is not allowed; allowed: {', '.join(TASKS)}")
    if features not in FEATURES:
        raise ValueError(f"features = {features!r} is not allowed; allowed: {', '.join(FEATURES)}")
    env = Gridworld(size, slip)
    return env, (TileFeatures(env) if features == "tiles" else OneHotFeatures(env))
