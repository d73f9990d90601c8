"""THE training loop, read top to bottom. No branch on a method's or a part's name.

One RL step:
  1. collect   -- sample groups, score, shape, filter, refill (rollout.collect)
  2. score     -- old / reference log-probs and critic values at the rollout weights (no grad)
  3. advantage -- the method's estimator (KL in the reward first, if the method puts it there)
  4. update    -- epochs x minibatches x micro-batches of policy_loss(method); one optimizer step
                  per minibatch, each with its own global Normalizer
  5. log, evaluate, checkpoint
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from polyrl.checkpoint import latest_checkpoint, load_checkpoint, remove_partial_saves, save_checkpoint
from polyrl.config import TrainConfig, to_dict
from polyrl.errors import RewardError
from polyrl.guard import make_monitor, roll_back
from polyrl.learner import LocalLearner, TokenBatch, ValueHead, boundary_token_ids, sample_ref_logp, segment_ids
from polyrl.logging import RunLogger, StepProgress, peak_rss_mb, plot_curves, write_summary
from polyrl.objectives import Method, kl_reward_penalty
from polyrl.objectives.objective import masked_mean
from polyrl.objectives.token_advantages import gae_advantages_and_returns
from polyrl.registry import ADVANTAGES
from polyrl.rollout.agency import AgencyArbiter, parse_schedule
from polyrl.rollout.collect import NoUsableGroups, RolloutBatch, collect
from polyrl.rollout.episodes import EpisodeRunner
from polyrl.rollout.generator import SamplingParams
from polyrl.rollout.hf import HFGenerator
from polyrl.rollout.pipeline import AsyncPipeline, prefetched
from polyrl.rollout.tree import TreeSampler, tree_advantages
from polyrl.runs import cut_logs, read_rows
from polyrl.tasks.base import Prompt, Task
from polyrl.tasks.rewards import RewardChannels, parse_reward_specs
from polyrl.update import Scored, update_policy


@dataclass
class TrainState:
    """Everything besides weights and optimizer that an exact resume needs."""

    step: int = 0
    data_pos: int = 0  # prompts drawn from the training stream so far
    history: dict[int, float] | None = None  # pool index -> best pass rate (no-positive-resampling)
    bad_steps: int = 0  # consecutive steps with a non-finite loss
    skipped_total: int = 0  # optimizer steps skipped for a non-finite loss
    empty_steps: int = 0  # RL steps without update because every group was filtered out
    rollbacks: int = 0  # collapse-guard rollbacks so far
    eval_before: float | None = None
    solved_before: list[bool] | None = None  # held-out prompts the starting model solved (eval/retained, eval/gained)
    last_samples: list | None = None  # a few (prompt, completion, reward) of the latest batch, for samples.jsonl
    pass_counts: dict[int, list[float]] | None = None  # tree sampler: pool index -> [successes, trials, step]


@dataclass
class Components:
    """The live objects of one run, built once by ``train`` and used by every ``rl_step``."""

    learner: LocalLearner
    generator: HFGenerator
    runner: EpisodeRunner  # samples single-turn completions or multi-turn tool episodes with the generator
    task: Task  # evaluation uses its own verifier (task.reward)
    rewards: RewardChannels  # training rewards: the task's checker and reward functions, one call per batch
    draw: Callable[[int, int], list[tuple[int, Prompt]]]  # training prompt stream
    boundaries: frozenset[int]  # token ids that end a sub-sentence (segment ids for SSPO)
    reference: torch.nn.Module | None = None  # frozen (or synced) reference policy
    critic: ValueHead | None = None
    critic_opt: torch.optim.Optimizer | None = None
    topk: int = 0  # top-K support size when the trust region reads it
    tree: TreeSampler | None = None  # --sampler tree
    pipeline: AsyncPipeline | None = None  # --async-staleness k


def evaluate(runner: EpisodeRunner, task: Task, prompts: list[Prompt], max_new_tokens: int) -> list[float]:
    """Held-out greedy rewards: the task reward of one greedy completion (or tool episode) per prompt."""
    samples = runner.sample(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens))
    return [task.reward(prompts[s.prompt_index], s.text)[0] for s in sorted(samples, key=lambda s: s.prompt_index)]


def evaluate_all(parts: Components, prompts: list[Prompt], max_new_tokens: int, step: int,
                 solved_before: list[bool] | None = None) -> tuple[dict[str, float], list[bool]]:
    """eval/accuracy of the acting system at ``step`` (and with agency transfer the standalone learner's), and
    which prompts it solved. Given those the starting model solved, also eval/retained (the share of them still
    solved: forgetting shows here) and eval/gained (the share of the others now solved)."""
    arbiter = parts.generator.arbiter
    if arbiter is not None:
        arbiter.set_step(step)
    rewards = evaluate(parts.runner, parts.task, prompts, max_new_tokens)
    out, solved = {"eval/accuracy": float(np.mean(rewards))}, [r > 0.5 for r in rewards]
    if solved_before is not None and len(solved_before) == len(rewards):
        for key, start in (("eval/retained", True), ("eval/gained", False)):
            if start in solved_before:
                out[key] = float(np.mean([now for now, was in zip(solved, solved_before) if was == start]))
    if arbiter is not None:
        beta, arbiter.beta = arbiter.beta, 0.0
        out["eval/learner_accuracy"] = float(np.mean(evaluate(parts.runner, parts.task, prompts, max_new_tokens)))
        out["eval/agency_beta"], arbiter.beta = beta, beta
    return out, solved


def prompt_stream(task: Task, seed: int, pool_size: int = 100_000) -> Callable[[int, int], list[tuple[int, Prompt]]]:
    """Deterministic training stream: ``draw(pos, k)`` returns the k prompts after position ``pos``.

    The task's seeded shuffle cycles through a pool of ``pool_size`` train prompts, so position alone
    fixes the data (which is what makes resume exact).
    """
    pool = task.prompts("train", pool_size, seed)
    index = {p.id: i for i, p in enumerate(pool)}

    def draw(pos: int, k: int) -> list[tuple[int, Prompt]]:
        picked = [pool[(pos + j) % len(pool)] for j in range(k)]
        return [(index[p.id], p) for p in picked]

    return draw


def _state_dict(state: TrainState, critic_opt) -> dict[str, Any]:
    out = dict(vars(state))
    if critic_opt is not None:
        out["critic_optimizer"] = critic_opt.state_dict()
    return out


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _advantages(method: Method, batch: RolloutBatch, mask: torch.Tensor, values, token_rewards) -> torch.Tensor:
    spec = method.advantage
    fn = ADVANTAGES.fn(spec.name)
    if batch.tree is not None:  # tree rollouts: root groups before the branch point, sibling groups after
        # Tree groups compare sequence rewards, so a KL penalty in the reward is summed over the tokens each sample
        # trains on first (a continuation's copy of its prefix has loss mask 0: the root rollout carries it).
        rewards = batch.rewards.double()
        if token_rewards is not None:
            rewards = rewards + (token_rewards * mask.double()).sum(-1)
        return tree_advantages(lambda r, g, m: fn(r, g, m, None, None, **spec.params), rewards,
                               batch.tree, mask.double()).float()
    # Estimators tagged "channels" (GDPO) normalise each reward channel separately when the task has several.
    per_channel = "channels" in ADVANTAGES.spec(spec.name).tags and batch.channels is not None
    rewards = batch.channels if per_channel else batch.rewards
    adv = fn(rewards.double(), batch.group_ids, mask.double(), values, token_rewards, **spec.params)
    adv = adv.float()
    return adv[:, None].expand_as(mask).contiguous() if adv.dim() == 1 else adv


def train(cfg: TrainConfig, method: Method, *, model_dir: str, task: Task, run_dir: str,
          console: Console | None = None) -> dict[str, Any]:
    """Run RL training as configured; return the summary also written to ``run_dir/summary.json``."""
    console = console or Console()
    _seed_everything(cfg.seed)
    rewards = RewardChannels(task, *parse_reward_specs(cfg.reward_funcs, cfg.reward_weights))
    from polyrl.model import load_policy

    policy, tokenizer = load_policy(model_dir, dtype=cfg.dtype, threads=_trainer_threads(cfg))
    learner = LocalLearner(policy, lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                           max_grad_norm=cfg.max_grad_norm, temperature=cfg.temperature, top_p=cfg.top_p,
                           top_k=cfg.top_k, fp32_head=cfg.fp32_lm_head, micro_batch_size=cfg.micro_batch_size)
    # The reference is a frozen copy of the starting model (synced to the policy by Humanline presets).
    reference = copy.deepcopy(policy).eval().requires_grad_(False) if method.needs_ref else None
    critic = ValueHead(copy.deepcopy(policy)) if method.needs_values else None
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr) if critic is not None else None
    # The sampler shares the policy module, so its weights are always current (no push needed in-process).
    generator = HFGenerator(policy, tokenizer, fp32_head=cfg.fp32_lm_head)
    if cfg.agency is not None:  # agency transfer: a frozen baseline acts first, the learner takes over
        baseline, _ = load_policy(cfg.agency, dtype=cfg.dtype)
        generator.arbiter = AgencyArbiter(baseline, parse_schedule(cfg.agency_schedule), mode=cfg.agency_mode)
    runner = EpisodeRunner(generator, tokenizer, task)
    draw = prompt_stream(task, cfg.seed, cfg.train_prompts or 100_000)
    eval_prompts = task.prompts("test", cfg.eval_prompts, seed=0)

    run = Path(run_dir)
    state = TrainState(history={}, pass_counts={})
    extra = {"critic": critic} if critic is not None else {}
    if reference is not None and method.ref_sync_every:
        extra["reference"] = reference  # a synced reference is state; a frozen one is the starting model
    remove_partial_saves(run)  # .tmp_step_* of a save that was killed
    resume_from = Path(cfg.resume_from) if cfg.resume_from else latest_checkpoint(run) if cfg.resume else None
    if resume_from is not None:
        saved = load_checkpoint(resume_from, model=policy, optimizer=learner.optimizer, scheduler=learner.scheduler,
                                extra_models=extra)
        critic_opt_state = saved.pop("critic_optimizer", None)
        state = TrainState(**saved)
        if critic_opt is not None and critic_opt_state is not None:
            critic_opt.load_state_dict(critic_opt_state)
        dropped = cut_logs(run, state.step)  # rows of steps after the checkpoint are redone now
        console.print(f"resumed from {resume_from} at step {state.step}"
                      + (f" ({dropped} logged rows after it dropped)" if dropped else ""))

    parts = Components(learner=learner, generator=generator, runner=runner, task=task, rewards=rewards, draw=draw,
                       boundaries=boundary_token_ids(tokenizer), reference=reference, critic=critic,
                       critic_opt=critic_opt, topk=TOPK if method.needs_topk else 0)
    if cfg.sampler == "tree":
        from polyrl.learner import answer_likelihood, prompt_embedder
        kind = cfg.tree_predictor
        embed = prompt_embedder(policy, tokenizer) if kind == "shared" else None
        exact = answer_likelihood(learner, generator, cfg.max_new_tokens) if kind == "likelihood" else None
        parts.tree = TreeSampler(runner, state.pass_counts, root_frac=cfg.tree_root_frac, roots=cfg.tree_roots,
                                 candidate_factor=cfg.tree_candidates, prune=cfg.tree_prune, branch=cfg.tree_branch,
                                 half_life=cfg.tree_half_life, max_group=cfg.tree_max_group, objective=cfg.tree_probe,
                                 embed=embed, likelihood=exact)
    if cfg.async_staleness:
        parts.pipeline = AsyncPipeline(model_dir, task_name=cfg.task, data_file=cfg.data_file,
                                       heldout_percent=cfg.heldout_percent,
                                       staleness=cfg.async_staleness, dtype=cfg.dtype, fp32_head=cfg.fp32_lm_head,
                                       threads=_generator_threads(cfg), weights=policy.state_dict(), version=state.step,
                                       reference=reference is not None and not method.ref_sync_every,
                                       micro_batch_size=cfg.micro_batch_size, **learner.sampling)
    logger = RunLogger(run, tensorboard=cfg.tensorboard, wandb=cfg.wandb, console=console,
                       table_every=cfg.log_every, config=to_dict(cfg),
                       history=read_rows(run) if resume_from is not None else None,
                       purge_step=state.step + 1 if resume_from is not None else None)
    if state.eval_before is None:
        first, state.solved_before = evaluate_all(parts, eval_prompts, cfg.max_new_tokens, state.step)
        state.eval_before = first["eval/accuracy"]
        logger.log(state.step, first)
    console.print(f"[bold]{method.name}[/] on {task.name}: held-out accuracy before = {state.eval_before:.3f}")

    monitor = make_monitor(logger.history, state.step) if cfg.guard else None
    started = time.perf_counter()
    steps_done = rollouts = 0
    step_seconds = 0.0  # time inside RL steps only (no evaluation or checkpointing)
    with StepProgress(console, "RL step", cfg.steps, completed=state.step) as bar:
        while state.step < cfg.steps:
            t0 = time.perf_counter()
            try:
                metrics = rl_step(cfg, method, state, parts)
            except RewardError as e:  # one line on the console; the reward function's traceback in the run dir
                e.step, e.log_path = state.step, str(run / "errors.log")
                if e.traceback:
                    with open(e.log_path, "a") as log:
                        log.write(f"{e}\n{e.traceback}\n")
                raise
            state.step += 1
            steps_done += 1
            rollouts += int(metrics["rollout/generated"])
            metrics["perf/step_seconds"] = time.perf_counter() - t0
            step_seconds += metrics["perf/step_seconds"]
            metrics["perf/lr"] = learner.lr
            if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < cfg.steps:
                metrics.update(evaluate_all(parts, eval_prompts, cfg.max_new_tokens, state.step,
                                            state.solved_before)[0])
            logger.log(state.step, metrics)
            reason = monitor.update(state.step, metrics) if monitor is not None else None
            if reason is not None:  # --guard: back to the last good checkpoint with a lower learning rate
                state = roll_back(run, state, learner, extra, critic_opt, cfg, reason, console)
                monitor = make_monitor(logger.history, state.step)
                logger.log(state.step, {"guard/rollbacks": state.rollbacks, "guard/lr": learner.lr})
                bar.update(state.step)
                continue
            if cfg.log_every and state.step % cfg.log_every == 0 and state.last_samples:
                logger.samples(state.step, state.last_samples)
            bar.update(state.step, info=f"reward {metrics.get('reward/mean', float('nan')):.3f}")
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and state.step < cfg.steps:
                save_checkpoint(run, state.step, **learner.state(), state=_state_dict(state, critic_opt),
                                extra_models=extra)

    if parts.pipeline is not None:
        parts.pipeline.close()
    last = evaluate_all(parts, eval_prompts, cfg.max_new_tokens, state.step, state.solved_before)[0]
    eval_after = last["eval/accuracy"]
    logger.log(state.step, last)
    save_checkpoint(run, state.step, **learner.state(), state=_state_dict(state, critic_opt), extra_models=extra)
    wall = time.perf_counter() - started
    logger.close()
    summary = {
        "method": method.name, "task": task.name, "model": model_dir, "steps": state.step,
        "eval_before": state.eval_before, "eval_after": eval_after, "wall_seconds": wall,
        "seconds_per_step": step_seconds / max(1, steps_done),
        "rollouts_per_second": rollouts / max(step_seconds, 1e-9),
        "skipped_steps": state.skipped_total, "peak_rss_mb": peak_rss_mb(),
    }
    if "eval/learner_accuracy" in last:  # agency transfer: the standalone learner, and the acting system's beta
        summary.update(learner_eval_after=last["eval/learner_accuracy"], agency_beta_after=last["eval/agency_beta"])
    write_summary(run, summary)
    plot_curves(logger.history, run / "curves.png")
    return summary


TOPK = 8  # support size for trust regions that read top-K log-probs (tag "needs_topk")


def _generator_threads(cfg: TrainConfig) -> int:
    """Threads of the asynchronous generation process: half the cores (the trainer keeps the rest)."""
    return max(1, (cfg.threads or os.cpu_count() or 1) // 2)


def _trainer_threads(cfg: TrainConfig) -> int | None:
    if cfg.async_staleness:
        return max(1, (cfg.threads or os.cpu_count() or 1) - _generator_threads(cfg))
    return cfg.threads or None


def rl_step(cfg: TrainConfig, method: Method, state: TrainState, parts: Components) -> dict[str, float]:
    """One RL step: collect, score, advantages, update. Returns the step's metrics."""
    learner, reference, critic, topk = parts.learner, parts.reference, parts.critic, parts.topk
    # 1. collect ----------------------------------------------------------------------------------
    def draw_next(k: int) -> list[tuple[int, Prompt]]:
        out = parts.draw(state.data_pos, k)
        state.data_pos += k
        return out

    t_start = time.perf_counter()
    params = _sampling(cfg, state.step)
    arbiter = parts.generator.arbiter
    if arbiter is not None:
        arbiter.set_step(state.step)
    sample = parts.runner.sample if parts.pipeline is None else prefetched(parts.pipeline, parts.runner, state.step)
    try:
        if parts.tree is not None:
            batch = parts.tree.collect(parts.rewards, method, draw_next, num_groups=cfg.prompts_per_step, params=params,
                                       history=state.history, step=state.step)
        else:
            batch = collect(sample, parts.rewards, method, draw_next, num_groups=cfg.prompts_per_step, params=params,
                            history=state.history, max_rounds=cfg.max_gen_rounds)
    except NoUsableGroups as e:  # dynamic sampling found no group with signal: no update this step
        state.empty_steps += 1
        return {**e.stats, "rollout/empty_steps": float(state.empty_steps)}
    if parts.pipeline is not None:  # generate the next k batches while this one trains
        for ahead in range(1, cfg.async_staleness + 1):
            if state.step + ahead < cfg.steps and state.step + ahead not in parts.pipeline.pending():
                nxt = parts.draw(state.data_pos + (ahead - 1) * cfg.prompts_per_step, cfg.prompts_per_step)
                parts.pipeline.submit(state.step + ahead, [p for _, p in nxt], _sampling(cfg, state.step + ahead))
    t_gen = time.perf_counter()
    tb = TokenBatch.from_samples(batch.samples, parts.generator.pad_id)
    mask = tb.loss_mask * batch.keep[:, None].float()  # [B, T] tokens the policy chose that count for the loss
    T = tb.completion_mask.shape[1]
    seg_ids = segment_ids(tb.input_ids[:, -T:], tb.completion_mask, parts.boundaries)

    # 2. score at the rollout weights -----------------------------------------------------------------
    if method.ref_sync_every and state.step % method.ref_sync_every == 0:
        reference.load_state_dict(learner.model.state_dict())  # Humanline: reference = recent policy
    # With a single optimizer step per batch the policy has not moved when the loss is computed, so pi_old is
    # the current policy: its detached log-probs from the update's own forward are reused (as TRL does)
    # instead of a separate forward -- unless something needs them before the update (KL in the reward).
    reuse_old = cfg.epochs_per_batch == 1 and cfg.minibatches == 1 and method.kl_placement != "reward"
    old = None if reuse_old else learner.logprobs_nograd(tb, topk=topk)
    old_logp = torch.zeros_like(tb.rollout_logp) if reuse_old else old.logp
    ref_logp = None
    if reference is not None:  # the pipeline's process scores a frozen reference while this one trains
        ref_logp = None if method.ref_sync_every else sample_ref_logp(batch.samples, T)
        ref_logp = learner.logprobs_nograd(tb, model=reference).logp if ref_logp is None else ref_logp
    values = None
    if critic is not None:
        with torch.no_grad():
            values = critic(tb) * tb.loss_mask

    # 3. advantages ----------------------------------------------------------------------------------
    token_rewards, kl_metrics = None, {}
    if method.kl_placement == "reward" and ref_logp is not None:
        token_rewards = -kl_reward_penalty(method, old_logp, ref_logp, tb.loss_mask).double()
        kl_metrics["reward/kl_penalty"] = float(masked_mean(-token_rewards, tb.loss_mask))  # verl's reward_kl_penalty
    adv = _advantages(method, batch, tb.loss_mask, values.double() if values is not None else None, token_rewards)
    returns = None
    if critic is not None:
        gae = method.advantage.params
        _, returns = gae_advantages_and_returns(batch.rewards.double(), values.double(), tb.loss_mask.double(),
                                                token_rewards, gamma=gae.get("gamma", 1.0), lam=gae.get("lam", 1.0))
        returns = returns.float()

    # 4. update: epochs x minibatches x micro-batches (polyrl.update) --------------------------------
    t_score = time.perf_counter()
    scored = Scored(tb=tb, mask=mask, adv=adv, group_ids=batch.group_ids, segment_ids=seg_ids, old_logp=old_logp,
                    old_topk=None if old is None else old.topk_logp, ref_logp=ref_logp, values=values, returns=returns,
                    sample_weight=None if batch.tree is None else batch.tree.weight)
    metrics = update_policy(learner, method, scored, state, epochs=cfg.epochs_per_batch, minibatches=cfg.minibatches,
                            micro_batch_size=cfg.micro_batch_size, horizon=cfg.max_new_tokens, topk=topk,
                            reuse_old=reuse_old, seed=cfg.seed * 7919 + state.step, max_bad_steps=cfg.max_bad_steps,
                            critic=critic, critic_opt=parts.critic_opt, value_clip=cfg.value_clip)
    if parts.pipeline is not None:  # weights after this step are version step + 1
        parts.pipeline.push(learner.model.state_dict(), state.step + 1)

    # 5. metrics -------------------------------------------------------------------------------------
    t_end = time.perf_counter()
    gen_tokens = float(batch.lengths.sum())
    train_tokens = float(tb.attention_mask.sum()) * cfg.epochs_per_batch
    metrics.update({"perf/gen_seconds": t_gen - t_start, "perf/score_seconds": t_score - t_gen,
                    "perf/update_seconds": t_end - t_score,
                    "perf/gen_tokens_per_second": gen_tokens / (t_gen - t_start),
                    "perf/train_tokens_per_second": train_tokens / max(t_end - t_gen, 1e-9)})
    state.last_samples = [{"prompt": p.text, "completion": s.text, "reward": float(r)}
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
        "rollout/rollout_vs_old_kl": float(masked_mean((tb.rollout_logp - scored.old_logp).abs(), tb.loss_mask)),
        "perf/skipped_steps": float(state.skipped_total),
        "rollout/gen_tokens": gen_tokens,
    })
    if arbiter is not None:
        metrics["agency/beta"] = arbiter.beta
        metrics["agency/baseline_share"] = sum(s.baseline_tokens for s in batch.samples) / max(1.0, float(mask.sum()))
    if parts.pipeline is not None:
        staleness = [state.step - s.policy_version for s in batch.samples]
        metrics["async/staleness_max"], metrics["async/staleness_mean"] = max(staleness), float(np.mean(staleness))
    return metrics


def _sampling(cfg: TrainConfig, step: int) -> SamplingParams:
    return SamplingParams(n=cfg.group_size, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          top_p=cfg.top_p, top_k=cfg.top_k or None, seed=cfg.seed * 1_000_003 + step)
