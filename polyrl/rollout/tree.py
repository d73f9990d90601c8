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
stages, as the paper describes:

1. roots: draw ``candidate_factor`` x groups prompts, predict each one's success probability from its
   pass-rate history (``SuccessPredictor``: a Beta-smoothed rate with the running mean as prior), prune
   prompts predicted decided (p < prune or p > 1 - prune) and allocate ``root_frac`` x B rollouts with
   the DP (n in {0} U [2, G]);
2. branches: every root rollout offers prefixes -- the completion up to a turn boundary (multi-turn
   tasks) or up to half its length (single-turn) -- as anchors. Each anchor's success probability is
   an online estimate from the root rollouts that share that prefix, smoothed toward their group's
   rate; decided anchors are pruned and the rest of the budget goes to them by the same DP. A chosen
   anchor gets n fresh continuations; with the root rollouts through it, they form a sibling group;
3. top-up: budget the branches left unused goes, by the same DP, to candidates that got no roots.

Tree advantages: a leaf is compared with the sibling group of its deepest branching anchor (the
method's group estimator on sibling groups); tokens after the branch point use that advantage, the
shared prefix uses the root-group advantage. Continuations train only on their own tokens (their copy
of the prefix has loss mask 0: the root rollout already carries it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, MutableMapping

import torch
from torch import Tensor

from polyrl.objectives import Method
from polyrl.registry import SHAPERS
from polyrl.rollout.collect import NoUsableGroups, RolloutBatch, TreeInfo
from polyrl.rollout.episodes import Episode, EpisodeRunner, prefix_episode
from polyrl.rollout.generator import SamplingParams
from polyrl.tasks.base import Prompt, Task


def p_mixed(p: Tensor, n: Tensor) -> Tensor:
    """Probability that n Bernoulli(p) rollouts contain both a success and a failure (0 for n < 2)."""
    p = p.to(torch.float64)
    n = torch.as_tensor(n, dtype=torch.float64)
    value = 1.0 - p.pow(n) - (1.0 - p).pow(n)
    return torch.where(n >= 2, value, torch.zeros_like(value))


def allocate_rollouts(p_hat: Tensor, budget: int, *, n_min: int = 2, n_max: int | None = None,
                      objective: str = "groups") -> Tensor:
    """Exact allocation [M] maximising the expected number of mixed-outcome groups under a rollout budget.

    ``p_hat`` [M]: predicted success probability per anchor; ``budget``: total rollouts B; each anchor
    gets 0 or between ``n_min`` and ``n_max`` (default: B) rollouts. Ties go to the smaller total, then
    to earlier anchors, so the result is deterministic. ``objective="groups"`` maximises
    sum_m P_mix(p_m, n_m) (the spec's form; it favours many groups of two); ``"rollouts"`` maximises the
    expected number of rollouts that sit in mixed groups, sum_m n_m P_mix(p_m, n_m) -- the rollout
    utilization the tree sampler reports, so it is the sampler's default.
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
    M = p.numel()
    choices = [0, *range(n_min, min(n_max, budget) + 1)]
    weight = (lambda n: float(n)) if objective == "rollouts" else (lambda n: 1.0)
    gain = [[weight(n) * float(p_mixed(p[m], torch.tensor(n))) for n in choices] for m in range(M)]
    # best[m][b]: best value of anchors m.. with b rollouts left; take[m][b]: the choice index achieving it
    best = [[0.0] * (budget + 1) for _ in range(M + 1)]
    take = [[0] * (budget + 1) for _ in range(M)]
    for m in range(M - 1, -1, -1):
        for b in range(budget + 1):
            top, arg = -1.0, 0
            for k, n in enumerate(choices):
                if n > b:
                    break
                value = gain[m][k] + best[m + 1][b - n]
                if value > top + 1e-12:  # strict improvement only: prefer fewer rollouts on ties
                    top, arg = value, k
            best[m][b], take[m][b] = top, arg
    out, left = [], budget
    for m in range(M):
        n = choices[take[m][left]]
        out.append(n)
        left -= n
    return torch.tensor(out, dtype=torch.long)


class SuccessPredictor:
    """Per-prompt success probability from its pass-rate history, smoothed toward the running mean.

    p_hat = (successes + a * p_bar) / (trials + a), with a = ``prior_strength`` and p_bar the success rate
    of every root rollout seen so far (0.5 before any). ``counts`` (pool index -> [successes, trials]) is
    the trainer's resumable state.
    """

    def __init__(self, counts: MutableMapping[int, list[float]], prior_strength: float = 2.0):
        self.counts = counts
        self.prior_strength = prior_strength

    @property
    def mean(self) -> float:
        s = sum(c[0] for c in self.counts.values())
        n = sum(c[1] for c in self.counts.values())
        return s / n if n else 0.5

    def prompts(self, pool_ids: list[int]) -> Tensor:
        p_bar, a = self.mean, self.prior_strength
        out = [(self.counts.get(i, [0.0, 0.0])[0] + a * p_bar) / (self.counts.get(i, [0.0, 0.0])[1] + a)
               for i in pool_ids]
        return torch.tensor(out, dtype=torch.float64)

    def record(self, pool_id: int, scores: list[float]) -> None:
        c = self.counts.setdefault(pool_id, [0.0, 0.0])
        c[0] += sum(min(1.0, max(0.0, s)) for s in scores)
        c[1] += len(scores)


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
                 objective: str = "rollouts"):
        self.runner = runner
        self.predictor = SuccessPredictor(counts, prior_strength)
        self.root_frac, self.candidate_factor, self.prune = root_frac, candidate_factor, prune
        self.prior_strength, self.objective = prior_strength, objective

    def _pruned(self, p: Tensor) -> Tensor:
        return torch.where((p < self.prune) | (p > 1 - self.prune), torch.zeros_like(p), p)

    def collect(self, task: Task, method: Method, draw_prompts: Callable[[int], list[tuple[int, Prompt]]], *,
                num_groups: int, params: SamplingParams, history: MutableMapping[int, float]) -> RolloutBatch:
        G, budget = params.n, num_groups * params.n
        # 1. roots: predicted pass rates -> DP allocation over the candidate prompts ----------------------
        drawn = draw_prompts(max(num_groups, math.ceil(self.candidate_factor * num_groups)))
        p_root = self.predictor.prompts([i for i, _ in drawn])
        root_budget = max(2, round(self.root_frac * budget))
        alloc = allocate_rollouts(self._pruned(p_root), root_budget, n_min=2, n_max=G, objective=self.objective)
        if int(alloc.sum()) == 0:  # every candidate predicted decided: probe the least decided ones
            order = (p_root - 0.5).abs().argsort()
            alloc[order[: max(1, root_budget // G)]] = min(G, root_budget)
        roots: list[Episode] = []
        root_of: list[int] = []  # index into drawn
        for k, n in enumerate(alloc.tolist()):
            roots += self.runner.new([drawn[k][1]], n)
            root_of += [k] * n
        self.runner.run(roots, params)
        root_scores = [task.reward(e.prompt, t)[0] for e, t in zip(roots, self._texts(roots))]
        # 2. branches: prefixes shared by root rollouts, online estimate, DP over the rest of the budget ---
        anchors: dict[tuple[int, tuple[int, ...]], list[int]] = {}  # (candidate, prefix tokens) -> root rollouts
        for j, e in enumerate(roots):
            for cut in branch_points(e, self.runner.tool):
                anchors.setdefault((root_of[j], tuple(e.token_ids[:cut])), [])
        for (k, prefix), members in anchors.items():
            members += [j for j, e in enumerate(roots) if root_of[j] == k and len(e.token_ids) > len(prefix)
                        and tuple(e.token_ids[: len(prefix)]) == prefix]
        keys = list(anchors)
        group_rate = {k: sum(root_scores[j] for j in range(len(roots)) if root_of[j] == k) / int(alloc[k])
                      for k in set(root_of)}
        p_anchor = torch.tensor([prefix_estimate(sum(root_scores[j] for j in anchors[key]), len(anchors[key]),
                                                 group_rate[key[0]], self.prior_strength) for key in keys],
                                dtype=torch.float64)
        branch_budget = budget - len(roots)
        n_branch = torch.zeros(len(keys), dtype=torch.long)
        if keys and branch_budget >= 2:
            n_branch = allocate_rollouts(self._pruned(p_anchor), branch_budget, n_min=2, n_max=G,
                                         objective=self.objective)
        chosen = [(key, n) for key, n in zip(keys, n_branch.tolist()) if n > 0]
        # each root rollout joins the sibling group of its deepest chosen anchor
        sibling_of = [-1] * len(roots)
        for a, (key, _) in enumerate(chosen):
            for j in anchors[key]:
                if sibling_of[j] < 0 or len(chosen[sibling_of[j]][0][1]) < len(key[1]):
                    sibling_of[j] = a
        conts: list[Episode] = []
        cont_anchor: list[int] = []
        for a, (key, n) in enumerate(chosen):
            source = roots[anchors[key][0]]
            conts += [prefix_episode(source, len(key[1])) for _ in range(n)]
            cont_anchor += [a] * n
        if conts:
            self.runner.run(conts, _reseeded(params, 1))
        cont_scores = [task.reward(e.prompt, t)[0] for e, t in zip(conts, self._texts(conts))]
        # 3. top-up: budget the branches did not use goes to roots of candidates that got none yet
        left = budget - len(roots) - len(conts)
        if left >= 2:
            unused = torch.where(alloc > 0, torch.zeros_like(p_root), self._pruned(p_root))
            extra = allocate_rollouts(unused, left, n_min=2, n_max=G, objective=self.objective)
            more: list[Episode] = []
            for k, n in enumerate(extra.tolist()):
                more += self.runner.new([drawn[k][1]], n)
                root_of += [k] * n
            if more:
                self.runner.run(more, _reseeded(params, 2))
                roots += more
                root_scores += [task.reward(e.prompt, t)[0] for e, t in zip(more, self._texts(more))]
                sibling_of += [-1] * len(more)
                alloc = alloc + extra
        for k in set(root_of):
            scores = [root_scores[j] for j in range(len(roots)) if root_of[j] == k]
            self.predictor.record(drawn[k][0], scores)
            history[drawn[k][0]] = max(history.get(drawn[k][0], 0.0), sum(scores) / len(scores))
        pruned = int((self._pruned(p_anchor) == 0).sum())
        return self._batch(method, params, drawn, roots, root_of, root_scores, sibling_of, conts, cont_anchor,
                           cont_scores, chosen, n_candidates=len(drawn), pruned=pruned)

    def _texts(self, episodes: list[Episode]) -> list[str]:
        return self.runner.tokenizer.batch_decode([e.token_ids for e in episodes], skip_special_tokens=True)

    def _batch(self, method, params, drawn, roots, root_of, root_scores, sibling_of, conts, cont_anchor, cont_scores,
               chosen, *, n_candidates: int, pruned: int) -> RolloutBatch:
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
        stats = {
            "rollout/gen_rounds": 1.0, "rollout/generated": float(len(episodes)),
            "rollout/groups": float(len(root_groups)),
            "rollout/utilization": useful / len(episodes),
            "rollout/useful_groups_per_token": (mixed_roots + mixed_sibs) / max(1, tokens),
            "rollout/mixed_group_frac": mixed_roots / max(1, len(root_groups)),
            "tree/candidates": float(n_candidates), "tree/roots": float(len(roots)),
            "tree/anchors_branched": float(len(chosen)), "tree/continuations": float(len(conts)),
            "tree/anchors_pruned": float(pruned), "tree/mixed_sibling_frac": mixed_sibs / max(1, len(chosen)),
        }
        return RolloutBatch(group_ids=pool_ids, prompts=[e.prompt for e in episodes], samples=samples, scores=scores,
                            rewards=rewards, keep=torch.ones(len(episodes), dtype=torch.bool), truncated=truncated,
                            lengths=lengths, stats=stats,
                            tree=TreeInfo(root_ids=pool_ids, sibling_ids=sibling, branch_at=branch_at,
                                          is_root=torch.arange(len(episodes)) < len(roots)))


def _reseeded(params: SamplingParams, salt: int) -> SamplingParams:
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed * 31 + salt)
