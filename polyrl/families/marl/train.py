"""The MAPPO / IPPO loop: roll out a batch of episodes, GAE per agent, PPO clip for the shared actor, value clip.

One step: ``envs`` episodes of ``horizon`` steps drawn from the training distribution (team sizes ``teams``);
each agent of each episode is one row [T] of the batch (padded agents are masked out). Advantages: the shared
``ADVANTAGES["gae"]`` on the team reward as per-step token rewards (outcome 0) with the critic's values, whitened
over the batch; returns from ``gae_advantages_and_returns``. Loss: ``trust_regions.clip`` on log pi(a|o) summed
over the 2 action dimensions, aggregated with ``aggregation.token_mean``; plus value_coef *
``value.clipped_value_loss`` minus entropy_coef * entropy. ``epochs`` passes, each split into ``minibatches`` by
episode (``tensor_split``: exactly ``minibatches`` optimizer steps per pass; ``validate_config`` keeps
``minibatches <= envs``). Convention: one Adam over actor and critic together (the critic's loss has its own
coefficient). A run that diverges (a non-finite loss or actor output) stops with ``TrainingError`` in one line naming
the step; the checkpoint written before it is kept.

Logged per step: reward/mean (team reward per agent-step), train/success, objective/* and, every eval_every
steps, eval/success_train, eval/success_heldout_shapes (unseen shapes and masses, trained team sizes) and
eval/accuracy = the held-out success rate (unseen shapes, masses and team sizes 5 and 7; ``polyrl compare`` ranks
by it). Checkpoints hold actor, critic, optimizer, generator state, step and history, so
a resumed run equals an uninterrupted one exactly (tested).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

import polyrl.objectives  # noqa: F401  (registers the advantage estimators)
from polyrl.errors import TrainingError
from polyrl.families import diverged
from polyrl.families.marl import env as E
from polyrl.families.marl.methods import MarlMethod
from polyrl.families.marl.nets import CRITICS, Actor
from polyrl.logging import RunLogger, plot_curves, write_summary
from polyrl.objectives.aggregation import token_mean
from polyrl.objectives.token_advantages import gae_advantages_and_returns
from polyrl.objectives.trust_regions import clip
from polyrl.objectives.value import clipped_value_loss
from polyrl.registry import ADVANTAGES
from polyrl.runs import check_fits, check_resume_steps, max_threads
from polyrl.types import LossInputs, Normalizer


@dataclass(frozen=True)
class MarlTrainConfig:
    """Settings of one formation run: one flag each (``polyrl marl train --help``), or keys of a ``--config`` TOML."""

    steps: int = 150
    """rollout batches (PPO iterations)"""
    envs: int = 48
    """episodes per rollout batch"""
    horizon: int = 30
    """environment steps per episode"""
    teams: str = "3,4,6,8"
    """team sizes seen in training, comma-separated, each 2..8 (held-out evaluation: 5 and 7)"""
    epochs: int = 3
    """passes over each rollout batch"""
    minibatches: int = 4
    """optimizer steps per pass (split by episode)"""
    lr: float = 2e-3
    """Adam learning rate (actor and critic)"""
    gamma: float = 0.97
    """discount of GAE"""
    lam: float = 0.95
    """GAE lambda"""
    clip_eps: float = 0.2
    """PPO ratio clip epsilon"""
    value_clip: float = 0.5
    """value-loss clip range around the rollout values"""
    value_coef: float = 0.5
    """weight of the critic loss"""
    entropy_coef: float = 0.003
    """weight of the entropy bonus"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm (0 = off)"""
    hidden: int = 64
    """width of every MLP"""
    eval_every: int = 20
    """steps between evaluations (and the last step)"""
    eval_episodes: int = 128
    """episodes per evaluation (train and held-out distributions each)"""
    checkpoint_every: int = 0
    """steps between checkpoints (0 = only at the end)"""
    seed: int = 0
    """seed of initialisation, episodes and sampling"""
    threads: int = 1
    """torch CPU threads"""
    tensorboard: bool = False
    """write TensorBoard event files to run_dir/tb"""


POSITIVE_INTS = ("steps", "envs", "horizon", "epochs", "minibatches", "hidden", "eval_every", "eval_episodes",
                 "threads")


def validate_config(cfg: MarlTrainConfig) -> None:
    """Raise ValueError with one line naming the field, the value and what is allowed."""
    for name in POSITIVE_INTS:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} = {v!r} is not allowed; allowed: an integer >= 1")
    if cfg.hidden < 2:  # the neighbour encoder is hidden // 2 wide: at 1 the robots would not see each other
        raise ValueError(f"hidden = {cfg.hidden} is not allowed; allowed: an integer >= 2 (the neighbour encoder "
                         "is hidden // 2 wide)")
    if cfg.threads > max_threads():
        raise ValueError(f"threads = {cfg.threads} is not allowed; allowed: an integer in [1, {max_threads()}] "
                         "(4 per core of this machine; a run recorded with more, resumed here, takes --threads)")
    if cfg.checkpoint_every < 0:
        raise ValueError(f"checkpoint_every = {cfg.checkpoint_every} is not allowed; allowed: an integer >= 0")
    try:
        teams = parse_teams(cfg.teams)
    except ValueError:
        teams = ()
    held = [n for n in teams if n in E.HELDOUT.teams]  # eval/accuracy would no longer test unseen team sizes
    if not teams or not all(2 <= n <= 8 for n in teams) or held:
        why = f" (held out: {', '.join(map(str, held))})" if held else ""
        raise ValueError(f"teams = {cfg.teams!r} is not allowed{why}; allowed: comma-separated integers in 2..8 "
                         f"but the held-out sizes {', '.join(map(str, E.HELDOUT.teams))} (e.g. '3,4,6,8')")
    if cfg.minibatches > cfg.envs:
        raise ValueError(f"minibatches = {cfg.minibatches} is not allowed; allowed: <= envs ({cfg.envs})")
    for name, lo, hi in (("gamma", 0, 1), ("lam", 0, 1), ("clip_eps", 1e-6, 1)):
        v = getattr(cfg, name)
        if not lo <= v <= hi:
            raise ValueError(f"{name} = {v} is not allowed; allowed: [{lo}, {hi}]")
    for name in ("lr", "value_clip"):
        if not (math.isfinite(getattr(cfg, name)) and getattr(cfg, name) > 0):
            raise ValueError(f"{name} = {getattr(cfg, name)} is not allowed; allowed: > 0")
    for name in ("value_coef", "entropy_coef", "max_grad_norm"):
        if not (math.isfinite(getattr(cfg, name)) and getattr(cfg, name) >= 0):
            raise ValueError(f"{name} = {getattr(cfg, name)} is not allowed; allowed: >= 0")
    # Bytes an environment step of N_MAX agents holds per unit of width, fitted to peak resident memory (minus the
    # start-up's) at 30,000 steps, hidden 64: 10.2, 26.8 and 55 KB a step with 16, 4 and 1 minibatches (the update
    # keeps one minibatch's activations; one minibatch holds less than 1/minibatches says), 49.6 KB at hidden 128
    # with 4; 6.2 KB evaluated at hidden 64.
    trained = 72 + 1400 / max(cfg.minibatches, 2)
    check_fits({
        f"envs x horizon = {cfg.envs} x {cfg.horizon} steps at hidden {cfg.hidden}":
            cfg.envs * cfg.horizon * cfg.hidden * trained,
        f"eval_episodes x horizon = {cfg.eval_episodes} x {cfg.horizon} steps at hidden {cfg.hidden}":
            cfg.eval_episodes * cfg.horizon * cfg.hidden * 100,
    })


def parse_teams(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


N_MAX = 8  # padded team size: every team (train and held-out) fits


def team_features(s: E.State) -> torch.Tensor:
    """[B, 3]: support margin (clipped), load imbalance, share of agents under the object."""
    inside = E.inside_polygon(s.pos, s.poly) & s.alive
    m = E.support_margin(s.pos, inside, s.com).clamp(-1, 0.5)
    imb = E.imbalance(s.pos, inside, s.com).clamp(-1, 1)
    return torch.stack([m, imb, inside.sum(-1) / s.alive.sum(-1)], -1)


class Agent(torch.nn.Module):
    def __init__(self, method: MarlMethod, hidden: int):
        super().__init__()
        self.actor = Actor(hidden)
        self.critic = CRITICS[method.critic](hidden)


@torch.no_grad()
def rollout(agent: Agent, cfg: MarlTrainConfig, dist: E.Distribution, n_env: int, g: torch.Generator,
            deterministic: bool = False) -> dict[str, Any]:
    """Play n_env episodes; tensors are [T, B, N, ...] (values, logp, actions, observations), rewards [T, B]."""
    s = E.reset(n_env, N_MAX, dist, g)
    nmask = E.neighbour_mask(s.alive)
    buf: dict[str, list] = {k: [] for k in ("own", "nbr", "team", "act", "logp", "value", "reward")}
    info = {}
    for _ in range(cfg.horizon):
        own, nbr = E.observe(s, cfg.horizon)
        team = team_features(s)
        d = agent.actor.dist(own, nbr, nmask)
        a = d.mean if deterministic else d.mean + d.stddev * torch.randn(d.mean.shape, generator=g)
        buf["own"].append(own)
        buf["nbr"].append(nbr)
        buf["team"].append(team)
        buf["act"].append(a)
        buf["logp"].append(d.log_prob(a).sum(-1))
        buf["value"].append(agent.critic(own, nbr, nmask, s.alive, team))
        s, r, info = E.step(s, a)
        buf["reward"].append(r)
    out = {k: torch.stack(v) for k, v in buf.items()}
    out.update(alive=s.alive, nmask=nmask, success=info["success"], margin=info["margin"])
    return out


def evaluate(agent: Agent, cfg: MarlTrainConfig, dist: E.Distribution, seed: int) -> float:
    """Success rate of the deterministic (mean-action) policy on cfg.eval_episodes fixed episodes of ``dist``."""
    g = torch.Generator().manual_seed(seed)
    return rollout(agent, cfg, dist, cfg.eval_episodes, g, deterministic=True)["success"].float().mean().item()


def evaluate_all(agent: Agent, cfg: MarlTrainConfig, dist: E.Distribution) -> dict[str, float]:
    """The three success rates logged at an evaluation step: training distribution, unseen shapes and masses with
    the trained team sizes, and the full held-out distribution (``eval/accuracy``, what `polyrl compare` ranks)."""
    return {"eval/success_train": evaluate(agent, cfg, dist, cfg.seed + 10_007),
            "eval/success_heldout_shapes": evaluate(agent, cfg, replace(E.HELDOUT, teams=dist.teams),
                                                    cfg.seed + 30_011),
            "eval/accuracy": evaluate(agent, cfg, E.HELDOUT, cfg.seed + 20_011)}


def train_dist(cfg: MarlTrainConfig) -> E.Distribution:
    return replace(E.TRAIN, teams=parse_teams(cfg.teams))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, B, N, ...] -> [B*N, T, ...] (one row per agent of each episode)."""
    x = x.movedim(0, 2)  # [B, N, T, ...]
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def update(agent: Agent, opt: torch.optim.Optimizer, batch: dict[str, Any], cfg: MarlTrainConfig,
           g: torch.Generator) -> dict[str, float]:
    """GAE, then epochs x minibatches PPO steps on actor and critic; returns averaged metrics."""
    T, B, N = batch["value"].shape
    mask = batch["alive"][:, :, None].expand(B, N, T).reshape(B * N, T).float()
    values = _rows(batch["value"])
    token_r = _rows(batch["reward"][:, :, None].expand(T, B, N))
    outcome = torch.zeros(B * N)
    ids = torch.arange(B).repeat_interleave(N)
    adv = ADVANTAGES.fn("gae")(outcome, ids, mask, values=values, token_rewards=token_r, gamma=cfg.gamma,
                               lam=cfg.lam, whiten=True)
    _, returns = gae_advantages_and_returns(outcome, values, mask, token_r, gamma=cfg.gamma, lam=cfg.lam)
    own, nbr, team = batch["own"], batch["nbr"], batch["team"]
    nmask = batch["nmask"][None].expand(T, B, N, N)
    alive = batch["alive"][None].expand(T, B, N)
    sums: dict[str, float] = {}
    count = 0
    params = list(agent.parameters())
    for _ in range(cfg.epochs):
        for envs in torch.randperm(B, generator=g).tensor_split(cfg.minibatches):  # chunk() may give fewer
            rows = (envs[:, None] * N + torch.arange(N)[None]).reshape(-1)
            d = agent.actor.dist(own[:, envs], nbr[:, envs], nmask[:, envs])
            logp = _rows(d.log_prob(batch["act"][:, envs]).sum(-1))
            ent = _rows(d.entropy().sum(-1))
            v = _rows(agent.critic(own[:, envs], nbr[:, envs], nmask[:, envs], alive[:, envs], team[:, envs]))
            m = mask[rows]
            norm = Normalizer.from_batch(m, ids[rows])
            inp = LossInputs(logp=logp, old_logp=_rows(batch["logp"][:, envs]), adv=adv[rows], mask=m,
                             normalizer=norm)
            per_tok, parts = clip(inp, logp - inp.old_logp, eps_low=cfg.clip_eps, eps_high=cfg.clip_eps)
            pg = token_mean(per_tok, m, norm, None)
            vloss = clipped_value_loss(v, values[rows], returns[rows], m, cfg.value_clip)
            entropy = token_mean(ent, m, norm, None)
            loss = pg + cfg.value_coef * vloss - cfg.entropy_coef * entropy
            if not bool(torch.isfinite(loss)):  # stop before NaN reaches the weights
                raise TrainingError("non-finite loss")
            opt.zero_grad()
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or math.inf)
            opt.step()
            count += 1
            for k, val in {"objective/loss": loss, "objective/pg_loss": pg, "objective/value_loss": vloss,
                           "objective/entropy": entropy, "objective/grad_norm": gn,
                           "objective/clip_frac": parts["clip_frac"]}.items():
                sums[k] = sums.get(k, 0.0) + float(val.detach())
    return {k: v / count for k, v in sums.items()}


def save_checkpoint(path: Path, agent: Agent, opt, g: torch.Generator, step: int, history: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # checkpoint.pt.tmp: a run's own leftover (runs.RUN_OUTPUTS)
    torch.save({"agent": agent.state_dict(), "opt": opt.state_dict(), "rng": g.get_state(), "step": step,
                "history": history}, tmp)
    tmp.replace(path)


def train_marl(cfg: MarlTrainConfig, method: MarlMethod, *, run_dir: str | Path, console=None, resume: bool = False,
               table_every: int = 10) -> dict[str, Any]:
    """Train ``method``; write metrics.jsonl, curves.png, checkpoint.pt and summary.json in ``run_dir``.

    ``resume``: continue from ``run_dir/checkpoint.pt`` (the same config, possibly more steps).
    """
    validate_config(cfg)
    torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    run_dir = Path(run_dir)
    ckpt = run_dir / "checkpoint.pt"
    torch.manual_seed(cfg.seed)
    agent = Agent(method, cfg.hidden)
    opt = torch.optim.Adam(agent.parameters(), lr=cfg.lr)
    g = torch.Generator().manual_seed(cfg.seed)
    start, history = 0, []
    if resume:
        state = torch.load(ckpt, weights_only=False)
        agent.load_state_dict(state["agent"])
        opt.load_state_dict(state["opt"])
        g.set_state(state["rng"])
        start, history = state["step"], state["history"]
        check_resume_steps(cfg.steps, start, run_dir)
        # the segment evaluated at its last step, which an unbroken run to cfg.steps does not (unless it ends there)
        final_eval = start % cfg.eval_every != 0 and cfg.steps > start
        _cut_metrics(run_dir, start, drop_eval=final_eval)
        if final_eval:
            history = [_without_eval(r) if r["step"] == start else r for r in history]
    dist = train_dist(cfg)
    logger = RunLogger(run_dir, tensorboard=cfg.tensorboard, console=console, table_every=table_every,
                       history=history, purge_step=start + 1 if resume else None)
    scales = {"lr": cfg.lr, "entropy-coef": cfg.entropy_coef, "value-coef": cfg.value_coef}  # what a loss scales by
    try:
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            with diverged(f"step {step}", scales):
                batch = rollout(agent, cfg, dist, cfg.envs, g)
                metrics = update(agent, opt, batch, cfg, g)
            metrics.update({"reward/mean": batch["reward"].mean().item(),
                            "train/success": batch["success"].float().mean().item(),
                            "train/margin": batch["margin"].mean().item()})
            if step % cfg.eval_every == 0 or step == cfg.steps:
                with diverged(f"step {step}", scales):
                    metrics.update(evaluate_all(agent, cfg, dist))
            metrics["perf/step_seconds"] = time.perf_counter() - t0
            logger.log(step, metrics)
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps:
                save_checkpoint(ckpt, agent, opt, g, step, logger.history)
    finally:
        logger.close()
    hist = logger.history
    last_eval = next((r for r in reversed(hist) if "eval/accuracy" in r), {})
    first = next((r for r in hist if "eval/accuracy" in r), {})
    summary = {"method": method.name, "critic": method.critic, "steps": cfg.steps,
               "success_train": last_eval.get("eval/success_train"), "success_heldout": last_eval.get("eval/accuracy"),
               "success_heldout_shapes": last_eval.get("eval/success_heldout_shapes"),
               "success_heldout_first_eval": first.get("eval/accuracy"),
               "reward_first": hist[0]["reward/mean"] if hist else None,
               "reward_last": hist[-1]["reward/mean"] if hist else None,
               "wall_seconds": time.perf_counter() - started, "config": asdict(cfg)}
    plot_curves(hist, run_dir / "curves.png", keys=("reward/mean", "eval/accuracy"))
    write_summary(run_dir, summary)
    return {**summary, "history": hist}


def _without_eval(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("eval/")}


def _cut_metrics(run_dir: Path, step: int, *, drop_eval: bool = False) -> None:
    """Drop metrics.jsonl rows after ``step`` (logged by an attempt that died before its next checkpoint); with
    ``drop_eval`` also the eval/* of ``step``'s row (a final evaluation off the --eval-every schedule)."""
    import json

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("step", 0) < step or (row.get("step", 0) == step and not drop_eval):
            kept.append(line)
        elif row.get("step", 0) == step:
            kept.append(json.dumps(_without_eval(row)))
    path.write_text("".join(k + "\n" for k in kept))
