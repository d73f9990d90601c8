"""Success predictors for the tree sampler's allocation (TRACE, arXiv:2606.11119).

Predictors: the pass-rate history (``SuccessPredictor``, optionally shared across similar prompts), or, on tasks
whose reward is 1 exactly when the completion is the reference answer, the policy's own probability of that answer
(``likelihood``: one teacher-forced forward pass per candidate, ``learner.answer_likelihood``). That probability is the
success rate of a rollout for the policy of this step (exact with a character tokenizer, else a lower bound): no
history to go stale, no prompt to see twice, so the DP picks the prompts whose groups will be mixed now from a fresh
draw of candidates every step (``EXACT_STRENGTH`` makes its Beta a point; the pass-rate history is still
recorded).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

import torch
from torch import Tensor


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

    With ``embed`` (prompts -> [N, H] features, e.g. the policy's mean hidden state of the prompt) the predictor is
    shared across prompts, as TRACE's is: a ridge regression of each seen prompt's smoothed logit pass rate on its
    features gives every prompt its own prior mean m(x), so a prompt never seen before is predicted from the ones
    like it; the strength s0 is then fitted to the residual spread E[(p - m(x))^2] by the same moments. Features
    are taken once, when a prompt is first a candidate (with the policy of that time), and kept in memory: a
    resumed run rebuilds them as prompts are drawn again, so its predictions are not bit-exact.
    """

    def __init__(self, counts: MutableMapping[int, list[float]], prior_strength: float = 2.0, half_life: float = 0.0,
                 min_prompts: int = 8, embed: Callable[[list], Tensor] | None = None, ridge: float = 10.0):
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

    def prompts(self, pool_ids: list[int], texts: list | None = None) -> tuple[Tensor, Tensor]:
        """Posterior (mean [M], strength [M]) of each prompt's success probability (``texts``: the prompts, Prompt
        or plain str, for ``embed``)."""
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
