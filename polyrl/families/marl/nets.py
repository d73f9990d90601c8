"""Permutation-invariant networks: one actor shared by every agent, a centralised or a local critic.

Actor (deep sets, arXiv:1703.06114): a_i ~ N(mu_i, diag(sigma^2)), mu_i = rho([o_i, mean_{j != i} phi(n_ij)]),
where phi is one hidden layer of width hidden/2, n_ij are agent i's features of neighbour j and the
mean runs over alive neighbours only; sigma is a learned
state-independent vector. Permuting the agents permutes the outputs (equivariance), and the same weights run for
any team size N (tested).

Critics (one value per agent, shared team reward): ``local`` V(o_i, neighbours of i) has the actor's inputs
(IPPO); ``central`` V(o_i, mean_j psi(o_j), team features) also sees every agent's own features and the
formation's current support margin, imbalance and share of agents under the object (MAPPO with agent-specific
global state, arXiv:2103.01955).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from polyrl.errors import TrainingError
from polyrl.families.marl.env import NBR_DIM, OBS_DIM

TEAM_DIM = 3


def mlp(i: int, h: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o))


def masked_mean(x: Tensor, mask: Tensor, dim: int) -> Tensor:
    m = mask.to(x.dtype).unsqueeze(-1)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1.0)


class SetEncoder(nn.Module):
    """[o_i, mean_j phi(n_ij)] -> rho -> out."""

    def __init__(self, own: int, nbr: int, hidden: int, out: int):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(nbr, hidden // 2), nn.ReLU(), nn.Linear(hidden // 2, hidden // 2))
        self.rho = mlp(own + hidden // 2, hidden, out)

    def forward(self, own: Tensor, nbr: Tensor, nmask: Tensor) -> Tensor:
        pooled = masked_mean(self.phi(nbr), nmask, -2)
        return self.rho(torch.cat([own, pooled], -1))


class Actor(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.net = SetEncoder(OBS_DIM, NBR_DIM, hidden, 2)
        self.log_std = nn.Parameter(torch.full((2,), -0.5))

    def dist(self, own: Tensor, nbr: Tensor, nmask: Tensor) -> torch.distributions.Normal:
        mu = self.net(own, nbr, nmask)
        std = self.log_std.exp().expand_as(mu)
        if not bool(torch.isfinite(mu).all() and torch.isfinite(std).all() and (std > 0).all()):
            # diverged weights: one line here rather than Normal's traceback listing every NaN
            raise TrainingError("non-finite actor output (action mean or std)")
        return torch.distributions.Normal(mu, std)


class LocalCritic(nn.Module):
    """V(o_i, neighbours of i): the actor's view only (IPPO)."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.net = SetEncoder(OBS_DIM, NBR_DIM, hidden, 1)

    def forward(self, own: Tensor, nbr: Tensor, nmask: Tensor, alive: Tensor, team: Tensor) -> Tensor:
        return self.net(own, nbr, nmask)[..., 0]


class CentralCritic(nn.Module):
    """V(o_i, neighbours, mean over all agents of psi(o_j), team features): the centralised critic (MAPPO)."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.net = SetEncoder(OBS_DIM + hidden + TEAM_DIM, NBR_DIM, hidden, 1)
        self.psi = mlp(OBS_DIM, hidden, hidden)

    def forward(self, own: Tensor, nbr: Tensor, nmask: Tensor, alive: Tensor, team: Tensor) -> Tensor:
        glob = masked_mean(self.psi(own), alive, -2)  # [..., hidden]
        glob = glob.unsqueeze(-2).expand(*own.shape[:-1], glob.shape[-1])
        t = team.unsqueeze(-2).expand(*own.shape[:-1], team.shape[-1])
        return self.net(torch.cat([own, glob, t], -1), nbr, nmask)[..., 0]


CRITICS = {"central": CentralCritic, "local": LocalCritic}
