"""Linear probe directions and their persistence between a base and a tuned model (spec §7, arXiv 2606.09735).

The Neutral Mask paper (Tam, arXiv 2606.09735; [abs] + [sec]) fits linear probes for a latent attribute on
residual activations of a base and an RLHF-tuned model and reports that the direction survives tuning while the
spread of the activations along it shrinks (std 0.234 -> 0.07, range -0.5..1.253 -> -0.011..0.388 [sec,
unverified]). The quantities below are our operationalisation of those measurements (spec §7 (d)); the paper's
exact probe recipe was not available.

Convention: a probe is a unit direction ``w`` and an offset ``b``; it predicts label 1 where ``acts @ w + b > 0``.
Convention: every accuracy here is in-sample on the activations given (pass held-out activations to measure
held-out accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

ProbeMethod = Literal["diffmean", "logreg"]


@dataclass(frozen=True)
class Probe:
    """A linear probe: unit direction ``w`` [d] (float64), offset ``b`` (predict 1 where x.w + b > 0), and its
    in-sample accuracy ``acc``."""

    w: torch.Tensor
    b: float
    acc: float

    def predict(self, acts: torch.Tensor) -> torch.Tensor:
        """0/1 predictions [N] of the probe on ``acts`` [N, d]."""
        return (acts.double() @ self.w.double() + self.b > 0).long()

    def accuracy(self, acts: torch.Tensor, labels: torch.Tensor) -> float:
        """Share of rows of ``acts`` whose prediction equals ``labels`` (0/1)."""
        return float((self.predict(acts) == labels.long()).double().mean())


def _check(acts: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if acts.ndim != 2 or labels.ndim != 1 or acts.shape[0] != labels.shape[0]:
        raise ValueError(f"acts must be [N, d] and labels [N]; got {tuple(acts.shape)} and {tuple(labels.shape)}")
    y = labels.long()
    if not bool(((y == 0) | (y == 1)).all()) or y.min() == y.max():
        raise ValueError("labels must be 0/1 with both classes present")
    return acts.double(), y


def fit_probe(acts: torch.Tensor, labels: torch.Tensor, method: ProbeMethod = "diffmean", *,
              l2: float = 1e-3, max_iter: int = 200) -> Probe:
    """Fit a linear probe for the binary ``labels`` [N] on ``acts`` [N, d].

    ``diffmean``: ``w = (mu_1 - mu_0) / ||mu_1 - mu_0||``, ``b = -w . (mu_1 + mu_0) / 2`` (the midpoint of the
    projected class means; the standard "difference of means" probe, e.g. Marks & Tegmark arXiv 2310.06824).
    ``logreg``: ``min_{v,c} mean_i BCE(sigmoid(x_i.v + c), y_i) + (l2 / 2) ||v||^2`` by L-BFGS in float64;
    ``w = v / ||v||``, ``b = c / ||v||``.
    Convention: logistic regression on raw (unstandardised) activations, L2 on v only (not on c), l2 = 1e-3.
    """
    x, y = _check(acts, labels)
    if method not in _FITTERS:
        raise ValueError(f"method must be 'diffmean' or 'logreg', got {method!r}")
    w, b = _FITTERS[method](x, y, l2=l2, max_iter=max_iter)
    return Probe(w=w, b=b, acc=Probe(w=w, b=b, acc=0.0).accuracy(acts, labels))


def _diffmean(x: torch.Tensor, y: torch.Tensor, **_: float) -> tuple[torch.Tensor, float]:
    """Unit difference of the class means and the midpoint threshold."""
    mu1, mu0 = x[y == 1].mean(0), x[y == 0].mean(0)
    diff = mu1 - mu0
    norm = diff.norm()
    if norm == 0:
        raise ValueError("class means coincide: no diff-of-means direction")
    w = diff / norm
    return w, float(-(w @ (mu1 + mu0)) / 2)


def _logreg(x: torch.Tensor, y: torch.Tensor, *, l2: float, max_iter: int) -> tuple[torch.Tensor, float]:
    """The logistic probe's weights, normalised to a unit direction and its offset."""
    v, c = fit_logreg(x, y.double(), l2=l2, max_iter=max_iter)
    norm = v.norm()
    if norm == 0:
        raise ValueError("logistic probe found no direction (all weights zero)")
    return v / norm, float(c / norm)


_FITTERS = {"diffmean": _diffmean, "logreg": _logreg}  # probe kind -> (x, y) -> (unit direction, offset)


def fit_logreg(x: torch.Tensor, y: torch.Tensor, *, l2: float = 1e-3,
               max_iter: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """The minimiser (v, c) of ``logreg_loss`` by L-BFGS (strong Wolfe line search) in float64, from zero."""
    x, y = x.double(), y.double()
    v = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    c = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([v, c], lr=1.0, max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-12,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = logreg_loss(x, y, v, c, l2)
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return v.detach(), c.detach()


def logreg_loss(x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, c: torch.Tensor, l2: float) -> torch.Tensor:
    """``mean_i BCE(sigmoid(x_i.v + c), y_i) + (l2 / 2) ||v||^2`` (the objective ``fit_probe`` minimises)."""
    z = x @ v + c
    return torch.nn.functional.binary_cross_entropy_with_logits(z, y) + 0.5 * l2 * (v @ v)


def fit_probe_direction(acts: torch.Tensor, labels: torch.Tensor,
                        method: ProbeMethod = "diffmean") -> tuple[torch.Tensor, float]:
    """Spec §7 (d): the unit probe direction ``w`` [d] and its in-sample accuracy (see ``fit_probe``)."""
    probe = fit_probe(acts, labels, method)
    return probe.w, probe.acc


def projection_stats(acts: torch.Tensor, w: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, float]:
    """Statistics of ``p = acts @ w / ||w||``: pooled std (population, /N), min, max, range, and with labels the
    class-mean gap ``mean(p | 1) - mean(p | 0)``.

    Convention: pooled over both classes and not centred per class -- the spread the paper reports (its range and
    std of the projection over all prompts [sec]).
    """
    p = acts.double() @ (w.double() / w.double().norm())
    out = {"std": float(p.std(unbiased=False)), "min": float(p.min()), "max": float(p.max()),
           "range": float(p.max() - p.min()), "mean": float(p.mean())}
    if labels is not None:
        y = labels.long()
        out["gap"] = float(p[y == 1].mean() - p[y == 0].mean())
    return out


def direction_persistence(acts_base: torch.Tensor, acts_tuned: torch.Tensor, labels: torch.Tensor,
                          method: ProbeMethod = "diffmean") -> dict[str, float]:
    """Does the base model's probe direction persist in the tuned model? ``acts_*`` [N, d] on the same N inputs.

    With ``P_b = fit_probe(acts_base)``, ``P_t = fit_probe(acts_tuned)`` and projections on the unit base
    direction ``p_m = acts_m @ w_b``:

    - ``cosine = w_b . w_t`` (both unit); 1 for an unchanged model;
    - ``probe_acc_base``: P_b on base; ``probe_acc_transfer``: P_b (w_b and b_b unchanged) on tuned;
      ``probe_acc_tuned``: P_t on tuned (is the attribute still linearly readable at all);
    - ``proj_std_ratio = std(p_tuned) / std(p_base)``; ``proj_range_ratio = range(p_tuned) / range(p_base)``;
      ``proj_gap_ratio``: ratio of the class-mean gaps along w_b;
    - ``orth_std_ratio = sqrt(tr Cov(Q x_tuned) / tr Cov(Q x_base))`` with ``Q = I - w_b w_b^T``: the spread of
      everything else; ``selective_ratio = proj_std_ratio / orth_std_ratio`` is below 1 only when the direction
      is compressed more than the rest of the residual stream (a control [ours]: tuning can shrink the whole
      stream, which a following RMSNorm undoes).

    Convention [ours]: ratios along the *base* direction, pooled over classes (``projection_stats``); the paper
    reports std and range of the projection [sec], here divided tuned / base so that 0.3 means "3x compressed".
    Convention: a scale c of the tuned activations gives |c| for both ratios; a shift changes neither ratio (it
    can change the transfer accuracy, which uses the base offset).
    """
    if acts_base.shape != acts_tuned.shape:
        raise ValueError(f"acts_base {tuple(acts_base.shape)} and acts_tuned {tuple(acts_tuned.shape)} differ")
    pb, pt = fit_probe(acts_base, labels, method), fit_probe(acts_tuned, labels, method)
    sb, st = projection_stats(acts_base, pb.w, labels), projection_stats(acts_tuned, pb.w, labels)
    orth = orth_std_ratio(acts_base, acts_tuned, pb.w)
    std_ratio = st["std"] / sb["std"] if sb["std"] > 0 else float("nan")
    return {
        "cosine": float(pb.w.double() @ pt.w.double()),
        "probe_acc_base": pb.acc,
        "probe_acc_transfer": pb.accuracy(acts_tuned, labels),
        "probe_acc_tuned": pt.acc,
        "proj_std_ratio": std_ratio,
        "proj_range_ratio": st["range"] / sb["range"] if sb["range"] > 0 else float("nan"),
        "proj_gap_ratio": st["gap"] / sb["gap"] if sb["gap"] != 0 else float("nan"),
        "orth_std_ratio": orth, "selective_ratio": std_ratio / orth if orth > 0 else float("nan"),
        "proj_std_base": sb["std"], "proj_std_tuned": st["std"],
    }


def orth_std_ratio(acts_base: torch.Tensor, acts_tuned: torch.Tensor, w: torch.Tensor) -> float:
    """``sqrt(tr Cov(Q x_tuned) / tr Cov(Q x_base))``, ``Q = I - w w^T / ||w||^2`` (population covariances)."""
    u = w.double() / w.double().norm()

    def spread(x: torch.Tensor) -> float:
        x = x.double()
        r = x - (x @ u)[:, None] * u[None, :]
        return float((r - r.mean(0)).pow(2).sum(1).mean())

    base = spread(acts_base)
    return (spread(acts_tuned) / base) ** 0.5 if base > 0 else float("nan")
