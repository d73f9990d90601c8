"""Seeded search for a small MDP where every-step linear Q-learning diverges and the λ-target update converges.

Spec §5(e)3 [ours]: a 3-state, 1-action MDP (linear Q-learning is then off-policy TD(0)) with 2 features,
drawn at random (Phi ~ N(0, 1), off-policy weights mu ~ Dirichlet(1), rows of P ~ Dirichlet(1), R ~ N(0, 1))
until

- max Re eig(gamma M - A) > 0: the every-step map I + alpha (gamma M - A) has an eigenvalue of modulus > 1
  for every alpha > 0, so plain linear Q-learning diverges whatever the step size;
- rho(gamma A^{-1} M) < 1: projected value iteration (lambda -> 1) is a contraction;
- rho(L_lambda_check) < 1 at alpha = alpha_scale / lambda_max(A) (default 0.9, lambda_check = 0.999).

Nothing is hard-coded: the MDP is a function of the seed; ``search_counterexample`` reports the trial index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polyrl.families.q.core import LinearMDP, lambda_linear_part, projected_fixed_point, spectral_radius

LAMBDA_GRID = (0.0, 0.5, 0.9, 0.95, 0.99, 0.995, 0.999, 0.9995, 0.9999)


@dataclass
class Counterexample:
    """The MDP found, its trial index and step size, and the spectral facts the search checked."""

    mdp: LinearMDP
    trial: int
    seed: int
    alpha: float
    max_real_eig: float  # max Re eig(gamma M - A) (> 0: every-step diverges for every alpha)
    rho_pvi: float  # rho(gamma A^{-1} M) (< 1: projected value iteration converges)
    lam_check: float

    @property
    def M(self) -> np.ndarray:
        return self.mdp.M(np.zeros(self.mdp.phi.shape[-1]))  # one action: M does not depend on theta

    @property
    def fixed_point(self) -> np.ndarray:
        return projected_fixed_point(self.mdp.A, self.mdp.b, self.M, self.mdp.gamma)

    def rho(self, lam: float) -> float:
        """Spectral radius of L_lambda at this step size."""
        return spectral_radius(lambda_linear_part(self.mdp.A, self.M, self.mdp.gamma, self.alpha, lam))


def random_mdp(rng: np.random.Generator, *, n_states: int = 3, n_features: int = 2, gamma: float = 0.99) -> LinearMDP:
    """One random 1-action MDP with linear features (the search's proposal)."""
    phi = rng.normal(size=(n_states, 1, n_features))
    P = rng.dirichlet(np.ones(n_states), size=n_states)[:, None, :]
    R = rng.normal(size=(n_states, 1))
    mu = rng.dirichlet(np.ones(n_states))[:, None]
    return LinearMDP(phi=phi, P=P, R=R, mu=mu, gamma=gamma)


def check_seed(seed: int) -> None:
    """Refuse a seed outside [0, 2**32) (ConfigError, a ValueError, naming ``seed``), before any search, training or
    write: the range every other polyrl command takes (numpy took up to 2**63, so q alone ran with 2**32)."""
    from polyrl.errors import ConfigError

    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ConfigError(f"seed = {seed!r} is not allowed; allowed: an integer in [0, 2**32)")


def search_counterexample(seed: int = 0, *, max_trials: int = 10_000, n_states: int = 3, n_features: int = 2,
                          gamma: float = 0.99, alpha_scale: float = 0.9, lam_check: float = 0.999) -> Counterexample:
    """The first random MDP (seeded) meeting the three conditions above; ValueError if none in ``max_trials``."""
    check_seed(seed)
    rng = np.random.default_rng(seed)
    for trial in range(1, max_trials + 1):
        mdp = random_mdp(rng, n_states=n_states, n_features=n_features, gamma=gamma)
        A = mdp.A
        if np.linalg.cond(A) > 1e8:
            continue
        M = mdp.M(np.zeros(n_features))
        max_re = float(np.max(np.linalg.eigvals(gamma * M - A).real))
        if max_re <= 0:
            continue
        rho_pvi = spectral_radius(np.linalg.solve(A, gamma * M))
        if rho_pvi >= 1:
            continue
        alpha = alpha_scale / float(np.max(np.linalg.eigvalsh(A)))
        if spectral_radius(lambda_linear_part(A, M, gamma, alpha, lam_check)) >= 1:
            continue
        return Counterexample(mdp, trial, seed, alpha, max_re, rho_pvi, lam_check)
    raise ValueError(f"no counterexample in max_trials = {max_trials} (seed {seed}); raise --trials")


def iterate_target_map(cx: Counterexample, lam: float, iters: int, theta0: np.ndarray | None = None) -> np.ndarray:
    """theta_minus_k (k = 0..iters) under the exact λ-target map T_lambda: [iters + 1, d]."""
    from polyrl.families.q.core import lambda_target_map

    d = cx.mdp.phi.shape[-1]
    theta = np.zeros(d) if theta0 is None else np.asarray(theta0, dtype=float)
    out = [theta]
    for _ in range(iters):
        theta = lambda_target_map(theta, cx.mdp.A, cx.mdp.b, cx.mdp.M, cx.alpha, lam, gamma=cx.mdp.gamma)
        out.append(theta)
    return np.array(out)


OUTPUTS = ("search.json", "spectral_radius.png")


def check_out(out_dir: str | Path, *, overwrite: bool) -> None:
    """Refuse (ValueError) an ``out_dir`` that already holds a search unless ``overwrite``: another seed's result
    would otherwise be replaced silently."""
    from polyrl.runs import check_out_dir

    check_out_dir(out_dir)
    held = [name for name in OUTPUTS if (Path(out_dir) / name).exists()]
    if held and not overwrite:
        raise ValueError(f"out = '{out_dir}' already holds {', '.join(held)}; pass --overwrite or another --out")


def run_search(out_dir: str | Path, seed: int = 0, *, max_trials: int = 10_000, lams=LAMBDA_GRID,
               overwrite: bool = False) -> dict:
    """Search, tabulate rho(L_lambda) over ``lams``, write ``search.json`` and ``spectral_radius.png``.

    Bad arguments and an existing result (without ``overwrite``) are refused before anything is written.
    """
    check_seed(seed)
    check_out(out_dir, overwrite=overwrite)
    cx = search_counterexample(seed, max_trials=max_trials)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rhos = {str(lam): cx.rho(lam) for lam in lams}
    fine = np.concatenate([np.linspace(0, 0.9, 30), 1 - np.logspace(-1, -4.5, 120)])
    fine_rho = [cx.rho(float(lam)) for lam in fine]
    traj = iterate_target_map(cx, 0.999, 300)
    result = {
        "seed": seed, "trial": cx.trial, "alpha": cx.alpha, "gamma": cx.mdp.gamma,
        "max_real_eig_gammaM_minus_A": cx.max_real_eig, "rho_projected_value_iteration": cx.rho_pvi,
        "rho_by_lambda": rhos, "fixed_point": cx.fixed_point.tolist(),
        "stable_from_lambda": next((float(lam) for lam, r in zip(fine, fine_rho) if r < 1), None),
        "lambda_0.999_error_after_300_target_updates": float(np.linalg.norm(traj[-1] - cx.fixed_point)),
        "mdp": {"phi": cx.mdp.phi[:, 0].tolist(), "P": cx.mdp.P[:, 0].tolist(), "R": cx.mdp.R[:, 0].tolist(),
                "mu": cx.mdp.mu[:, 0].tolist()},
    }
    (out / "search.json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(1 - fine, fine_rho, label=r"$\rho(L_\lambda)$")
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="stability boundary")
    ax.axhline(cx.rho_pvi, color="g", lw=0.8, ls=":", label=r"$\rho(\gamma A^{-1}M)$ ($\lambda\to 1$)")
    ax.set_xscale("log")
    ax.invert_xaxis()
    ax.set_xlabel(r"$1-\lambda$ (mean target period $=1/(1-\lambda)$)")
    ax.set_ylabel("spectral radius")
    ax.set_title(f"searched 3-state MDP (seed {seed}, trial {cx.trial}), alpha={cx.alpha:.3g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "spectral_radius.png", dpi=120)
    plt.close(fig)
    result["png"] = str(out / "spectral_radius.png")
    return result
