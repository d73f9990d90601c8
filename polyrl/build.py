"""The builder: the one reader of `polyrl train` settings that turns them into a validated plan.

``resolve_train`` merges a TOML file beneath the flags (on ``--resume``, the run's own settings from its
``config.json``), resolves the method with its part overrides, builds the task and its reward channels,
and checks every rule that spans fields, the method and the task (``combinations.check_combinations``), so that a
setting that would have no effect is refused in one line before anything is loaded. The CLI and the lab
both call it; it imports nothing heavy until it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyrl.combinations import check_combinations
from polyrl.config import ConfigError, Once, TrainConfig, add_config_args, flat, settings
from polyrl.runs import check_out_dir, check_resume_steps
from polyrl.tasks.base import held_out_prompts


def add_method_args(p: argparse.ArgumentParser) -> None:
    """Part overrides shared by every command that takes a method (explain, train, compare)."""
    g = p.add_argument_group("part overrides (NAME or NAME:key=value,key=value)")
    g.add_argument("--advantage", help="advantage estimator, e.g. rloo or grpo:eps=1e-4")
    g.add_argument("--ratio", help="ratio granularity, e.g. sequence")
    g.add_argument("--trust-region", help="trust region, e.g. dppo_tv:delta_low=0.1,delta_high=0.1")
    g.add_argument("--aggregation", help="loss aggregation, e.g. prompt_mean")
    g.add_argument("--correction", action="append", help="rollout-mismatch correction (repeatable; 'none' clears)")
    g.add_argument("--shaper", action="append", help="reward shaper (repeatable; 'none' clears)")
    g.add_argument("--filter", action="append", help="group filter (repeatable; 'none' clears)")
    g.add_argument("--kl", help="KL estimator (k1, k2, k3, k3_plus, ...; 'none' removes the KL term)")
    g.add_argument("--kl-coef", type=float, help="KL coefficient beta (>= 0)")
    g.add_argument("--kl-placement", choices=["loss", "reward"], help="KL in the loss or in the reward")
    g.add_argument("--kl-target", type=float, help="adaptive KL: move beta toward this KL (Ziegler et al.; 0 = fixed)")
    g.add_argument("--kl-horizon", type=int, help="adaptive KL controller's horizon in sequences (default 10000)")
    g.add_argument("--entropy-coef", type=float, help="entropy bonus: loss -= coef * entropy (the adaptive start)")
    g.add_argument("--entropy-target", type=float, help="adaptive entropy coefficient toward this entropy (0 = fixed)")
    g.add_argument("--entropy-delta", type=float, help="adaptive entropy coefficient's step per RL step (0.005)")
    g.add_argument("--entropy-coef-max", type=float, help="adaptive entropy coefficient's ceiling")
    g.add_argument("--entropy-top", type=float, help="train only on this top fraction of tokens by entropy (0 = all)")
    g.add_argument("--anchor", choices=["old", "rollout"], help="ratio denominator: pi_old or the rollout policy")


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Every `polyrl train` option: a TOML file, one flag per ``TrainConfig`` field, the part overrides."""
    p.add_argument("--config", metavar="FILE.toml", action=Once,
                   help="TOML file of train settings; flags override it")
    add_config_args(p)
    add_method_args(p)


SINGLE_OVERRIDES = ("advantage", "ratio", "trust_region", "aggregation", "kl", "kl_coef", "kl_placement", "anchor",
                    "kl_target", "kl_horizon", "entropy_coef", "entropy_target", "entropy_delta", "entropy_coef_max",
                    "entropy_top")
LIST_OVERRIDES = {"correction": "corrections", "shaper": "shapers", "filter": "filters"}  # flag dest -> Method field
METHOD_OVERRIDES = (*SINGLE_OVERRIDES, *LIST_OVERRIDES)  # every dest of add_method_args


def part_changes(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Part overrides as given on the command line (``add_method_args`` dests) -> ``get_method`` keywords."""
    changes: dict[str, Any] = {}
    for key in SINGLE_OVERRIDES:
        if overrides.get(key) is not None:
            changes[key] = overrides[key]
    for key, plural in LIST_OVERRIDES.items():
        if overrides.get(key) is not None:
            changes[plural] = [v for v in overrides[key] if v != "none"]
    if changes.get("kl") == "none":  # the coefficient, placement and controller go with the term (given: refused)
        changes["kl"] = None
        changes.setdefault("kl_coef", 0.0)
        changes.setdefault("kl_placement", "loss")
        changes.setdefault("kl_target", 0.0)
        changes.setdefault("kl_horizon", 10_000)
    return changes


def method_from_overrides(name: str, overrides: Mapping[str, Any]):
    """Resolve preset ``name`` with command-line part overrides (raises PartError)."""
    from polyrl.methods import get_method

    return get_method(name, **part_changes(overrides))




@dataclass
class TrainPlan:
    """A validated `polyrl train`: settings, method, task, run directory, and what a resume changes."""

    cfg: TrainConfig
    method: Any  # Method
    task: Any  # Task
    run_dir: str
    overrides: dict[str, Any]  # part overrides as given (recorded in config.json)
    changes: dict[str, list] = field(default_factory=dict)  # resume: {setting: [saved, new]}
    resume_step: int | None = None  # resume: the checkpoint's step
    notes: list[str] = field(default_factory=list)  # what the builder added or assumed, for the console
    replace: bool = False  # --overwrite found a run in run_dir: cmd_train sets it aside until the new one starts
    replaced: Path | None = None  # where it was set aside (runs.set_aside_run)


def resolve_train(args: argparse.Namespace, *, claim: Callable[[str], None] | None = None) -> TrainPlan:
    """Config (TOML beneath flags; on resume the run's own), method with overrides, task, run directory: validated.

    ``claim(run_dir)`` is called once the run directory is known, before anything reads or changes it (the
    command's hold on it: ``runs.run_lock``)."""
    from polyrl.config import build_config, load_toml, validate
    from polyrl.runs import absolute_paths
    from polyrl.tasks import get_task
    from polyrl.tasks.rewards import RewardChannels, parse_reward_specs

    values = load_toml(args.config, flags_only=METHOD_OVERRIDES) if args.config else {}
    names = {s.name for s in settings(TrainConfig)}
    values.update({k: v for k, v in vars(args).items() if k in names and v is not None})
    values = absolute_paths(values)  # recorded so, a run resumes from any directory
    if values.get("resume_from") is not None:
        if getattr(args, "resume", None) is False:  # --no-resume beside a checkpoint to resume from (a TOML's
            # resume = false gives way to the flag, as every TOML value does)
            raise ConfigError(f"resume = false and resume_from = {values['resume_from']!r} contradict each other; "
                              "drop one")
        values["resume"] = True
    overrides = {k: getattr(args, k) for k in METHOD_OVERRIDES if getattr(args, k, None) is not None}
    given = build_config(values)
    run_dir = given.run_dir if given.run_dir is not None else \
        f"runs/{method_from_overrides(given.method, overrides).name}-{given.task}-s{given.seed}"
    changes: dict[str, list] = {}
    notes: list[str] = []
    # a file, a name too long, or '' (it meant the default run: TOML run_dir = "")
    check_out_dir(run_dir, "run_dir", try_making=False)
    if claim is not None:
        claim(run_dir)
    _recover_replaced(run_dir, notes, given.overwrite)  # before anything reads the run dir (config.json for --resume)
    if given.resume and not given.overwrite:
        values, overrides, changes = _resume_settings(run_dir, values, overrides, notes)
        _check_plugins(run_dir, getattr(args, "plugin", None) or [])
    cfg = build_config(values, strict=False)  # on resume, the run's saved record (an older polyrl's names too)
    cfg.run_dir = run_dir
    _processes_from_launcher(cfg, getattr(args, "nproc", None) is not None)
    validate(cfg)
    method = method_from_overrides(cfg.method, overrides)
    if cfg.agency.baseline is not None and not method.corrections and "correction" not in overrides:
        # The behaviour policy is the baseline/learner mixture: importance weights pi_theta / mu keep the update
        # on-policy for the learner (truncated at C = 2, verl's default); an explicit --correction overrides.
        from polyrl.objectives import override

        method = override(method, corrections=["tis"])
        notes.append("agency transfer: adding the TIS correction (pi_theta / mixture, C = 2) to the method")
    if cfg.engine.backend == "vllm" and not method.corrections and "correction" not in overrides:
        # vLLM's kernels (and its bfloat16 head) sample from a slightly different policy than the trainer scores.
        from polyrl.objectives import override

        method = override(method, corrections=["tis"])
        notes.append("vllm: adding the TIS correction (pi_theta / pi_vllm, C = 2) to the method")
    try:
        task = get_task(cfg.task, data_file=cfg.data.file, heldout_percent=cfg.data.heldout_percent)
        RewardChannels(task, *parse_reward_specs(cfg.reward_funcs, cfg.reward_weights))  # imports them: fail now
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ConfigError(f"task = {cfg.task!r}: {e}") from None
    own = getattr(task, "max_new_tokens", None)  # a task whose episodes need more than the default cap
    if own is not None and "max_new_tokens" not in values and own != cfg.max_new_tokens:
        cfg.max_new_tokens = own
        notes.append(f"max_new_tokens = {own}: task {cfg.task!r}'s own cap (a tool call, the reply and the answer "
                     "fit in it); --max-new-tokens sets another")
    where = check_combinations(cfg, method, task)
    method = _channel_weights(cfg, method, notes)
    if cfg.scale.device == "auto" and where.type == "cuda":
        notes.append("device = 'auto': training on the GPU (--device cpu keeps it on the CPU)")
    try:
        held_out = len(held_out_prompts(task, cfg.eval.prompts))
    except (ValueError, KeyError) as e:  # a data file's split that cannot be drawn
        raise ConfigError(f"task = {cfg.task!r}: {e}") from None
    if held_out < cfg.eval.prompts:
        notes.append(f"eval_prompts = {cfg.eval.prompts}: the task's held-out split gives {held_out} distinct prompts; "
                     "each is evaluated once")
    if cfg.drift.prompts and cfg.drift.prompts > held_out:
        from polyrl.drift import DRIFT_SEED

        probes = len(held_out_prompts(task, cfg.drift.prompts, seed=DRIFT_SEED))
        if probes < cfg.drift.prompts:
            notes.append(f"drift_prompts = {cfg.drift.prompts}: the task's held-out split gives {probes} distinct "
                         "prompts; each is a probe once")
    if cfg.model is not None:
        from polyrl.model import TOKENIZER_FILES

        if not any((Path(cfg.model) / f).is_file() for f in TOKENIZER_FILES):
            raise ConfigError(f"model = {cfg.model!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    from polyrl.tasks.chat import check_prompt_format

    try:  # --chat-template, --system-prompt, message prompts: against the model's tokenizer
        check_prompt_format(cfg.data.chat_template, cfg.data.system_prompt, cfg.model, task)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_contexts(cfg, notes)
    from polyrl.checkpoint import latest_checkpoint, resume_checkpoint
    from polyrl.launch import world

    if cfg.resume and cfg.overwrite:
        raise ConfigError("resume = true and overwrite = true contradict each other; choose one")
    if cfg.model is None:  # before --overwrite clears anything: a task read from --data-file has no warm start
        from polyrl.tinylm import check_warmstart

        check_warmstart(cfg.task)
    plan = TrainPlan(cfg, method, task, run_dir, overrides, changes, notes=notes)
    inputs = {**vars(flat(cfg)), "config": getattr(args, "config", None)}  # what --overwrite must not delete
    if cfg.resume:
        checkpoint, meta = resume_checkpoint(run_dir, cfg.resume_from)
        cfg.resume_from, plan.resume_step = str(checkpoint), int(meta["step"])
        check_resume_steps(cfg.steps, plan.resume_step, run_dir)  # fewer: nothing trains, the record disagrees
    elif world()[0] != 0:  # ranks > 0 of a multi-process run leave the run directory to rank 0
        pass
    elif cfg.overwrite:  # only an empty directory or a polyrl run is replaced; anything else is refused
        from polyrl.runs import replaceable

        plan.replace = replaceable(run_dir, inputs=inputs)
    elif latest_checkpoint(run_dir) is not None:
        raise ConfigError(f"run_dir = {run_dir!r} already holds checkpoints; pass --resume to continue it, "
                          "--overwrite to start over, or another --run-dir")
    elif any((Path(run_dir) / f).exists() for f in ("config.json", "metrics.jsonl")):
        raise ConfigError(f"run_dir = {run_dir!r} already holds a run with no checkpoint to resume; pass "
                          "--overwrite to start over, or another --run-dir")
    else:
        from polyrl.runs import refuse_foreign

        refuse_foreign(run_dir, inputs=inputs)
    return plan


def _check_contexts(cfg: TrainConfig, notes: list[str]) -> None:
    """``max_new_tokens`` must leave room for a prompt in the position table of every model that reads a completion:
    the policy, a distillation teacher, an agency baseline (``model.context_length``; a rotary model gets a note
    instead, and the warm start is one). The sampler checks each prompt's own length (``rollout/hf.py``)."""
    from polyrl.model import beyond_context, check_context, context_length, model_config

    models = {"model": cfg.model, "teacher": cfg.distill.teacher, "agency": cfg.agency.baseline}
    for setting, path in models.items():
        if path is None or (config := model_config(path)) is None:
            continue
        check_context(1, cfg.max_new_tokens, context_length(config), model=f"{setting} = {str(path)!r}")
        if (note := beyond_context(config, cfg.max_new_tokens)) is not None:
            notes.append(f"{setting}: {note}")


def _check_data_prompts(task, tokenizer, max_new_tokens: int, context: int | None) -> None:
    """Every prompt of a data file fits the model's context with ``max_new_tokens``, checked before any step (as
    verl's truncation='error'; the sampler refuses one too, but only once a step reaches it, hours in)."""
    from polyrl.tasks.chat import own_unk_id, prompt_ids, unknown_characters

    size, unk = getattr(task, "split_size", None), own_unk_id(tokenizer)
    if (context is None and unk is None) or size is None:
        return

    for split in ("train", "test"):
        prompts = task.prompts(split, size(split), 0) if size(split) else []  # each once, put as the run puts them
        encoded = prompt_ids(tokenizer, prompts)
        unknown = [i for i, ids in enumerate(encoded) if unk is not None and unk in ids]
        if unknown:  # a character tokenizer (the warm starts') has no token for it: the model would read <unk>
            text = prompts[unknown[0]].rendered or prompts[unknown[0]].text
            chars = unknown_characters(tokenizer, unk, text)
            raise ConfigError(f"data_file: {len(unknown)} of its {len(prompts)} {split} prompts hold characters the "
                              f"tokenizer has no token for (prompt {prompts[unknown[0]].id!r}: "
                              f"{', '.join(map(repr, chars[:8])) or 'its markup'}), which it would read as "
                              f"{tokenizer.unk_token}; drop them or use a model whose tokenizer covers them")
        if context is None:
            continue
        lengths = [len(ids) for ids in encoded]
        over = [i for i, n in enumerate(lengths) if n + max_new_tokens > context]
        if over:
            worst = max(over, key=lengths.__getitem__)
            raise ConfigError(f"data_file: {len(over)} of its {len(prompts)} {split} prompts do not fit the model's "
                              f"context of {context} positions with max_new_tokens = {max_new_tokens} (the longest, "
                              f"{prompts[worst].id!r}, has {lengths[worst]} tokens); shorten or drop them, or lower "
                              "max_new_tokens")


def _recover_replaced(run_dir: str, notes: list[str], overwrite: bool) -> None:
    """An old run that a killed ``--overwrite`` left set aside is put back (or dropped, if its replacement had
    started) by rank 0 (``runs.recover_replaced``); the other ranks of a torchrun refuse rather than read the run
    directory while it is being put back. Under ``--overwrite`` they read nothing of the old run, and the run set
    aside may be this command's own (rank 0 moves it before a late rank gets here): they leave it to rank 0."""
    from polyrl.launch import world
    from polyrl.runs import aside_path, recover_replaced

    if world()[0] != 0:
        if not overwrite and (aside := aside_path(run_dir)).is_dir():
            raise ConfigError(f"run_dir = {run_dir!r}: an earlier --overwrite left the old run in {str(aside)!r}; "
                              "run `polyrl train` on it in one process first")
        return
    if (note := recover_replaced(run_dir)) is not None:
        notes.append(note)


def _processes_from_launcher(cfg: TrainConfig, given: bool) -> None:
    """Under torchrun the launcher decides the processes: ``nproc`` records them (config.json, the rules that
    depend on it); a different ``--nproc`` given with it is refused."""
    from polyrl.launch import local_processes, under_launcher

    if not under_launcher():
        return
    if given and cfg.scale.nproc != local_processes():
        raise ConfigError(f"nproc = {cfg.scale.nproc} differs from the {local_processes()} processes torchrun started "
                          "on this machine (--nproc-per-node); leave --nproc out under torchrun")
    cfg.scale.nproc = local_processes()


def _channel_weights(cfg: TrainConfig, method, notes: list[str]):
    """``method`` with a per-channel advantage's (GDPO's) channel weights taken from --reward-weights: it normalises
    each channel on its own and reads no weighted total, so the weights must reach it as its own."""
    from polyrl.objectives import override
    from polyrl.registry import ADVANTAGES
    from polyrl.tasks.rewards import parse_reward_specs

    specs, weights = parse_reward_specs(cfg.reward_funcs, cfg.reward_weights)
    spec = method.advantage
    if "channels" not in ADVANTAGES.spec(spec.name).tags or len(specs) < 2 or weights is None \
            or spec.params.get("weights"):
        return method
    given = ";".join(f"{w:g}" for w in weights)
    notes.append(f"advantage {spec.name!r}: channel weights {given} from reward_weights")
    return override(method, advantage=f"{spec.name}:weights={given}")


def _check_plugins(run_dir: str, given: list[str]) -> None:
    """Refuse a resume without a --plugin the run was trained with: its parts would be unknown (the message said
    "unknown trust_region 'mine' (did you mean 'clip'?)", as if the run had a typo)."""
    from polyrl.plugins import plugin_key
    from polyrl.runs import CONFIG, saved_record

    missing = [m for m in (saved_record(run_dir) or {}).get("plugins", [])
               if plugin_key(m) not in map(plugin_key, given)]
    if missing:
        flags = " ".join(f"--plugin {m}" for m in missing)
        raise ConfigError(f"run_dir = {run_dir!r} was trained with {flags} ({run_dir}/{CONFIG}); resume it with "
                          f"`polyrl {flags} train --resume ...`")


def _resume_settings(run_dir: str, values: dict[str, Any], overrides: dict[str, Any], notes: list[str]):
    """The run's own settings and part overrides (config.json), with the changes a resume may make."""
    from polyrl.runs import CONFIG, RESUME_MAY_CHANGE, effective_config, resume_values, saved_record

    record = saved_record(run_dir)
    if record is None:
        if Path(run_dir).is_dir():  # started from Python (train()): no record, so the flags given are the settings
            notes.append(f"{run_dir} has no {CONFIG}: resuming with the settings given on this command")
        return values, overrides, {}
    saved = effective_config(run_dir)
    merged, changes = resume_values(saved, _as_saved(saved, values), what=f" ({run_dir}/{CONFIG})")
    saved_overrides = record.get("overrides")
    if saved_overrides is not None:  # runs recorded before part overrides were saved accept the ones given
        method = saved.get("method", values.get("method"))
        for key, new in overrides.items():
            if saved_overrides.get(key) != new and not _same_method(method, saved_overrides, {key: new}):
                flag, old = "--" + key.replace("_", "-"), saved_overrides.get(key)
                raise ConfigError(f"{flag} {new!r} differs from the run's own "
                                  f"{'(the preset' + chr(39) + 's)' if old is None else repr(old)} "
                                  f"({run_dir}/{CONFIG}); a resume keeps the run's settings and method (may change: "
                                  f"{', '.join(RESUME_MAY_CHANGE)}): drop the flag, or start a new run with another "
                                  "--run-dir")
        overrides = dict(saved_overrides)
    return merged, overrides, changes


def _as_saved(saved: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with each reward setting that resolves to the run's saved one replaced by the saved spelling: a
    resume compares what the run computes, and ``--reward-weights 1.0,0.20`` is ``1,0.2``, ``--reward-funcs task``
    the default (None)."""
    from polyrl.tasks.rewards import parse_reward_specs

    def resolved(values: dict[str, Any]) -> tuple | None:
        try:
            return parse_reward_specs(values.get("reward_funcs"), values.get("reward_weights"))
        except ValueError:  # a bad value is refused by name once the config is built
            return None

    out, own = dict(given), resolved(saved)
    for name in ("reward_funcs", "reward_weights"):
        if out.get(name) is not None and name in saved and out[name] != saved[name]:
            if own is not None and resolved({**saved, name: out[name]}) == own:
                out[name] = saved[name]
    return out


def _same_method(preset: str | None, saved: dict[str, Any], change: dict[str, Any]) -> bool:
    """Whether part override ``change`` leaves the run's method (preset ``preset`` with the ``saved`` overrides) as it
    is: ``--kl-coef 0.04`` or ``--trust-region clip`` given to resume a grpo run asks for grpo's own values."""
    from polyrl.registry import PartError

    if preset is None:
        return False
    try:
        return method_from_overrides(preset, saved) == method_from_overrides(preset, {**saved, **change})
    except PartError:  # a bad override is refused by name where the method is built
        return False


TOPK = 8  # support size for trust regions that read top-K log-probs (tag "needs_topk")


@dataclass
class Components:
    """The live objects of one run, built once from the settings; the loop talks to nothing else."""

    learner: Any  # Learner: policy, reference, critic, optimizers
    source: Any  # RolloutSource: where each step's scored rollouts come from
    evaluate: Any  # Evaluator: held-out accuracy of the acting system at a step
    pad_id: int
    boundaries: frozenset[int]  # token ids that end a sub-sentence (segment ids for SSPO)
    topk: int  # top-K support size when the trust region reads it, else 0
    writes: bool = True  # this process writes the run directory (rank 0 of several)
    held_out: int = 0  # the evaluation's distinct held-out prompts (``evaluate`` may wrap the Evaluator)
    task: Any = None  # the task as the model sees it: prompts put by the chat format (tasks.chat.formatted_task)
    # Per-step metrics of the reference against the sampling policy: (student_logp, ref_logp, mask) -> metrics
    # (distill/reverse_kl with a teacher; none otherwise).
    reference_metrics: Callable[..., dict[str, float]] = lambda *_: {}
    run_info: dict[str, Any] = field(default_factory=dict)  # recorded in summary.json (the teacher)


def build_components(cfg: TrainConfig, method, task, model_dir: str) -> Components:
    """Load the policy and build the learner, the rollout source and the evaluator that ``cfg`` asks for.

    Under several processes (``--nproc``, torchrun) the learner is FSDP2's and the source and evaluator live on
    rank 0, which generates with its own full copy of the policy (``polyrl.ranks``).
    """
    import copy
    import dataclasses

    import torch

    from polyrl.batch import boundary_token_ids
    from polyrl.evaluation import Evaluator
    from polyrl.launch import local_processes
    from polyrl.learner.dist import device, init_from_env, pick_device
    from polyrl.learner.local import ValueHead
    from polyrl.learner.lora import BaseReference
    from polyrl.model import context_length, disable_dropout, load_policy
    from polyrl.ranks import RankEvaluator, RankSource
    from polyrl.rollout.agency.arbiter import AgencyArbiter, AgencySource
    from polyrl.rollout.agency.config import parse_schedule
    from polyrl.rollout.episodes import EpisodeRunner
    from polyrl.rollout.generator import SamplingParams
    from polyrl.rollout.hf import HFGenerator
    from polyrl.tasks.chat import PromptFormat, formatted_task
    from polyrl.tasks.rewards import RewardChannels, parse_reward_specs

    where = pick_device(cfg.scale.device, local_processes())
    ranks = init_from_env(cuda=where.type == "cuda")  # (rank, world size) under torchrun / --nproc; None in one
    # process, whose models live on ``where`` (a sharded learner places its shards on each rank's device itself)
    on = where if ranks is None else torch.device("cpu")
    rewards = RewardChannels(task, *parse_reward_specs(cfg.reward_funcs, cfg.reward_weights))
    policy, tokenizer = load_policy(model_dir, dtype=cfg.dtype, threads=_trainer_threads(cfg))
    disable_dropout(policy).to(on)  # before the critic copies it and LoRA adds its own
    task = formatted_task(task, PromptFormat(tokenizer, cfg.data.chat_template, cfg.data.system_prompt,
                                             model=f"model {model_dir!r}"))
    critic = ValueHead(copy.deepcopy(policy)).to(on) if method.needs_values else None
    adapters = _adapters(cfg, policy)
    # The reference is the distillation teacher when one is given (LoRA too); else a frozen copy of the starting
    # model (synced to the policy by Humanline presets); with LoRA, the policy itself with its adapters off.
    reference = teacher = _teacher(cfg, tokenizer)
    if teacher is not None:
        teacher.to(on)
    if cfg.agency.baseline is not None:
        from polyrl.distill import check_vocab

        problem = check_vocab(tokenizer, cfg.agency.baseline, "agency",
                              "agency transfer mixes the baseline's next-token distribution with the learner's")
        if problem is not None:
            raise ConfigError(problem)
    if reference is None and method.needs_ref:
        reference = BaseReference(adapters) if adapters is not None else \
            copy.deepcopy(policy).eval().requires_grad_(False)
    # In one process the sampler shares the policy module, so its weights are always current; a sharded learner
    # leaves rank 0 a full copy of its own, refreshed after every update (EpisodeRunner own_weights).
    sampler_model = policy if ranks is None else copy.deepcopy(policy).to(device())
    learner = _learner(cfg, method, policy, reference, critic, adapters, sharded=ranks is not None)
    contexts = [n for n in (context_length(policy), teacher and context_length(teacher)) if n]  # a teacher reads them
    _check_data_prompts(task, tokenizer, cfg.max_new_tokens, min(contexts, default=None))
    if cfg.engine.backend == "vllm":  # rollout/vllm.py: imported only here
        from polyrl.rollout.vllm import VLLMGenerator

        generator = VLLMGenerator(model_dir, tokenizer, dtype=cfg.dtype, seed=cfg.seed,
                                  gpu_memory_utilization=cfg.engine.gpu_memory_utilization)
    else:
        generator = HFGenerator(sampler_model, tokenizer, fp32_head=cfg.fp32_lm_head)
    parts = dict(learner=learner, pad_id=generator.pad_id, boundaries=boundary_token_ids(tokenizer),
                 topk=TOPK if method.needs_topk else 0, task=task, **_distill_parts(cfg))
    if ranks is not None and ranks[0] != 0:
        return Components(source=RankSource(None), evaluate=RankEvaluator(None), writes=False, **parts)
    arbiter = None
    if cfg.agency.baseline is not None:  # agency transfer: a frozen baseline acts first, the learner takes over
        baseline, _ = load_policy(cfg.agency.baseline, dtype=cfg.dtype, threads=_trainer_threads(cfg),
                                  setting="agency")
        baseline.to(next(sampler_model.parameters()).device)  # it mixes its next-token distribution in the sampler
        from polyrl.shared_prompt import kv_only_cache

        if not (kv_only_cache(policy) and kv_only_cache(baseline)):  # found at the first decode before
            raise ConfigError(f"agency = {cfg.agency.baseline!r} is not allowed with this model: agency transfer "
                              "drops finished rows from the decode batch, which a linear-attention or state-space "
                              "model's cache (LFM2, Qwen3.5) cannot do")
        arbiter = generator.arbiter = AgencyArbiter(baseline, parse_schedule(cfg.agency.schedule),
                                                    mode=cfg.agency.mode)
    runner = EpisodeRunner(generator, tokenizer, task, own_weights=ranks is not None or cfg.engine.backend == "vllm")
    held_out = held_out_prompts(task, cfg.eval.prompts)
    evaluate = Evaluator(runner, task, held_out, cfg.max_new_tokens, arbiter)

    def sampling(step: int) -> SamplingParams:
        sample = cfg.sampling
        return SamplingParams(n=cfg.group_size, max_new_tokens=cfg.max_new_tokens, temperature=sample.temperature,
                              top_p=sample.top_p, top_k=sample.top_k or None, seed=cfg.seed * 1_000_003 + step)

    if cfg.drift.prompts:  # before any update or checkpoint load: the probe set is the starting policy's
        from polyrl.drift import DRIFT_SEED, DriftMeter

        probes = held_out_prompts(task, cfg.drift.prompts, seed=DRIFT_SEED)
        evaluate = DriftMeter(evaluate, learner, runner, probes, dataclasses.replace(sampling(0), n=1, seed=DRIFT_SEED),
                              generator.pad_id)

    trainer_gpus = local_processes() if where.type == "cuda" else 0  # rollout actors get the other GPUs
    sampler = _rollout_runner(cfg, method, learner, runner, arbiter, model_dir, trainer_gpus)  # evaluator: `runner`
    try:  # the workers (and a Ray instance they started) stop if the source cannot be built: train() owns none yet
        source = _source(cfg, learner, generator, sampler, rewards, sampling, tokenizer, policy, model_dir)
    except BaseException:
        sampler.close()
        raise
    if arbiter is not None:
        source = AgencySource(source, arbiter)
    if ranks is not None:
        source, evaluate = RankSource(source), RankEvaluator(evaluate)
    return Components(source=source, evaluate=evaluate, held_out=len(held_out), **parts)


def _source(cfg: TrainConfig, learner, generator, sampler, rewards, sampling, tokenizer, policy, model_dir: str):
    """The rollout source: offline preference rows, the tree sampler or uniform groups over ``sampler``."""
    from polyrl.model import context_length
    from polyrl.tasks.chat import PromptFormat

    if cfg.preference.file is not None:  # offline preference rows: no generation
        from polyrl.rollout.preference import PreferenceSource
        from polyrl.rollout.preference_data import read_pairs

        put = PromptFormat(tokenizer, cfg.data.chat_template, cfg.data.system_prompt, model=f"model {model_dir!r}")
        return PreferenceSource(read_pairs(cfg.preference.file), tokenizer, put.apply,
                                pairs_per_step=cfg.prompts_per_step, seed=cfg.seed, max_new_tokens=cfg.max_new_tokens,
                                context=context_length(policy))
    if cfg.sampler == "tree":
        return _tree_source(cfg, learner, generator, sampler, rewards, sampling, tokenizer)
    return _group_source(cfg, sampler, rewards, sampling)


def _teacher(cfg: TrainConfig, tokenizer):
    """The distillation teacher as a frozen reference (``--teacher``), or None; refused unless it shares the
    student's vocabulary."""
    if cfg.distill.teacher is None:
        return None
    from polyrl.distill import check_vocab, load_teacher

    problem = check_vocab(tokenizer, cfg.distill.teacher)
    if problem is not None:
        raise ConfigError(problem)
    return load_teacher(cfg.distill.teacher, dtype=cfg.dtype, threads=_trainer_threads(cfg))


def _distill_parts(cfg: TrainConfig) -> dict[str, Any]:
    """With a teacher: its per-step reverse KL (distill/reverse_kl) and its directory in summary.json."""
    if cfg.distill.teacher is None:
        return {}
    from polyrl.distill import reverse_kl_metrics

    return dict(reference_metrics=reverse_kl_metrics, run_info={"teacher": cfg.distill.teacher})


def _adapters(cfg: TrainConfig, policy):
    """LoRA adapters injected into ``policy`` through PEFT (its base frozen), or None for full fine-tuning."""
    if not cfg.lora.rank:
        return None
    from polyrl.learner.lora import add_adapters

    try:
        return add_adapters(policy, rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=cfg.lora.targets,
                            dropout=cfg.lora.dropout)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _learner(cfg: TrainConfig, method, policy, reference, critic, adapters, *, sharded: bool):
    """The one-process learner, or FSDP2's over the process group (same settings, same results)."""
    from polyrl.learner.fsdp import FSDPLearner
    from polyrl.learner.local import LocalLearner

    lora = dict(adapters=adapters) if adapters is not None else {}  # validate refuses LoRA with several processes
    return (FSDPLearner if sharded else LocalLearner)(
        policy, **lora, lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
        max_grad_norm=cfg.max_grad_norm, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
        top_k=cfg.sampling.top_k,
        fp32_head=cfg.fp32_lm_head, micro_batch_size=cfg.micro_batch_size, reference=reference,
        ref_sync_every=method.ref_sync_every, critic=critic, critic_lr=cfg.critic.lr,
        value_clip=cfg.critic.value_clip, value_loss_agg=cfg.critic.value_loss_agg,
        share_prompts=cfg.speed.share_prompts, fused_adam=cfg.speed.fused_adam)


def _group_source(cfg: TrainConfig, runner, rewards, sampling):
    from polyrl.rollout.group import GroupSource

    prefetch = None
    if cfg.prefetch.staleness:  # the rollout workers generate the next k steps' batches while the trainer trains
        from polyrl.rollout.remote.prefetch import Prefetch

        prefetch = Prefetch(runner, cfg.prefetch.staleness)
    return GroupSource(runner, rewards, num_groups=cfg.prompts_per_step, sampling=sampling,
                       max_rounds=cfg.max_gen_rounds, steps=cfg.steps, prefetch=prefetch)


def _rollout_runner(cfg: TrainConfig, method, learner, local, arbiter, model_dir: str, trainer_gpus: int):
    """The runner sources sample with: ``local`` (this process), or Ray rollout workers when asked for."""
    actors = cfg.scale.actors(cfg.prefetch.staleness)
    if not actors:
        return local
    from polyrl.learner.lora import plain_state_dict
    from polyrl.rollout.remote import RemoteRunner, WorkerPool, WorkerSpec

    # A frozen reference scores each batch where it was generated, off the trainer's critical path (a reference
    # that follows the policy stays with the learner).
    spec = WorkerSpec(model_dir, local.task, dtype=cfg.dtype, fp32_head=cfg.fp32_lm_head,
                      threads=_generator_threads(cfg), baseline_dir=cfg.agency.baseline, agency_mode=cfg.agency.mode,
                      reference=method.needs_ref and not method.ref_sync_every,
                      reference_dir=cfg.distill.teacher,
                      logprob_kwargs=dict(micro_batch_size=cfg.micro_batch_size, **learner.sampling))
    pool = WorkerPool(spec, workers=actors, address=cfg.scale.ray_address, cpus=cfg.scale.ray_cpus,
                      gpus_per_worker=cfg.scale.rollout_worker_gpus, trainer_gpus=trainer_gpus,
                      weights=lambda: plain_state_dict(local.generator.model))
    return RemoteRunner(local, pool, arbiter)


def _tree_source(cfg: TrainConfig, learner, generator, runner, rewards, sampling, tokenizer):
    from polyrl.learner.local import answer_likelihood, prompt_embedder
    from polyrl.rollout.tree.sampler import TreeSampler
    from polyrl.rollout.tree.source import TreeSource

    tree = cfg.tree
    kind = tree.predictor
    embed = prompt_embedder(generator.model, tokenizer) if kind == "shared" else None  # the policy's weights
    exact = answer_likelihood(learner, generator, cfg.max_new_tokens) if kind == "likelihood" else None
    sampler = TreeSampler(runner, {}, root_frac=tree.root_frac, roots=tree.roots, candidate_factor=tree.candidates,
                          prune=tree.prune, branch=tree.branch, half_life=tree.half_life, max_group=tree.max_group,
                          objective=tree.probe,
                          embed=embed, likelihood=exact)
    return TreeSource(sampler, rewards, num_groups=cfg.prompts_per_step, sampling=sampling)


def _cores(cfg: TrainConfig) -> int:
    from polyrl.runs import cores

    return cfg.threads or cores()


def _generator_threads(cfg: TrainConfig) -> int:
    """Threads of each rollout worker: the cores shared by the workers; half of them when they generate while
    the trainer trains (asynchronous), all of them when the trainer waits for them (synchronous)."""
    actors = cfg.scale.actors(cfg.prefetch.staleness)
    cores = _cores(cfg) // 2 if cfg.prefetch.staleness else _cores(cfg)
    return max(1, cores // max(1, actors))


def _trainer_threads(cfg: TrainConfig) -> int | None:
    """Threads of each training process: the cores left by asynchronous workers, shared by the ranks."""
    from polyrl.launch import local_processes

    ranks = local_processes()
    if cfg.prefetch.staleness:
        return max(1, (_cores(cfg) - _cores(cfg) // 2) // ranks)
    return max(1, _cores(cfg) // ranks) if ranks > 1 else cfg.threads or None
