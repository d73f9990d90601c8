"""The flow RL loop: roll out groups with the SDE sampler, score, take group advantages, update.

One step: each of ``groups`` contexts (prompts) gets ``group_size`` episodes; rewards -> advantages
through the shared ``ADVANTAGES`` registry; pi_old's step log-probs and means (or FPO's CFM losses) are
frozen once; then ``updates_per_batch`` passes over the batch (each split into ``minibatches``) call
the method's flow loss. No method-name branches: the loss part's tags say what it needs.

Logged per step (``metrics.jsonl``, TensorBoard): ``reward/mean``, ``reward/std``, ``objective/loss``,
the loss's own metrics as ``objective/*``, ``objective/kl`` = path KL from the current policy to the
pretrained (initial) one on this batch's rollouts, in nats summed over stochastic sampler steps and
dimensions (exact, by the chain rule over the Gaussian steps; the sum over an episode's actions for
multi-step tasks), ``objective/grad_norm`` and ``perf/step_seconds``. Loss metrics are averaged over the
batch's optimizer steps (the first pass has rho = 1, so clip and mask fractions are diluted by it).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from polyrl.errors import TrainingError
from polyrl.families import lower
from polyrl.families.flow.losses import FLOW_LOSSES, FlowLossInputs, fpo_cfm_losses, step_kl
from polyrl.families.flow.methods import FlowMethod
from polyrl.families.flow.policy import VelocityMLP, pretrain
from polyrl.families.flow.sampler import Trajectory, replay, sample_sde, sde_window
from polyrl.families.flow.tasks import get_task
from polyrl.logging import RunLogger, plot_curves, write_summary
from polyrl.registry import ADVANTAGES
from polyrl.runs import check_fits


@dataclass(frozen=True)
class FlowTrainConfig:
    """Settings of one flow RL run: one flag each (``polyrl flow train --help``), or keys of a ``--config`` TOML."""

    task: str = "ring_modes"
    """task: ring_modes, ring_modes_cond or reach"""
    steps: int = 100
    """rollout batches to train on (each followed by updates_per_batch passes)"""
    groups: int = 16
    """contexts (prompts) per rollout batch"""
    group_size: int = 16
    """samples per context (G)"""
    updates_per_batch: int = 2
    """passes over each rollout batch, pi_old frozen first (Flow-DPPO recipe: 2)"""
    minibatches: int = 1
    """optimizer steps per pass (at most the actions per batch: groups x group_size x task horizon)"""
    lr: float = 5e-4
    """Adam learning rate"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm (0 = off)"""
    sampler_steps: int = 10
    """SDE steps per sample"""
    eval_samples: int = 1024
    """episodes for the mean reward before and after"""
    seed: int = 0
    """seed of rollouts, evaluation and from-scratch initialisation"""
    tensorboard: bool = True
    """write TensorBoard event files to run_dir/tb"""


def validate_config(cfg: FlowTrainConfig) -> None:
    """Raise ValueError with one line naming the field, the value and what is allowed."""
    for name in ("steps", "groups", "group_size", "updates_per_batch", "minibatches", "sampler_steps", "eval_samples"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r} is not allowed; allowed: an integer >= 1")
    if cfg.groups * cfg.group_size > 10**6 or cfg.eval_samples > 10**6:  # sampled at once: past this, the OOM killer
        big = "groups" if cfg.groups * cfg.group_size > 10**6 else "eval_samples"
        raise ValueError(f"{big} = {getattr(cfg, big)} is not allowed; allowed: at most 1000000 samples at once "
                         f"(groups x group_size = {cfg.groups * cfg.group_size}, eval_samples = {cfg.eval_samples})")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ValueError(f"lr = {cfg.lr!r} is not allowed; allowed: > 0")
    if not (math.isfinite(cfg.max_grad_norm) and cfg.max_grad_norm >= 0):
        raise ValueError(f"max_grad_norm = {cfg.max_grad_norm!r} is not allowed; allowed: >= 0")
    _check_minibatches(cfg, get_task(cfg.task))


# Bytes held at once per unit, measured as peak resident memory above the start-up's (ring_modes and reach, 10^4
# samples, 10-40 sampler steps, flow_dppo and fpo): a training batch keeps about 4 KB per action and sampler step (the
# SDE trajectories and the policy's activations for the backward), FPO about 4 KB per action and stored (t, eps)
# pair, evaluation about 1.3 KB per sample and sampler step. 10^6 samples of 10 steps were OOM-killed at 24 GiB.
TRAIN_BYTES, CFM_BYTES, EVAL_BYTES = 4096, 4096, 1536


def run_record(cfg: FlowTrainConfig, method: FlowMethod) -> dict[str, Any]:
    """What defines a run: its settings, preset and the parts that define it (its ``config.json``, and the same keys
    in ``summary.json``)."""
    parts = {"advantage": str(method.advantage), "loss": str(method.loss), "schedule": method.schedule,
             "eta": method.eta, "reduce": method.reduce, "cfm_samples": method.cfm_samples}
    if method.sde_steps:  # only then: a run with noise at every step keeps the record it had before the setting
        parts.update(sde_steps=method.sde_steps, sde_window=method.sde_window)
    return {"config": asdict(cfg), "method": method.name, "parts": parts}


def check_memory(cfg: FlowTrainConfig, method: FlowMethod) -> None:
    """Refuse (ConfigError, one line) sizes that would not fit in this machine's memory (``runs.check_fits``)."""
    horizon = getattr(get_task(cfg.task), "horizon", 1)
    actions = cfg.groups * cfg.group_size * horizon
    check_fits({
        f"groups x group_size x sampler_steps = {actions * cfg.sampler_steps} action steps":
            actions * cfg.sampler_steps * TRAIN_BYTES,
        f"cfm_samples = {method.cfm_samples} (x {actions} actions)": actions * method.cfm_samples * CFM_BYTES,
        f"eval_samples x sampler_steps = {cfg.eval_samples * horizon * cfg.sampler_steps} action steps":
            cfg.eval_samples * horizon * cfg.sampler_steps * EVAL_BYTES,
    })


def _check_minibatches(cfg: FlowTrainConfig, task) -> None:
    """Refuse more minibatches than actions in a batch: a pass could not take ``minibatches`` optimizer steps.

    A batch holds groups x group_size episodes of ``horizon`` actions each (1 for the bandit tasks).
    """
    actions = cfg.groups * cfg.group_size * getattr(task, "horizon", 1)
    if cfg.minibatches > actions:
        raise ValueError(f"minibatches = {cfg.minibatches} is not allowed; allowed: 1 to {actions}, the actions per "
                         f"batch (groups {cfg.groups} x group_size {cfg.group_size} x {task.name} horizon "
                         f"{getattr(task, 'horizon', 1)})")


def initial_policy(task, seed: int, *, cache: str | Path | None = None) -> tuple[VelocityMLP, dict[str, Any]]:
    """The task's pretrained policy (cached), or a fresh random one for tasks trained from scratch."""
    if task.pretrain is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return VelocityMLP(dim=task.dim, context_dim=task.context_dim), {"pretrained": None}
    res = pretrain(task.pretrain, cache=cache)
    return res.model, {"pretrained": res.path, "pretrain_cached": res.cached, "pretrain_seconds": res.seconds,
                       "pretrain_loss": res.loss}


def _cat(trajs: list[Trajectory]) -> Trajectory:
    if len(trajs) == 1:
        return trajs[0]
    ctx = None if trajs[0].context is None else torch.cat([t.context for t in trajs])
    sde = None if trajs[0].sde is None else torch.cat([t.sde for t in trajs])
    return Trajectory(states=torch.cat([t.states for t in trajs]), times=trajs[0].times,
                      logp=torch.cat([t.logp for t in trajs]), mean=torch.cat([t.mean for t in trajs]),
                      std=torch.cat([t.std for t in trajs]), context=ctx, sde=sde)


def _index(traj: Trajectory, idx: Tensor) -> Trajectory:
    return Trajectory(states=traj.states[idx], times=traj.times, logp=traj.logp[idx], mean=traj.mean[idx],
                      std=traj.std[idx], context=None if traj.context is None else traj.context[idx],
                      sde=None if traj.sde is None else traj.sde[idx])


def play(policy, task, method: FlowMethod, contexts: Tensor | None, n: int, steps: int,
         generator: torch.Generator) -> tuple[Trajectory, Tensor, int]:
    """Run n episodes; returns (all actions' trajectories, episode rewards [n], actions per episode)."""

    def act(obs: Tensor | None, count: int) -> Trajectory:
        noise = torch.randn(count, task.dim, generator=generator)
        sde = sde_window(steps, method.sde_steps, method.sde_window, generator) if method.sde_steps else None
        return sample_sde(policy, noise, context=obs, steps=steps, eta=method.eta, schedule=method.schedule,
                          reduce=method.reduce, generator=generator, sde=sde)

    trajs, rewards = task.episode(act, contexts, n, generator)
    return _cat(trajs), rewards, len(trajs)


def path_kl(mean: Tensor, ref_mean: Tensor, traj: Trajectory) -> Tensor:
    """Exact path KL [N] between step means [N, S, D] along ``traj`` (nats, summed over stochastic steps and dims)."""
    kl = step_kl(mean, ref_mean, torch.where(traj.stochastic, traj.std, torch.ones_like(traj.std)), "sum")
    return (kl * traj.stochastic).sum(-1)


@torch.no_grad()
def frozen_steps(policy, ref, traj: Trajectory, method: FlowMethod) -> tuple[Tensor, Tensor, Tensor]:
    """pi_old's step log-probs [N, S] and means [N, S, D], and the pretrained policy's means, without gradient."""
    logp, mean = replay(policy, traj, eta=method.eta, schedule=method.schedule, reduce=method.reduce)
    _, ref_mean = replay(ref, traj, eta=method.eta, schedule=method.schedule, reduce=method.reduce)
    return logp, mean, ref_mean


@torch.no_grad()
def evaluate(policy, ref, task, method: FlowMethod, cfg: FlowTrainConfig) -> dict[str, Any]:
    """Mean reward and path KL to ``ref`` over ``eval_samples`` episodes with a fixed seed; plot points."""
    g = torch.Generator().manual_seed(cfg.seed + 10_007)
    ctx = task.contexts(cfg.eval_samples, g)
    traj, rewards, horizon = play(policy, task, method, ctx, cfg.eval_samples, cfg.sampler_steps, g)
    _, mean, ref_mean = frozen_steps(policy, ref, traj, method)
    kl = path_kl(mean, ref_mean, traj).reshape(horizon, -1).sum(0)
    return {"reward": rewards.mean().item(), "kl": kl.mean().item(), "points": task.points(traj, ctx, horizon),
            "contexts": ctx}


def train_flow(cfg: FlowTrainConfig, method: FlowMethod, *, run_dir: str | Path, console=None,
               cache: str | Path | None = None, table_every: int = 10) -> dict[str, Any]:
    """Train ``method`` on ``cfg.task``; write metrics, plots and summary.json in ``run_dir``; return the summary."""
    validate_config(cfg)
    started = time.perf_counter()
    task = get_task(cfg.task)
    policy, info = initial_policy(task, cfg.seed, cache=cache)
    ref = copy.deepcopy(policy).requires_grad_(False)
    torch.manual_seed(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    loss_fn = FLOW_LOSSES.fn(method.loss.name)
    adv_fn = ADVANTAGES.fn(method.advantage.name)
    before = evaluate(policy, ref, task, method, cfg)
    run_dir = Path(run_dir)
    logger = RunLogger(run_dir, tensorboard=cfg.tensorboard, console=console, table_every=table_every)
    bad = 0
    try:
        for step in range(1, cfg.steps + 1):
            t0 = time.perf_counter()
            metrics = _train_step(policy, ref, task, method, cfg, opt, loss_fn, adv_fn, g)
            if not math.isfinite(metrics["objective/loss"]):
                bad += 1
                if bad >= 3:
                    raise TrainingError(f"non-finite loss at {bad} steps in a row (step {step}); "
                                        f"{lower({'lr': cfg.lr, 'eta': method.eta})}")
            else:
                bad = 0
            metrics["perf/step_seconds"] = time.perf_counter() - t0
            logger.log(step, metrics)
    finally:
        logger.close()
    after = evaluate(policy, ref, task, method, cfg)
    wall = time.perf_counter() - started
    from polyrl.families.flow.plots import scatter_before_after

    scatter_before_after(before, after, task, run_dir / "samples.png", title=f"{method.name} on {task.name}")
    plot_curves(logger.history, run_dir / "curves.png", keys=("reward/mean", "objective/kl"))
    summary = {"method": method.name, "task": task.name, "reward_before": before["reward"],
               "reward_after": after["reward"], "kl_before": before["kl"], "kl_after": after["kl"],
               "steps": cfg.steps, "updates_per_batch": cfg.updates_per_batch, "wall_seconds": wall,
               "seconds_per_step": sum(r["perf/step_seconds"] for r in logger.history) / cfg.steps,
               **run_record(cfg, method), **info}
    write_summary(run_dir, summary)
    return {**summary, "history": logger.history}


def _train_step(policy, ref, task, method: FlowMethod, cfg: FlowTrainConfig, opt, loss_fn, adv_fn,
                g: torch.Generator) -> dict[str, float]:
    n = cfg.groups * cfg.group_size
    ctx = task.contexts(cfg.groups, g)
    ctx = None if ctx is None else ctx.repeat_interleave(cfg.group_size, 0)
    group_ids = torch.arange(cfg.groups).repeat_interleave(cfg.group_size)
    traj, rewards, horizon = play(policy, task, method, ctx, n, cfg.sampler_steps, g)
    adv_ep = adv_fn(rewards, group_ids, torch.ones(n, 1), **method.advantage.params)
    adv = adv_ep.repeat(horizon).to(torch.get_default_dtype())  # actions are ordered (env step, episode)
    n_act = adv.shape[0]
    frozen: dict[str, Tensor] = {}
    frozen["old_logp"], frozen["old_mean"], frozen["ref_mean"] = frozen_steps(policy, ref, traj, method)
    kl = path_kl(frozen["old_mean"], frozen["ref_mean"], traj).reshape(horizon, -1).sum(0)
    with torch.no_grad():
        if method.needs_cfm:
            frozen["t"] = torch.rand(n_act, method.cfm_samples, generator=g)
            frozen["eps"] = torch.randn(n_act, method.cfm_samples, task.dim, generator=g)
            frozen["old_cfm"] = fpo_cfm_losses(policy, traj.samples, traj.context, frozen["t"], frozen["eps"])
    std = torch.where(traj.stochastic, traj.std, torch.ones_like(traj.std))
    dt = traj.dt.expand(n_act, -1)
    sums: dict[str, float] = {}
    count = 0
    for _ in range(cfg.updates_per_batch):
        # tensor_split, not chunk: exactly ``minibatches`` non-empty pieces (chunk may return fewer).
        for idx in torch.randperm(n_act, generator=g).tensor_split(cfg.minibatches):
            sub = _index(traj, idx)
            inp = FlowLossInputs(adv=adv[idx], reduce=method.reduce, std=std[idx], dt=dt[idx],
                                 mask=sub.stochastic)
            if method.needs_steps:
                inp.logp, inp.mean = replay(policy, sub, eta=method.eta, schedule=method.schedule,
                                            reduce=method.reduce)
                inp.old_logp, inp.old_mean = frozen["old_logp"][idx], frozen["old_mean"][idx]
                inp.ref_mean = frozen["ref_mean"][idx]
            if method.needs_cfm:
                inp.cfm_loss = fpo_cfm_losses(policy, sub.samples, sub.context, frozen["t"][idx], frozen["eps"][idx])
                inp.old_cfm_loss = frozen["old_cfm"][idx]
            loss, parts = loss_fn(inp, **method.loss.params)
            opt.zero_grad()
            if not torch.isfinite(loss):
                sums["objective/loss"] = math.nan
                continue
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm or math.inf)
            opt.step()
            count += 1
            for k, v in {"objective/loss": loss.detach(), "objective/grad_norm": gn,
                         **{f"objective/{k}": v for k, v in parts.items()}}.items():
                sums[k] = sums.get(k, 0.0) + float(v)
    out = {k: v / max(count, 1) for k, v in sums.items()}
    out.update({"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item(),
                "objective/kl": kl.mean().item(), "objective/adv_abs": adv_ep.abs().mean().item()})
    return out
