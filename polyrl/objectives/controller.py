"""The adaptive coefficients of a method: KL beta (Ziegler et al.) and entropy alpha (Skywork-OR1).

Both are *state*: ``Controller`` holds them, the trainer applies them to the method at the start of an RL step
(``controller.method``), updates them once per step from the step's measured KL and entropy, and saves
``state_dict()`` with every checkpoint (``TrainState.coefs``), so a resumed run continues with exactly the
coefficients it stopped with. A method without ``kl_target`` or ``entropy_target`` keeps its fixed coefficients.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from polyrl.objectives.objective import Method

CLIP = 0.2  # Ziegler et al.'s bound on the proportional error (verl, TRL)


def adaptive_kl_coef(beta: float, kl: float, *, target: float, horizon: int, n_steps: int) -> float:
    """Move beta toward a target KL: beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon).

    arXiv:1909.08593 (Ziegler et al., section 2.2). Convention: n_steps = sequences in the step's batch and
    kl = the KL estimator averaged per sequence, then over sequences (verl's AdaptiveKLController fed by
    ``apply_kl_penalty``); TRL's old PPOTrainer feeds the KL *summed* over each sequence's tokens instead (its
    default target 6 is per sequence). The multiplier is > 0 while n_steps / horizon < 5; a batch that large for
    the horizon is refused rather than flipping beta's sign.
    """
    if n_steps >= 5 * horizon:
        raise ValueError(f"kl_horizon = {horizon} is too small for {n_steps} sequences per step (the adaptive "
                         "KL multiplier would reach 0); use kl_horizon > n_sequences / 5")
    error = min(max(kl / target - 1.0, -CLIP), CLIP)
    return beta * (1.0 + error * n_steps / horizon)


def adaptive_entropy_coef(alpha: float, entropy: float, *, target: float, delta: float,
                          ceiling: float) -> tuple[float, bool]:
    """Step alpha toward a target entropy: (clamp(alpha +- delta, 0, max), bonus on next step = entropy <= target).

    arXiv:2505.22312 (Skywork-OR1, adaptive entropy control): alpha_{k+1} = alpha_k + delta when the entropy
    e_k < target, alpha_k - delta when e_k > target, clamped to [0, entropy_coef_max]; the loss uses
    c = alpha * 1{e <= target}, so the bonus is off while the entropy is above the target.
    Convention: e_k is the step's mean entropy per loss token measured during its update, so the coefficient and
    its indicator act from the next step on (one step of lag) [assumed: the report computes e_k on the batch it
    trains].
    """
    step = delta if entropy < target else -delta if entropy > target else 0.0
    return min(max(alpha + step, 0.0), ceiling), entropy <= target


class Controller:
    """The method's adapted coefficients; ``update`` once per RL step, ``state_dict`` into every checkpoint."""

    def __init__(self, method: Method, state: dict[str, Any] | None = None):
        self.base = method
        self.kl_coef = method.kl_coef
        self.alpha = method.entropy_coef
        self.bonus_on = True  # Skywork-OR1's indicator 1{entropy <= target}; True until a step has measured it
        if state:
            self.kl_coef, self.alpha, self.bonus_on = state["kl_coef"], state["alpha"], state["bonus_on"]

    @property
    def method(self) -> Method:
        """The method with this step's coefficients (the preset's own when nothing adapts)."""
        if not (self.base.kl_target or self.base.entropy_target):
            return self.base
        return replace(self.base, kl_coef=self.kl_coef, entropy_coef=self.alpha if self.bonus_on else 0.0)

    def update(self, metrics: dict[str, float], n_seqs: int) -> dict[str, float]:
        """Adapt the coefficients to this step's measured KL and entropy; return the coefficients it used.

        The KL is ``reward/kl`` when the method's KL is in the reward, else ``objective/kl`` (its loss term); the
        entropy is ``objective/entropy``. A step without update (every group filtered) changes nothing.
        """
        m = self.base
        used: dict[str, float] = {}
        if m.kl is not None and m.kl_coef > 0:
            used["objective/kl_coef"] = self.kl_coef
        if m.entropy_grad:
            used["objective/entropy_coef"] = self.method.entropy_coef
        kl = metrics.get("reward/kl" if m.kl_placement == "reward" else "objective/kl")
        if m.kl_target and kl is not None:
            self.kl_coef = adaptive_kl_coef(self.kl_coef, kl, target=m.kl_target, horizon=m.kl_horizon,
                                            n_steps=n_seqs)
        entropy = metrics.get("objective/entropy")
        if m.entropy_target and entropy is not None:
            self.alpha, self.bonus_on = adaptive_entropy_coef(self.alpha, entropy, target=m.entropy_target,
                                                              delta=m.entropy_delta, ceiling=m.entropy_coef_max)
        return used

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.kl_coef, "alpha": self.alpha, "bonus_on": self.bonus_on}
