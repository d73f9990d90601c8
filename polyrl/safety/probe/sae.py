"""A small sparse autoencoder on residual activations, and feature activation rates (spec §7).

No maintained SAE library installs without large dependencies here, so this is a short torch implementation of
the standard ReLU + L1 sparse autoencoder (Bricken et al. 2023 "Towards Monosemanticity"; Cunningham et al.
arXiv 2309.08600), with a top-k variant (Gao et al. arXiv 2406.04093):

    f(x)  = ReLU(W_enc (x - b_dec) + b_enc)              (top-k: only the k largest pre-activations kept)
    x^(f) = W_dec f + b_dec,  every column of W_dec of unit norm
    loss  = mean_i ||x_i - x^_i||^2 + l1 * mean_i sum_j f_ij      (top-k: no L1 term)

Convention: decoder columns are renormalised to unit norm after every optimizer step (so the L1 penalty cannot be
evaded by shrinking f and growing W_dec); W_enc starts as W_dec^T and b_dec as the data mean; Adam, full-batch
or minibatch. The Neutral Mask paper's SAE dictionary and layers were not retrieved (spec §7 (b)).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn


class SparseAutoencoder(nn.Module):
    """ReLU (or top-k) sparse autoencoder with ``n_features`` dictionary atoms for ``d``-dimensional inputs."""

    def __init__(self, d: int, n_features: int, *, kind: Literal["relu", "topk"] = "relu", k: int = 8,
                 seed: int = 0) -> None:
        super().__init__()
        if kind not in ("relu", "topk"):
            raise ValueError(f"kind must be 'relu' or 'topk', got {kind!r}")
        if kind == "topk" and not 1 <= k <= n_features:
            raise ValueError(f"k must be in [1, n_features={n_features}], got {k}")
        self.kind, self.k = kind, k
        gen = torch.Generator().manual_seed(seed)
        w_dec = torch.randn(d, n_features, generator=gen)
        w_dec = w_dec / w_dec.norm(dim=0, keepdim=True)
        self.W_dec = nn.Parameter(w_dec)
        self.W_enc = nn.Parameter(w_dec.t().clone())
        self.b_enc = nn.Parameter(torch.zeros(n_features))
        self.b_dec = nn.Parameter(torch.zeros(d))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations f [N, n_features] of x [N, d] (non-negative; at most k non-zero for top-k)."""
        pre = (x - self.b_dec) @ self.W_enc.t() + self.b_enc
        if self.kind == "topk":
            top = pre.topk(self.k, dim=-1)
            pre = torch.zeros_like(pre).scatter(-1, top.indices, top.values)
        return torch.relu(pre)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        """Reconstruction W_dec f + b_dec [N, d]."""
        return f @ self.W_dec.t() + self.b_dec

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.encode(x)
        return self.decode(f), f

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Rescale every decoder column to unit norm."""
        self.W_dec.div_(self.W_dec.norm(dim=0, keepdim=True).clamp_min(1e-12))


@dataclass(frozen=True)
class SAEFit:
    """A trained SAE and how well it fits: fraction of variance explained and mean active features per input."""

    sae: SparseAutoencoder
    fve: float
    l0: float


def sae_loss(sae: SparseAutoencoder, x: torch.Tensor, l1: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``mean_i ||x_i - x^_i||^2 + l1 * mean_i sum_j f_ij`` (the L1 term only for kind 'relu') and f."""
    x_hat, f = sae(x)
    loss = (x - x_hat).pow(2).sum(-1).mean()
    if sae.kind == "relu":
        loss = loss + l1 * f.sum(-1).mean()
    return loss, f


def fraction_variance_explained(sae: SparseAutoencoder, x: torch.Tensor) -> float:
    """``1 - sum ||x - x^||^2 / sum ||x - mean(x)||^2``."""
    with torch.no_grad():
        x_hat, _ = sae(x)
        return float(1 - (x - x_hat).pow(2).sum() / (x - x.mean(0)).pow(2).sum().clamp_min(1e-12))


def train_sae(acts: torch.Tensor, n_features: int, *, kind: Literal["relu", "topk"] = "relu", l1: float = 1e-2,
              k: int = 8, steps: int = 1000, lr: float = 3e-3, batch_size: int = 256, seed: int = 0) -> SAEFit:
    """Train a sparse autoencoder on ``acts`` [N, d] (module docstring for the model and loss).

    Convention: ``l1`` multiplies the summed feature activations of inputs at their own scale; callers scale
    activations first (the experiment divides by the mean row norm) so one l1 suits every model.
    """
    if acts.ndim != 2 or acts.shape[0] < 2:
        raise ValueError(f"acts must be [N >= 2, d], got {tuple(acts.shape)}")
    x = acts.detach().float()
    sae = SparseAutoencoder(x.shape[1], n_features, kind=kind, k=k, seed=seed)
    with torch.no_grad():
        sae.b_dec.copy_(x.mean(0))
    opt = torch.optim.Adam(sae.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    with torch.enable_grad():
        for _ in range(steps):
            idx = torch.randint(0, x.shape[0], (min(batch_size, x.shape[0]),), generator=gen)
            loss, _ = sae_loss(sae, x[idx], l1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sae.normalize_decoder()
    with torch.no_grad():
        l0 = float((sae.encode(x) > 0).float().sum(-1).mean())
    return SAEFit(sae=sae, fve=fraction_variance_explained(sae, x), l0=l0)


def feature_activation_rates(encode_fn: Callable[[torch.Tensor], torch.Tensor], acts: torch.Tensor,
                             threshold: float = 0.0) -> torch.Tensor:
    """Spec §7 (d): the share of rows of ``acts`` [N, d] on which each feature fires, ``mean_i [f_ij > threshold]``
    [n_features], with ``f = encode_fn(acts)`` (any encoder; the caller's SAE)."""
    with torch.no_grad():
        f = encode_fn(acts)
    return (f > threshold).float().mean(0)
