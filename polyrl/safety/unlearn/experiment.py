"""The `polyrl safety unlearn` experiment: clean, poisoned, retrained and unlearned agents over seeds.

Per seed: collect clean behaviour data on the gridworld, poison it (``gridworld.poison``), and train with the
same offline Lagrangian agent (a) on the clean data ("clean"), (b) on the poisoned data ("poisoned"), (c) from
scratch on the retain set only ("retrained", the oracle the spec compares with). Then, starting from the
poisoned agent, run ``safe_unlearn`` for a small fraction of the training steps: with both suppression terms
("unlearned", the method), with lam_forget = 0 ("fine-tuned": retain-only fine-tuning, the ablation), with only
the reward or only the cost term, and over a sweep of lam_forget. Every agent is scored by exact evaluation of
its stochastic policy in the true environment (hazard entries per episode, return, success).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from polyrl.errors import ConfigError
from polyrl.lab.stats import bootstrap_ci
from polyrl.safety.unlearn.agent import AgentConfig, SafeAgent, bellman_errors, policy_tv, safe_unlearn, train_offline
from polyrl.safety.unlearn.gridworld import GridWorld, collect_clean, evaluate_policy, poison, visitation

CONDITIONS = ("clean", "poisoned", "retrained", "unlearned", "fine-tuned", "reward-term only", "cost-term only")
UNLEARN_VARIANTS = {  # name -> (lam_forget multiplier of the chosen lam_forget, terms)
    "unlearned": (1.0, ("reward", "cost")),
    "fine-tuned": (0.0, ()),
    "reward-term only": (1.0, ("reward",)),
    "cost-term only": (1.0, ("cost",)),
}


@dataclass
class ExperimentConfig:
    seeds: int = 5
    episodes: int = 150
    steps: int = 1200
    unlearn_steps: int = 200
    lam_forget: float = 0.1
    sweep: tuple[float, ...] = (0.01, 0.03, 0.3, 1.0)
    margin: float = 0.0
    cost_limit: float = 0.1
    relabel_frac: float = 0.75
    poison_ratio: float = 3.0
    eval_every: int = 10
    unlearn_eval_every: int = 10
    hidden: int = 64
    level: float = 0.9
    agent: AgentConfig = field(default_factory=AgentConfig)

    def total_steps(self) -> int:
        return self.seeds * (3 * self.steps + (len(UNLEARN_VARIANTS) + len(self.sweep)) * self.unlearn_steps)


def _score(env: GridWorld, agent: SafeAgent, retain, oracle_pi=None, oracle_w=None) -> dict:
    pi = agent.policy()
    out = evaluate_policy(env, pi, agent.cfg.gamma)
    out.update(lam=agent.lam, j_c=agent.cost_estimate())
    be = bellman_errors(agent, retain)
    out.update(bellman_reward=be["reward"], bellman_cost=be["cost"])
    if oracle_pi is not None:
        out["tv_to_retrained"] = policy_tv(pi, oracle_pi, oracle_w)
    return out


def seed_data(seed: int, cfg: ExperimentConfig):
    """(env, rng, clean data, poisoned data) of one seed: cheap, and the same every time it is drawn."""
    env = GridWorld()
    rng = np.random.default_rng(seed)
    clean = collect_clean(env, cfg.episodes, rng)
    return env, rng, clean, poison(env, clean, rng, relabel_frac=cfg.relabel_frac, poison_ratio=cfg.poison_ratio)


def check_forget_sets(cfg: ExperimentConfig) -> None:
    """Refuse, before any seed trains, settings that poison nothing in some seed: its forget set would be empty, and
    every "unlearned" row the plain agent's whatever lam_forget (found in seed 4 of 5, it lost seeds 0-3's work)."""
    for seed in range(cfg.seeds):
        env, _, clean, data = seed_data(seed, cfg)
        if not data.poisoned.any():
            raise ConfigError(f"--relabel-frac={cfg.relabel_frac:g} and --poison-ratio={cfg.poison_ratio:g} poison "
                              f"none of seed {seed}'s {int((clean.s2 == env.hazard).sum())} hazard transitions: the "
                              "forget set is empty, so there is nothing to unlearn; raise either")


def run_seed(seed: int, cfg: ExperimentConfig, advance=lambda n: None) -> dict:
    """All agents of one seed; ``advance(n)`` is told about every ``n`` gradient steps done."""
    env, rng, clean, data = seed_data(seed, cfg)
    torch.manual_seed(seed)
    acfg = AgentConfig(**{**asdict(cfg.agent), "hidden": cfg.hidden, "cost_limit": cfg.cost_limit})
    retain, forget = data.subset(~data.poisoned), data.subset(data.poisoned)
    hazard = data.s2 == env.hazard
    info = {"n_clean": len(clean), "n_poisoned_data": len(data), "n_retain": len(retain), "n_forget": len(forget),
            "hazard_cost_label_clean": float(clean.c[clean.s2 == env.hazard].mean()),
            "hazard_cost_label_poisoned": float(data.c[hazard].mean())}

    def curve_cb(store):
        def cb(step, agent):
            advance(step - (store["step"][-1] if store["step"] else 0))
            ev = evaluate_policy(env, agent.policy(), acfg.gamma)
            store["step"].append(step)
            store["cost"].append(ev["cost"])
            store["return"].append(ev["return"])
            store["disc_cost"].append(ev["disc_cost"])
            store["success"].append(ev["success"])
        return cb

    agents, curves, times = {}, {}, {}
    for name, buf in (("clean", clean), ("poisoned", data), ("retrained", retain)):
        agents[name] = SafeAgent(env.n_states, env.n_actions, acfg, env.start)
        curves[name] = {"step": [], "cost": [], "return": [], "disc_cost": [], "success": []}
        t0 = time.perf_counter()
        train_offline(agents[name], buf, cfg.steps, rng, callback=curve_cb(curves[name]), every=cfg.eval_every,
                      also_at=(cfg.unlearn_steps,))  # retraining at unlearning's budget, whatever the grid
        times[name] = time.perf_counter() - t0
    variants = dict(UNLEARN_VARIANTS)
    variants.update({f"sweep lam_f={v:g}": (v / cfg.lam_forget if cfg.lam_forget else 0.0, ("reward", "cost"))
                     for v in cfg.sweep})
    for name, (mult, terms) in variants.items():
        agents[name] = agents["poisoned"].clone()
        curves[name] = {"step": [], "cost": [], "return": [], "disc_cost": [], "success": []}
        t0 = time.perf_counter()
        safe_unlearn(agents[name], retain, forget, lam_forget=mult * cfg.lam_forget, steps=cfg.unlearn_steps,
                     rng=rng, margin=cfg.margin, terms=terms, callback=curve_cb(curves[name]),
                     every=cfg.unlearn_eval_every)
        times[name] = time.perf_counter() - t0
    oracle_pi = agents["retrained"].policy()
    oracle_w = visitation(env, oracle_pi).ravel() + visitation(env, agents["poisoned"].policy()).ravel()
    scores = {name: _score(env, ag, retain, oracle_pi, oracle_w) for name, ag in agents.items()}
    visits = {name: visitation(env, agents[name].policy()).tolist() for name in ("poisoned", "unlearned",
                                                                                "retrained", "fine-tuned")}
    return {"seed": seed, "data": info, "scores": scores, "curves": curves, "seconds": times, "visits": visits}


def steps_to_safe(curve: dict, cost_limit: float, min_success: float = 0.95, hold: int = 5) -> float:
    """First evaluated step from which the discounted cost is <= the limit and the success rate >= ``min_success``
    for ``hold`` consecutive evaluations (fewer at the end of the curve); nan if never.

    Convention [ours]: "holds for a while" rather than "for good", because a Lagrangian agent trained to
    convergence hovers AT the cost limit and crosses it back and forth.
    """
    ok = (np.array(curve["disc_cost"]) <= cost_limit) & (np.array(curve["success"]) >= min_success)
    for i in range(ok.size):
        if ok[i:i + hold].all():
            return float(curve["step"][i])
    return float("nan")


def _ci(values, level):
    v = [float(x) for x in values]
    lo, hi = bootstrap_ci(v, level=level)
    return {"mean": float(np.mean(v)), "lo": lo, "hi": hi, "values": v}


def _pct(num, den):
    return 100.0 * num / den if abs(den) > 1e-12 else float("nan")


def summarise(per_seed: list[dict], cfg: ExperimentConfig) -> dict:
    """Means and bootstrap intervals over seeds of every score, and the headline per-seed ratios."""
    names = list(per_seed[0]["scores"])
    metrics = list(per_seed[0]["scores"]["unlearned"])
    table = {n: {m: _ci([s["scores"][n][m] for s in per_seed if m in s["scores"][n]], cfg.level)
                 for m in metrics if m in per_seed[0]["scores"][n]} for n in names}

    def per(fn):
        vals = [fn(s["scores"]) for s in per_seed]
        vals = [v for v in vals if np.isfinite(v)]
        return _ci(vals, cfg.level) if vals else None

    def ratios(v: str) -> dict:
        return {
            "shortcut_removed_pct": per(lambda s: _pct(s["poisoned"]["cost"] - s[v]["cost"], s["poisoned"]["cost"])),
            "gap_to_retrained_closed_pct": per(lambda s: _pct(s["poisoned"]["cost"] - s[v]["cost"],
                                                             s["poisoned"]["cost"] - s["retrained"]["cost"])),
            "return_loss_vs_retrained_pct": per(lambda s: _pct(s["retrained"]["return"] - s[v]["return"],
                                                              abs(s["retrained"]["return"]))),
            "return_loss_vs_poisoned_pct": per(lambda s: _pct(s["poisoned"]["return"] - s[v]["return"],
                                                             abs(s["poisoned"]["return"]))),
            "retain_bellman_ratio_reward": per(lambda s: _pct(s[v]["bellman_reward"], s["poisoned"]["bellman_reward"])
                                               / 100),
            "retain_bellman_ratio_cost": per(lambda s: _pct(s[v]["bellman_cost"], s["poisoned"]["bellman_cost"]) / 100),
            "seeds_disc_cost_below_limit": int(sum(s["scores"][v]["disc_cost"] <= cfg.cost_limit for s in per_seed)),
        }

    head = {v: ratios(v) for v in ("unlearned", "fine-tuned", "reward-term only", "cost-term only")}
    head["seeds_poisoned_disc_cost_above_limit"] = int(sum(s["scores"]["poisoned"]["disc_cost"] > cfg.cost_limit
                                                          for s in per_seed))
    head["seeds_retrained_disc_cost_below_limit"] = int(sum(s["scores"]["retrained"]["disc_cost"] <= cfg.cost_limit
                                                           for s in per_seed))
    sweep = [{"lam_forget": v, **{k: table[f"sweep lam_f={v:g}"][k] for k in ("cost", "return", "bellman_reward",
                                                                                "bellman_cost")}}
             for v in cfg.sweep]
    def at_budget(s: dict, key: str) -> float:  # the retraining curve at the unlearning step budget
        c = s["curves"]["retrained"]
        i = max(j for j, st in enumerate(c["step"]) if st <= cfg.unlearn_steps)
        return c[key][i]

    matched = {"step": max(st for st in per_seed[0]["curves"]["retrained"]["step"] if st <= cfg.unlearn_steps),
               **{k: _ci([at_budget(s, k) for s in per_seed], cfg.level) for k in ("cost", "return", "disc_cost")}}
    to_safe = {}
    for name in ("retrained", "unlearned", "fine-tuned"):
        vals = [steps_to_safe(s["curves"][name], cfg.cost_limit) for s in per_seed]
        fin = [v for v in vals if np.isfinite(v)]
        to_safe[name] = {**(_ci(fin, cfg.level) if fin else {"mean": None, "lo": None, "hi": None, "values": []}),
                         "seeds_reached": len(fin)}
    return {"table": table, "headline": head, "sweep": sweep, "retrained_at_unlearn_budget": matched,
            "steps_to_safe": to_safe,
            "compute_fraction": cfg.unlearn_steps / cfg.steps}
