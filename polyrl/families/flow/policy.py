"""A small rectified-flow policy: an MLP velocity field, its pretraining targets and a cached warm start.

The velocity follows the sampler's convention (``polyrl.families.flow.sampler``): ``x_t = (1-t) x_0 + t eps``,
target velocity ``eps - x_0``. An optional context vector (the analogue of a prompt: a one-hot class,
or a control task's observation) is concatenated to the input. Pretraining is conditional flow
matching, ``E ||v(x_t, t, c) - (eps - x_0)||^2`` with t ~ U(0, 1), and is cached on disk like
``polyrl.tinylm.warmstart`` so a second run starts at once.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from polyrl.errors import ConfigError

META_FILE = "flow_meta.json"
WEIGHTS_FILE = "velocity.pt"


class VelocityMLP(nn.Module):
    """MLP velocity field v(x, t, context) -> [N, dim], with sinusoidal time features."""

    def __init__(self, dim: int = 2, context_dim: int = 0, hidden: int = 128, layers: int = 3,
                 time_features: int = 8):
        super().__init__()
        self.dim, self.context_dim = dim, context_dim
        self.register_buffer("freqs", math.pi * 2.0 ** torch.arange(time_features, dtype=torch.float32) / 2)
        width_in = dim + context_dim + 1 + 2 * time_features
        mods: list[nn.Module] = []
        for i in range(layers):
            mods += [nn.Linear(width_in if i == 0 else hidden, hidden), nn.SiLU()]
        mods.append(nn.Linear(hidden, dim))
        self.net = nn.Sequential(*mods)

    def forward(self, x: Tensor, t: Tensor, context: Tensor | None = None) -> Tensor:
        t = t.reshape(-1, 1).to(x.dtype).expand(x.shape[0], 1)
        ang = t * self.freqs.to(x.dtype)
        parts = [x, t, ang.sin(), ang.cos()]
        if self.context_dim:
            if context is None:
                raise ValueError(f"context is required: this velocity field has context_dim = {self.context_dim}")
            parts.append(context.to(x.dtype))
        return self.net(torch.cat(parts, -1))


# --- targets ------------------------------------------------------------------------------------


def ring_means(n_modes: int = 8, radius: float = 2.0) -> Tensor:
    """[n_modes, 2] centres on a circle, mode j at angle 2 pi j / n_modes."""
    ang = 2 * math.pi * torch.arange(n_modes, dtype=torch.float32) / n_modes
    return radius * torch.stack([ang.cos(), ang.sin()], -1)


@dataclass(frozen=True)
class GaussianMixture:
    """Isotropic Gaussian mixture; ``weights`` [C, K] gives one mixture per context class (C = 1: unconditional)."""

    means: Tensor  # [K, D]
    std: float
    weights: Tensor  # [C, K], rows sum to 1

    @property
    def n_contexts(self) -> int:
        return self.weights.shape[0]

    def sample(self, n: int, generator: torch.Generator, context_ids: Tensor | None = None) -> Tensor:
        """[n, D] samples; context_ids [n] picks each sample's mixture row (None: row 0)."""
        rows = self.weights[context_ids] if context_ids is not None else self.weights[0].expand(n, -1)
        comp = torch.multinomial(rows, 1, generator=generator).squeeze(-1)
        return self.means[comp] + self.std * torch.randn(n, self.means.shape[1], generator=generator)


def make_target(name: str) -> GaussianMixture:
    """Pretraining targets: ``ring8`` (8 modes, radius 2, std 0.15) and ``ring8_cond`` (4 context classes).

    ring8_cond: class c weights the modes j with j % 4 == c twice as much as the others, so the
    conditional model must read its context (the RL task then asks for exactly those two modes).
    """
    means = ring_means(8, 2.0)
    if name == "ring8":
        return GaussianMixture(means, 0.15, torch.full((1, 8), 1 / 8))
    if name == "ring8_cond":
        w = torch.ones(4, 8)
        w[torch.arange(8) % 4, torch.arange(8)] = 2.0
        return GaussianMixture(means, 0.15, w / w.sum(-1, keepdim=True))
    raise ValueError(f"target = {name!r}; allowed: 'ring8', 'ring8_cond'")


def one_hot(ids: Tensor, n: int) -> Tensor:
    return torch.nn.functional.one_hot(ids, n).to(torch.get_default_dtype())


def cfm_loss(model: VelocityMLP, x0: Tensor, context: Tensor | None, generator: torch.Generator) -> Tensor:
    """Conditional flow-matching loss mean_n ||v(x_t, t, c) - (eps - x_0)||^2 (sum over dims)."""
    t = torch.rand(x0.shape[0], generator=generator)
    eps = torch.randn(x0.shape, generator=generator)
    xt = (1 - t[:, None]) * x0 + t[:, None] * eps
    return ((model(xt, t, context) - (eps - x0)) ** 2).sum(-1).mean()


# --- cached warm start --------------------------------------------------------------------------


def flow_cache_dir() -> Path:
    """$POLYRL_CACHE/flow, else ~/.cache/polyrl/families/flow (the same root as the language-model warm starts)."""
    return Path(os.environ.get("POLYRL_CACHE", Path.home() / ".cache" / "polyrl")) / "flow"


@dataclass(frozen=True)
class PretrainResult:
    """A pretrained velocity field and how it was obtained."""

    model: VelocityMLP
    path: str  # cache directory holding velocity.pt and flow_meta.json
    loss: float  # final CFM loss (mean of the last 100 steps)
    seconds: float  # wall time of the training run (not of a cached call)
    cached: bool


@dataclass(frozen=True)
class PretrainSettings:
    target: str = "ring8"
    hidden: int = 128
    layers: int = 3
    steps: int = 2500
    batch_size: int = 256
    lr: float = 3e-3
    seed: int = 0


def build_model(settings: PretrainSettings) -> VelocityMLP:
    target = make_target(settings.target)
    ctx = target.n_contexts if target.n_contexts > 1 else 0
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's global RNG
        torch.manual_seed(settings.seed)
        return VelocityMLP(dim=target.means.shape[1], context_dim=ctx, hidden=settings.hidden,
                           layers=settings.layers)


def pretrain(settings: PretrainSettings = PretrainSettings(), *, cache: str | Path | None = None) -> PretrainResult:
    """Fit a velocity field to ``settings.target`` by flow matching, or load it from the cache.

    The directory is ``<cache>/<target>-h<hidden>-l<layers>-seed<seed>-<hash of all settings>``;
    a complete one is loaded at once. Training is a few seconds on one CPU thread.
    """
    for name in ("hidden", "layers", "steps", "batch_size"):
        if getattr(settings, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(settings, name)}")
    root = Path(cache) if cache is not None else flow_cache_dir()
    digest = hashlib.sha256(json.dumps(asdict(settings), sort_keys=True).encode()).hexdigest()[:10]
    s = settings
    final = root / f"{s.target}-h{s.hidden}-l{s.layers}-seed{s.seed}-{digest}"
    model = build_model(settings)
    if (final / META_FILE).is_file():
        try:
            meta = json.loads((final / META_FILE).read_text())
            model.load_state_dict(torch.load(final / WEIGHTS_FILE, weights_only=True))
            return PretrainResult(model=model, path=str(final), loss=float(meta["loss"]),
                                  seconds=float(meta["seconds"]), cached=True)
        except Exception as e:  # written atomically, so damaged by hand: a cache entry is trained again, not fatal
            print(f"polyrl: warning: the cached flow policy {final} cannot be read ({type(e).__name__}); training "
                  "it again", file=sys.stderr)
            model = build_model(settings)
    try:  # before training: a cache that cannot be written fails now, in one line, not after the work
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"the flow policy cache {str(root)!r} cannot be created ({e.strerror or e}); set "
                          "POLYRL_CACHE to a writable directory") from None
    target = make_target(s.target)
    g = torch.Generator().manual_seed(s.seed)
    opt = torch.optim.Adam(model.parameters(), lr=s.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, s.steps)
    started, tail = time.perf_counter(), []
    for _ in range(s.steps):
        ids = torch.randint(target.n_contexts, (s.batch_size,), generator=g)
        x0 = target.sample(s.batch_size, g, ids)
        ctx = one_hot(ids, target.n_contexts) if model.context_dim else None
        loss = cfm_loss(model, x0, ctx, g)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        tail = (tail + [loss.item()])[-100:]
    seconds = time.perf_counter() - started
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    torch.save(model.state_dict(), staging / WEIGHTS_FILE)
    meta = dict(asdict(s), loss=sum(tail) / len(tail), seconds=seconds)
    (staging / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if final.exists():
        import shutil

        shutil.rmtree(final)
    os.replace(staging, final)
    return PretrainResult(model=model, path=str(final), loss=meta["loss"], seconds=seconds, cached=False)
