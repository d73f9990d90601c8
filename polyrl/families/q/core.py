"""The λ-target update for linear Q-learning: exact target map, closed-form gain, the learner (arXiv:2606.10835).

Deterministic (expected) linear Q-learning with features Phi [n_sa, d], state-action weighting D = diag(mu),
next-state transition P and the greedy policy Pi_theta at the next state:

    A = Phi^T D Phi,  b = Phi^T D R,  M(theta_minus) = Phi^T D P Pi_{theta_minus} Phi
    online step (target frozen):  theta <- theta + alpha * (b + gamma * M(theta_minus) theta_minus - A theta)

F_m(theta_minus) is the online parameter after m such steps from theta = theta_minus (an m-periodic hard
target update); the λ-target map averages them geometrically:

    T_lambda(theta_minus) = sum_{m>=1} (1 - lambda) lambda^(m-1) F_m(theta_minus)

Closed form [ours; spec §5(a)]: with B = I - alpha A and theta_star = A^{-1}(b + gamma M theta_minus),
F_m = theta_star + B^m (theta_minus - theta_star), so

    T_lambda(theta_minus) = theta_star + K_lambda (theta_minus - theta_star)
    K_lambda = (1 - lambda) B (I - lambda B)^{-1}

(needs rho(lambda B) < 1); K_0 = B (plain Q-learning) and K_lambda -> 0 as lambda -> 1 (projected value
iteration). For a fixed greedy policy the target iteration is affine with linear part
L_lambda = (I - K_lambda) A^{-1} gamma M + K_lambda. Stochastic form [ours]: after each online step copy
online -> target with probability 1 - lambda; the period is Geometric(1 - lambda) and the expected target map
equals T_lambda. Everything here is float64 numpy (the closed form is checked to 1e-10).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

TARGET_MODES = ("every_step", "periodic", "lambda_exact", "lambda_geometric")


def spectral_radius(m: np.ndarray) -> float:
    """max |eig(m)|."""
    return float(np.max(np.abs(np.linalg.eigvals(np.asarray(m, dtype=float)))))


def _check_lam(lam: float) -> None:
    if not (isinstance(lam, (int, float)) and 0.0 <= lam < 1.0):
        raise ValueError(f"lam = {lam!r} is not allowed; allowed: 0 <= lam < 1")


def one_step_matrix(A: np.ndarray, alpha: float) -> np.ndarray:
    """B = I - alpha A: the online step's linear part with the target frozen."""
    A = np.asarray(A, dtype=float)
    return np.eye(A.shape[0]) - alpha * A


def lambda_target_gain(A: np.ndarray, alpha: float, lam: float) -> np.ndarray:
    """K_lambda = (1 - lambda) B (I - lambda B)^{-1}, B = I - alpha A [ours, spec §5(a)].

    B and (I - lambda B)^{-1} commute, so this is (1 - lambda) (I - lambda B)^{-1} B (one linear solve).
    Raises ValueError when rho(lambda B) >= 1 (the geometric series does not converge).
    """
    _check_lam(lam)
    B = one_step_matrix(A, alpha)
    if lam > 0 and spectral_radius(lam * B) >= 1.0:
        raise ValueError(f"rho(lam * B) = {spectral_radius(lam * B):.4g} >= 1 for lam = {lam}, alpha = {alpha}: "
                         "the lambda-average does not converge; lower alpha")
    return (1.0 - lam) * np.linalg.solve(np.eye(B.shape[0]) - lam * B, B)


def lambda_target_gain_series(A: np.ndarray, alpha: float, lam: float, terms: int) -> np.ndarray:
    """The truncated series sum_{m=1}^{terms} (1 - lambda) lambda^(m-1) B^m (the definition K_lambda comes from)."""
    _check_lam(lam)
    B = one_step_matrix(A, alpha)
    out, power = np.zeros_like(B), np.eye(B.shape[0])
    for m in range(1, terms + 1):
        power = power @ B
        out += (1.0 - lam) * lam ** (m - 1) * power
    return out


def online_map(theta_minus: np.ndarray, A: np.ndarray, b: np.ndarray, M_fn: Callable[[np.ndarray], np.ndarray],
               alpha: float, m: int, *, gamma: float = 1.0) -> np.ndarray:
    """F_m(theta_minus): m online steps theta <- theta + alpha (b + gamma M theta_minus - A theta) from theta_minus.

    Convention: ``M_fn(theta_minus)`` returns M(theta_minus) = Phi^T D P Pi_{theta_minus} Phi; ``gamma`` multiplies
    it (leave gamma = 1 when M_fn already includes the discount).
    """
    theta_minus = np.asarray(theta_minus, dtype=float)
    drive = b + gamma * (M_fn(theta_minus) @ theta_minus)
    theta = theta_minus.copy()
    for _ in range(m):
        theta = theta + alpha * (drive - A @ theta)
    return theta


def lambda_target_map(theta_minus: np.ndarray, A: np.ndarray, b: np.ndarray,
                      M_fn: Callable[[np.ndarray], np.ndarray], alpha: float, lam: float, *,
                      gamma: float = 1.0) -> np.ndarray:
    """T_lambda(x) = theta_star + K_lambda (x - theta_star), theta_star = A^-1 (b + gamma M(x) x), x = theta_minus.

    Exact and deterministic (the greedy policy is frozen at theta_minus for the whole average, as in F_m).
    """
    theta_minus = np.asarray(theta_minus, dtype=float)
    theta_star = np.linalg.solve(A, b + gamma * (M_fn(theta_minus) @ theta_minus))
    return theta_star + lambda_target_gain(A, alpha, lam) @ (theta_minus - theta_star)


def lambda_linear_part(A: np.ndarray, M: np.ndarray, gamma: float, alpha: float, lam: float) -> np.ndarray:
    """L_lambda = (I - K_lambda) A^{-1} gamma M + K_lambda: the target iteration's linear part for a fixed policy.

    L_0 = I + alpha (gamma M - A) (every-step Q-learning); L_lambda -> gamma A^{-1} M as lambda -> 1.
    """
    K = lambda_target_gain(A, alpha, lam)
    return (np.eye(A.shape[0]) - K) @ np.linalg.solve(A, gamma * M) + K


def projected_fixed_point(A: np.ndarray, b: np.ndarray, M: np.ndarray, gamma: float) -> np.ndarray:
    """theta with A theta = b + gamma M theta (fixed policy): the fixed point of every T_lambda (projected Bellman)."""
    return np.linalg.solve(A - gamma * M, b)


def geometric_window(lam: float, tail: float = 1e-3) -> int:
    """Window H of the sample-based ``lambda_exact`` mode: the smallest H with lambda^H <= tail (1 when lambda = 0)."""
    _check_lam(lam)
    return 1 if lam == 0 else max(1, math.ceil(math.log(tail) / math.log(lam)))


@dataclass
class LinearMDP:
    """A finite MDP with linear state-action features, for the expected (deterministic) dynamics.

    phi [S, nA, d] features, P [S, nA, S] transitions, R [S, nA] expected rewards, mu [S, nA] the
    state-action weighting D (any positive weights: off-policy data), terminal [S] states with no bootstrap.
    """

    phi: np.ndarray
    P: np.ndarray
    R: np.ndarray
    mu: np.ndarray
    gamma: float
    terminal: np.ndarray | None = None

    @property
    def flat_phi(self) -> np.ndarray:
        return self.phi.reshape(-1, self.phi.shape[-1])

    @property
    def A(self) -> np.ndarray:
        Phi = self.flat_phi
        return Phi.T @ (self.mu.reshape(-1, 1) * Phi)

    @property
    def b(self) -> np.ndarray:
        return self.flat_phi.T @ (self.mu.reshape(-1) * self.R.reshape(-1))

    def greedy_next_features(self, theta: np.ndarray) -> np.ndarray:
        """psi [S, d]: phi(s', argmax_a phi(s', a) theta) (zero at terminal states); ties go to the lowest action."""
        q = self.phi @ theta  # [S, nA]
        psi = self.phi[np.arange(self.phi.shape[0]), np.argmax(q, axis=1)]
        if self.terminal is not None:
            psi = psi * (~self.terminal)[:, None]
        return psi

    def M(self, theta: np.ndarray) -> np.ndarray:
        """M(theta) = Phi^T D P Pi_theta Phi (no discount)."""
        Phi = self.flat_phi
        P = self.P.reshape(-1, self.P.shape[-1])
        return Phi.T @ (self.mu.reshape(-1, 1) * (P @ self.greedy_next_features(theta)))


class FeatureMap(Protocol):
    """A feature map: ``fm(state) -> [n_actions, dim]``, with its ``dim`` and ``n_actions``."""

    dim: int
    n_actions: int

    def __call__(self, state) -> np.ndarray: ...


class LinearQLearner:
    """Linear Q-learning with a target parameter refreshed by one of four rules (spec §5(d)).

    Online TD step (sample): theta += alpha (r + gamma max_a' phi(s', a') theta_minus - phi(s, a) theta) phi(s, a);
    expected step: theta += alpha (b + gamma M(theta_minus) theta_minus - A theta). After each online step:

    - ``every_step``: theta_minus <- theta (plain linear Q-learning, lambda = 0);
    - ``periodic``: theta_minus <- theta every ``period`` online steps;
    - ``lambda_geometric``: theta_minus <- theta with probability 1 - lam (period ~ Geometric(1 - lam));
    - ``lambda_exact``: the window average theta_minus <- sum_{m=1}^H w_m theta_m, w_m = (1-lam) lam^(m-1) / (1-lam^H),
      of the online iterates since the last refresh, then theta <- theta_minus (the next F_m starts from the target).

    Convention [ours]: ``lambda_exact`` truncates the geometric average at H = ``geometric_window(lam)``
    (lam^H <= 1e-3) and renormalises; with expected steps and a fixed greedy policy one refresh is T_lambda up
    to that truncation (``lambda_target_map`` is the untruncated closed form). ``features`` is a
    ``FeatureMap``; the learner's own generator draws the exploration and the geometric copies.
    """

    def __init__(self, features: FeatureMap, n_actions: int, gamma: float, alpha: float,
                 target_mode: str = "every_step", period: int = 1, lam: float = 0.0, seed: int = 0):
        if target_mode not in TARGET_MODES:
            raise ValueError(f"target_mode = {target_mode!r} is not allowed; allowed: {', '.join(TARGET_MODES)}")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"period = {period!r} is not allowed; allowed: an integer >= 1")
        _check_lam(lam)
        if not (0 <= gamma <= 1 and alpha > 0):
            raise ValueError(f"gamma = {gamma}, alpha = {alpha}: need 0 <= gamma <= 1 and alpha > 0")
        self.features, self.n_actions, self.gamma, self.alpha = features, n_actions, float(gamma), float(alpha)
        self.target_mode, self.period, self.lam = target_mode, period, float(lam)
        self.window = geometric_window(self.lam) if target_mode == "lambda_exact" else 0
        d = features.dim
        self.theta = np.zeros(d)
        self.target = np.zeros(d)
        self.rng = np.random.default_rng(seed)
        self.steps = 0  # online steps taken
        self.since_refresh = 0  # online steps since the last target refresh
        self.refreshes = 0  # target refreshes so far
        self._acc = np.zeros(d)  # lambda_exact: the running weighted sum of online iterates

    def q(self, state) -> np.ndarray:
        """Q(state, .) = phi(state) theta [n_actions]."""
        return self.features(state) @ self.theta

    def act(self, state, epsilon: float) -> int:
        """epsilon-greedy on the online Q (ties to the lowest action)."""
        if self.rng.random() < epsilon:
            return int(self.rng.integers(self.n_actions))
        return int(np.argmax(self.q(state)))

    def td_step(self, state, action: int, reward: float, next_state, done: bool) -> float:
        """One sample-based online step and the target rule; returns the TD error."""
        phi = self.features(state)[action]
        boot = 0.0 if done else float(np.max(self.features(next_state) @ self.target))
        delta = reward + self.gamma * boot - float(phi @ self.theta)
        self.theta = self.theta + self.alpha * delta * phi
        self._after_online_step()
        return delta

    def expected_step(self, mdp: LinearMDP) -> None:
        """One expected online step theta += alpha (b + gamma M(theta_minus) theta_minus - A theta), then the rule."""
        drive = mdp.b + self.gamma * (mdp.M(self.target) @ self.target)
        self.theta = self.theta + self.alpha * (drive - mdp.A @ self.theta)
        self._after_online_step()

    def _refresh(self, new_target: np.ndarray) -> None:
        self.target = new_target.copy()
        self.since_refresh = 0
        self.refreshes += 1

    def _after_online_step(self) -> None:
        self.steps += 1
        self.since_refresh += 1
        mode = self.target_mode
        if mode == "every_step":
            self._refresh(self.theta)
        elif mode == "periodic":
            if self.since_refresh >= self.period:
                self._refresh(self.theta)
        elif mode == "lambda_geometric":
            if self.rng.random() < 1.0 - self.lam:
                self._refresh(self.theta)
        else:  # lambda_exact
            m = self.since_refresh
            self._acc += (1.0 - self.lam) * self.lam ** (m - 1) * self.theta
            if m >= self.window:
                self._refresh(self._acc / (1.0 - self.lam ** self.window))
                self.theta = self.target.copy()
                self._acc = np.zeros_like(self._acc)

    def state_dict(self) -> dict:
        """Everything a resume needs: weights, target, generator state, counters."""
        return {"theta": self.theta.copy(), "target": self.target.copy(), "rng": self.rng.bit_generator.state,
                "steps": self.steps, "since_refresh": self.since_refresh, "refreshes": self.refreshes,
                "acc": self._acc.copy()}

    def load_state_dict(self, state: dict) -> None:
        self.theta, self.target = np.array(state["theta"], dtype=float), np.array(state["target"], dtype=float)
        self.rng.bit_generator.state = state["rng"]
        self.steps, self.since_refresh, self.refreshes = state["steps"], state["since_refresh"], state["refreshes"]
        self._acc = np.array(state["acc"], dtype=float)
