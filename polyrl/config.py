"""Typed run configuration: core fields plus feature sections declared beside their code, one docstring each.

``TrainConfig`` holds the core settings and nests each feature's own dataclass: ``tree``
(``rollout/tree/config.py``), ``agency`` (``rollout/agency/config.py``), ``prefetch``
(``rollout/source.py``), ``scale`` (Ray rollout workers and training processes, ``launch.py``),
``critic`` and ``lora`` (``learner/config.py``), ``engine`` and ``sampling`` (``rollout/engine_config.py``), ``guard``
(``guard.py``), ``drift`` (``drift.py``), ``distill`` (``distill.py``), ``data`` (the data file and the prompt format,
``tasks/config.py``), ``eval`` and ``log`` (``logconfig.py``). Users name every setting flat:
``--tree-roots`` / ``tree_roots`` is ``cfg.tree.roots``, and a feature's own switch keeps its name
(``--agency DIR``, ``--guard``). ``settings`` lists them; ``add_config_args`` turns them into flags
(help text = the field's docstring), ``load_toml`` reads a file of flat keys or feature tables
(``[tree]`` then ``roots = "sample"``), ``build_config`` type-checks flat values into the nested config,
``to_dict`` gives the flat record (a run's ``config.json``), and ``validate`` raises ConfigError with one
line naming the setting, the value and what is allowed. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import math
import os
import textwrap
import tomllib
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, NamedTuple

from polyrl.distill import DistillConfig
from polyrl.drift import DriftConfig
from polyrl.errors import ConfigError  # re-exported: `from polyrl.config import ConfigError` keeps working
from polyrl.guard import GuardConfig
from polyrl.launch import ScaleConfig
from polyrl.learner.config import CriticConfig, LoraConfig, SpeedConfig
from polyrl.logconfig import EvalConfig, LogConfig
from polyrl.rollout.agency.config import AgencyConfig
from polyrl.rollout.engine_config import EngineConfig, SamplingConfig
from polyrl.rollout.preference_data import PreferenceConfig
from polyrl.rollout.source import PrefetchConfig
from polyrl.rollout.tree.config import TreeConfig
from polyrl.runs import max_threads
from polyrl.tasks.config import DataConfig


class Once(argparse.Action):
    """An option given at most once (``--config``): a second one would drop the first file's settings without a
    word."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)!r} and {values!r}); "
                         "allowed: one TOML file (flags override its values)")
        setattr(namespace, self.dest, values)


@dataclass
class TrainConfig:
    """Everything `polyrl train` needs; the method's maths is chosen by `method` plus part overrides."""

    method: str = "grpo"
    """preset name (see `polyrl methods`)"""
    task: str = "addition"
    """task name: addition, addition_mixed, calculator (tool use), countdown, math or code (both need --data-file)"""
    data: DataConfig = field(default_factory=DataConfig)
    """data file and prompt format: --data-file, --heldout-percent, --chat-template, --system-prompt, TOML [data]"""
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
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """how completions are sampled: --temperature, --top-p, --top-k, TOML table [sampling]"""
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
    """sequences per forward/backward pass (gradient accumulation inside a minibatch); see also micro_batch_tokens"""
    max_gen_rounds: int = 4
    """dynamic sampling: generation rounds per step at most when filters drop groups"""
    train_prompts: int = 0
    """size of the training prompt pool the stream cycles through (0 = the whole train split)"""
    sampler: Literal["uniform", "tree"] = "uniform"
    """rollout allocation: uniform (G per prompt) or tree (TRACE-style roots + branches, same budget)"""
    tree: TreeConfig = field(default_factory=TreeConfig)
    """the tree sampler (--sampler tree): flags --tree-*, TOML table [tree]"""
    agency: AgencyConfig = field(default_factory=AgencyConfig)
    """agency transfer: flags --agency DIR, --agency-*, TOML table [agency]"""
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    """asynchronous generation: flag --async-staleness, TOML table [async]"""
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    """Ray rollout workers and FSDP2 training processes: --rollout-workers, --ray-*, --nproc, TOML table [scale]"""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """the critic of GAE presets: flags --critic-lr, --value-clip, --value-loss-agg, TOML table [critic]"""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters through PEFT: flags --lora-*, TOML table [lora]"""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """the generation engine: flags --generator, --vllm-*, TOML table [vllm]"""
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    """the learner's speed switches (same results): --[no-]share-prompts, --[no-]fused-adam, TOML table [speed]"""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """held-out evaluation: --eval-every, --eval-prompts, TOML table [eval]"""
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
    """torch CPU threads (0 = every core this process may run on: its CPU affinity)"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """model dtype"""
    fp32_lm_head: bool = False
    """compute the LM head in float32 (ScaleRL)"""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """the collapse guard: flags --guard, --guard-*, TOML table [guard]"""
    drift: DriftConfig = field(default_factory=DriftConfig)
    """the drift meter: flag --drift-prompts, TOML table [drift]"""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """on-policy distillation: --teacher DIR (the KL term's reference), TOML table [distill]"""
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    """offline preference pairs: --preference-file (dpo, kto, ... without generation), TOML table [preference]"""
    max_bad_steps: int = 5
    """stop after this many consecutive optimizer steps (minibatch updates) with a non-finite loss or gradient, each
    skipped"""
    log: LogConfig = field(default_factory=LogConfig)
    """console table and event files: --log-every, --[no-]tensorboard, --[no-]wandb, TOML table [log]"""


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field), read from the class source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = str(b.value.value).strip()  # type: ignore[attr-defined]
    return docs


class Setting(NamedTuple):
    """One setting as users name it (a flag, a TOML key) and where it lives in the (nested) config."""

    name: str  # flat name: --tree-roots is tree_roots; a feature's own switch keeps its name (--agency, --guard)
    path: tuple[str, ...]  # ("tree", "roots")
    type: Any
    default: Any
    doc: str


def _is_section(f: dataclasses.Field) -> bool:
    return f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)


def settings(cls: type = TrainConfig) -> list[Setting]:
    """Every setting of ``cls``, flat: its own fields, then each feature section's (``TreeConfig`` ...)."""
    hints, docs, out = typing.get_type_hints(cls), field_docs(cls), []
    for f in fields(cls):
        if not _is_section(f):
            out.append(Setting(f.name, (f.name,), hints[f.name], f.default, docs.get(f.name, "")))
            continue
        sub = f.default_factory
        sub_hints, sub_docs = typing.get_type_hints(sub), field_docs(sub)
        for g in fields(sub):
            flat = g.metadata.get("flag", f"{sub.PREFIX}_{g.name}")
            out.append(Setting(flat, (f.name, g.name), sub_hints[g.name], g.default, sub_docs.get(g.name, "")))
    return out


def add_config_args(parser: argparse.ArgumentParser, cls: type = TrainConfig) -> None:
    """Add one ``--setting-name`` option per setting; defaults are None so that TOML values can sit beneath."""
    for s in settings(cls):
        flag = "--" + s.name.replace("_", "-")
        help_ = f"{s.doc} (default: {s.default})"
        if s.type is bool:
            parser.add_argument(flag, dest=s.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typing.get_origin(s.type) is Literal:
            parser.add_argument(flag, dest=s.name, choices=typing.get_args(s.type), default=None, help=help_)
        else:
            parser.add_argument(flag, dest=s.name, type=_base_type(s.type), default=None, help=help_)


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is not Literal and args else tp


def load_toml(path: str | os.PathLike, cls: type = TrainConfig, flags_only: Collection[str] = ()) -> dict[str, Any]:
    """Read a TOML config into flat settings; keys are setting names (dashes allowed) or a feature's table.

    A table names a feature: ``[tree]`` then ``roots = "sample"`` is ``tree_roots`` (flags stay flat:
    ``--tree-roots``); ``[guard]`` ``enabled = true`` is ``guard``. An unknown key anywhere is an error; one of
    ``flags_only`` (the method's part overrides) is refused as given by flag only.
    """
    p = Path(path)
    named = f"config = {str(p)!r}"
    if p.is_dir():
        raise ConfigError(f"{named}: is a directory; allowed: a TOML file")
    if not p.exists():
        raise ConfigError(f"{named}: config file does not exist")
    if not p.is_file():
        raise ConfigError(f"{named}: is not a regular file; allowed: a TOML file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{named}: is not UTF-8 text (byte {e.start}); allowed: a TOML file") from None
    except OSError as e:
        raise ConfigError(f"{named}: cannot be read ({e.strerror or e}); allowed: a readable TOML file") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{named}: is not valid TOML: {e}") from None
    known = {s.name: s for s in settings(cls)}
    by_table = {}  # "tree.roots" -> tree_roots (the table may be the section's field name or its prefix)
    for f in fields(cls):
        if _is_section(f):
            for s in known.values():
                if s.path[0] == f.name:
                    by_table[f"{f.name}.{s.path[1]}"] = by_table[f"{f.default_factory.PREFIX}.{s.path[1]}"] = s.name
    out: dict[str, Any] = {}
    written_as: dict[str, str] = {}
    tables = {name for f in fields(cls) if _is_section(f) for name in (f.name, f.default_factory.PREFIX)}
    for key, value in data.items():
        items = [(f"{key}.{k}", v) for k, v in value.items()] if isinstance(value, dict) else [(key, value)]
        for written, v in items:
            name = written.replace("-", "_")
            setting = by_table.get(name) if "." in name else name if name in known else None
            if name in flags_only:
                raise ConfigError(f"config file {str(p)!r}: {written!r} is a part override of the method, given as "
                                  f"a flag only (--{name.replace('_', '-')}); the file holds the run's settings")
            if name in tables and not isinstance(v, dict):
                keys = sorted(k.split(".", 1)[1] for k in by_table if k.startswith(f"{name}."))
                raise ConfigError(f"config file {str(p)!r}: {written!r} is a table; write [{name}] with its keys "
                                  f"({', '.join(keys)})")
            if setting is None or isinstance(v, dict):
                near = difflib.get_close_matches(name, list(by_table) if "." in name else list(known), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ConfigError(f"config file {str(p)!r}: unknown field {written!r}{hint}; "
                                  f"allowed: {', '.join(sorted(known))}")
            if setting in out:  # `lora_rank` and `[lora] rank`, or `warmup-steps` and `warmup_steps`: one silently won
                raise ConfigError(f"config file {str(p)!r}: {written!r} and {written_as[setting]!r} both set "
                                  f"{setting}; give it once")
            try:  # here, not only when the settings are built: a flag given over it would hide a wrong type
                _typed(known[setting], v)
            except ConfigError as e:
                raise ConfigError(f"config file {str(p)!r}: {e}") from None
            out[setting] = v
            written_as[setting] = written
    return out


def _typed(s: Setting, value: Any) -> Any:
    """``value`` of setting ``s`` checked against its type (a float setting's int becomes a float); ConfigError in one
    line otherwise."""
    base = _base_type(s.type)
    ok = (
        value in typing.get_args(s.type) if typing.get_origin(s.type) is Literal
        else isinstance(value, bool) if base is bool
        else isinstance(value, (int, float)) and not isinstance(value, bool) if base is float
        else isinstance(value, int) and not isinstance(value, bool) if base is int
        else isinstance(value, base)
    )
    if not ok:
        allowed = ("one of " + ", ".join(map(repr, typing.get_args(s.type)))
                   if typing.get_origin(s.type) is Literal else getattr(base, "__name__", base))
        raise ConfigError(f"{s.name} = {value!r} must be {allowed}")
    if base is float and not (abs(value) < 1e308 if isinstance(value, int) else math.isfinite(value)):
        raise ConfigError(f"{s.name} = {value!r} must be a finite number")  # (an int past 1e308 has no float)
    if base is int and not -2**63 < value < 2**63:  # past int64, torch's C++ raised an overflow traceback
        raise ConfigError(f"{s.name} = {value!r} must be an integer of magnitude below 2**63")
    return float(value) if base is float else value


def build_config(values: dict[str, Any], cls: type = TrainConfig, *, strict: bool = True) -> Any:
    """Instantiate ``cls`` from flat settings (TOML merged with flags), checking each one's type. A name that is no
    setting is refused in one line (``build_config({"tree_root": ...})`` was silently ignored); ``strict=False``
    leaves out those of a run's saved record, which an older polyrl may have written."""
    if strict:
        known = {s.name for s in settings(cls)}
        unknown = sorted(k for k in values if k not in known)
        if unknown:
            from polyrl.registry import did_you_mean

            raise ConfigError(f"{unknown[0]} is not a setting of {cls.__name__}{did_you_mean(unknown[0], known)}; "
                              "the flat names are polyrl train's flags with _ for -")
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for s in settings(cls):
        if s.name not in values or values[s.name] is None:
            continue
        value = _typed(s, values[s.name])
        if len(s.path) == 1:
            top[s.name] = value
        else:
            sections.setdefault(s.path[0], {})[s.path[1]] = value
    for f in fields(cls):
        if _is_section(f):
            top[f.name] = f.default_factory(**sections.get(f.name, {}))
    return cls(**top)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The flat settings of a config (what flags, TOML keys and a run's config.json name)."""
    out = {}
    for s in settings(type(cfg)):
        value = cfg
        for part in s.path:
            value = getattr(value, part)
        out[s.name] = value
    return out


def flat(cfg: Any) -> Any:
    """A read-only view of ``cfg`` by flat setting names (``flat(cfg).tree_roots``), for rules across sections."""
    return types.SimpleNamespace(**to_dict(cfg))


def _rule(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name} = {value!r} is not allowed; {allowed}")


def validate(config: TrainConfig) -> None:
    """Check value ranges and combinations that do not depend on loading anything."""
    cfg, default = flat(config), flat(TrainConfig())
    for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "epochs_per_batch", "minibatches",
                 "micro_batch_size", "eval_prompts", "max_gen_rounds", "max_bad_steps"):
        v = getattr(cfg, name)
        _rule(name, v, v >= 1, "must be an integer >= 1")
    for name in ("warmup_steps", "eval_every", "checkpoint_every", "threads", "top_k", "log_every", "train_prompts",
                 "async_staleness", "micro_batch_tokens"):
        v = getattr(cfg, name)
        _rule(name, v, v >= 0, "must be an integer >= 0")
    _rule("seed", cfg.seed, 0 <= cfg.seed < 2**32, "must be an integer in [0, 2**32)")
    _rule("threads", cfg.threads, cfg.threads <= max_threads(),
          f"must be an integer in [0, {max_threads()}] (0 = every core this process may run on; at most 4 per core; "
          "a run recorded with more, resumed here, takes --threads)")
    _rule("train_prompts", cfg.train_prompts, cfg.train_prompts <= 10**7,  # the pool is built before step 1
          "must be an integer in [0, 10000000] (0 = the whole train split)")
    rollouts = cfg.prompts_per_step * cfg.group_size  # one step's batch is generated and held at once
    _rule("prompts_per_step", cfg.prompts_per_step, rollouts <= 10**6,
          f"prompts_per_step x group_size ({rollouts}) must be at most 1000000 rollouts a step")
    _rule("eval_prompts", cfg.eval_prompts, cfg.eval_prompts <= 10**6, "must be an integer in [1, 1000000]")
    _rule("lr", cfg.lr, cfg.lr > 0, "must be > 0")
    _rule("critic_lr", cfg.critic_lr, cfg.critic_lr > 0, "must be > 0")
    _rule("weight_decay", cfg.weight_decay, cfg.weight_decay >= 0, "must be >= 0")
    _rule("max_grad_norm", cfg.max_grad_norm, cfg.max_grad_norm >= 0, "must be >= 0 (0 = off)")
    _rule("guard_lr_factor", cfg.guard_lr_factor, 0 < cfg.guard_lr_factor < 1, "must be in (0, 1)")
    _rule("guard_max_rollbacks", cfg.guard_max_rollbacks, cfg.guard_max_rollbacks >= 1, "must be an integer >= 1")
    for name in ("guard_lr_factor", "guard_max_rollbacks"):
        _rule(name, getattr(cfg, name), cfg.guard or getattr(cfg, name) == getattr(default, name),
              "only applies with the collapse guard (add --guard)")
    if cfg.guard:
        _rule("checkpoint_every", cfg.checkpoint_every, cfg.checkpoint_every >= 1,
              "must be >= 1 with --guard (the guard rolls back to a checkpoint)")
    _rule("tree_root_frac", cfg.tree_root_frac, 0 < cfg.tree_root_frac <= 1, "must be in (0, 1]")
    _rule("tree_candidates", cfg.tree_candidates, 1 <= cfg.tree_candidates <= 1000, "must be in [1, 1000] (candidate "
          "prompts a group slot; 1e5 drew and scored prompts for 18 s a step, 1e9 grew past 5 GB before step 1)")
    _rule("tree_prune", cfg.tree_prune, 0 <= cfg.tree_prune < 0.5, "must be in [0, 0.5)")
    _rule("tree_half_life", cfg.tree_half_life, cfg.tree_half_life >= 0, "must be >= 0 (0 = no ageing)")
    if cfg.agency is not None:
        _rule("agency", cfg.agency, bool(str(cfg.agency).strip()) and Path(cfg.agency).is_dir(),
              "must be an existing local model directory")
        from polyrl.rollout.agency.config import parse_schedule

        try:
            parse_schedule(cfg.agency_schedule)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.async_staleness:
        _rule("async_staleness", cfg.async_staleness, cfg.sampler == "uniform",
              f"needs sampler = 'uniform' (got sampler = {cfg.sampler!r})")
        _rule("async_staleness", cfg.async_staleness, not cfg.guard,
              "does not combine with --guard (batches prefetched before a rollback were sampled by the collapsed "
              "policy)")
        _rule("async_staleness", cfg.async_staleness, cfg.agency is None,
              "does not combine with agency transfer (a prefetched batch would mix at an earlier step's beta)")
    _rule("vllm_gpu_memory_utilization", cfg.vllm_gpu_memory_utilization, 0 < cfg.vllm_gpu_memory_utilization <= 1,
          "must be in (0, 1]")
    _rule("vllm_gpu_memory_utilization", cfg.vllm_gpu_memory_utilization, cfg.generator == "vllm"
          or cfg.vllm_gpu_memory_utilization == default.vllm_gpu_memory_utilization,
          "only applies with --generator vllm")
    if cfg.generator == "vllm":  # one in-process engine beside a one-process learner (rollout/vllm.py)
        for name, off, why in [
            ("agency", cfg.agency is None, "agency transfer mixes two models token by token in HFGenerator's loop"),
            ("rollout_workers", not cfg.rollout_workers, "Ray rollout workers run HFGenerator"),
            ("async_staleness", not cfg.async_staleness, "prefetching rollout workers run HFGenerator"),
            ("nproc", cfg.nproc == 1, "the engine runs beside a one-process learner"),
            ("tree_predictor", cfg.sampler != "tree" or cfg.tree_predictor != "shared",
             "'shared' embeds prompts with the sampler's transformers model; use history or likelihood"),
        ]:
            _rule(name, getattr(cfg, name), off, f"does not combine with --generator vllm ({why})")
    _rule("rollout_workers", cfg.rollout_workers, cfg.rollout_workers >= 0, "must be an integer >= 0")
    _rule("ray_cpus", cfg.ray_cpus, cfg.ray_cpus >= 0, "must be an integer >= 0 (0 = the machine's cores)")
    _rule("rollout_worker_gpus", cfg.rollout_worker_gpus, cfg.rollout_worker_gpus >= 0, "must be >= 0")
    for name in ("ray_address", "ray_cpus", "rollout_worker_gpus"):
        _rule(name, getattr(cfg, name), cfg.rollout_workers or cfg.async_staleness
              or getattr(cfg, name) == getattr(default, name),
              "only applies with Ray rollout workers (add --rollout-workers N or --async-staleness k)")
    _rule("ray_cpus", cfg.ray_cpus, not cfg.ray_cpus or cfg.ray_address is None,
          "sizes the local Ray instance polyrl starts; a cluster joined with --ray-address has its own")
    _rule("ray_cpus", cfg.ray_cpus, not cfg.ray_cpus or cfg.ray_cpus >= max(cfg.rollout_workers, 1),
          f"must be >= the {max(cfg.rollout_workers, 1)} rollout worker(s) it hosts (one CPU each)")
    _rule("nproc", cfg.nproc, cfg.nproc >= 1, "must be an integer >= 1")
    _rule("nproc", cfg.nproc, cfg.nproc == 1 or not cfg.guard,
          "does not combine with --guard (the guard's rollback runs in one process)")
    _rule("nproc", cfg.nproc, cfg.nproc == 1 or cfg.sampler != "tree" or cfg.tree_predictor != "likelihood",
          "does not combine with tree_predictor = 'likelihood' (it scores with the learner on rank 0 alone, which a "
          "sharded learner cannot do); use history or shared")
    if cfg.sampler == "tree":
        _rule("sampler", cfg.sampler, cfg.group_size >= 2, "'tree' needs group_size >= 2")
    # settings of a feature that is off would be silently ignored: refuse them
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
    _rule("value_clip", cfg.value_clip, cfg.value_clip >= 0, "must be >= 0 (0 = unclipped)")
    _rule("drift_prompts", cfg.drift_prompts, 0 <= cfg.drift_prompts <= 10**6,
          "must be an integer in [0, 1000000] (0 = off)")
    _rule("drift_prompts", cfg.drift_prompts, not cfg.drift_prompts or (cfg.nproc == 1 and cfg.agency is None),
          "does not combine with nproc > 1 or --agency (it scores the probe set with the policy in this process, "
          "sampled from the starting policy alone)")
    _rule("lora_rank", cfg.lora_rank, cfg.lora_rank >= 0, "must be an integer >= 0 (0 = full fine-tuning)")
    _rule("lora_alpha", cfg.lora_alpha, cfg.lora_alpha > 0, "must be > 0")
    _rule("lora_dropout", cfg.lora_dropout, 0 <= cfg.lora_dropout < 1, "must be in [0, 1)")
    _rule("lora_targets", cfg.lora_targets, bool(cfg.lora_targets.strip(", ")),
          "must be all-linear or comma-separated module names (q_proj,v_proj)")
    for name in ("lora_alpha", "lora_targets", "lora_dropout"):
        _rule(name, getattr(cfg, name), cfg.lora_rank or getattr(cfg, name) == getattr(default, name),
              "only applies with LoRA (add --lora-rank r)")
    _rule("lora_rank", cfg.lora_rank, not cfg.lora_rank or cfg.nproc == 1,
          "does not combine with nproc > 1 yet (the FSDP2 learner shards full weights); train LoRA in one process")
    _rule("fp32_lm_head", cfg.fp32_lm_head, not cfg.fp32_lm_head or cfg.dtype != "float32",
          "only applies with dtype = 'bfloat16' (a float32 model's head is float32 already)")
    if cfg.wandb:
        import importlib.util

        _rule("wandb", cfg.wandb, importlib.util.find_spec("wandb") is not None,
              "needs the wandb package (pip install wandb); TensorBoard events are written without it")
    _rule("temperature", cfg.temperature, cfg.temperature > 0, "must be > 0")
    _rule("temperature", cfg.temperature, cfg.generator != "vllm" or 0.01 <= cfg.temperature <= 2,
          "must be in [0.01, 2] with --generator vllm (vLLM refuses more than 2 and samples at 0.01 below it, "
          "while the trainer would score at the temperature given)")
    _rule("top_p", cfg.top_p, 0 < cfg.top_p <= 1, "must be in (0, 1]")
    batch = cfg.prompts_per_step * cfg.group_size
    _rule("minibatches", cfg.minibatches, batch % cfg.minibatches == 0,
          f"must divide prompts_per_step * group_size = {batch}")
    if cfg.model is not None:
        _rule("model", cfg.model, Path(cfg.model).is_dir(), "must be an existing local model directory")
    _rule("task", cfg.task, cfg.task != "code" or cfg.model is not None,
          "has no warm start (its rows are problems with tests, not answers to imitate): pass --model DIR")
    if cfg.data_file is not None:
        _rule("data_file", cfg.data_file, Path(cfg.data_file).is_file(),
              "must be an existing JSONL, JSON or Parquet file")
    _rule("heldout_percent", cfg.heldout_percent, 1 <= cfg.heldout_percent <= 50,
          "must be an integer in [1, 50] (training evaluates on the held-out rows)")
    _rule("heldout_percent", cfg.heldout_percent,
          cfg.data_file is not None or cfg.heldout_percent == default.heldout_percent,
          "only applies to a task read from --data-file")


