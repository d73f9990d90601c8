"""The duplex loop: imitate the scripted natural agent, then GRPO (or more imitation) on the simulator.

Phase 1 (``imitation_steps``): behaviour cloning, cross-entropy on the natural agent's actions (forced frames
masked out). Its policy is the baseline ("before") and the reference. Phase 2 (``steps``), per step for an RL
method: ``groups`` fresh segments, each rolled out ``group_size`` times (a GRPO group: the same segment); reward =
axis reward + w_quality * quality (``sim.rewards``); advantages from ``polyrl.registry.ADVANTAGES`` (one per
rollout, broadcast to its frames); ``updates_per_batch`` passes of the PPO clip (``TRUST_REGIONS['clip']``) on the
per-frame log-ratio to the frozen rollout policy, aggregated by ``AGGREGATIONS['seq_mean_token_mean']`` over the
agent's free frames; optional k3 KL to the imitation policy (``kl_coef``). An imitation method takes
``steps`` more cloning steps instead (and rolls out once per step only to log ``reward/mean``).

Logged per step (``metrics.jsonl``): ``reward/mean``, ``reward/std``, ``objective/loss``, ``objective/clip_frac``,
``objective/kl``, ``objective/grad_norm``, ``perf/step_seconds``. Checkpoints (``polyrl.checkpoint``) hold the
policy, the reference, Adam, every RNG (the torch and numpy generators of the loop included) and the step, so
``--resume`` continues bit-exactly.

A policy that diverges (a non-finite loss or action probabilities, e.g. from a learning rate far too large) stops
the run with ``TrainingError`` in one line naming the phase and step; the checkpoints written before it are kept.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from polyrl.errors import TrainingError
from polyrl.families import diverged
from polyrl.families.duplex.methods import DuplexMethod
from polyrl.families.duplex.policy import GRUPolicy
from polyrl.families.duplex.rewards import AXES
from polyrl.families.duplex.sim import (
    RewardSettings,
    Segments,
    axis_metrics,
    features,
    make_segments,
    natural_agent,
    rewards,
    segment_axes,
)
from polyrl.runs import check_fits, check_resume_steps, max_threads


@dataclass(frozen=True)
class DuplexTrainConfig:
    """Settings of one duplex run: one flag each (``polyrl duplex train --help``), or keys of a ``--config`` TOML."""

    task: str = "mix"
    """segments to train and evaluate on: mix (all four axes) or one of pause, turn, backchannel, interrupt"""
    steps: int = 100
    """RL steps (or, for the imitation method, extra cloning steps) after the imitation phase"""
    imitation_steps: int = 300
    """behaviour-cloning steps on the scripted natural agent before RL (the baseline policy)"""
    imitation_batch: int = 128
    """segments per cloning step"""
    imitation_lr: float = 3e-3
    """Adam learning rate of the cloning phase"""
    natural_noise: float = 1.0
    """noise of the scripted natural agent (0 = nearly ideal timing, 1 = default human-like noise)"""
    groups: int = 32
    """distinct segments per RL step"""
    group_size: int = 8
    """rollouts per segment (G, the GRPO group)"""
    updates_per_batch: int = 2
    """passes over each rollout batch (pi_old frozen before the first)"""
    lr: float = 1e-3
    """Adam learning rate of the RL phase"""
    clip_eps: float = 0.2
    """PPO clip range eps (ratio in [1 - eps, 1 + eps])"""
    kl_coef: float = 0.0
    """weight of the k3 KL estimate to the imitation policy (0 = off)"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm (0 = off)"""
    frames: int = 48
    """frames per segment (80 ms each; >= 40)"""
    hidden: int = 64
    """GRU width"""
    cue_noise: float = 0.3
    """std of the prosodic cue features (higher = turn ends and pauses harder to tell apart)"""
    min_gap: int = 2
    """turn-taking: the ideal gap in frames after the user's turn end (maximum reward)"""
    max_gap: int = 10
    """turn-taking: a later onset gets late_penalty -1"""
    stop_within: int = 4
    """interruption: frames after a barge-in past which the reward is negative"""
    decay: float = 0.25
    """interruption: reward lost per frame spoken after the barge-in"""
    w_quality: float = 0.5
    """weight of the quality term (share of speech in bursts >= 3 frames)"""
    eval_segments: int = 512
    """evaluation segments (a fixed set per seed) for the before/after metrics"""
    checkpoint_every: int = 20
    """save a checkpoint every this many steps (and at the end); 0 = only at the end"""
    seed: int = 0
    """seed of initialisation, segments, rollouts and evaluation"""
    threads: int = 1
    """torch CPU threads"""
    tensorboard: bool = False
    """write TensorBoard event files to run_dir/tb"""


# Settings only the RL phase reads: an imitation-only method would ignore them, so they are refused with it.
RL_ONLY = ("lr", "clip_eps", "kl_coef", "updates_per_batch", "group_size")

_POSITIVE_INT = ("steps", "imitation_batch", "groups", "group_size", "updates_per_batch", "frames", "hidden",
                 "eval_segments", "threads")


def validate_config(cfg: DuplexTrainConfig) -> None:
    """Raise ValueError with one line naming the field, the value and what is allowed."""
    for name in _POSITIVE_INT:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} = {v!r} is not allowed; allowed: an integer >= 1")
    if cfg.threads > max_threads():
        raise ValueError(f"threads = {cfg.threads} is not allowed; allowed: an integer in [1, {max_threads()}] "
                         "(4 per core of this machine; a run recorded with more, resumed here, takes --threads)")
    for name in ("imitation_steps", "checkpoint_every", "seed", "min_gap"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} = {v!r} is not allowed; allowed: an integer >= 0")
    if cfg.task not in ("mix", *AXES):
        raise ValueError(f"task = {cfg.task!r} is not allowed; allowed: mix, {', '.join(AXES)}")
    if cfg.frames < 40:
        raise ValueError(f"frames = {cfg.frames} is not allowed; allowed: >= 40 (the scripted segments need it)")
    if cfg.group_size < 2:
        raise ValueError(f"group_size = {cfg.group_size} is not allowed; allowed: >= 2 (a group needs two rollouts)")
    if cfg.max_gap <= cfg.min_gap:
        raise ValueError(f"max_gap = {cfg.max_gap} is not allowed; allowed: > min_gap ({cfg.min_gap})")
    if cfg.stop_within < 0:
        raise ValueError(f"stop_within = {cfg.stop_within} is not allowed; allowed: >= 0")
    for name in ("lr", "imitation_lr", "clip_eps", "decay"):
        v = getattr(cfg, name)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} = {v!r} is not allowed; allowed: > 0")
    for name in ("kl_coef", "max_grad_norm", "w_quality", "cue_noise", "natural_noise"):
        v = getattr(cfg, name)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} = {v!r} is not allowed; allowed: >= 0")
    if cfg.natural_noise > cfg.frames:  # offsets of 8 x noise frames: beyond a segment it is noise no more
        raise ValueError(f"natural_noise = {cfg.natural_noise:g} is not allowed; allowed: in [0, frames = "
                         f"{cfg.frames}]")
    # Bytes a frame holds, measured at hidden 64 and 128 (peak resident memory of one step, minus the start-up's):
    # a trained frame (RL rollouts and cloning keep the GRU's activations for the backward) 3.4-4.3 KB at hidden 64,
    # 8.1 KB at 128; an evaluated frame 111 B at hidden 64. 200,000 segments of an RL step were OOM-killed at 24 GiB.
    trained, evaluated = 64 * cfg.hidden + 512, 2 * cfg.hidden + 32
    of = f"segments of {cfg.frames} frames at hidden {cfg.hidden}"
    check_fits({
        f"groups x group_size = {cfg.groups * cfg.group_size} {of}": cfg.groups * cfg.group_size * cfg.frames * trained,
        f"imitation_batch = {cfg.imitation_batch} {of}": cfg.imitation_batch * cfg.frames * trained,
        f"eval_segments = {cfg.eval_segments} {of}": cfg.eval_segments * cfg.frames * evaluated,
    })
    check_eval_axes(cfg)


# The reward settings of one axis: a single-axis task (``--task pause``) never scores the others.
AXIS_SETTINGS = {"turn": ("min_gap", "max_gap"), "interrupt": ("stop_within", "decay")}


def check_method_settings(method: DuplexMethod, given: dict[str, Any]) -> None:
    """Refuse a setting that was given (flag or TOML) where it would change nothing, and a setting that changes
    nothing must not look as if it did (ValueError, one line): an RL-only setting with a method that has no RL
    phase, another axis's reward setting with a single-axis task, imitation settings with no imitation phase."""
    task = given.get("task", DuplexTrainConfig.task)
    for axis, names in AXIS_SETTINGS.items():
        for name in names:
            if task not in ("mix", axis) and name in given:
                raise ValueError(f"{name} = {given[name]!r} does not apply to task {task!r} (a setting of the "
                                 f"{axis!r} axis, which this task never scores); drop it or use task mix or {axis}")
    if method.kind == "rl" and given.get("imitation_steps", DuplexTrainConfig.imitation_steps) == 0:
        for name in ("imitation_lr", "imitation_batch"):
            if name in given:
                raise ValueError(f"{name} = {given[name]!r} does not apply with imitation_steps = 0 (no imitation "
                                 "phase); drop it")
    if method.kind == "rl":
        return
    for name in RL_ONLY:
        if name in given:
            raise ValueError(f"{name} = {given[name]!r} does not apply to method {method.name!r} (no RL phase; "
                             f"its extra steps are cloning with imitation_lr); drop it")


def _finite(loss: torch.Tensor, what: str) -> None:
    """Stop before a non-finite loss reaches the weights (it would turn every later rollout into NaN)."""
    if not bool(torch.isfinite(loss)):
        raise TrainingError(f"non-finite {what}")


def reward_settings(cfg: DuplexTrainConfig) -> RewardSettings:
    return RewardSettings(min_gap=cfg.min_gap, max_gap=cfg.max_gap, stop_within=cfg.stop_within, decay=cfg.decay,
                          w_quality=cfg.w_quality)


def _axes(cfg: DuplexTrainConfig) -> tuple[str, ...]:
    return AXES if cfg.task == "mix" else (cfg.task,)


def imitation_step(policy: GRUPolicy, opt, cfg: DuplexTrainConfig, rng: np.random.Generator) -> float:
    """One behaviour-cloning step on fresh scripted segments; returns the cross-entropy."""
    seg = make_segments(cfg.imitation_batch, cfg.frames, rng, axes=_axes(cfg), cue_noise=cfg.cue_noise)
    acts = natural_agent(seg, rng, min_gap=cfg.min_gap, noise=cfg.natural_noise)
    logp = policy.logp(features(seg, acts), acts)
    mask = (~seg.forced).float()
    loss = -(logp * mask).sum() / mask.sum()
    _finite(loss, "imitation loss")
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm or math.inf)
    opt.step()
    return loss.item()


def eval_set(cfg: DuplexTrainConfig) -> Segments:
    return make_segments(cfg.eval_segments, cfg.frames, _eval_rng(cfg), axes=_axes(cfg), cue_noise=cfg.cue_noise)


def _eval_rng(cfg: DuplexTrainConfig) -> np.random.Generator:
    return np.random.default_rng(cfg.seed + 10_007)


def check_eval_axes(cfg: DuplexTrainConfig) -> None:
    """Refuse (ValueError, one line) an evaluation set of this seed in which an axis of the task has no segment: its
    metrics would be nan (bare NaN in summary.json) and a report would drop that axis without a word."""
    drawn = set(segment_axes(cfg.eval_segments, _eval_rng(cfg), _axes(cfg)).tolist())
    missing = [a for a in _axes(cfg) if AXES.index(a) not in drawn]
    if missing:
        raise ValueError(f"eval_segments = {cfg.eval_segments} is not allowed: seed {cfg.seed}'s evaluation set has "
                         f"no {missing[0]!r} segment (axes drawn at random from {', '.join(_axes(cfg))}); allowed: "
                         "enough segments that every axis gets one (the default 512 does)")


@torch.no_grad()
def evaluate(policy: GRUPolicy, cfg: DuplexTrainConfig, seg: Segments | None = None) -> dict[str, float]:
    """Per-axis metrics of sampled rollouts on the seed's fixed evaluation set (a fixed sampling seed too)."""
    seg = eval_set(cfg) if seg is None else seg
    acts = policy.rollout(seg, torch.Generator().manual_seed(cfg.seed + 20_011))
    return axis_metrics(seg, acts, reward_settings(cfg))


def natural_metrics(cfg: DuplexTrainConfig) -> dict[str, float]:
    seg = eval_set(cfg)
    acts = natural_agent(seg, np.random.default_rng(cfg.seed + 30_011), min_gap=cfg.min_gap, noise=cfg.natural_noise)
    return axis_metrics(seg, acts, reward_settings(cfg))


def rl_step(policy: GRUPolicy, ref: GRUPolicy, opt, cfg: DuplexTrainConfig, method: DuplexMethod,
            rng: np.random.Generator, g: torch.Generator) -> dict[str, float]:
    """One GRPO step (see the module docstring)."""
    from types import SimpleNamespace

    from polyrl.registry import ADVANTAGES, AGGREGATIONS, TRUST_REGIONS
    from polyrl.types import Normalizer

    seg = make_segments(cfg.groups, cfg.frames, rng, axes=_axes(cfg), cue_noise=cfg.cue_noise).repeat(cfg.group_size)
    silence = seg.silence_run()
    acts = policy.rollout(seg, g, silence)
    feats = features(seg, acts, silence)
    r = rewards(seg, acts, reward_settings(cfg))
    group_ids = torch.arange(cfg.groups).repeat_interleave(cfg.group_size)
    B = r.shape[0]
    adv = ADVANTAGES.fn(method.advantage.name)(r, group_ids, torch.ones(B, 1), **method.advantage.params)
    mask = (~seg.forced).float()
    with torch.no_grad():
        old_logp = policy.logp(feats, acts)
        ref_logp = ref.logp(feats, acts)
    inp = SimpleNamespace(adv=adv[:, None].expand_as(mask), mask=mask)
    norm = Normalizer.from_batch(mask, group_ids, horizon=float(cfg.frames))
    clip_fn, agg = TRUST_REGIONS.fn("clip"), AGGREGATIONS.fn("seq_mean_token_mean")
    sums: dict[str, float] = {}
    for _ in range(cfg.updates_per_batch):
        logp = policy.logp(feats, acts)
        per_tok, parts = clip_fn(inp, logp - old_logp, eps_low=cfg.clip_eps, eps_high=cfg.clip_eps)
        d = ref_logp - logp
        k3 = d.exp() - 1 - d  # k3 estimator of KL(pi || pi_ref), per frame
        loss = agg(per_tok + cfg.kl_coef * k3, mask, norm, None)
        _finite(loss, "RL loss")
        opt.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm or math.inf)
        opt.step()
        for k, v in {"objective/loss": loss.detach(), "objective/grad_norm": gn,
                     "objective/kl": agg(k3.detach(), mask, norm, None),
                     **{f"objective/{k}": v for k, v in parts.items()}}.items():
            sums[k] = sums.get(k, 0.0) + float(v) / cfg.updates_per_batch
    return {**sums, "reward/mean": float(r.mean()), "reward/std": float(r.std()),
            "objective/adv_abs": float(adv.abs().mean())}


def imitation_extra_step(policy: GRUPolicy, opt, cfg: DuplexTrainConfig, rng: np.random.Generator,
                         g: torch.Generator) -> dict[str, float]:
    """One step of an imitation method after the baseline: a cloning step, then one rollout only to log the reward
    (so its curve is comparable with an RL method's)."""
    metrics = {"objective/loss": imitation_step(policy, opt, cfg, rng)}
    seg = make_segments(cfg.groups, cfg.frames, rng, axes=_axes(cfg), cue_noise=cfg.cue_noise)
    r = rewards(seg, policy.rollout(seg, g), reward_settings(cfg))
    return {**metrics, "reward/mean": float(r.mean()), "reward/std": float(r.std())}


def train_duplex(cfg: DuplexTrainConfig, method: DuplexMethod, *, run_dir: str | Path, resume: bool = False,
                 console=None, table_every: int = 10) -> dict[str, Any]:
    """Run the two phases; write metrics.jsonl, checkpoints and summary.json in ``run_dir``; return the summary."""
    from polyrl.checkpoint import load_checkpoint, resume_checkpoint, save_checkpoint
    from polyrl.logging import RunLogger, write_summary
    from polyrl.runs import cut_logs, read_rows

    validate_config(cfg)
    torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    run_dir = Path(run_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        policy = GRUPolicy(cfg.hidden)
        ref = GRUPolicy(cfg.hidden).requires_grad_(False)
    rng = np.random.default_rng(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    start = 0
    if resume:
        path, _ = resume_checkpoint(run_dir)
        opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
        state = load_checkpoint(path, model=policy, optimizer=opt, extra_models={"ref": ref})
        start, before, natural, bc_loss = state["step"], state["before"], state["natural"], state["bc_loss"]
        check_resume_steps(cfg.steps, start, run_dir)
        rng.bit_generator.state = state["np_generator"]
        g.set_state(state["torch_generator"])
        cut_logs(run_dir, start)
        history = read_rows(run_dir)
    else:
        opt = torch.optim.Adam(policy.parameters(), lr=cfg.imitation_lr)
        bc_loss = math.nan
        for i in range(cfg.imitation_steps):
            with diverged(f"imitation step {i + 1}", {"imitation-lr": cfg.imitation_lr}):
                bc_loss = imitation_step(policy, opt, cfg, rng)
        ref.load_state_dict(policy.state_dict())
        opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr if method.kind == "rl" else cfg.imitation_lr)
        with diverged("the end of the imitation phase", {"imitation-lr": cfg.imitation_lr}):
            before = evaluate(policy, cfg)
        natural = natural_metrics(cfg)
        history = []
    logger = RunLogger(run_dir, tensorboard=cfg.tensorboard, console=console, table_every=table_every,
                       history=history, purge_step=start + 1 if resume else None)

    def save(step: int) -> None:
        save_checkpoint(run_dir, step, model=policy, optimizer=opt, extra_models={"ref": ref},
                        state={"step": step, "before": before, "natural": natural, "bc_loss": bc_loss,
                               "np_generator": rng.bit_generator.state, "torch_generator": g.get_state()})

    scales = ({"lr": cfg.lr, "kl-coef": cfg.kl_coef} if method.kind == "rl"  # what the loss and step scale by
              else {"imitation-lr": cfg.imitation_lr})
    try:
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            with diverged(f"step {step}", scales):
                metrics = (rl_step(policy, ref, opt, cfg, method, rng, g) if method.kind == "rl"
                           else imitation_extra_step(policy, opt, cfg, rng, g))
            metrics["perf/step_seconds"] = time.perf_counter() - t0
            logger.log(step, metrics)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps:
                save(step)
    finally:
        logger.close()
    with diverged(f"the final evaluation (step {cfg.steps})", scales):
        after = evaluate(policy, cfg)  # before the final save: a diverged policy is not saved as the run's end
    save(cfg.steps)
    rows = [r for r in logger.history if "perf/step_seconds" in r]
    summary = {"method": method.name, "task": cfg.task, "reward_before": before["reward/mean"],
               "reward_after": after["reward/mean"], "metrics_before": before, "metrics_after": after,
               "natural_agent": natural, "imitation_loss": bc_loss, "steps": cfg.steps,
               "wall_seconds": time.perf_counter() - started,
               "seconds_per_step": sum(r["perf/step_seconds"] for r in rows) / max(len(rows), 1),
               "config": asdict(cfg), "parts": {"kind": method.kind,
                                                "advantage": method.advantage and str(method.advantage),
                                                "trust_region": f"clip:eps={cfg.clip_eps}",
                                                "aggregation": "seq_mean_token_mean"}}
    write_summary(run_dir, summary)
    return {**summary, "history": logger.history, "policy": policy}
