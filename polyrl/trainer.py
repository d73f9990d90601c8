"""THE training loop, read top to bottom. It talks to a learner, a rollout source and an evaluator, nothing else.

One RL step:
  1. collect   -- the source's scored batch (uniform groups with refill and prefetch, a tree, agency transfer:
                  the loop never asks which)
  2. score     -- old / reference log-probs and critic values at the rollout weights (no grad)
  3. advantage -- the method's estimator on the batch's layout (KL in the reward first, if the method puts it there)
  4. update    -- epochs x minibatches x micro-batches of policy_loss(method); one optimizer step
                  per minibatch, each with its own global Normalizer; then the source hears of the new weights
  5. log, evaluate, checkpoint
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from rich.console import Console

from polyrl.batch import TokenBatch, segment_ids
from polyrl.checkpoint import latest_checkpoint, remove_partial_saves, set_aside_newer
from polyrl.config import TrainConfig, to_dict
from polyrl.errors import RewardError
from polyrl.guard import live_rows, make_monitor, roll_back
from polyrl.logging import RunLogger, StepProgress, peak_rss_mb, plot_curves, write_summary
from polyrl.objectives import Method
from polyrl.objectives.controller import Controller
from polyrl.objectives.group_layout import advantages
from polyrl.objectives.kl import kl_in_reward
from polyrl.objectives.objective import masked_mean
from polyrl.rollout.collect import NoUsableGroups
from polyrl.rollout.source import PromptStream
from polyrl.runs import cut_logs, read_rows
from polyrl.tasks.base import Task
from polyrl.update import Scored, update_policy

if TYPE_CHECKING:
    from polyrl.build import Components


@dataclass
class TrainState:
    """Everything besides weights and optimizer that an exact resume needs."""

    step: int = 0
    data_pos: int = 0  # prompts drawn from the training stream so far
    bad_steps: int = 0  # consecutive steps with a non-finite loss
    skipped_total: int = 0  # optimizer steps skipped for a non-finite loss
    empty_steps: int = 0  # RL steps without update because every group was filtered out
    rollbacks: int = 0  # collapse-guard rollbacks so far
    eval_before: float | None = None
    solved_before: list[bool] | None = None  # held-out prompts the starting model solved (eval/retained, eval/gained)
    last_samples: list | None = None  # a few (prompt, completion, reward) of the latest batch, for samples.jsonl
    source: dict | None = None  # the rollout source's state (pass-rate histories), saved with each checkpoint
    coefs: dict | None = None  # the method's adapted coefficients (adaptive KL beta, entropy alpha): Controller state
    timing: dict | None = None  # wall and RL-step seconds, steps and rollouts up to this save: a resume adds to them


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _save(parts: Components, run: Path, state: TrainState) -> None:
    parts.learner.save(run, state.step, {**vars(state), "source": parts.source.state_dict()})


def _restore(parts: Components, path: Path) -> TrainState:
    """Load a checkpoint into the learner and the source; return the loop's state."""
    saved = parts.learner.load(path)
    legacy = {k: saved.pop(k) for k in ("history", "pass_counts") if k in saved}  # checkpoints before sources
    state = TrainState(**saved)
    parts.source.load_state_dict(state.source if state.source is not None else legacy)
    parts.source.after_update(parts.learner.weights, state.step)  # generators elsewhere sample with these now
    return state


def train(cfg: TrainConfig, method: Method, *, model_dir: str, task: Task, run_dir: str,
          console: Console | None = None, on_start: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run RL training as configured; return the summary also written to ``run_dir/summary.json``. ``on_start`` is
    called once the parts are built, when no setting can refuse the run any more (the CLI drops the run that
    ``--overwrite`` replaces)."""
    from polyrl.build import build_components

    _seed_everything(cfg.seed)
    parts = build_components(cfg, method, task, model_dir)
    try:
        if on_start is not None:
            on_start()
        return _train(cfg, method, parts, task=parts.task, model_dir=model_dir, run_dir=run_dir, console=console)
    finally:
        parts.source.close()  # rollout workers and Ray stop whatever happened, before the loop too


def _train(cfg: TrainConfig, method: Method, parts: Components, *, task: Task, model_dir: str, run_dir: str,
           console: Console | None) -> dict[str, Any]:
    console = (console or Console()) if parts.writes else Console(quiet=True)  # one process of several speaks
    stream = PromptStream.of(task, cfg.seed, cfg.train_prompts or 100_000)
    run = Path(run_dir)
    state = TrainState()
    resume_from = Path(cfg.resume_from) if cfg.resume_from else latest_checkpoint(run) if cfg.resume else None
    if parts.writes:
        remove_partial_saves(run)  # .tmp_step_* of a save that was killed
    if resume_from is not None:
        state = _restore(parts, resume_from)
        on_schedule = bool(cfg.eval.every) and state.step % cfg.eval.every == 0 and state.step < cfg.steps
        # First the newer branch is set aside (never loaded again), then the rows after this step go (redone): killed
        # between the two, the next --resume starts here and cuts them; the other way round it resumed the newer
        # branch past a gap in metrics.jsonl.
        aside = set_aside_newer(run, state.step) if parts.writes else []
        dropped = cut_logs(run, state.step, keep_eval=on_schedule) if parts.writes else 0
        console.print(f"resumed from {resume_from} at step {state.step}"
                      + (f" ({dropped} logged rows after it dropped)" if dropped else "")
                      + (f"; newer checkpoints kept as {', '.join(p.name for p in aside)}" if aside else ""))
        if state.solved_before is not None and len(state.solved_before) != parts.held_out:  # another version's
            console.print(f"[yellow]note[/]: {parts.held_out} held-out prompts now, {len(state.solved_before)} when "
                          "the run started: eval/retained and eval/gained are not logged")
    logger = RunLogger(run, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb, console=console,
                       table_every=cfg.log.every, config=to_dict(cfg),
                       history=read_rows(run) if resume_from is not None else None,
                       purge_step=state.step + 1 if resume_from is not None else None, enabled=parts.writes)
    if state.eval_before is None:
        first, state.solved_before = parts.evaluate(state.step)
        state.eval_before = first["eval/accuracy"]
        logger.log(state.step, first)
    console.print(f"[bold]{method.name}[/] on {task.name}: held-out accuracy before = {state.eval_before:.3f}")

    monitor = make_monitor(logger.history, state.step) if cfg.guard.enabled else None
    if monitor is not None and state.step == 0:  # the starting weights, judged healthy by step 0's evaluation: a
        _save(parts, run, state)  # collapse before the first periodic checkpoint has them to roll back to
    last: dict[str, float] | None = None  # the final evaluation, once made
    started = time.perf_counter()
    steps_done = rollouts = 0
    step_seconds = 0.0  # time inside RL steps only (no evaluation or checkpointing)
    before = {"wall": 0.0, "step_seconds": 0.0, "steps": 0, "rollouts": 0, **(state.timing or {})}  # earlier segments

    def timing() -> dict[str, float]:  # the whole run's, so that a resumed run's summary is not its last segment's
        return {"wall": before["wall"] + time.perf_counter() - started, "step_seconds": before["step_seconds"] +
                step_seconds, "steps": before["steps"] + steps_done, "rollouts": before["rollouts"] + rollouts}
    try:
        with StepProgress(console, "RL step", cfg.steps, completed=state.step) as bar:
            while state.step < cfg.steps:
                t0, lr = time.perf_counter(), parts.learner.lr  # the lr of the step's first update (not the next's)
                try:
                    metrics = rl_step(cfg, method, state, parts, stream)
                except RewardError as e:  # one line on the console; the reward function's traceback in the run dir
                    e.step, e.log_path = state.step, str(run / "errors.log")
                    if e.traceback and parts.writes:
                        with open(e.log_path, "a") as log:
                            log.write(f"{e}\n{e.traceback}\n")
                    raise
                state.step += 1
                steps_done += 1
                rollouts += int(metrics["rollout/generated"])
                metrics["perf/step_seconds"] = time.perf_counter() - t0
                step_seconds += metrics["perf/step_seconds"]
                metrics["perf/lr"] = lr
                if cfg.eval.every and state.step % cfg.eval.every == 0 and state.step < cfg.steps:
                    metrics.update(parts.evaluate(state.step, state.solved_before)[0])
                logger.log(state.step, metrics)
                if monitor is not None and state.step == cfg.steps:  # the guard judges the final evaluation too
                    last = parts.evaluate(state.step, state.solved_before)[0]
                    logger.log(state.step, last)
                    metrics = {**metrics, **last}
                reason = monitor.update(state.step, metrics) if monitor is not None else None
                if reason is not None:  # --guard: back to the last good checkpoint with a lower learning rate
                    last = None
                    state = roll_back(run, state, lambda path: _restore(parts, path), parts.learner,
                                      history=logger.history, base_lr=cfg.lr,
                                      factor=cfg.guard.lr_factor, max_rollbacks=cfg.guard.max_rollbacks,
                                      reason=reason, console=console)
                    if parts.writes:  # the branch left: no resume, export or later rollback may pick it up
                        set_aside_newer(run, state.step)
                    _save(parts, run, state)  # at once: the rollback count and lower lr, which a resume keeps
                    logger.rewind(state.step)
                    monitor = make_monitor(logger.history, state.step)
                    logger.log(state.step, {"guard/rollbacks": state.rollbacks, "guard/lr": parts.learner.lr})

                    bar.update(state.step)
                    continue
                if cfg.log.every and state.step % cfg.log.every == 0 and state.last_samples:
                    logger.samples(state.step, state.last_samples)
                bar.update(state.step, info=f"reward {metrics.get('reward/mean', float('nan')):.3f}")
                if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and state.step < cfg.steps:
                    state.timing = timing()
                    _save(parts, run, state)
    finally:
        parts.source.close()
    if last is None:
        last = parts.evaluate(state.step, state.solved_before)[0]
        logger.log(state.step, last)
    state.timing = total = timing()
    _save(parts, run, state)
    logger.close()
    summary = {
        "method": method.name, "task": task.name, "model": model_dir, **parts.run_info, "steps": state.step,
        "eval_before": state.eval_before, **parts.evaluate.summary(last), "wall_seconds": total["wall"],
        "seconds_per_step": total["step_seconds"] / max(1, total["steps"]),
        "rollouts_per_second": total["rollouts"] / max(total["step_seconds"], 1e-9),
        "skipped_steps": state.skipped_total, "peak_rss_mb": peak_rss_mb(),
    }
    if parts.writes:
        write_summary(run, summary)
        plot_curves(live_rows(logger.history), run / "curves.png")  # without a branch a rollback left
    return summary


def rl_step(cfg: TrainConfig, method: Method, state: TrainState, parts: Components,
            stream: PromptStream) -> dict[str, float]:
    """One RL step: collect, score, advantages, update. Returns the step's metrics."""
    learner, topk = parts.learner, parts.topk
    controller = Controller(method, state.coefs)  # this step's coefficients; adapted once the step is measured
    method = controller.method
    # 1. collect ----------------------------------------------------------------------------------
    t_start = time.perf_counter()
    stream.pos = state.data_pos
    try:
        batch = parts.source.collect(method, stream, state.step)
    except NoUsableGroups as e:  # dynamic sampling found no group with signal: no update this step
        state.data_pos = stream.pos
        state.empty_steps += 1
        return {**e.stats, "rollout/empty_steps": float(state.empty_steps)}
    state.data_pos = stream.pos
    t_gen = time.perf_counter()
    tb = TokenBatch.from_samples(batch.samples, parts.pad_id)
    mask = tb.loss_mask * batch.keep[:, None].float()  # [B, T] tokens the policy chose that count for the loss
    T = tb.completion_mask.shape[1]
    seg_ids = segment_ids(tb.input_ids[:, -T:], tb.completion_mask, parts.boundaries)

    # 2. score at the rollout weights -----------------------------------------------------------------
    learner.begin_step(state.step)
    # With a single optimizer step per batch the policy has not moved when the loss is computed, so pi_old is
    # the current policy: its detached log-probs from the update's own forward are reused (as TRL does)
    # instead of a separate forward -- unless something needs them before the update (KL in the reward).
    reuse_old = cfg.epochs_per_batch == 1 and cfg.minibatches == 1 and method.kl_placement != "reward"
    old = None if reuse_old else learner.logprobs_nograd(tb, topk=topk)
    old_logp = torch.zeros_like(tb.rollout_logp) if reuse_old else old.logp
    ref_logp = learner.ref_logprobs(tb, batch.samples)
    values = learner.values(tb)

    # 3. advantages ----------------------------------------------------------------------------------
    token_rewards, kl_metrics = kl_in_reward(method, old_logp, ref_logp, tb.loss_mask)
    kl_metrics.update(parts.reference_metrics(tb.rollout_logp if reuse_old else old_logp, ref_logp, tb.loss_mask))
    adv, returns = advantages(method, batch.rewards, batch.group_ids, tb.loss_mask, values=values,
                              token_rewards=token_rewards, channels=batch.channels, tree=batch.tree,
                              greedy_rewards=batch.greedy_rewards,
                              sum_pi_sq=tb.sum_pi_sq, sampled_logp=tb.rollout_logp)

    # 4. update: epochs x minibatches x micro-batches (polyrl.update) --------------------------------
    t_score = time.perf_counter()
    scored = Scored(tb=tb, mask=mask, adv=adv, group_ids=batch.group_ids, segment_ids=seg_ids, old_logp=old_logp,
                    old_topk=None if old is None else old.topk_logp, old_topk_ids=None if old is None else old.topk_ids,
                    ref_logp=ref_logp, values=values, returns=returns, sample_weight=batch.sample_weight)
    metrics = update_policy(learner, method, scored, state, epochs=cfg.epochs_per_batch, minibatches=cfg.minibatches,
                            micro_batch_size=cfg.micro_batch_size, micro_batch_tokens=cfg.speed.micro_batch_tokens,
                            skip_zero_adv=cfg.speed.skip_zero_adv,
                            horizon=cfg.max_new_tokens, topk=topk,
                            reuse_old=reuse_old, seed=cfg.seed * 7919 + state.step, max_bad_steps=cfg.max_bad_steps)
    parts.source.after_update(learner.weights, state.step + 1)  # weights after this step are version step + 1

    # 5. metrics -------------------------------------------------------------------------------------
    t_end = time.perf_counter()
    gen_tokens = float(tb.loss_mask.sum())  # tokens the policy wrote (an environment's reply is not one)
    train_tokens = float(tb.attention_mask.sum()) * cfg.epochs_per_batch
    metrics.update({"perf/generate_s": t_gen - t_start, "perf/score_s": t_score - t_gen,
                    "perf/train_s": t_end - t_score,
                    "perf/gen_tokens_per_second":  # every token sampled in the time, filtered groups' too
                        batch.stats.get("rollout/generated_tokens", gen_tokens) / (t_gen - t_start),
                    "perf/train_tokens_per_second": train_tokens / max(t_end - t_gen, 1e-9)})
    state.last_samples = [{"prompt": p.model_text, "completion": s.text, "reward": float(r)}
                          for p, s, r in list(zip(batch.prompts, batch.samples, batch.scores))[:4]]
    metrics.update(batch.stats)
    metrics.update(kl_metrics)
    metrics.update({
        "reward/mean": float(batch.scores.mean()),
        "reward/shaped_mean": float(batch.rewards.mean()),
        "reward/std": float(batch.scores.std()) if len(batch.scores) > 1 else 0.0,
        "rollout/mean_len": float(batch.lengths.float().mean()),
        "rollout/truncated_frac": float(batch.truncated.float().mean()),
        "rollout/kept_frac": float(batch.keep.float().mean()),
        "objective/adv_abs_mean": float(masked_mean(adv.abs(), mask)),
        # mean |rollout - trainer| log-prob at the rollout weights: ~0 for hf, the engine mismatch for vllm
        "rollout/logp_mismatch": float(masked_mean((tb.rollout_logp - scored.old_logp).abs(), tb.loss_mask)),
        "perf/skipped_steps": float(state.skipped_total),
        "rollout/gen_tokens": gen_tokens,
    })
    metrics.update(controller.update(metrics, n_seqs=len(batch.samples)))
    state.coefs = controller.state_dict()
    return metrics
