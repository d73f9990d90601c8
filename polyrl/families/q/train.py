"""The sample-based loop: epsilon-greedy linear Q-learning on the gridworld with one of the four target rules.

One logged step = ``samples_per_step`` environment transitions, each followed by one online TD step and the
method's target rule (``LinearQLearner``); so methods are compared at matched sample counts. Episodes that
reach ``max_episode_steps`` are cut without a terminal flag (the cut state is bootstrapped).

Logged per step (``metrics.jsonl``; TensorBoard when ``tensorboard``): ``reward/mean`` = the exact discounted
return from the start of the greedy policy of the online Q (no sampling noise: the model is known),
``eval/q_error`` = mean |Q_theta - Q*| over non-terminal state-actions, ``q/td_abs`` (mean |TD error| of the
step), ``q/theta_norm``, ``q/target_refreshes`` (cumulative), ``q/episodes`` (cumulative),
``rollout/generated`` (= samples_per_step, the lab's compute axis) and ``perf/step_seconds``. A run whose
weights leave [-1e6, 1e6] (or turn non-finite) stops there with ``diverged: true`` in ``summary.json``.

Resume: ``checkpoint.pkl`` (the learner's weights, target, generator, counters; the environment's generator,
state and episode clock; the step) is written every ``checkpoint_every`` steps and at the end, so a run
resumed at step k continues bit-for-bit as the uninterrupted one.
"""

from __future__ import annotations

import math
import pickle
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from polyrl.config import ConfigError
from polyrl.families.q.core import LinearQLearner
from polyrl.families.q.methods import QMethod
from polyrl.families.q.search import check_seed
from polyrl.families.q.tasks import TASKS, make_task
from polyrl.logging import RunLogger, plot_curves, write_summary

CHECKPOINT = "checkpoint.pkl"
DIVERGED = 1e6


@dataclass(frozen=True)
class QTrainConfig:
    """Settings of one Q run: one flag each (``polyrl q train --help``), or keys of a ``--config`` TOML."""

    task: str = "gridworld"
    """task: gridworld (slippery size x size grid, start top-left, reward 1 on reaching the bottom-right goal)"""
    features: Literal["tiles", "onehot"] = "tiles"
    """feature map: tiles (two offset tilings of 2x2 tiles per action: linear approximation) or onehot (tabular)"""
    size: int = 5
    """grid side length (states = size^2)"""
    slip: float = 0.1
    """probability that the chosen action is replaced by a uniformly random one"""
    gamma: float = 0.95
    """discount"""
    alpha: float = 0.2
    """online step size of the TD update"""
    epsilon: float = 1.0
    """behaviour: probability of a uniformly random action, else greedy on the online Q (1 = uniform, off-policy)"""
    steps: int = 40
    """logged steps; each is samples_per_step transitions"""
    samples_per_step: int = 250
    """environment transitions (= online updates) per logged step"""
    max_episode_steps: int = 200
    """an episode is cut (bootstrapped, not terminal) after this many transitions"""
    seed: int = 0
    """seed of the learner (exploration, geometric copies) and of the environment"""
    checkpoint_every: int = 10
    """write checkpoint.pkl every this many steps (and at the end); 0 = only at the end"""
    tensorboard: bool = False
    """write TensorBoard event files to run_dir/tb (imports torch)"""


# The gridworld's exact model is a dense [S, 4, S] array (S = size^2) and Q* 2000 sweeps of value iteration over it,
# before the first step: measured here, size 30 took 8.7 s, 40 50 s and 60 more than 4 minutes with no output (the
# work grows as size^4; 50 is about 2 minutes); the one-hot table is [S, 4, 4S] (size 1000 asked for 58 TiB).
MAX_SIZE = 50


def run_record(cfg: QTrainConfig, method) -> dict:
    """What defines a run: its settings, preset and target rule (its ``config.json``, and the same keys in
    ``summary.json``)."""
    parts = {"target_mode": method.target_mode, "period": method.period, "lam": method.lam}
    return {"config": asdict(cfg), "method": method.name, "parts": parts}


def validate_config(cfg: QTrainConfig) -> None:
    """Raise ConfigError with one line naming the field, the value and what is allowed."""
    for name in ("size", "steps", "samples_per_step", "max_episode_steps"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} = {v!r} is not allowed; allowed: an integer >= 1")
    if not 2 <= cfg.size <= MAX_SIZE:
        raise ConfigError(f"size = {cfg.size} is not allowed; allowed: an integer in [2, {MAX_SIZE}] (the exact model "
                          "and Q* are dense in the size^2 states: size 60 ran for minutes before its first step)")
    check_seed(cfg.seed)
    if cfg.checkpoint_every < 0:
        raise ConfigError(f"checkpoint_every = {cfg.checkpoint_every} is not allowed; allowed: an integer >= 0")
    for name, lo, hi in (("slip", 0.0, 1.0), ("epsilon", 0.0, 1.0), ("gamma", 0.0, 1.0)):
        v = getattr(cfg, name)
        if not (math.isfinite(v) and lo <= v <= hi) or (name == "gamma" and v >= 1):
            allowed = "0 <= gamma < 1" if name == "gamma" else f"{lo} <= {name} <= {hi}"
            raise ConfigError(f"{name} = {v!r} is not allowed; allowed: {allowed}")
    if not (math.isfinite(cfg.alpha) and cfg.alpha > 0):
        raise ConfigError(f"alpha = {cfg.alpha!r} is not allowed; allowed: > 0")
    if cfg.task not in TASKS:
        raise ConfigError(f"task = {cfg.task!r} is not allowed; allowed: {', '.join(TASKS)}")


def _save(run_dir: Path, state: dict[str, Any]) -> None:
    tmp = run_dir / (CHECKPOINT + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(state, f)
    tmp.replace(run_dir / CHECKPOINT)


def load_checkpoint(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise ConfigError(f"run_dir = '{run_dir}' has no {CHECKPOINT} to resume from; start it without --resume")
    try:
        with open(path, "rb") as f:
            state = pickle.load(f)
        state["step"]
    except Exception as e:  # cut short by a kill, or not this family's checkpoint
        from polyrl.runs import unreadable

        raise unreadable(run_dir, CHECKPOINT, e) from None
    return state


def train_q(cfg: QTrainConfig, method: QMethod, *, run_dir: str | Path, resume: bool = False, console=None,
            table_every: int = 10) -> dict[str, Any]:
    """Train ``method`` on ``cfg.task``; write metrics, curves.png, checkpoint.pkl, summary.json; return the summary."""
    validate_config(cfg)
    started = time.perf_counter()
    run_dir = Path(run_dir)
    env, feats = make_task(cfg.task, cfg.size, cfg.slip, cfg.features)
    learner = LinearQLearner(feats, env.n_actions, cfg.gamma, cfg.alpha, method.target_mode, method.period,
                             method.lam, seed=cfg.seed)
    env_rng = np.random.default_rng([cfg.seed, 1])
    s, ep_t, episodes, start, diverged, history = env.start, 0, 0, 0, False, None
    if resume:
        from polyrl.runs import cut_logs, read_rows

        ck = load_checkpoint(run_dir)
        learner.load_state_dict(ck["learner"])
        env_rng.bit_generator.state = ck["env_rng"]
        s, ep_t, episodes, start, diverged = ck["s"], ck["ep_t"], ck["episodes"], ck["step"], ck["diverged"]
        cut_logs(run_dir, start)
        history = read_rows(run_dir)
    q_star = env.optimal_q(cfg.gamma)
    live = np.ones(env.n_states, dtype=bool)
    live[env.goal] = False
    table = feats._table  # [S, nA, d]

    def checkpoint(step: int) -> None:
        _save(run_dir, {"step": step, "learner": learner.state_dict(), "env_rng": env_rng.bit_generator.state,
                        "s": s, "ep_t": ep_t, "episodes": episodes, "diverged": diverged})

    logger = RunLogger(run_dir, tensorboard=cfg.tensorboard, console=console, table_every=table_every,
                       history=history, purge_step=start + 1 if resume else None)
    step = start
    try:
        for step in range(start + 1, cfg.steps + 1):
            if diverged:
                step -= 1
                break
            t0 = time.perf_counter()
            td = 0.0
            for _ in range(cfg.samples_per_step):
                a = learner.act(s, cfg.epsilon)
                s2, r, done = env.step(s, a, env_rng)
                td += abs(learner.td_step(s, a, r, s2, done))
                ep_t += 1
                if done or ep_t >= cfg.max_episode_steps:
                    s, ep_t, episodes = env.start, 0, episodes + 1
                else:
                    s = s2
            norm = float(np.linalg.norm(learner.theta))
            metrics = {"q/td_abs": td / cfg.samples_per_step, "q/theta_norm": norm,
                       "q/target_refreshes": learner.refreshes, "q/episodes": episodes,
                       "rollout/generated": cfg.samples_per_step}
            if not (math.isfinite(norm) and np.max(np.abs(learner.theta)) <= DIVERGED):
                diverged = True
            else:
                q = table @ learner.theta
                metrics["reward/mean"] = env.greedy_return(q, cfg.gamma)
                metrics["eval/q_error"] = float(np.mean(np.abs(q - q_star)[live]))
            metrics["perf/step_seconds"] = time.perf_counter() - t0
            logger.log(step, metrics)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                checkpoint(step)
        checkpoint(step)
    finally:
        logger.close()
    plot_curves(logger.history, run_dir / "curves.png", keys=("reward/mean", "eval/q_error"))
    q = table @ learner.theta
    finite = bool(np.all(np.isfinite(q)))
    summary = {
        "method": method.name, "task": cfg.task, "features": cfg.features, "diverged": diverged,
        "reward_final": env.greedy_return(q, cfg.gamma) if finite else None,
        "optimal_return": env.greedy_return(q_star, cfg.gamma),
        "q_error_final": float(np.mean(np.abs(q - q_star)[live])) if finite else None,
        "steps_done": step, "samples": step * cfg.samples_per_step, "target_refreshes": learner.refreshes,
        "episodes": episodes, "wall_seconds": time.perf_counter() - started, "resumed": resume,
        **run_record(cfg, method),
    }
    write_summary(run_dir, summary)
    return {**summary, "history": logger.history, "learner": learner}
