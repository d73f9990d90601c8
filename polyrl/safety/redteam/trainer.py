"""AdvGRPO co-training: attacker and defender updated in alternation, each with GRPO over its own groups.

Source: Bullwinkel, Kim, Minnich, Russinovich, "Learning to Attack and Defend: Adaptive Red Teaming of Language
Models via GRPO", arXiv:2606.09701 [abs + secondary notes]; spec ``methods-seedblog.md`` §10 and B3.

Each role's update is polyrl's own parts: advantages from the registered estimator through
``polyrl.objectives.group_layout.advantages`` (``gdpo``: per reward channel; the baseline ``grpo`` on the
weighted channel sum), the loss from ``polyrl.objectives.objective.policy_loss`` of the ``gdpo`` preset
(PPO clip, seq_mean_token_mean) and the channels from ``polyrl.tasks.rewards.RewardChannels`` (judges by
import path). The policies here are the toy game's tabular ones (``game.py``); a policy is anything with a
``logp`` of its sampled tokens.

Convention [ours; the paper's schedule was not retrieved]: the curriculum is
``single_turn`` (attacker only, one message, frozen defender) -> ``multi_turn`` (attacker only, closed loop
of two messages against the frozen defender) -> ``co_train`` (rounds of ``steps_per_role`` attacker updates
then ``steps_per_role`` defender updates, two-message episodes). The defender trains on the attacker's
messages (harmful) mixed with benign prompts from a fixed pool, ``benign_frac`` of its groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

import polyrl.safety.redteam.game as game
from polyrl.methods import get_method
from polyrl.objectives.group_layout import advantages
from polyrl.objectives.objective import Method, policy_loss
from polyrl.registry import ADVANTAGES
from polyrl.safety.redteam.judges import HELPFULNESS
from polyrl.tasks.base import Prompt
from polyrl.tasks.rewards import RewardChannels
from polyrl.types import LossInputs, Normalizer, group_token_counts

Estimator = Literal["gdpo", "summed"]
PHASES = ("single_turn", "multi_turn", "co_train")


def _flat(rewards: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    B, G = rewards.shape[:2]
    return (rewards.reshape(B * G, -1).double(), torch.arange(B).repeat_interleave(G),
            torch.ones(B * G, 1, dtype=torch.float64))


def gdpo_advantages(rewards: Tensor, weights: Tensor | Sequence[float] | None = None, eps: float = 1e-6,
                    batch_norm: bool = True, std: Literal["sample", "population"] = "sample") -> Tensor:
    """GDPO (spec B3; arXiv:2601.05242): rewards [B, G, K] -> advantages [B, G].

    Ahat_k = (r_k - mean_g r_k) / (std_g r_k + eps) per channel and group;  S = sum_k w_k Ahat_k;
    A = (S - mean_batch S) / (std_batch S + eps) when ``batch_norm``, else A = S.
    Convention: ``std="sample"`` (Bessel, the registered ``gdpo``'s choice, which this then calls) or
    ``"population"`` (the spec's hand example: G = 2 gives +-1 per channel); the batch std is Bessel's.
    """
    flat, gid, mask = _flat(rewards)
    K = flat.shape[1]
    w = [1.0] * K if weights is None else [float(x) for x in weights]
    if batch_norm and std == "sample":
        adv = ADVANTAGES.fn("gdpo")(flat, gid, mask, eps=eps, weights=";".join(map(repr, w)))
    else:
        grpo = ADVANTAGES.fn("grpo")
        adv = sum(wk * grpo(flat[:, k], gid, mask, eps=eps, std=std) for k, wk in enumerate(w))
        if batch_norm and adv.numel() > 1:
            adv = (adv - adv.mean()) / (adv.std() + eps)
    return adv.reshape(rewards.shape[:2])


def summed_advantages(rewards: Tensor, weights: Sequence[float] | None = None, eps: float = 1e-6,
                      std: Literal["sample", "population"] = "sample") -> Tensor:
    """The baseline: GRPO (arXiv:2402.03300) on the summed reward, A = (R - mean_g R) / (std_g R + eps),
    R = sum_k w_k r_k. [B, G]. Convention: the registered ``grpo`` (Bessel std by default), no batch step."""
    flat, gid, mask = _flat(rewards)
    w = torch.tensor([1.0] * flat.shape[1] if weights is None else list(weights), dtype=flat.dtype)
    return ADVANTAGES.fn("grpo")(flat @ w, gid, mask, eps=eps, std=std).reshape(rewards.shape[:2])


def role_method(estimator: Estimator, weights: Sequence[float], clip: float = 0.2) -> Method:
    """The ``gdpo`` preset (clip, seq_mean_token_mean) with its channel weights, or with ``grpo`` for 'summed'."""
    adv = f"gdpo:weights={';'.join(repr(float(w)) for w in weights)}" if estimator == "gdpo" else "grpo"
    return get_method("gdpo", advantage=adv, trust_region=f"clip:eps_low={clip},eps_high={clip}")


@dataclass
class CoTrainConfig:
    """Sizes of the co-training run (defaults: the experiment's)."""

    group_size: int = 8
    attacker_groups: int = 16  # groups (goals) per attacker update
    defender_prompts: int = 32  # prompts (groups) per defender update
    benign_frac: float = 0.5  # share of the defender's prompts drawn from the benign pool
    lr: float = 0.05
    epochs: int = 2  # PPO epochs per batch (full batch each)
    clip: float = 0.2
    steps: dict[str, int] = field(default_factory=lambda: {"single_turn": 40, "multi_turn": 40, "co_train": 200})
    steps_per_role: int = 1


class AdversarialCoTrainer:
    """Alternating GRPO for an attacker and a defender with per-channel (GDPO) or summed advantages.

    ``attacker_channels`` / ``defender_channels``: reward functions by import path (``module:function``),
    with ``attacker_weights`` / ``defender_weights``; ``estimator``: "gdpo" or "summed" (the baseline).
    ``history`` gets one row per update with the exact metrics of ``game`` (no sampling noise).
    """

    def __init__(self, attacker: game.AttackerPolicy, defender: game.DefenderPolicy, *,
                 attacker_channels: Sequence[str], defender_channels: Sequence[str],
                 attacker_weights: Sequence[float] | None = None, defender_weights: Sequence[float] | None = None,
                 estimator: Estimator = "gdpo", curriculum: Sequence[str] = PHASES,
                 config: CoTrainConfig | None = None, seed: int = 0) -> None:
        bad = [p for p in curriculum if p not in PHASES]
        if bad:
            raise ValueError(f"curriculum phase {bad[0]!r}; allowed: {', '.join(PHASES)}")
        self.attacker, self.defender = attacker, defender
        self.cfg = config or CoTrainConfig()
        self.curriculum = tuple(curriculum)
        aw = list(attacker_weights or [1.0] * len(attacker_channels))
        dw = list(defender_weights or [1.0] * len(defender_channels))
        self.judges = {"attacker": RewardChannels(None, attacker_channels, aw),
                       "defender": RewardChannels(None, defender_channels, dw)}
        self.methods = {"attacker": role_method(estimator, aw, self.cfg.clip),
                        "defender": role_method(estimator, dw, self.cfg.clip)}
        self.opts = {"attacker": torch.optim.Adam(attacker.parameters(), lr=self.cfg.lr),
                     "defender": torch.optim.Adam(defender.parameters(), lr=self.cfg.lr)}
        self.gen = torch.Generator().manual_seed(seed)
        self.history: list[dict[str, float | str]] = []
        self.updates = 0

    # --- one update of each role -------------------------------------------------------------------------

    def _advantages(self, role: str, prompts: list[Prompt], completions: list[str], group_ids: Tensor,
                    mask: Tensor) -> tuple[Tensor, Tensor]:
        scored = self.judges[role](prompts, completions)
        total = torch.tensor(scored.total, dtype=torch.float64)
        channels = None if scored.channels is None else torch.tensor(scored.channels, dtype=torch.float64)
        adv, _ = advantages(self.methods[role], total, group_ids, mask, channels=channels)
        return adv, total if channels is None else channels

    def _update(self, role: str, logp_fn: Callable[[], Tensor], mask: Tensor, adv: Tensor, group_ids: Tensor) -> None:
        """``epochs`` full-batch steps of ``policy_loss`` (PPO clip against the pre-update log-probs)."""
        old = logp_fn().detach()
        norm = Normalizer.from_batch(mask, group_ids)
        tokens = group_token_counts(mask, group_ids)
        for _ in range(self.cfg.epochs):
            inp = LossInputs(logp=logp_fn(), old_logp=old, adv=adv, mask=mask, normalizer=norm, group_ids=group_ids,
                             group_tokens=tokens)
            out = policy_loss(inp, self.methods[role])
            self.opts[role].zero_grad()
            out.loss.backward()
            self.opts[role].step()

    def attacker_step(self, turns: int) -> Tensor:
        """One attacker update on ``attacker_groups`` x ``group_size`` episodes; returns the channel rewards."""
        G, n = self.cfg.group_size, self.cfg.attacker_groups
        ep = game.sample_episodes(self.attacker, self.defender, n * G, turns, self.gen)
        gid = torch.arange(n).repeat_interleave(G)
        prompts = [Prompt(id=f"goal-{int(g)}", text=f"synthetic goal {int(g)}", answer="harmful") for g in gid]
        mask = ep.token_mask
        adv, rewards = self._advantages("attacker", prompts, ep.transcripts(), gid, mask)
        self._update("attacker", lambda: self.attacker.logp(ep.ctx, ep.s, ep.o), mask, adv, gid)
        return rewards

    def defender_step(self, turns: int) -> Tensor:
        """One defender update: ``defender_prompts`` groups (attack messages and benign prompts) x ``group_size``."""
        G, n = self.cfg.group_size, self.cfg.defender_prompts
        n_benign = int(round(self.cfg.benign_frac * n))
        n_attack = n - n_benign
        ep = game.sample_episodes(self.attacker, self.defender, n_attack, turns, self.gen)
        pick = torch.randint(0, turns, (n_attack,), generator=self.gen)  # one message of each episode
        pick = torch.where(ep.sent[torch.arange(n_attack), pick] > 0, pick, torch.zeros_like(pick))
        rows = torch.arange(n_attack)
        s_a, o_a, c_a = ep.s[rows, pick], ep.o[rows, pick], ep.cue[rows, pick]
        s_b, c_b = game.sample_benign(n_benign, self.gen)
        s = torch.cat([s_a, s_b]).repeat_interleave(G)
        o = torch.cat([o_a, torch.zeros_like(s_b)]).repeat_interleave(G)
        cue = torch.cat([c_a, c_b]).repeat_interleave(G)
        harmful = torch.cat([torch.ones(n_attack), torch.zeros(n_benign)]).repeat_interleave(G)
        gid = torch.arange(n).repeat_interleave(G)
        reply = torch.multinomial(self.defender.probs()[s, cue], 1, generator=self.gen)[:, 0]
        prompts = [Prompt(id=f"p{int(g)}", text=game.defender_prompt(int(a), int(b), int(c)),
                          answer="harmful" if h > 0 else "benign") for g, a, b, c, h in zip(gid, s, o, cue, harmful)]
        mask = torch.ones(len(gid), 1)
        adv, rewards = self._advantages("defender", prompts, [game.RESPONSES[int(r)] for r in reply], gid, mask)
        self._update("defender", lambda: self.defender.logp(s, cue, reply), mask, adv, gid)
        return rewards

    # --- the curriculum --------------------------------------------------------------------------------

    def record(self, phase: str, role: str) -> dict[str, float | str]:
        help_score, refusal = game.exact_benign(self.defender, tuple(game_helpfulness()))
        row = {"update": self.updates, "phase": phase, "role": role,
               "asr_single": game.exact_asr(self.attacker, self.defender, 1),
               "asr_multi": game.exact_asr(self.attacker, self.defender, 2),
               "helpfulness": (help_score - 1.0) / 9.0, "benign_refusal": refusal,
               "attacker_entropy": game.attacker_entropy(self.attacker)}
        self.history.append(row)
        return row

    def run(self, on_update: Callable[[], None] | None = None) -> list[dict[str, float | str]]:
        """Run the curriculum; ``on_update`` is called after every update (a progress bar)."""
        if not self.history:
            self.record("init", "none")
        for phase in self.curriculum:
            for _ in range(self.cfg.steps.get(phase, 0)):
                if phase == "co_train":
                    for role in ("attacker", "defender"):
                        for _ in range(self.cfg.steps_per_role):
                            (self.attacker_step if role == "attacker" else self.defender_step)(2)
                            self._tick(phase, role, on_update)
                else:
                    self.attacker_step(1 if phase == "single_turn" else 2)
                    self._tick(phase, "attacker", on_update)
        return self.history

    def _tick(self, phase: str, role: str, on_update: Callable[[], None] | None) -> None:
        self.updates += 1
        self.record(phase, role)
        if on_update is not None:
            on_update()

    def total_updates(self) -> int:
        return total_updates(self.cfg, self.curriculum)


def total_updates(cfg: CoTrainConfig, curriculum: Sequence[str] = PHASES) -> int:
    """Number of updates (attacker and defender) the curriculum makes: the length of ``history`` minus one."""
    s = cfg.steps
    return sum(s.get(p, 0) * (2 * cfg.steps_per_role if p == "co_train" else 1) for p in curriculum)


def game_helpfulness() -> list[float]:
    """The helpfulness judge's Likert score of each reply type, in ``game.RESPONSES`` order (for exact metrics)."""
    return [HELPFULNESS[r] for r in game.RESPONSES]
