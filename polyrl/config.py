"""Typed run configuration: dataclasses with one docstring line per field, a TOML file plus flags.

``add_config_args`` turns the fields into ``--flag`` options (help text = the field's docstring);
``load_toml`` reads a file whose keys must be field names; ``validate`` raises ConfigError with one
line naming the field, the value and what is allowed. The CLI is the only caller (ARCHITECTURE.md:
``cli`` is the only place that reads config files and flags).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import os
import textwrap
import tomllib
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration value that cannot be used; one line naming field, value and what is allowed."""


@dataclass
class TrainConfig:
    """Everything `polyrl train` needs; the method's maths is chosen by `method` plus part overrides."""

    method: str = "grpo"
    """preset name (see `polyrl methods`)"""
    task: str = "addition"
    """task name: addition, addition_mixed, calculator (tool use), countdown, math (needs --data-file)"""
    data_file: str | None = None
    """math task: local JSONL, JSON or Parquet file with a question (or problem, prompt) and an answer (or solution,
    ground_truth) column"""
    heldout_percent: int = 10
    """math task: percent of the data file's rows held out for evaluation (chosen by a hash of the question)"""
    reward_funcs: str | None = None
    """comma-separated reward functions (module:function or file.py:function; 'task' = the task's checker)"""
    reward_weights: str | None = None
    """comma-separated weights of the reward functions (default: all 1)"""
    model: str | None = None
    """local Hugging Face model directory; default: the cached warm start for the task"""
    run_dir: str | None = None
    """where metrics, checkpoints and plots go; default runs/<method>-<task>-s<seed>"""
    steps: int = 150
    """number of RL steps (one rollout batch each)"""
    prompts_per_step: int = 8
    """prompts sampled per step"""
    group_size: int = 8
    """completions per prompt (G)"""
    max_new_tokens: int = 8
    """generation cap per completion (L_max)"""
    temperature: float = 1.0
    """sampling temperature, applied identically when log-probs are recomputed"""
    top_p: float = 1.0
    """nucleus sampling threshold in (0, 1]"""
    top_k: int = 0
    """top-k sampling (0 = off)"""
    lr: float = 1e-4
    """AdamW learning rate"""
    warmup_steps: int = 5
    """linear learning-rate warm-up steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm (0 = off)"""
    epochs_per_batch: int = 1
    """optimizer passes over each rollout batch (stale data for K > 1)"""
    minibatches: int = 1
    """optimizer steps per epoch (the batch is split into this many minibatches)"""
    micro_batch_size: int = 64
    """sequences per forward/backward pass (gradient accumulation inside a minibatch)"""
    critic_lr: float = 1e-4
    """learning rate of the critic (GAE presets only)"""
    value_clip: float = 0.5
    """critic value clipping range eps_v (GAE presets only)"""
    max_gen_rounds: int = 4
    """dynamic sampling: generation rounds per step at most when filters drop groups"""
    train_prompts: int = 0
    """size of the training prompt pool the stream cycles through (0 = the whole train split)"""
    sampler: Literal["uniform", "tree"] = "uniform"
    """rollout allocation: uniform (G per prompt) or tree (TRACE-style roots + branches, same budget)"""
    tree_root_frac: float = 0.5
    """tree sampler: share of the rollout budget spent probing prompts (the rest extends them: roots or branches)"""
    tree_candidates: float = 2.0
    """tree sampler: candidate prompts drawn per group slot (the allocation may skip some)"""
    tree_prune: float = 0.05
    """tree sampler: anchors predicted to succeed with p < prune or p > 1 - prune get no rollouts (with
    tree_roots = 'sample' only prefixes are pruned: every prompt keeps a chance to be drawn)"""
    tree_half_life: float = 0.0
    """tree sampler: steps after which a prompt's pass-rate history counts half (0 = it never ages)"""
    tree_max_group: int = 0
    """tree sampler: most rollouts of one prompt in a step, probes and extensions together (0 = 2 x group size)"""
    tree_predictor: Literal["history", "shared", "likelihood"] = "history"
    """tree sampler: a prompt's success prior from the pool (history) or also from prompts like it (shared: a
    regression on the policy's features of the prompt, so unseen prompts are predicted too); likelihood: the policy's
    probability of the reference answer, which is the success rate itself on exact-answer tasks (addition)"""
    tree_probe: Literal["groups", "rollouts"] = "rollouts"
    """tree sampler: what the probe allocation maximises: expected mixed groups (spreads probes of two over more
    prompts) or expected rollouts in mixed groups (fewer, fuller groups)"""
    tree_roots: Literal["dp", "sample"] = "dp"
    """tree sampler: how prompts are chosen for probing: dp (the exact allocation, the most expected mixed groups)
    or sample (drawn in proportion to their chance of a mixed group, with importance weights on the loss, KL
    included, that keep its expectation that of prompts drawn uniformly)"""
    tree_branch: bool = True
    """tree sampler: continue prefixes of the probes (turn boundaries, or half the completion) as sibling groups;
    --no-tree-branch spends the extension budget on the probed prompts' root groups only"""
    agency: str | None = None
    """agency transfer: local model directory of a frozen baseline policy that acts first"""
    agency_schedule: str = "linear:steps=50"
    """agency transfer: the baseline's share beta(step): linear:steps=N, exp:tau=T or step:steps=N"""
    agency_mode: Literal["token", "sequence"] = "token"
    """agency transfer: the arbiter picks the acting policy per token or per completion"""
    async_staleness: int = 0
    """asynchronous pipeline: a generation process runs up to k policy versions ahead (0 = synchronous)"""
    eval_every: int = 25
    """held-out greedy evaluation every N steps (0 = only before and after)"""
    eval_prompts: int = 200
    """held-out prompts per evaluation"""
    checkpoint_every: int = 50
    """save an atomic checkpoint every N steps (0 = only at the end)"""
    resume: bool = False
    """continue from the newest checkpoint in run_dir with the run's own settings (its config.json)"""
    resume_from: str | None = None
    """continue from this checkpoint directory of run_dir instead of the newest (implies --resume)"""
    overwrite: bool = False
    """delete an existing run_dir first (otherwise a run_dir with checkpoints needs --resume)"""
    seed: int = 0
    """seed for sampling, data order and initialisation"""
    threads: int = 0
    """torch CPU threads (0 = all cores)"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """model dtype"""
    fp32_lm_head: bool = False
    """compute the LM head in float32 (ScaleRL)"""
    guard: bool = False
    """collapse guard: on a detected collapse roll back to the last good checkpoint and lower the lr"""
    guard_lr_factor: float = 0.5
    """the guard multiplies the learning rate by this on every rollback"""
    guard_max_rollbacks: int = 3
    """the guard stops the run after this many rollbacks"""
    max_bad_steps: int = 5
    """stop after this many consecutive steps with a non-finite loss"""
    log_every: int = 10
    """print the compact console table every N steps"""
    tensorboard: bool = True
    """write TensorBoard event files to run_dir/tb"""
    wandb: bool = False
    """also log to Weights & Biases (offline mode)"""


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field), read from the class source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = str(b.value.value).strip()  # type: ignore[attr-defined]
    return docs


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is not Literal and args else tp


def add_config_args(parser: argparse.ArgumentParser, cls: type = TrainConfig) -> None:
    """Add one ``--field-name`` option per field; defaults are None so that TOML values can sit beneath."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in fields(cls):
        tp = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        help_ = f"{docs.get(f.name, '')} (default: {f.default})"
        if tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typing.get_origin(tp) is Literal:
            parser.add_argument(flag, dest=f.name, choices=typing.get_args(tp), default=None, help=help_)
        else:
            parser.add_argument(flag, dest=f.name, type=_base_type(tp), default=None, help=help_)


def load_toml(path: str | os.PathLike, cls: type = TrainConfig) -> dict[str, Any]:
    """Read a TOML config; keys are field names (dashes allowed), unknown keys are an error."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    known = {f.name for f in fields(cls)}
    # A table names a feature: [tree] roots = "sample" is tree_roots = "sample" (flags stay flat: --tree-roots).
    flat = [(f"{table}.{k}", f"{table}_{k}", v) for table, sub in data.items() if isinstance(sub, dict)
            for k, v in sub.items()]
    flat += [(key, key, value) for key, value in data.items() if not isinstance(value, dict)]
    out = {}
    for key, name, value in flat:
        name = name.replace("-", "_")
        if name not in known or isinstance(value, dict):
            near = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {near[0].replace('_', '.', 1) if '.' in key else near[0]!r}?)" if near else ""
            raise ConfigError(f"config file {str(p)!r}: unknown field {key!r}{hint}; "
                              f"allowed: {', '.join(sorted(known))}")
        out[name] = value
    return out


def build_config(values: dict[str, Any], cls: type = TrainConfig) -> Any:
    """Instantiate ``cls`` from values (TOML merged with flags), checking types."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        if f.name not in values or values[f.name] is None:
            continue
        value, tp = values[f.name], hints[f.name]
        base = _base_type(tp)
        ok = (
            value in typing.get_args(tp) if typing.get_origin(tp) is Literal
            else isinstance(value, bool) if base is bool
            else isinstance(value, (int, float)) and not isinstance(value, bool) if base is float
            else isinstance(value, int) and not isinstance(value, bool) if base is int
            else isinstance(value, base)
        )
        if not ok:
            raise ConfigError(f"{f.name} = {value!r} must be {getattr(base, '__name__', base)}")
        kwargs[f.name] = float(value) if base is float else value
    return cls(**kwargs)


def _rule(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name} = {value!r} is not allowed; {allowed}")


def validate(cfg: TrainConfig) -> None:
    """Check value ranges and combinations that do not depend on loading anything."""
    for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "epochs_per_batch", "minibatches",
                 "micro_batch_size", "eval_prompts", "max_gen_rounds", "max_bad_steps"):
        v = getattr(cfg, name)
        _rule(name, v, v >= 1, "must be an integer >= 1")
    for name in ("warmup_steps", "eval_every", "checkpoint_every", "threads", "top_k", "log_every", "train_prompts",
                 "async_staleness"):
        v = getattr(cfg, name)
        _rule(name, v, v >= 0, "must be an integer >= 0")
    _rule("lr", cfg.lr, cfg.lr > 0, "must be > 0")
    _rule("critic_lr", cfg.critic_lr, cfg.critic_lr > 0, "must be > 0")
    _rule("weight_decay", cfg.weight_decay, cfg.weight_decay >= 0, "must be >= 0")
    _rule("max_grad_norm", cfg.max_grad_norm, cfg.max_grad_norm >= 0, "must be >= 0 (0 = off)")
    _rule("guard_lr_factor", cfg.guard_lr_factor, 0 < cfg.guard_lr_factor < 1, "must be in (0, 1)")
    _rule("guard_max_rollbacks", cfg.guard_max_rollbacks, cfg.guard_max_rollbacks >= 1, "must be an integer >= 1")
    for name in ("guard_lr_factor", "guard_max_rollbacks"):
        _rule(name, getattr(cfg, name), cfg.guard or getattr(cfg, name) == getattr(TrainConfig(), name),
              "only applies with the collapse guard (add --guard)")
    if cfg.guard:
        _rule("checkpoint_every", cfg.checkpoint_every, cfg.checkpoint_every >= 1,
              "must be >= 1 with --guard (the guard rolls back to a checkpoint)")
    _rule("tree_root_frac", cfg.tree_root_frac, 0 < cfg.tree_root_frac <= 1, "must be in (0, 1]")
    _rule("tree_candidates", cfg.tree_candidates, cfg.tree_candidates >= 1, "must be >= 1")
    _rule("tree_prune", cfg.tree_prune, 0 <= cfg.tree_prune < 0.5, "must be in [0, 0.5)")
    _rule("tree_half_life", cfg.tree_half_life, cfg.tree_half_life >= 0, "must be >= 0 (0 = no ageing)")
    if cfg.agency is not None:
        _rule("agency", cfg.agency, Path(cfg.agency).is_dir(), "must be an existing local model directory")
        from polyrl.rollout.agency import parse_schedule

        try:
            parse_schedule(cfg.agency_schedule)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.async_staleness:
        _rule("async_staleness", cfg.async_staleness, cfg.sampler == "uniform",
              f"needs sampler = 'uniform' (got sampler = {cfg.sampler!r})")
        _rule("async_staleness", cfg.async_staleness, not cfg.guard,
              "does not combine with --guard (a rollback would send the generation process older weights)")
        _rule("async_staleness", cfg.async_staleness, cfg.agency is None,
              "does not combine with agency transfer (the baseline would have to live in the generation process)")
    if cfg.sampler == "tree":
        _rule("sampler", cfg.sampler, cfg.group_size >= 2, "'tree' needs group_size >= 2")
    # settings of a feature that is off would be silently ignored: refuse them
    default = TrainConfig()
    _rule("tree_max_group", cfg.tree_max_group, cfg.tree_max_group == 0 or cfg.tree_max_group >= cfg.group_size,
          f"must be 0 (twice the group size) or >= group_size = {cfg.group_size}")
    _rule("tree_half_life", cfg.tree_half_life, cfg.tree_predictor != "likelihood" or not cfg.tree_half_life,
          "ages pass-rate histories, which tree_predictor = 'likelihood' does not use")
    _rule("tree_predictor", cfg.tree_predictor, cfg.tree_predictor != "likelihood" or cfg.agency is None,
          "is the learner's success rate, but agency transfer samples from the baseline/learner mixture; use history")
    _rule("tree_prune", cfg.tree_prune,
          cfg.tree_roots == "dp" or cfg.tree_branch or cfg.tree_prune == default.tree_prune,
          "prunes only prefixes with tree_roots = 'sample', and --no-tree-branch leaves none")
    _rule("tree_probe", cfg.tree_probe, cfg.tree_roots == "dp" or cfg.tree_probe == default.tree_probe,
          "only applies with tree_roots = 'dp' (sampled roots are groups of group_size)")
    for name in ("tree_root_frac", "tree_candidates", "tree_prune", "tree_half_life", "tree_max_group", "tree_probe",
                 "tree_predictor", "tree_roots", "tree_branch"):
        _rule(name, getattr(cfg, name), cfg.sampler == "tree" or getattr(cfg, name) == getattr(default, name),
              "only applies with sampler = 'tree' (add --sampler tree)")
    for name in ("agency_schedule", "agency_mode"):
        _rule(name, getattr(cfg, name), cfg.agency is not None or getattr(cfg, name) == getattr(default, name),
              "only applies with agency transfer (add --agency DIR)")
    _rule("value_clip", cfg.value_clip, cfg.value_clip > 0, "must be > 0")
    _rule("fp32_lm_head", cfg.fp32_lm_head, not cfg.fp32_lm_head or cfg.dtype != "float32",
          "only applies with dtype = 'bfloat16' (a float32 model's head is float32 already)")
    if cfg.wandb:
        import importlib.util

        _rule("wandb", cfg.wandb, importlib.util.find_spec("wandb") is not None,
              "needs the wandb package (pip install wandb); TensorBoard events are written without it")
    _rule("temperature", cfg.temperature, cfg.temperature > 0, "must be > 0")
    _rule("top_p", cfg.top_p, 0 < cfg.top_p <= 1, "must be in (0, 1]")
    batch = cfg.prompts_per_step * cfg.group_size
    _rule("minibatches", cfg.minibatches, batch % cfg.minibatches == 0,
          f"must divide prompts_per_step * group_size = {batch}")
    if cfg.model is not None:
        _rule("model", cfg.model, Path(cfg.model).is_dir(), "must be an existing local model directory")
    if cfg.data_file is not None:
        _rule("data_file", cfg.data_file, Path(cfg.data_file).is_file(), "must be an existing JSONL or Parquet file")
    _rule("heldout_percent", cfg.heldout_percent, 1 <= cfg.heldout_percent <= 50,
          "must be an integer in [1, 50] (training evaluates on the held-out rows)")
    _rule("heldout_percent", cfg.heldout_percent,
          cfg.data_file is not None or cfg.heldout_percent == default.heldout_percent,
          "only applies to a task read from --data-file")


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
