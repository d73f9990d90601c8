"""The tree sampler (TRACE, arXiv:2606.11119): two-stage rollouts under a fixed budget, and tree advantages.

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
   is an upper bound there.) Both stages together never exceed B. ``branch=False`` leaves out the prefix
   continuations: the extension only grows root groups.

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
from polyrl.rollout.collect import NoUsableGroups, RolloutBatch
from polyrl.rollout.episodes import Episode, EpisodeRunner, prefix_episode
from polyrl.rollout.generator import SamplingParams, written_tokens
from polyrl.rollout.score import mixed, shape, succeeded
from polyrl.rollout.tree.allocation import (
    EXACT_STRENGTH,
    allocate_by_gain,
    allocate_rollouts,
    expected_useful,
    inclusion_probabilities,
    p_mixed,
    root_weights,
    systematic_sample,
)
from polyrl.rollout.tree.predictors import SuccessPredictor, prefix_estimate
from polyrl.tasks.base import Prompt
from polyrl.tasks.rewards import RewardChannels
from polyrl.types import TreeInfo


def branch_points(episode: Episode, multi_turn: bool) -> list[int]:
    """Completion lengths at which ``episode`` may branch: turn boundaries, or half its length (single-turn)."""
    n = len(episode.token_ids)
    if multi_turn:  # a new agent turn starts where an environment span ends
        return [t for t in range(1, n) if episode.loss_mask[t - 1] == 0 and episode.loss_mask[t] == 1]
    return [n // 2] if n >= 2 else []


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
            p_root, s_root = self.predictor.prompts([i for i, _ in drawn], [p for _, p in drawn])
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
        root_mixed = [mixed(g) for g in group]
        succ = [sum(map(succeeded, g)) for g in group] + [sum(succeeded(root_scores[j]) for j in anchors[key])
                                                          for key in keys]
        succ = torch.tensor(succ, dtype=torch.float64)
        size = torch.tensor([len(g) for g in group] + [len(anchors[key]) for key in keys], dtype=torch.float64)
        idle = torch.tensor([0 if root_mixed[k] else len(g) for k, g in enumerate(group)]
                            + [sum(not root_mixed[root_of[j]] for j in anchors[key]) for key in keys],
                            dtype=torch.float64)
        # candidates: the posterior updated with this step's outcomes; prefixes: the online estimate
        p_anchor = torch.tensor([prefix_estimate(float(succ[len(drawn) + a]), len(anchors[key]),  # successes, as
                                                 float(succ[key[0]] / size[key[0]]), self.prior_strength)  # succ
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
            history[drawn[k][0]] = max(history.get(drawn[k][0], 0.0), sum(min(1.0, max(0.0, g)) for g in got)
                                        / len(got))  # clamped, as collect() records it
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
        rewards = shape(method, scores, lengths, truncated, params.max_new_tokens)
        # utilization: a completion is useful when its root group or its sibling group has mixed outcomes
        useful = 0
        for i in range(len(episodes)):
            in_root = i < len(roots) and mixed([root_scores[j] for j in range(len(roots)) if root_of[j] == index[i]])
            in_sib = bool(sibling[i] >= 0) and mixed(scores[sibling == sibling[i]].tolist())
            useful += int(in_root or in_sib)
        root_groups = set(root_of)
        mixed_roots = sum(mixed([root_scores[j] for j in range(len(roots)) if root_of[j] == k]) for k in root_groups)
        mixed_sibs = sum(mixed(scores[sibling == a].tolist()) for a in range(len(chosen)))
        tokens = written_tokens(samples)  # a continuation's copied prefix was written once, by its root
        weight = None
        if inclusion is not None:  # sampled roots: the expected loss is that of prompts drawn uniformly
            weight = root_weights(torch.tensor(index), inclusion)
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
                                          is_root=torch.arange(len(episodes)) < len(roots)), sample_weight=weight)


def _reseeded(params: SamplingParams, salt: int) -> SamplingParams:
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed * 31 + salt)
