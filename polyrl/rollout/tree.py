"""Rollout budget allocation for mixed-outcome groups (TRACE, arXiv:2606.11119) -- the allocation rule.

The paper's principle: spend rollouts on the anchors (prompts, or prefixes in a tree of turns) whose
continuations are most likely to contain both successes and failures, since only such groups give a
group-relative gradient. The exact objective was not readable; this module is OUR operationalisation
of that principle (shared/spec/methods-seedblog.md section 3, marked [ours] there):

    P_mix(p, n) = 1 - p^n - (1 - p)^n  for n >= 2, else 0   (chance a group of n has mixed outcomes)
    n* = argmax sum_m P_mix(p_m, n_m)  s.t.  sum_m n_m <= B,  n_m in {0} U [n_min, n_max]

The objective is separable over anchors, so a dynamic programme over (anchor, budget used) solves it
exactly. Anchors predicted to always succeed or always fail (p in {0, 1}) get nothing: "stop expanding
branches that clearly succeed or fail".

The tree sampler (``TreeSampler``, also ours) spends one step's rollout budget B = groups x G in two
stages, as the paper describes (roots, then expansions):

1. roots: draw ``candidate_factor`` x groups prompts, predict each one's success probability from its
   pass-rate history (``SuccessPredictor``: a Beta posterior under a prior fitted to the whole pool, so
   P_mix is the Beta-binomial predictive and an unseen prompt is worth the pool's mixed rate, not the
   maximum), prune prompts predicted decided (p < prune or p > 1 - prune) and allocate ``root_frac`` x B
   rollouts with the DP (n in {0} U [2, G]);
2. extend, once the probes' outcomes are known: one DP (``allocate_by_gain``) over two kinds of anchor.
   (a) every candidate prompt: more rollouts join its root group (up to ``max_group``, default 2 G); (b) every prefix of
   a root rollout -- the completion up to a turn boundary (multi-turn tasks) or up to half its length
   (single-turn) -- whose success probability is an online estimate from the root rollouts through it,
   smoothed toward their group's rate (decided prefixes are pruned); a chosen prefix gets n fresh
   continuations, which form a sibling group with the root rollouts through it. The gain of n rollouts
   is ``expected_useful``: the expected number of rollouts newly in a mixed group given the outcomes
   the group already holds -- a probe that came back mixed makes every extra rollout useful, one that
   came back all-fail is worth extending only as far as a success stays likely. (A root rollout that
   could become useful through both its root and a sibling group is counted in both: the DP's value
   is an upper bound there.) Both stages together never exceed B.

Predictors: the pass-rate history above (``SuccessPredictor``, optionally shared across similar prompts), or, on tasks
whose reward is 1 exactly when the completion is the reference answer, the policy's own probability of that answer
(``likelihood``: one teacher-forced forward pass per candidate, ``learner.answer_likelihood``). That probability is the
success rate of a rollout for the policy of this step (exact with a character tokenizer, else a lower bound): no
history to go stale, no prompt to see twice, so the DP picks the prompts whose groups will be mixed now from a fresh
draw of candidates every step (``EXACT_STRENGTH`` makes its Beta a point; the pass-rate history is still
recorded). ``branch=False`` leaves out the prefix continuations: the extension only grows root groups.

Sampled roots (``roots="sample"``, also ours): stage 1 draws groups of G at random instead, prompt m with
inclusion probability pi_m proportional to max(P_mix(p_m, G), floor) (``inclusion_probabilities``, exact by
systematic sampling), and stage 2 extends only the drawn prompts. The loss of every sample of prompt m, KL
term included, then weighs 1 / (pi_m n_m) (n_m: the prompt's samples in the batch; ``TreeInfo.weight``,
scaled to mean 1 over the batch), so the expected loss is that of prompts drawn uniformly: the importance
correction of prioritized replay, self-normalized (a small bias for less variance). The DP's choice pulls
the policy toward the prompts it prefers and away from the ones it stops drawing (on a small pool it
forgets them); the weights undo that, and the preference only changes the variance.

Tree advantages: a leaf is compared with the sibling group of its deepest branching anchor (the
method's group estimator on sibling groups); tokens after the branch point use that advantage, the
shared prefix uses the root-group advantage. Continuations train only on their own tokens (their copy
of the prefix has loss mask 0: the root rollout already carries it).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, MutableMapping

import torch
from torch import Tensor

from polyrl.objectives import Method
from polyrl.registry import SHAPERS
from polyrl.rollout.collect import NoUsableGroups, RolloutBatch, TreeInfo
from polyrl.rollout.episodes import Episode, EpisodeRunner, prefix_episode
from polyrl.rollout.generator import SamplingParams
from polyrl.tasks.base import Prompt
from polyrl.tasks.rewards import RewardChannels

EXACT_STRENGTH = 1e4  # pseudo-trials of a predicted rate known exactly (the likelihood predictor): Beta ~ a point


def p_mixed(p: Tensor, n: Tensor, strength: Tensor | None = None) -> Tensor:
    """Probability that n Bernoulli(p) rollouts contain both a success and a failure (0 for n < 2).

    With ``strength`` s the success probability is itself uncertain, p ~ Beta(p s, (1 - p) s) (a posterior
    from s pseudo-trials), and the value is the Beta-binomial predictive 1 - E[p^n] - E[(1 - p)^n], with
    E[p^n] = prod_{j<n} (a + j) / (s + j). An anchor seen once at 1/2 is then worth less than one seen
    many times at 1/2: the allocation prefers prompts it knows to be uncertain over prompts it knows nothing of.
    """
    p = torch.as_tensor(p, dtype=torch.float64)
    n = torch.as_tensor(n, dtype=torch.float64)
    if strength is None:
        value = 1.0 - p.pow(n) - (1.0 - p).pow(n)
    else:
        e_p, e_q = _beta_moments(p, torch.as_tensor(strength, dtype=torch.float64), n)
        value = 1.0 - e_p - e_q
    return torch.where(n >= 2, value, torch.zeros_like(value))


def _beta_moments(p: Tensor, s: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
    """(E[q^n], E[(1 - q)^n]) for q ~ Beta(p s, (1 - p) s): prod_{j<n} (a + j) / (s + j), broadcast."""
    p, s, n = torch.broadcast_tensors(p, s, n)
    e_p, e_q = torch.ones_like(p), torch.ones_like(p)
    for j in range(int(n.max()) if n.numel() else 0):
        on = n > j
        e_p = torch.where(on, e_p * (p * s + j) / (s + j), e_p)
        e_q = torch.where(on, e_q * ((1 - p) * s + j) / (s + j), e_q)
    return e_p, e_q


def allocate_rollouts(p_hat: Tensor, budget: int, *, n_min: int = 2, n_max: int | None = None,
                      objective: str = "groups", strength: Tensor | None = None) -> Tensor:
    """Exact allocation [M] maximising the expected number of mixed-outcome groups under a rollout budget.

    ``p_hat`` [M]: predicted success probability per anchor; ``budget``: total rollouts B; each anchor
    gets 0 or between ``n_min`` and ``n_max`` (default: B) rollouts. Ties go to the smaller total, then
    to earlier anchors, so the result is deterministic. ``objective="groups"`` maximises
    sum_m P_mix(p_m, n_m) (the spec's form; it favours many groups of two); ``"rollouts"`` maximises the
    expected number of rollouts that sit in mixed groups, sum_m n_m P_mix(p_m, n_m) -- the rollout
    utilization the tree sampler reports, so it is the sampler's default. ``strength`` [M] (optional): the
    predictions are Beta posteriors with that many pseudo-trials (``p_mixed``).
    """
    if objective not in ("groups", "rollouts"):
        raise ValueError(f"objective = {objective!r} is not allowed; use 'groups' or 'rollouts'")
    if budget < 0:
        raise ValueError(f"budget = {budget} must be >= 0")
    if n_min < 1:
        raise ValueError(f"n_min = {n_min} must be >= 1")
    n_max = budget if n_max is None else n_max
    if n_max < n_min:
        raise ValueError(f"n_max = {n_max} must be >= n_min = {n_min}")
    p = p_hat.detach().to(torch.float64).cpu()
    if ((p < 0) | (p > 1)).any():
        raise ValueError("p_hat must lie in [0, 1]")
    if strength is not None and (strength.shape != p.shape or bool((strength <= 0).any())):
        raise ValueError(f"strength must be positive with the shape of p_hat {tuple(p.shape)}")
    choices = torch.arange(min(n_max, budget) + 1, dtype=torch.float64)
    weight = choices if objective == "rollouts" else torch.ones_like(choices)
    table = weight * p_mixed(p[:, None], choices[None, :], None if strength is None else
                             strength.to(torch.float64)[:, None])
    table[:, 1:n_min] = -math.inf  # 0 or between n_min and n_max
    return allocate_by_gain(table, budget)


def allocate_by_gain(gain: Tensor, budget: int) -> Tensor:
    """Exact allocation [M] maximising sum_m gain[m, n_m] subject to sum_m n_m <= budget (dynamic programme).

    ``gain`` [M, K + 1]: the value of giving anchor m exactly n = 0..K rollouts (-inf: not allowed; column 0
    must be 0). Ties go to the smaller total, then to earlier anchors, so the result is deterministic.
    """
    if budget < 0:
        raise ValueError(f"budget = {budget} must be >= 0")
    g = gain.detach().to(torch.float64).cpu()
    if g.dim() != 2 or bool((g[:, 0] != 0).any()):
        raise ValueError(f"gain must be [M, K + 1] with gain[:, 0] = 0, got shape {tuple(g.shape)}")
    M, K = g.shape[0], g.shape[1] - 1
    rows = [[(n, float(g[m, n])) for n in range(min(K, budget) + 1) if g[m, n] > -math.inf] for m in range(M)]
    # best[m][b]: best value of anchors m.. with b rollouts left; take[m][b]: the n achieving it
    best = [[0.0] * (budget + 1) for _ in range(M + 1)]
    take = [[0] * (budget + 1) for _ in range(M)]
    for m in range(M - 1, -1, -1):
        for b in range(budget + 1):
            top, arg = -math.inf, 0
            for n, value in rows[m]:
                if n > b:
                    break
                value = value + best[m + 1][b - n]
                if value > top + 1e-12:  # strict improvement only: prefer fewer rollouts on ties
                    top, arg = value, n
            best[m][b], take[m][b] = top, arg
    out, left = [], budget
    for m in range(M):
        out.append(take[m][left])
        left -= out[-1]
    return torch.tensor(out, dtype=torch.long)


def inclusion_probabilities(weights: Tensor, k: int) -> Tensor:
    """Inclusion probabilities [M] proportional to ``weights`` that sum to ``k``, none above 1.

    An item whose share would exceed 1 is included for sure and the rest share what is left (the
    standard capping of sampling proportional to size). Items of weight 0 are never included.
    """
    w = weights.detach().to(torch.float64).cpu().clamp_min(0)
    k = min(k, int((w > 0).sum()))
    pi, sure = torch.zeros_like(w), torch.zeros_like(w, dtype=torch.bool)
    while k > 0:
        free = ~sure & (w > 0)
        pi[free] = (k - int(sure.sum())) * w[free] / w[free].sum()
        over = free & (pi >= 1)
        if not over.any():
            break
        sure |= over
        pi[over] = 1.0
    return pi


def systematic_sample(pi: Tensor, u: float) -> list[int]:
    """Indices drawn by systematic sampling at offset ``u`` in [0, 1): item i is drawn with probability exactly pi_i.

    The points u, u + 1, ... fall on the cumulative sum of ``pi`` (which must sum to an integer k, each pi_i <= 1), so
    exactly k distinct items are drawn, in order, and averaging over u gives each one its pi_i.
    """
    if not 0 <= u < 1:
        raise ValueError(f"u = {u} must be in [0, 1)")
    edges = torch.cumsum(pi.detach().to(torch.float64).cpu(), 0)
    k = round(float(edges[-1])) if len(edges) else 0
    points = torch.arange(k, dtype=torch.float64) + u
    return torch.searchsorted(edges, points, right=True).clamp_max(len(edges) - 1).tolist() if k else []


def expected_useful(p: Tensor, strength: Tensor, n: Tensor, successes: Tensor, failures: Tensor,
                    idle: Tensor) -> Tensor:
    """Expected rollouts newly in a mixed group when ``n`` more join a group that already has some outcomes.

    A group holding ``successes`` and ``failures`` (counts) is mixed once it has one of each; the new
    rollouts succeed with p ~ Beta(p s, (1 - p) s). Value: P(mixed after n) (n + idle) - P(mixed now) idle,
    where ``idle`` counts the group's rollouts not yet useful. An already mixed group gains exactly n (every
    extra rollout is useful); an empty group gains n P_mix (``p_mixed``); a group of successes only gains
    (n + idle) (1 - E[p^n]). This is what lets a probe be extended once its outcome is known.
    """
    p, s, n = (torch.as_tensor(x, dtype=torch.float64) for x in (p, strength, n))
    has_s, has_f = torch.as_tensor(successes) > 0, torch.as_tensor(failures) > 0
    idle = torch.as_tensor(idle, dtype=torch.float64)
    p, s, n, has_s, has_f, idle = torch.broadcast_tensors(p, s, n, has_s, has_f, idle)
    e_p, e_q = _beta_moments(p, s, n)
    mixed_now = (has_s & has_f).to(torch.float64)
    mixed_after = torch.where(has_s & has_f, torch.ones_like(p), torch.where(
        has_s, 1 - e_p, torch.where(has_f, 1 - e_q, (1 - e_p - e_q).clamp_min(0))))
    return mixed_after * (n + idle) - mixed_now * idle


class SuccessPredictor:
    """Per-prompt success probability from its pass-rate history: a Beta posterior under a fitted population prior.

    The prior Beta(m s0, (1 - m) s0) is fitted to every prompt seen so far by the method of moments: m is the
    pooled success rate and E[p^2] the mean of k (k - 1) / (n (n - 1)) (unbiased per prompt for a binomial),
    so s0 = m (1 - m) / (E[p^2] - m^2) - 1. A bimodal population (prompts mostly solved or mostly failed)
    gives a U-shaped prior (s0 < 2): an unseen prompt is then predicted likely decided, and a prompt seen at
    1/2 likely mixed. Before ``min_prompts`` prompts have two or more trials the prior is Beta(m s, (1 - m) s)
    with s = ``prior_strength`` (m = 0.5 before any data). A prompt with k successes in n trials gets
    mean (m s0 + k) / (s0 + n) and strength s0 + n (``prompts``). The policy moves, so evidence ages: with
    ``half_life`` H > 0 a prompt's counts weigh 2^(-t / H) after t steps without a visit (``now`` is the current
    step), and its posterior widens back toward the prior. Without it a prompt once seen solved (p > 1 - prune)
    would never be drawn again, and if the policy forgot it nothing would notice. ``counts`` (pool index ->
    [successes, trials, step of the last visit]) is the trainer's resumable state.

    With ``embed`` (texts -> [N, H] features, e.g. the policy's mean hidden state of the prompt) the predictor is
    shared across prompts, as TRACE's is: a ridge regression of each seen prompt's smoothed logit pass rate on its
    features gives every prompt its own prior mean m(x), so a prompt never seen before is predicted from the ones
    like it; the strength s0 is then fitted to the residual spread E[(p - m(x))^2] by the same moments. Features
    are taken once, when a prompt is first a candidate (with the policy of that time), and kept in memory: a
    resumed run rebuilds them as prompts are drawn again, so its predictions are not bit-exact.
    """

    def __init__(self, counts: MutableMapping[int, list[float]], prior_strength: float = 2.0, half_life: float = 0.0,
                 min_prompts: int = 8, embed: Callable[[list[str]], Tensor] | None = None, ridge: float = 10.0):
        self.counts = counts
        self.prior_strength, self.half_life, self.min_prompts = prior_strength, half_life, min_prompts
        self.now = 0  # current step (the sampler sets it)
        self.embed, self.ridge = embed, ridge
        self.features: dict[int, Tensor] = {}  # pool index -> features (with embed)

    def _aged(self, c: list[float]) -> tuple[float, float]:
        """(successes, trials) of one prompt, discounted by the steps since its last visit."""
        if not self.half_life or len(c) < 3:
            return c[0], c[1]
        w = 0.5 ** (max(0, self.now - c[2]) / self.half_life)
        return c[0] * w, c[1] * w

    def prior(self) -> tuple[float, float]:
        """(mean m, strength s0) of the population prior."""
        aged = torch.tensor([self._aged(c) for c in self.counts.values()], dtype=torch.float64).reshape(-1, 2)
        k, n = aged[:, 0], aged[:, 1]
        m = float(k.sum() / n.sum()) if len(n) and float(n.sum()) > 0 else 0.5
        two = n >= 2 - 1e-9
        if int(two.sum()) < self.min_prompts or not 0 < m < 1:
            return m, self.prior_strength
        kk, nn = k[two], n[two]
        p2 = float(_unbiased_p2(kk, nn).mean())
        var = min(max(p2 - m * m, 1e-4), m * (1 - m) * (1 - 1e-3))
        return m, max(m * (1 - m) / var - 1, 1e-3)

    def prompts(self, pool_ids: list[int], texts: list[str] | None = None) -> tuple[Tensor, Tensor]:
        """Posterior (mean [M], strength [M]) of each prompt's success probability (``texts``: for ``embed``)."""
        shared = None
        if self.embed is not None and texts is not None:
            new = [(i, t) for i, t in zip(pool_ids, texts) if i not in self.features]
            if new:
                self.features.update(zip([i for i, _ in new], self.embed([t for _, t in new]).double()))
            shared = self._shared_prior(pool_ids)
        m, s0 = shared if shared is not None else self.prior()
        seen = torch.tensor([self._aged(self.counts.get(i, [0.0, 0.0])) for i in pool_ids],
                            dtype=torch.float64).reshape(-1, 2)
        k, n = seen[:, 0], seen[:, 1]
        return (m * s0 + k) / (s0 + n), s0 + n

    def _shared_prior(self, pool_ids: list[int]) -> tuple[Tensor, float] | None:
        """(m(x) [M], s0) from a ridge regression on the features of the prompts seen so far, or None (too few)."""
        fit = [i for i in self.counts if i in self.features]
        aged = torch.tensor([self._aged(self.counts[i]) for i in fit], dtype=torch.float64).reshape(-1, 2)
        k, n = aged[:, 0], aged[:, 1]
        if int((n >= 2 - 1e-9).sum()) < max(self.min_prompts, 16):
            return None
        x = torch.stack([self.features[i] for i in fit])
        mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
        design = torch.cat([(x - mu) / sd, torch.ones(len(fit), 1, dtype=torch.float64)], 1)
        y = torch.logit((k + 0.5) / (n + 1))
        w = n / (n + 2)  # more trials, more trust
        gram = design.T @ (w[:, None] * design) + self.ridge * torch.eye(design.shape[1], dtype=torch.float64)
        gram[-1, -1] -= self.ridge  # the intercept is not shrunk
        coef = torch.linalg.solve(gram, design.T @ (w * y))

        def mean_of(feats: Tensor) -> Tensor:
            z = torch.cat([(feats - mu) / sd, torch.ones(len(feats), 1, dtype=torch.float64)], 1) @ coef
            return torch.sigmoid(z.clamp(-6, 6))

        m_fit = mean_of(x)
        two = n >= 2 - 1e-9
        kk, nn, mm = k[two], n[two], m_fit[two]
        resid = float((_unbiased_p2(kk, nn) - 2 * mm * kk / nn + mm * mm).mean())  # E[(p - m(x))^2]
        spread = float((mm * (1 - mm)).mean())
        s0 = min(max(spread / min(max(resid, 1e-4), spread * (1 - 1e-3)) - 1, 1e-3), 1e3)
        return mean_of(torch.stack([self.features[i] for i in pool_ids])), s0

    def record(self, pool_id: int, scores: list[float]) -> None:
        k, n = self._aged(self.counts.get(pool_id, [0.0, 0.0]))
        self.counts[pool_id] = [k + sum(min(1.0, max(0.0, s)) for s in scores), n + len(scores), float(self.now)]


def _unbiased_p2(k: Tensor, n: Tensor) -> Tensor:
    """Per prompt, k (k - 1) / (n (n - 1)): unbiased for p^2 when k ~ Binomial(n, p) (n >= 2)."""
    return (k * (k - 1)).clamp_min(0) / (n * (n - 1))


def prefix_estimate(successes: float, trials: int, group_rate: float, prior_strength: float = 2.0) -> float:
    """Online success estimate of a prefix from the rollouts through it, smoothed toward its group's rate."""
    return (successes + prior_strength * group_rate) / (trials + prior_strength)


def branch_points(episode: Episode, multi_turn: bool) -> list[int]:
    """Completion lengths at which ``episode`` may branch: turn boundaries, or half its length (single-turn)."""
    n = len(episode.token_ids)
    if multi_turn:  # a new agent turn starts where an environment span ends
        return [t for t in range(1, n) if episode.loss_mask[t - 1] == 0 and episode.loss_mask[t] == 1]
    return [n // 2] if n >= 2 else []


def tree_advantages(adv_fn: Callable[[Tensor, Tensor, Tensor], Tensor], rewards: Tensor, tree: TreeInfo,
                    mask: Tensor) -> Tensor:
    """Token advantages [B, T]: root-group advantage before the branch point, sibling-group advantage after.

    ``adv_fn(rewards, group_ids, mask)`` is the method's group estimator ([B] or [B, T] out). Root groups
    hold the root rollouts only (unbiased samples of the prompt); continuations have no root advantage
    (their prefix tokens carry no loss).
    """
    B, T = mask.shape
    root = tree.is_root
    a_root = torch.zeros(B, T, dtype=mask.dtype)
    if root.any():
        a_root[root] = _per_token(adv_fn(rewards[root], tree.root_ids[root], mask[root]), T)
    sib = tree.sibling_ids >= 0
    a_sib = torch.zeros(B, T, dtype=mask.dtype)
    if sib.any():
        a_sib[sib] = _per_token(adv_fn(rewards[sib], tree.sibling_ids[sib], mask[sib]), T)
    after = (torch.arange(T)[None, :] >= tree.branch_at[:, None]) & sib[:, None]
    return torch.where(after, a_sib, a_root)


def _per_token(adv: Tensor, T: int) -> Tensor:
    return adv[:, None].expand(-1, T) if adv.dim() == 1 else adv


def _mixed(scores: list[float]) -> bool:
    return len(scores) >= 2 and max(scores) - min(scores) > 1e-6


class TreeSampler:
    """Two-stage tree rollouts under a fixed budget of groups x G completions (see the module docstring)."""

    def __init__(self, runner: EpisodeRunner, counts: MutableMapping[int, list[float]], *, root_frac: float = 0.5,
                 candidate_factor: float = 2.0, prune: float = 0.05, prior_strength: float = 2.0,
                 objective: str = "rollouts", half_life: float = 0.0, max_group: int = 0,
                 embed: Callable[[list[str]], Tensor] | None = None, roots: str = "dp", floor: float = 0.05,
                 branch: bool = True, likelihood: Callable[[list[Prompt]], Tensor] | None = None):
        if roots not in ("dp", "sample"):
            raise ValueError(f"roots = {roots!r} is not allowed; use 'dp' or 'sample'")
        self.runner = runner
        self.roots = roots  # how probed prompts are chosen: the DP's best, or drawn with importance weights
        self.floor = floor  # sampled roots: least draw weight, > 0 so that every prompt can be drawn (unbiasedness)
        self.predictor = SuccessPredictor(counts, prior_strength, half_life, embed=embed)
        self.root_frac, self.candidate_factor, self.prune = root_frac, candidate_factor, prune
        self.prior_strength, self.objective = prior_strength, objective
        self.max_group = max_group  # largest root group after extension (0: twice the group size)
        self.branch = branch  # False: no prefix continuations, the extension only grows root groups
        self.likelihood = likelihood  # prompts -> the policy's probability of the reference answer (exact-answer tasks)

    def _pruned(self, p: Tensor) -> Tensor:
        return torch.where((p < self.prune) | (p > 1 - self.prune), torch.zeros_like(p), p)

    def collect(self, rewards: RewardChannels, method: Method,
                draw_prompts: Callable[[int], list[tuple[int, Prompt]]], *, num_groups: int, params: SamplingParams,
                history: MutableMapping[int, float], step: int = 0) -> RolloutBatch:
        G, budget = params.n, num_groups * params.n
        self.predictor.now = step
        # 1. roots: probe the candidate prompts whose posterior promises mixed groups -------------------
        drawn = draw_prompts(max(num_groups, math.ceil(self.candidate_factor * num_groups)))
        if self.likelihood is not None:  # the success probability itself, from the policy of this step: no posterior
            p_root = self.likelihood([p for _, p in drawn]).to(torch.float64).clamp(0, 1)
            s_root = torch.full_like(p_root, EXACT_STRENGTH)
        else:
            p_root, s_root = self.predictor.prompts([i for i, _ in drawn], [p.text for _, p in drawn])
        root_budget = max(2, round(self.root_frac * budget))
        inclusion = None
        if self.roots == "sample":  # draw groups of G in proportion to P_mix; weights undo the preference
            inclusion = inclusion_probabilities(p_mixed(p_root, torch.full_like(p_root, G), s_root)
                                                .clamp_min(self.floor), max(1, root_budget // G))
            u = random.Random(params.seed).random() if params.seed is not None else random.random()
            alloc = torch.zeros(len(drawn), dtype=torch.long)
            alloc[systematic_sample(inclusion, u)] = G  # never empty: the floor keeps every weight > 0
        else:
            alloc = allocate_rollouts(self._pruned(p_root), root_budget, n_min=2, n_max=G, objective=self.objective,
                                      strength=s_root)
            if int(alloc.sum()) == 0:  # every candidate predicted decided: probe the least decided ones
                order = (p_root - 0.5).abs().argsort()
                alloc[order[: max(1, root_budget // G)]] = min(G, root_budget)
        roots: list[Episode] = []
        root_of: list[int] = []  # index into drawn
        for k, n in enumerate(alloc.tolist()):
            roots += self.runner.new([drawn[k][1]], n)
            root_of += [k] * n
        root_scores = self._play(rewards, roots, root_of, params)
        # 2. extend: one DP over (a) the candidates -- more rollouts join the prompt's root group -- and
        #    (b) the prefixes of root rollouts -- continuations form a sibling group with the roots through it
        anchors: dict[tuple[int, tuple[int, ...]], list[int]] = {}  # (candidate, prefix tokens) -> root rollouts
        for j, e in enumerate(roots if self.branch else []):
            for cut in branch_points(e, self.runner.tool):
                anchors.setdefault((root_of[j], tuple(e.token_ids[:cut])), [])
        for (k, prefix), members in anchors.items():
            members += [j for j, e in enumerate(roots) if root_of[j] == k and len(e.token_ids) > len(prefix)
                        and tuple(e.token_ids[: len(prefix)]) == prefix]
        keys = list(anchors)
        group = [[root_scores[j] for j in range(len(roots)) if root_of[j] == k] for k in range(len(drawn))]
        root_mixed = [_mixed(g) for g in group]
        succ = torch.tensor([sum(x > 0.5 for x in g) for g in group]  # success = score above 1/2
                            + [sum(root_scores[j] > 0.5 for j in anchors[key]) for key in keys], dtype=torch.float64)
        size = torch.tensor([len(g) for g in group] + [len(anchors[key]) for key in keys], dtype=torch.float64)
        idle = torch.tensor([0 if root_mixed[k] else len(g) for k, g in enumerate(group)]
                            + [sum(not root_mixed[root_of[j]] for j in anchors[key]) for key in keys],
                            dtype=torch.float64)
        # candidates: the posterior updated with this step's outcomes; prefixes: the online estimate
        p_anchor = torch.tensor([prefix_estimate(float(succ[len(drawn) + a]), len(anchors[key]),
                                                 sum(group[key[0]]) / len(group[key[0]]), self.prior_strength)
                                 for a, key in enumerate(keys)], dtype=torch.float64)
        p_anchor = self._pruned(p_anchor)  # decided prefixes: 0, and no continuations below
        mean = torch.cat([(p_root * s_root + succ[: len(drawn)]) / (s_root + size[: len(drawn)]),
                          p_anchor])
        strength = torch.cat([s_root + size[: len(drawn)], size[len(drawn):] + self.prior_strength])
        cap = torch.cat([(self.max_group or 2 * G) - size[: len(drawn)], torch.full((len(keys),), float(G))])
        cap = cap.clamp_min(0).long()
        n = torch.arange(int(cap.max()) + 1, dtype=torch.float64)
        gain = expected_useful(mean[:, None], strength[:, None], n[None, :], succ[:, None],
                               (size - succ)[:, None], idle[:, None])
        gain[n[None, :] > cap[:, None]] = -math.inf
        gain[(size == 0)[:, None] & (n[None, :] == 1)] = -math.inf  # a new group needs two rollouts
        if inclusion is not None:  # sampled roots: a prompt not drawn stays out (its weight assumes the draw)
            gain[torch.cat([size[: len(drawn)] == 0, torch.zeros(len(keys), dtype=torch.bool)]), 1:] = -math.inf
        gain[torch.cat([torch.zeros(len(drawn), dtype=torch.bool), p_anchor == 0]), 1:] = -math.inf
        extra = allocate_by_gain(gain, max(0, budget - len(roots)))
        chosen = [(key, int(m)) for key, m in zip(keys, extra[len(drawn):].tolist()) if m > 0]
        # each root rollout joins the sibling group of its deepest chosen anchor
        sibling_of = [-1] * len(roots)
        for a, (key, _) in enumerate(chosen):
            for j in anchors[key]:
                if sibling_of[j] < 0 or len(chosen[sibling_of[j]][0][1]) < len(key[1]):
                    sibling_of[j] = a
        more: list[Episode] = []
        more_of: list[int] = []
        for k, m in enumerate(extra[: len(drawn)].tolist()):
            more += self.runner.new([drawn[k][1]], m)
            more_of += [k] * m
        conts: list[Episode] = []
        cont_anchor: list[int] = []
        for a, (key, m) in enumerate(chosen):
            conts += [prefix_episode(roots[anchors[key][0]], len(key[1])) for _ in range(m)]
            cont_anchor += [a] * m
        cont_of = [chosen[a][0][0] for a in cont_anchor]
        scores = self._play(rewards, more + conts, more_of + cont_of, _reseeded(params, 1))
        roots, root_of, root_scores = roots + more, root_of + more_of, root_scores + scores[: len(more)]
        sibling_of += [-1] * len(more)
        cont_scores = scores[len(more):]
        for k in set(root_of):
            got = [root_scores[j] for j in range(len(roots)) if root_of[j] == k]
            self.predictor.record(drawn[k][0], got)
            history[drawn[k][0]] = max(history.get(drawn[k][0], 0.0), sum(got) / len(got))
        pruned = int((p_anchor == 0).sum())
        return self._batch(method, params, drawn, roots, root_of, root_scores, sibling_of, conts, cont_anchor,
                           cont_scores, chosen, n_candidates=len(drawn), pruned=pruned, extended=len(more),
                           inclusion=inclusion)

    def _play(self, rewards: RewardChannels, episodes: list[Episode], prompt_index: list[int],
              params: SamplingParams) -> list[float]:
        """Run the episodes to their end; their training rewards (``prompt_index``: each one's candidate)."""
        if not episodes:
            return []
        self.runner.run(episodes, params)
        return rewards([e.prompt for e in episodes], self._texts(episodes), prompt_index=prompt_index).total

    def _texts(self, episodes: list[Episode]) -> list[str]:
        return self.runner.tokenizer.batch_decode([e.token_ids for e in episodes], skip_special_tokens=True)

    def _batch(self, method, params, drawn, roots, root_of, root_scores, sibling_of, conts, cont_anchor, cont_scores,
               chosen, *, n_candidates: int, pruned: int, extended: int, inclusion: Tensor | None) -> RolloutBatch:
        episodes = roots + conts
        if not episodes:
            raise NoUsableGroups("the tree sampler allocated no rollouts", {"rollout/generated": 0.0,
                                                                            "rollout/utilization": 0.0})
        index = [root_of[j] for j in range(len(roots))] + [chosen_root for chosen_root in
                                                           (chosen[a][0][0] for a in cont_anchor)]
        samples = self.runner.to_samples(episodes, index)
        scores = torch.tensor(root_scores + cont_scores, dtype=torch.float32)
        sibling = torch.tensor(sibling_of + cont_anchor, dtype=torch.long)
        branch_at = torch.tensor([len(chosen[a][0][1]) if a >= 0 else 0 for a in sibling.tolist()], dtype=torch.long)
        pool_ids = torch.tensor([drawn[k][0] for k in index], dtype=torch.long)
        lengths = torch.tensor([len(e.token_ids) for e in episodes])
        truncated = torch.tensor([s.finish_reason == "length" for s in samples])
        rewards = scores.clone()
        for shaper in method.shapers:
            rewards = SHAPERS.fn(shaper.name)(rewards, lengths, truncated, params.max_new_tokens, **shaper.params)
        # utilization: a completion is useful when its root group or its sibling group has mixed outcomes
        useful = 0
        for i in range(len(episodes)):
            in_root = i < len(roots) and _mixed([root_scores[j] for j in range(len(roots)) if root_of[j] == index[i]])
            in_sib = bool(sibling[i] >= 0) and _mixed(scores[sibling == sibling[i]].tolist())
            useful += int(in_root or in_sib)
        root_groups = set(root_of)
        mixed_roots = sum(_mixed([root_scores[j] for j in range(len(roots)) if root_of[j] == k]) for k in root_groups)
        mixed_sibs = sum(_mixed(scores[sibling == a].tolist()) for a in range(len(chosen)))
        tokens = int(lengths.sum())
        weight = None
        if inclusion is not None:  # sampled roots: each prompt weighs 1 / (its inclusion probability), spread over
            per = torch.tensor(index)  # its samples, so the expected loss is that of prompts drawn uniformly
            n_of = torch.bincount(per, minlength=len(drawn)).to(torch.float64)
            weight = (1.0 / (inclusion[per] * n_of[per])).to(torch.float32)
            weight = weight / weight.mean()
        stats = {
            "rollout/gen_rounds": 1.0, "rollout/generated": float(len(episodes)),
            "rollout/groups": float(len(root_groups)),
            "rollout/utilization": useful / len(episodes),
            "rollout/useful_groups_per_token": (mixed_roots + mixed_sibs) / max(1, tokens),
            "rollout/mixed_group_frac": mixed_roots / max(1, len(root_groups)),
            "tree/candidates": float(n_candidates), "tree/roots": float(len(roots)),
            "tree/anchors_branched": float(len(chosen)), "tree/continuations": float(len(conts)),
            "tree/anchors_pruned": float(pruned), "tree/roots_extended": float(extended),
            "tree/mixed_sibling_frac": mixed_sibs / max(1, len(chosen)),
        }
        if weight is not None:  # how uneven the importance weights are (1: as uniform sampling)
            stats["tree/weight_max"] = float(weight.max())
        return RolloutBatch(group_ids=pool_ids, prompts=[e.prompt for e in episodes], samples=samples, scores=scores,
                            rewards=rewards, keep=torch.ones(len(episodes), dtype=torch.bool), truncated=truncated,
                            lengths=lengths, stats=stats,
                            tree=TreeInfo(root_ids=pool_ids, sibling_ids=sibling, branch_at=branch_at,
                                          is_root=torch.arange(len(episodes)) < len(roots), weight=weight))


def _reseeded(params: SamplingParams, salt: int) -> SamplingParams:
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed * 31 + salt)
