"""Formation environment: N robots move under a 2D polygon object of non-uniform mass to carry it, around obstacles.

Batched in torch: B episodes at once, each with its own object, masses, obstacles and team size N (padded to
``n_max`` agents with an ``alive`` mask). Spec section 13 (d) [ours: arXiv:2606.09610's observations, reward and
algorithm were not retrieved; this is the project's operationalisation].

Physics (single integrator): p <- clamp(p + speed * clip(a, -1, 1), arena); a robot that ends inside an obstacle
disc (radius + robot radius) is projected onto its rim. Robots are discs of radius ``ROBOT_R``; two robots
closer than 2 * ROBOT_R collide (penalised, not resolved).

Support: a robot *supports* the object when its centre lies inside the object polygon. The support margin is the
signed distance from the centre of mass c to the boundary of the convex hull H of the supporters, positive iff c
is strictly inside H:  m = min_{|u|=1} (h_H(u) - u.c), h_H(u) = max_{s in H} u.s (support function). The minimum
is attained at an edge normal of H (c inside) or at the direction from the nearest hull point to c (outside);
``support_margin`` evaluates it exactly over the candidate directions {normals of every pair of supporters} and
{c - s_i} (the pair normals include every hull edge's, and a candidate can only overestimate the minimum).
Convention: with no supporter m = -1 (arena units); one or two supporters give m <= 0 (a point or a segment).

Load shares: the minimum-norm f with sum_i f_i = 1 and sum_i f_i s_i = c (static balance of a rigid object on
point supports, least squares via the pseudo-inverse); imbalance = max_i f_i - 1/n_sup (0 when equal shares).

Team reward per step (every agent gets the same; weights in ``RewardWeights``):
  r = w_support * clamp(m, -1, m_cap)/m_cap - w_balance * imbalance - w_reach * mean_i d(p_i, object)
      - w_collide * (colliding pairs + obstacle contacts) / N - w_time
where d(p, object) is the distance to the polygon (0 inside). Success (end of episode): every robot under the
object, m >= success_margin and no robot-robot collision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

ROBOT_R = 0.08
ARENA = 2.2
SPEED = 0.12  # distance per step at |a| = 1
OBS_DIM = 13  # own features per agent
NBR_DIM = 4  # features per neighbour
N_MASSES = 4


@dataclass(frozen=True)
class Distribution:
    """Where episodes are drawn from: team sizes, polygon vertex count and irregularity, mass skew, obstacles."""

    teams: tuple[int, ...] = (3, 4, 6, 8)  # team sizes, drawn uniformly
    k_min: int = 5  # polygon vertices
    k_max: int = 8
    radius_jitter: float = 0.25  # vertex radius in scale * [1 - jitter, 1]
    mass_skew: float = 1.0  # point-mass weights ~ U(0.1, 1) ** skew (higher: more uneven)
    obstacles: int = 2
    scale: float = 0.9


TRAIN = Distribution()
# unseen team sizes (between and beside the trained ones), polygons of 9-11 vertices, more irregular, skewed masses
HELDOUT = Distribution(teams=(5, 7), k_min=9, k_max=11, radius_jitter=0.35, mass_skew=2.5)


@dataclass(frozen=True)
class RewardWeights:
    support: float = 0.3
    margin_cap: float = 0.15
    balance: float = 0.2
    reach: float = 1.0
    collide: float = 0.3
    time: float = 0.02


@dataclass
class State:
    pos: Tensor  # [B, N, 2]
    alive: Tensor  # [B, N] bool
    poly: Tensor  # [B, K, 2] vertices in order (padded by repeating the last one)
    com: Tensor  # [B, 2] centre of mass
    obs_c: Tensor  # [B, O, 2] obstacle centres
    obs_r: Tensor  # [B, O] obstacle radii
    t: int = 0


# ---------------------------------------------------------------- geometry (pure functions, batched)

def inside_polygon(p: Tensor, poly: Tensor) -> Tensor:
    """Crossing-number test: p [B, N, 2] inside poly [B, K, 2] -> [B, N] bool (degenerate edges never cross)."""
    a, b = poly[:, None, :, :], poly.roll(-1, dims=1)[:, None, :, :]  # [B, 1, K, 2]
    x, y = p[..., 0:1], p[..., 1:2]  # [B, N, 1]
    ay, by = a[..., 1], b[..., 1]
    crosses = (ay > y) != (by > y)
    dy = torch.where(by == ay, torch.ones_like(ay), by - ay)
    xint = a[..., 0] + (y - ay) * (b[..., 0] - a[..., 0]) / dy
    return ((crosses & (x < xint)).sum(-1) % 2) == 1


def polygon_distance(p: Tensor, poly: Tensor) -> tuple[Tensor, Tensor]:
    """Distance [B, N] from p to the polygon's boundary and the unit vector [B, N, 2] from p to the nearest point."""
    a, b = poly[:, None], poly.roll(-1, dims=1)[:, None]  # [B, 1, K, 2]
    ab = b - a
    t = (((p[:, :, None] - a) * ab).sum(-1) / (ab * ab).sum(-1).clamp_min(1e-12)).clamp(0, 1)
    near = a + t[..., None] * ab  # [B, N, K, 2]
    d = (near - p[:, :, None]).norm(dim=-1)
    dmin, k = d.min(-1)
    vec = torch.gather(near, 2, k[..., None, None].expand(-1, -1, 1, 2))[:, :, 0] - p
    return dmin, vec / dmin[..., None].clamp_min(1e-9)


def support_margin(points: Tensor, mask: Tensor, c: Tensor) -> Tensor:
    """Signed distance [B] from c [B, 2] to the boundary of the convex hull of points [B, N, 2] where mask [B, N].

    Positive iff c is strictly inside the hull; exact (see the module docstring); -1 when no point is masked in.
    """
    B, N, _ = points.shape
    m = mask.bool()
    d = points[:, :, None] - points[:, None, :]  # [B, N, N, 2] s_i - s_j
    normals = torch.stack([-d[..., 1], d[..., 0]], -1)
    normals = torch.cat([normals, -normals], 2).reshape(B, 2 * N * N, 2)
    pair_ok = (m[:, :, None] & m[:, None, :] & ~torch.eye(N, dtype=torch.bool, device=points.device))
    pair_ok = torch.cat([pair_ok, pair_ok], 2).reshape(B, 2 * N * N)
    radial = c[:, None] - points  # [B, N, 2]
    dirs = torch.cat([normals, radial], 1)
    ok = torch.cat([pair_ok, m], 1)
    length = dirs.norm(dim=-1)
    ok = ok & (length > 1e-9)
    u = dirs / length[..., None].clamp_min(1e-9)  # [B, M, 2]
    proj = torch.einsum("bmk,bnk->bmn", u, points)  # u . s_n
    h = proj.masked_fill(~m[:, None, :], -math.inf).max(-1).values  # support function [B, M]
    val = h - (u * c[:, None]).sum(-1)
    val = val.masked_fill(~ok, math.inf).min(-1).values
    none = ~m.any(-1)
    return torch.where(none, torch.full_like(val, -1.0), val.clamp(max=1e3).nan_to_num(-1.0))


def load_shares(points: Tensor, mask: Tensor, c: Tensor) -> Tensor:
    """Minimum-norm load shares f [B, N] (0 where not masked): sum f = 1, sum f s = c, least squares."""
    m = mask.to(points.dtype)
    A = torch.stack([points[..., 0] * m, points[..., 1] * m, m], 1)  # [B, 3, N]
    b = torch.stack([c[:, 0], c[:, 1], torch.ones_like(c[:, 0])], 1)[..., None]  # [B, 3, 1]
    return (torch.linalg.pinv(A) @ b)[..., 0] * m


def imbalance(points: Tensor, mask: Tensor, c: Tensor) -> Tensor:
    """max_i f_i - 1/n_sup [B] (0 for equal shares; 1 with no supporter)."""
    n = mask.sum(-1).to(points.dtype)
    f = load_shares(points, mask, c).masked_fill(~mask.bool(), -math.inf).max(-1).values
    return torch.where(n > 0, f - 1.0 / n.clamp_min(1.0), torch.ones_like(n))


def collisions(pos: Tensor, alive: Tensor) -> Tensor:
    """Colliding robot pairs per agent [B, N] (how many alive robots are within 2 * ROBOT_R of each)."""
    d = (pos[:, :, None] - pos[:, None, :]).norm(dim=-1)
    pair = alive[:, :, None] & alive[:, None, :] & (d < 2 * ROBOT_R)
    pair &= ~torch.eye(pos.shape[1], dtype=torch.bool, device=pos.device)
    return pair.sum(-1)


# ---------------------------------------------------------------- sampling and stepping

def _uniform(g: torch.Generator, *shape: int) -> Tensor:
    return torch.rand(*shape, generator=g)


def reset(batch: int, n_max: int, dist: Distribution, g: torch.Generator) -> State:
    """Draw ``batch`` episodes from ``dist``: team sizes, polygons, masses, obstacles and start positions."""
    B, kmax = batch, dist.k_max
    n = torch.tensor(dist.teams)[torch.randint(len(dist.teams), (B,), generator=g)]
    alive = torch.arange(n_max)[None] < n[:, None]
    k = torch.randint(dist.k_min, dist.k_max + 1, (B,), generator=g)
    ang = torch.sort(_uniform(g, B, kmax) * 2 * math.pi, -1).values
    ang = torch.where(torch.arange(kmax)[None] < k[:, None], ang, ang.gather(1, (k - 1)[:, None]).expand(-1, kmax))
    rad = dist.scale * (1 - dist.radius_jitter * _uniform(g, B, kmax))
    rad = torch.where(torch.arange(kmax)[None] < k[:, None], rad, rad.gather(1, (k - 1)[:, None]).expand(-1, kmax))
    poly = torch.stack([rad * ang.cos(), rad * ang.sin()], -1)
    # point masses: a random point of a random fan triangle (origin, v_j, v_j+1): inside (star-shaped about 0)
    j = (_uniform(g, B, N_MASSES) * k[:, None]).long()
    v1 = poly.gather(1, j[..., None].expand(-1, -1, 2))
    v2 = poly.gather(1, ((j + 1) % k[:, None])[..., None].expand(-1, -1, 2))
    r1, r2 = _uniform(g, B, N_MASSES, 1), _uniform(g, B, N_MASSES, 1)
    flip = (r1 + r2) > 1
    r1, r2 = torch.where(flip, 1 - r1, r1), torch.where(flip, 1 - r2, r2)
    pts = r1 * v1 + r2 * v2
    w = (0.1 + 0.9 * _uniform(g, B, N_MASSES)) ** dist.mass_skew
    com = (w[..., None] * pts).sum(1) / w.sum(1, keepdim=True)
    oa = _uniform(g, B, dist.obstacles) * 2 * math.pi
    orad = 1.15 + 0.2 * _uniform(g, B, dist.obstacles)
    obs_c = torch.stack([orad * oa.cos(), orad * oa.sin()], -1)
    obs_r = 0.1 + 0.06 * _uniform(g, B, dist.obstacles)
    sa = _uniform(g, B, n_max) * 2 * math.pi
    sr = 1.6 + 0.3 * _uniform(g, B, n_max)
    pos = torch.stack([sr * sa.cos(), sr * sa.sin()], -1)
    return State(pos=pos, alive=alive, poly=poly, com=com, obs_c=obs_c, obs_r=obs_r)


def _resolve_obstacles(pos: Tensor, obs_c: Tensor, obs_r: Tensor) -> tuple[Tensor, Tensor]:
    """Project robots out of obstacle discs; return (positions, contacts per agent [B, N])."""
    rel = pos[:, :, None] - obs_c[:, None]  # [B, N, O, 2]
    dist = rel.norm(dim=-1)
    reach = obs_r[:, None] + ROBOT_R
    hit = dist < reach
    push = rel / dist[..., None].clamp_min(1e-9) * (reach - dist).clamp_min(0)[..., None]
    return pos + (push * hit[..., None]).sum(2), hit.sum(-1)


def step(s: State, action: Tensor) -> tuple[State, Tensor, dict[str, Tensor]]:
    """Move every alive robot by SPEED * clip(action); return (new state, team reward [B], info)."""
    a = action.clamp(-1, 1) * s.alive[..., None]
    pos = (s.pos + SPEED * a).clamp(-ARENA, ARENA)
    pos, contacts = _resolve_obstacles(pos, s.obs_c, s.obs_r)
    pos = torch.where(s.alive[..., None], pos, s.pos)
    ns = State(pos=pos, alive=s.alive, poly=s.poly, com=s.com, obs_c=s.obs_c, obs_r=s.obs_r, t=s.t + 1)
    r, info = reward(ns, contacts=contacts * s.alive)
    return ns, r, info


def reward(s: State, weights: RewardWeights = RewardWeights(), contacts: Tensor | None = None
           ) -> tuple[Tensor, dict[str, Tensor]]:
    """The team reward [B] of a state (module docstring) and its parts."""
    w = weights
    inside = inside_polygon(s.pos, s.poly) & s.alive
    margin = support_margin(s.pos, inside, s.com)
    imb = imbalance(s.pos, inside, s.com)
    d, _ = polygon_distance(s.pos, s.poly)
    d = torch.where(inside | ~s.alive, torch.zeros_like(d), d)
    n = s.alive.sum(-1).to(s.pos.dtype)
    coll = collisions(s.pos, s.alive)
    hits = coll.sum(-1) / 2 + (contacts.sum(-1) if contacts is not None else 0)
    r = (w.support * margin.clamp(-1, w.margin_cap) / w.margin_cap - w.balance * imb.clamp(max=1.0)
         - w.reach * d.sum(-1) / n - w.collide * hits / n - w.time)
    success = (inside.sum(-1) == s.alive.sum(-1)) & (margin >= 0.03) & (coll.sum(-1) == 0)
    return r, {"margin": margin, "imbalance": imb, "inside": inside, "collisions": coll.sum(-1) / 2,
               "success": success}


def observe(s: State, horizon: int) -> tuple[Tensor, Tensor]:
    """Per-agent features: own [B, N, OBS_DIM] and neighbours [B, N, N, NBR_DIM] (relative, permutation-free)."""
    inside = inside_polygon(s.pos, s.poly)
    d, vec = polygon_distance(s.pos, s.poly)
    sd = torch.where(inside, -d, d)
    rel_o = s.obs_c[:, None] - s.pos[:, :, None]  # [B, N, O, 2]
    od = rel_o.norm(dim=-1) - s.obs_r[:, None]
    k = od.argmin(-1)
    near_o = torch.gather(rel_o, 2, k[..., None, None].expand(-1, -1, 1, 2))[:, :, 0]
    B, N = s.alive.shape
    own = torch.cat([s.com[:, None] - s.pos, -s.pos, inside[..., None].float(), sd[..., None], vec, near_o,
                     od.min(-1).values[..., None],
                     torch.full((B, N, 1), s.t / horizon), (s.alive.sum(-1, keepdim=True)[..., None] / 8.0)
                     .expand(B, N, 1).float()], -1)
    rel = s.pos[:, None, :] - s.pos[:, :, None]  # [B, i, j, 2] p_j - p_i
    nbr = torch.cat([rel, rel.norm(dim=-1, keepdim=True), inside[:, None, :, None].float().expand(B, N, N, 1)], -1)
    return own, nbr


def neighbour_mask(alive: Tensor) -> Tensor:
    """[B, N, N] True where j is an alive robot other than i."""
    n = alive.shape[1]
    return alive[:, :, None] & alive[:, None, :] & ~torch.eye(n, dtype=torch.bool, device=alive.device)
