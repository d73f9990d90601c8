"""`polyrl` command line: train, compare, warmstart, methods, explain, parts, docs, and the RL families (flow).

Bad input prints one line naming the field, the value and what is allowed, and exits with code 2.

torch and transformers are imported only by the commands that need them: `methods`, `parts`, `explain NAME`,
`--help` and usage errors answer from the argument parser and the shipped catalog manifest (polyrl/manifest.py).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from polyrl.build import (
    TrainPlan,
    add_method_args,
    add_train_args,
    method_from_overrides,
    part_changes,
    resolve_train,
)
from polyrl.config import ConfigError
from polyrl.errors import CheckpointError, RewardError, Terminated, TrainingError
from polyrl.plugins import plugin_names
from polyrl.registry import ALL_REGISTRIES, PartError, unknown
from polyrl.runs import files_line

# Piped output (CI logs, tests, `| less`) gets a wide console instead of rich's 80-column default.
console = Console() if sys.stdout.isatty() else Console(width=200)


def uses_manifest(args: argparse.Namespace) -> bool:
    """Whether the command can answer from the catalog manifest, without importing the registries (torch).

    A plugin may register presets and parts that the manifest does not know, and part overrides must be
    validated by the registries: either takes the full path.
    """
    if args.plugin:
        return False
    return args.command in ("methods", "parts") or (args.command == "explain" and not part_changes(vars(args)))


def load_catalog(args: argparse.Namespace) -> dict[str, Any]:
    """What `methods`, `parts` and `explain` print: the shipped manifest, else built from the live registries."""
    from polyrl.manifest import build_manifest, load_manifest

    manifest = load_manifest() if uses_manifest(args) else None
    return manifest if manifest is not None else build_manifest()


def cmd_methods(args: argparse.Namespace) -> int:
    if args.json and args.wide:  # --wide lays out the table; the JSON is the same either way
        raise ConfigError("wide = true does not apply with --json (it widens the table); drop one of them")
    methods = load_catalog(args)["methods"]
    if args.json:
        print(json.dumps([_strict_json(m["dict"]) for m in methods], indent=2, default=str))
        return 0
    if args.wide:
        table = Table(title=f"polyrl presets ({len(methods)})", show_lines=False)
        rows, out = [m["row"] for m in methods], console
    else:
        # Related parts share a column, one per line, and a blank line separates presets: 100 columns are enough.
        table = Table(title=f"polyrl presets ({len(methods)})", box=box.SIMPLE_HEAD, show_lines=True,
                      show_edge=False, pad_edge=False)
        rows, out = [m["compact"] for m in methods], narrow_console()
    for i, col in enumerate(rows[0]):
        # Compact: the name columns keep their width; trust region and other parts wrap after commas.
        table.add_column(col, overflow="fold", no_wrap=not args.wide and i < 2)
    for r in rows:
        table.add_row(*r.values())
    out.print(table)
    out.print("Details: [bold]polyrl explain NAME[/]; overrides such as --trust-region dppo_tv:delta_low=0.1")
    from polyrl.safety import TOOLS

    out.print("Alignment and safety tools ([bold]polyrl safety TOOL --help[/]):")
    for name, (_, line) in TOOLS.items():
        out.print(f"  {name:<11} {line}")
    if not args.wide:
        out.print("One column per part: [bold]polyrl methods --wide[/]")
    return 0


def narrow_console() -> Console:
    """The terminal's own width, or 100 columns when piped (the module's console is 200 wide there)."""
    return console if sys.stdout.isatty() else Console(width=100)


def cmd_explain(args: argparse.Namespace) -> int:
    if uses_manifest(args):
        methods = {m["name"]: m for m in load_catalog(args)["methods"]}
        if args.name not in methods:
            raise unknown("method", args.name, methods)  # the message `get_method` gives
        entry = methods[args.name]
    else:
        from polyrl.manifest import method_entry

        entry = method_entry(method_from_overrides(args.name, vars(args)))
    if args.json:
        print(json.dumps(_strict_json(entry["dict"]), indent=2, default=str))
        return 0
    console.print(f"[bold]{entry['name']}[/] — {entry['summary']}")
    console.print(f"paper: {entry['paper']}")
    table = Table(show_header=True)
    for col in ("part", "resolved", "non-default settings", "what it is"):
        table.add_column(col, overflow="fold")
    for row in entry["explain"]:
        table.add_row(*row)
    console.print(table)
    return 0


def cmd_parts(args: argparse.Namespace) -> int:
    kinds = load_catalog(args)["parts"]
    selected = [k for k in kinds if args.kind in (None, k["kind"])]
    if not selected:
        raise PartError(f"unknown part kind {args.kind!r}; allowed: {', '.join(k['kind'] for k in kinds)}")
    for kind in selected:
        table = Table(title=kind["kind"])
        for col in ("name", "settings (defaults)", "summary"):
            table.add_column(col, overflow="fold")
        for part in kind["parts"]:
            table.add_row(part["name"], part["settings"], part["summary"])
        console.print(table)
    return 0


def cmd_docs(args: argparse.Namespace) -> int:
    """Print docs/methods.md, or write / check it together with the catalog manifest the fast commands read."""
    from polyrl.catalog import render_methods_markdown
    from polyrl.manifest import MANIFEST_PATH, build_manifest, render_manifest

    text = render_methods_markdown()
    if not (args.check or args.write):
        if args.manifest:
            raise ConfigError(f"--manifest {args.manifest!r} has no effect without --write or --check (printing "
                              "docs/methods.md writes no manifest)")
        print(text)
        return 0
    if args.plugin:  # the shipped manifest must describe the built-in presets and parts only
        raise ConfigError("docs --write / --check describe the built-in presets and parts: leave out --plugin")
    docs = Path(args.check or args.write)
    targets = [(docs, "--check" if args.check else "--write", text),  # (path, the flag naming it, its text)
               (Path(args.manifest or MANIFEST_PATH), "--manifest", render_manifest(build_manifest()))]
    for p, flag, _ in targets:
        if p.is_dir():
            raise ConfigError(f"{flag} {str(p)!r} is a directory; allowed: the path of a file")
    if args.check:
        stale = [p for p, flag, t in targets if not p.exists() or _text(p, flag) != t]
        for p in stale:
            print(f"{p} is stale: run `polyrl docs --write {docs}`", file=sys.stderr)
        return 1 if stale else 0
    for p, flag, t in targets:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(t)
        except OSError as e:
            raise ConfigError(f"{flag} {str(p)!r} cannot be written ({e.strerror or e})") from None
        console.print(f"wrote {p}")
    return 0


def _text(path: Path, flag: str) -> str:
    """A file ``docs --check`` compares; one that is not UTF-8 text is a one-line ConfigError naming ``flag``."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ConfigError(f"{flag} {str(path)!r} cannot be read ({why}); allowed: a text file") from None


def load_plugin(module: str) -> None:
    """Import a module by dotted name or a ``.py`` file path so that its parts and presets register."""
    from polyrl.plugins import import_module_or_file

    try:
        import_module_or_file(module)
    except Exception as e:  # a missing module, a syntax error or a module that raises while it loads
        here = Path(module.replace(".", "/") + ".py")
        hint = (f" (the `polyrl` command does not import from the current directory: give the file, --plugin {here})"
                if isinstance(e, ModuleNotFoundError) and e.name == module.split(".")[0] and here.is_file() else "")
        raise PartError(f"--plugin {module!r} could not be imported: {type(e).__name__}: {e}{hint}") from None


def cache_dir() -> Path:
    """Where warm starts are cached: $POLYRL_CACHE, else ~/.cache/polyrl."""
    return Path(os.environ.get("POLYRL_CACHE", Path.home() / ".cache" / "polyrl"))


def _strict_json(value):
    """``value`` with its non-finite floats as the strings 'inf', '-inf', 'nan': json.dumps would write Infinity,
    which strict JSON parsers refuse (a part parameter may be inf, e.g. an unbounded trust region)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def cmd_warmstart(args: argparse.Namespace) -> int:
    from polyrl.runs import signals_unwind
    from polyrl.tinylm import warmstart

    # Bad settings are a one-line ConfigError (check_warmstart), a threshold not reached a TrainingError; a SIGTERM
    # ends it with one line, as every other command.
    with signals_unwind():
        result = warmstart(args.task, cache_dir() / "warmstart", threshold=args.threshold, seed=args.seed,
                           hidden=args.hidden, layers=args.layers)
    how = "cached" if result.cached else f"trained in {result.seconds:.0f} s, {result.steps} steps"
    console.print(f"warm start for {args.task}: accuracy {result.accuracy:.3f} ({how})\n{result.path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from polyrl.checkpoint import checkpoint_step, resume_checkpoint, verify_checkpoint
    from polyrl.learner.sharded import export_hf
    from polyrl.runs import saved_record

    checkpoint = Path(args.checkpoint)
    if checkpoint.name == "checkpoints" and not (checkpoint / "meta.json").exists():  # RUN_DIR/checkpoints
        checkpoint = checkpoint.parent
    if not (checkpoint / "meta.json").exists() and (checkpoint / "checkpoints").is_dir():  # a run directory
        checkpoint, _ = resume_checkpoint(checkpoint, use=f"export it with `polyrl export {{path}} {args.out}`")
    named = checkpoint_step(checkpoint) is not None  # a checkpoint without meta.json: incomplete or corrupt
    if checkpoint.is_dir() and not (checkpoint / "meta.json").exists() and not named:
        inside = next((p for p in checkpoint.parents if (p / "meta.json").is_file()), None)  # e.g. step_N/adapter
        raise ConfigError(f"{checkpoint} is not a checkpoint{f' (it is inside checkpoint {inside})' if inside else ''}"
                          "; allowed: a run directory or its checkpoints/step_NNNNNN")
    verify_checkpoint(checkpoint)  # one line for a missing or corrupt checkpoint
    run = checkpoint.parent.parent
    record = saved_record(str(run)) or {}
    saved = record.get("config", {})
    model = args.model or saved.get("model")
    if model is None and (run / "summary.json").is_file():  # a warm-start run: summary.json names the directory
        model = json.loads((run / "summary.json").read_text()).get("model")
    if model is None:
        raise ConfigError(f"checkpoint {checkpoint}: its run has no config.json naming the model; pass --model DIR")
    out = export_hf(checkpoint, args.out, model, chat_template=saved.get("chat_template", "auto"),
                    template_text=record.get("chat_template_text"))
    console.print(f"exported {checkpoint} to {out} (load it with from_pretrained)")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from polyrl.launch import die_with_launcher, relaunches, world
    from polyrl.runs import run_lock, set_aside_run, signals_unwind

    global console
    die_with_launcher()
    if world()[0] != 0:  # one rank of several speaks and writes the run directory: rank 0
        console = Console(quiet=True)
    with contextlib.ExitStack() as held:

        def claim(run_dir: str) -> None:  # rank 0 holds the run directory (a --nproc launcher while it reads
            if world()[0] == 0:  # the run, then hands the hold to the rank 0 it launches: _train_plan)
                held.enter_context(run_lock(run_dir))

        plan = resolve_train(args, claim=claim)
        # --overwrite moves the old run aside; the trainer deletes it once its parts are built, and a command that
        # ends before that (a refusal while the model loads, Ctrl-C, SIGTERM) puts it back. With --nproc the rank-0
        # process that this one launches does it.
        with signals_unwind():
            try:
                if plan.replace and not relaunches(plan.cfg.scale.nproc):
                    plan.replaced = set_aside_run(plan.run_dir)
                return _train_plan(args, plan, release=held.close)
            finally:
                _settle_replaced(args, plan)


def _drop_replaced(plan: TrainPlan) -> None:
    """The new run's parts are built: delete the old run ``--overwrite`` set aside; if the file system refuses, say
    where it is in one line and train on."""
    from polyrl.runs import drop_replaced

    try:
        drop_replaced(plan.replaced)
    except OSError as e:
        print(f"polyrl: warning: the replaced run of {plan.run_dir} could not be deleted ({e.strerror or e}); it is "
              f"in {plan.replaced} or {plan.replaced}.deleting", file=sys.stderr)


def _settle_replaced(args: argparse.Namespace, plan: TrainPlan) -> None:
    """Put back or delete the old run ``--overwrite`` set aside (``runs.settle_replaced``); if the file system refuses,
    say where it is in one line and let the command's own outcome stand."""
    from polyrl.runs import settle_replaced

    try:
        args.restored_run = settle_replaced(plan.run_dir, plan.replaced)
    except OSError as e:
        print(f"polyrl: warning: the old run of {plan.run_dir} is still in {plan.replaced} ({e.strerror or e}); "
              "move it back or delete it by hand", file=sys.stderr)


def _train_plan(args: argparse.Namespace, plan: TrainPlan, release=lambda: None) -> int:
    from polyrl.catalog import method_dict
    from polyrl.config import to_dict
    from polyrl.launch import relaunch, relaunches, world
    from polyrl.learner.dist import leave
    from polyrl.runs import forget_unstarted, record_resume, write_record
    from polyrl.trainer import train

    for note in plan.notes:
        console.print(note)
    cfg, method, task, run_dir = plan.cfg, plan.method, plan.task, plan.run_dir
    args.resolved_run_dir = run_dir  # for `main`'s line on Ctrl-C (resolve_train checked it: runs.check_out_dir)
    if cfg.model is None:
        from polyrl.tinylm import warmstart

        ws = warmstart(cfg.task, cache_dir() / "warmstart", seed=0)  # resolve_train checked the task has one
        cfg.model = ws.path
        console.print(f"warm start: {cfg.model} ({'cached' if ws.cached else f'{ws.seconds:.0f} s'}, "
                      f"accuracy {ws.accuracy:.3f})")
    if relaunches(cfg.scale.nproc):  # the same command as N ranks (torch.distributed.run)
        console.print(f"starting {cfg.scale.nproc} training processes (FSDP2)")
        release()  # the launched rank 0 holds the run directory from here
        return relaunch(cfg.scale.nproc, [*args.argv, "--model", cfg.model])
    if world()[0] != 0:
        done = train(cfg, method, model_dir=cfg.model, task=task, run_dir=run_dir, console=console)
        leave()
        return 0 if done else 1
    created = not Path(run_dir).exists()
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. no permission
        raise ConfigError(f"run_dir = {run_dir!r} cannot be created: {e.strerror or e}") from None
    existing = {p.name for p in Path(run_dir).iterdir()}  # e.g. its own --config TOML: not the new run's
    if cfg.resume:
        record_resume(run_dir, plan.resume_step, cfg.resume_from, plan.changes)
        said = "; ".join(f"{k} {old} -> {new}" for k, (old, new) in plan.changes.items())
        console.print(f"resuming {run_dir} from {cfg.resume_from} with its own settings"
                      + (f" (changed: {said})" if said else ""))
    else:
        from polyrl.tasks.chat import read_template

        record = {"config": to_dict(cfg), "method": method_dict(method), "overrides": plan.overrides,
                  "plugins": plugin_names(args.plugin)}  # a resume needs them again
        template = read_template(cfg.data.chat_template)  # its text, for the export (the file may move or change)
        write_record(run_dir, record if template is None else {**record, "chat_template_text": template})
        console.print_json(json.dumps(to_dict(cfg)))
    console.print(f"method: {method.name} = " + "; ".join(f"{k} {v}" for k, v in method.parts().items() if v))
    try:
        summary = train(cfg, method, model_dir=cfg.model, task=task, run_dir=run_dir, console=console,
                        on_start=lambda: _drop_replaced(plan))
    except Exception:
        if not cfg.resume:
            forget_unstarted(run_dir, created=created, existing=existing)
        raise
    leave()  # the ranks of --nproc / torchrun leave their process group together (no-op in one process)
    table = Table(title=f"{method.name} on {task.name}")
    for col in ("held-out accuracy before", "after", "steps", "s/step", "rollouts/s", "wall s"):
        table.add_column(col, justify="right")
    table.add_row(f"{summary['eval_before']:.3f}", f"{summary['eval_after']:.3f}", str(summary["steps"]),
                  f"{summary['seconds_per_step']:.2f}", f"{summary['rollouts_per_second']:.1f}",
                  f"{summary['wall_seconds']:.0f}")
    console.print(table)
    console.print(files_line(run_dir))
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (naming the option and value) and exit code 2."""

    subcommands: Any = None  # the action of add_subparsers: command name -> its parser
    raising = False  # raise ConfigError instead of exiting (flags checked inside another command)

    def __init__(self, *args, **kwargs) -> None:
        # No abbreviations: `compare --seed 2` was read as --seeds 2, past the refusal meant for --seed.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        if self.raising:
            raise ConfigError(message)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    def add_subparsers(self, **kwargs):
        self.subcommands = super().add_subparsers(**kwargs)
        return self.subcommands

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """argparse's, with a did-you-mean for misspelled flags (see ``unrecognized``)."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self.error(self.unrecognized(parsed, extra))
        return parsed

    def command_parser(self, args: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the (sub)command that ``args`` selected: the one that knows its options."""
        parser = self
        while (action := getattr(parser, "subcommands", None)) is not None:
            chosen = action.choices.get(getattr(args, action.dest, None))
            if chosen is None:
                break
            parser = chosen
        return parser

    def unrecognized(self, args: argparse.Namespace, extra: Sequence[str]) -> str:
        """argparse's message for leftover arguments, with the command's closest option for each unknown flag."""
        options = [s for action in self.command_parser(args)._actions for s in action.option_strings]
        words, value_may_follow = [], False
        for token in extra:
            if token.split("=", 1)[0] == "--plugin":  # polyrl's own option, parsed before the command
                command = getattr(args, "command", None) or "COMMAND"
                words.append(f"{token} (it goes before the command: polyrl --plugin MODULE {command} ...)")
                value_may_follow = "=" not in token
            elif token.startswith("--") or (token.startswith("-") and token[1:2].isalpha()):
                near = difflib.get_close_matches(token.split("=", 1)[0], options, n=1)
                words.append(token + (f" (did you mean {near[0]}?)" if near else ""))
                value_may_follow = "=" not in token
            elif value_may_follow:  # most likely the unknown flag's value: naming the flag says enough
                value_may_follow = False
            else:
                words.append(token)
        return "unrecognized arguments: " + " ".join(words)


def cmd_compare(args: argparse.Namespace) -> int:
    import math

    from polyrl.lab.compare import (
        check_train_flags,
        method_labels,
        parse_method_args,
        refuse_foreign_out,
        refuse_run_flags,
        threads_given,
        validate_runs,
    )
    from polyrl.runs import MAX_SEEDS, check_out_dir

    check_out_dir(args.out)
    refuse_foreign_out(Path(args.out))
    presets = method_labels(args.methods)  # label -> preset
    methods = list(presets)
    if not methods:
        raise ConfigError("methods = '' : give at least one preset, e.g. --methods grpo,dapo")
    if not 1 <= args.seeds <= MAX_SEEDS or args.workers < 1:
        raise ConfigError(f"seeds = {args.seeds}, workers = {args.workers}: seeds must be in [1, {MAX_SEEDS}] (each "
                          "seed is a training run per method), workers >= 1")
    # The analysis settings are used after every run has trained: checked now.
    if not 0.0 < args.ci < 1.0:
        raise ConfigError(f"ci = {args.ci} is not allowed: a confidence level in (0, 1), e.g. 0.9")
    if not 0.0 < args.collapse_drop <= 1.0:
        raise ConfigError(f"collapse_drop = {args.collapse_drop} is not allowed: a fraction in (0, 1], e.g. 0.5")
    if not math.isfinite(args.threshold):
        raise ConfigError(f"threshold = {args.threshold} is not allowed: a finite number (a held-out accuracy)")
    if not getattr(args, "family", None) and not 0.0 <= args.threshold <= 1.0:  # a family's may be any reward
        raise ConfigError(f"threshold = {args.threshold:g} is not allowed: a held-out accuracy in [0, 1] (beyond it "
                          "no run can ever reach it)")
    per_method = parse_method_args(args.method_args, methods)
    # every run loads the --plugin modules this command loaded (its presets and parts were checked with them)
    plugins = tuple(a for m in plugin_names(args.plugin) for a in ("--plugin", m))
    refuse_run_flags(args.extra, "train flags")  # compare sets these per run: given again, they would win
    for method, flags in per_method.items():
        refuse_run_flags(flags, f"method_args for {method!r}")
    if args.family is not None:  # an RL family: its own train command and settings, no model to start from
        from polyrl.families import discover, family_module

        if args.family not in discover():
            raise ConfigError(f"family = {args.family!r} is not allowed; families: {', '.join(discover())}")
        if args.model is not None:
            raise ConfigError(f"model = {args.model!r} does not apply with family = {args.family!r} (it trains its "
                              "own policy)")
        module = family_module(args.family)
        shared, model = [*(["--task", args.task] if args.task else []), *args.extra], None
        command, resumable, check = (*plugins, args.family, "train"), False, module.check_train_flags
        args.checkpointed = getattr(module, "checkpointed", None)  # None: its runs restart (flow saves none)
    else:
        shared, model = ["--task", args.task or "addition", *args.extra], args.model
        flags = OneLineParser(prog="polyrl train", add_help=False)
        flags.raising = True
        add_train_args(flags)
        if model is None:  # a misspelt flag or preset is refused before the warm start trains (minutes), not after
            from polyrl.build import METHOD_OVERRIDES
            from polyrl.tinylm import warmstart

            def names_only(argv: list[str]) -> None:  # the flags parse, the preset and its part overrides resolve
                parsed = flags.parse_args([*argv, "--model", "-"])
                method_from_overrides(parsed.method, {k: getattr(parsed, k) for k in METHOD_OVERRIDES
                                                      if getattr(parsed, k, None) is not None})

            validate_runs(methods, shared, per_method, presets, check=names_only)
            model = warmstart(args.task or "addition", cache_dir() / "warmstart", seed=0).path
        command, resumable, check = (*plugins, "train"), True, check_train_flags(flags.parse_args, model)
        args.threads_given = {m for m in methods  # a method's own flags or --config may set them (kept, not split)
                              if threads_given(flags.parse_args, [*shared, *per_method.get(m, []), "--model", model])}
    args.expected = validate_runs(methods, shared, per_method, presets, check=check)
    from polyrl.runs import run_lock, signals_unwind

    # SIGTERM unwinds as Ctrl-C does (run_all stops the runs it started); one compare at a time on an --out (a second
    # one truncated the running runs' logs and reported them half done)
    with signals_unwind(), run_lock(args.out, "out"):
        return _run_compare(args, methods, presets, shared, per_method, model, command, resumable)


def _run_compare(args, methods, presets, shared, per_method, model, command, resumable) -> int:
    from polyrl.lab import CollapseRule, print_ranking, write_report
    from polyrl.lab.analysis import analyse_runs, load_runs
    from polyrl.lab.compare import plan_runs, run_all

    out = Path(args.out)
    specs = plan_runs(methods, list(range(args.seeds)), out, shared, per_method, model, workers=args.workers,
                      presets=presets, command=command, resumable=resumable,
                      checkpointed=getattr(args, "checkpointed", None), threads=getattr(args, "threads_given", ()),
                      expected=getattr(args, "expected", None))
    console.print(f"{len(specs)} run(s) to do of {len(methods) * args.seeds} (others finished)"
                  + (f"; model {model}" if model else ""))
    failed = [s for s, code, _ in run_all(specs, workers=args.workers, console=console) if code != 0]
    found = load_runs(out)
    runs = {m: kept for m in methods if (kept := [r for r in found.get(m, []) if r.seed < args.seeds])}
    if not runs:  # every run failed before it logged a step: nothing to analyse
        raise TrainingError(f"no run under {out} logged a step (every run failed): see its METHOD/seedK.train.log "
                            "files")
    other = sum(len(rs) for rs in found.values()) - sum(len(rs) for rs in runs.values())
    if other:  # the report is this command's methods x seeds, not every run an earlier command left there
        console.print(f"{other} other run(s) under {out} (other methods or seeds) are not in this report")
    results = analyse_runs(runs, threshold=args.threshold,
                           collapse_rule=CollapseRule(drop_fraction=args.collapse_drop), ci=args.ci)
    results["out_dir"] = str(out)
    paths = write_report(results, out)
    print_ranking(results, console)
    console.print(f"report: {out / 'report.html'}  results: {out / 'results.json'}  ({len(paths)} files)")
    if failed:
        console.print(f"[red]{len(failed)} run(s) failed[/]: " + ", ".join(s.name for s in failed))
        return 1
    return 0


def build_parser(*, family: str | None = None) -> OneLineParser:
    """The `polyrl` parser. Every RL family (``polyrl.families``) is a placeholder that only parses its name,
    except ``family``, whose full parser is built: a family's parser may import torch, so ``main`` builds it
    only when its command runs and every other command (and `--help`) starts fast.
    """
    from polyrl.families import add_parser, discover

    parser = OneLineParser(prog="polyrl", description=__doc__.splitlines()[0])
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE first, so that its registered parts and presets are available")
    sub = parser.add_subparsers(dest="command", required=True)
    for fam in discover().values():
        if fam.name == family:
            add_parser(fam, sub)
        else:
            sub.add_parser(fam.name, help=fam.help, add_help=False)
    from polyrl.safety import HELP as SAFETY_HELP

    if family == "safety":  # the toolkit's tools may import torch: its real parser is built only for its command
        from polyrl.safety.cli import add_parser as add_safety_parser

        add_safety_parser(sub)
    else:
        sub.add_parser("safety", help=SAFETY_HELP, add_help=False)

    p = sub.add_parser("train", help="RL-train a local Hugging Face causal LM with a preset (and overrides)")
    add_train_args(p)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("export", help="write a run's (or a checkpoint's) policy as a plain Hugging Face directory")
    p.add_argument("checkpoint", help="a run directory (its newest checkpoint) or a checkpoint directory: "
                   "RUN_DIR/checkpoints/step_000050 (any layout; a LoRA adapter is merged into the base)")
    p.add_argument("out", help="the directory to write (config, tokenizer, model.safetensors)")
    p.add_argument("--model", default=None,
                   help="the run's starting model directory (config and tokenizer); default: the run's config.json")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("compare", help="run methods x seeds on one task and report stability and efficiency",
                       description="Any other option is passed to every `polyrl train` run (e.g. --steps 150 "
                                   "--epochs-per-batch 4 --lr 3e-4).")
    p.add_argument("--methods", required=True, help="comma-separated presets, e.g. grpo,dapo,cispo,dppo_tv; "
                   "LABEL=PRESET names a variant (uniform=grpo,tree=grpo with --method-args 'tree=--sampler tree')")
    p.add_argument("--seeds", type=int, default=3, help="seeds per method (0 .. N-1)")
    p.add_argument("--task", help="task for every run (default: addition; a family's own default)")
    p.add_argument("--model", help="start every run from this model directory (default: the task's warm start)")
    p.add_argument("--family", help="compare presets of an RL family (e.g. flow) instead of language-model presets")
    p.add_argument("--out", required=True, help="output directory: one run directory per method and seed")
    p.add_argument("--workers", type=int, default=1, help="runs in parallel (each gets cores / workers threads)")
    p.add_argument("--method-args", action="append", metavar="METHOD=FLAGS",
                   help="extra train flags for one method, e.g. 'dppo_tv=--trust-region dppo_tv:delta_low=0.1'")
    p.add_argument("--threshold", type=float, default=0.6, help="held-out accuracy threshold for the efficiency table")
    p.add_argument("--collapse-drop", type=float, default=0.5,
                   help="collapse: metric falls below (1 - this) x its best so far")
    p.add_argument("--ci", type=float, default=0.9, help="bootstrap confidence level over seeds")
    p.set_defaults(fn=cmd_compare, extra=[])

    p = sub.add_parser("evidence", help="test the seed documents' claims and write docs/evidence.md")
    p.add_argument("--claims", help="comma-separated claim ids to run, or to print with --list (default: all); "
                   "the report always covers every claim in OUT/results.json")
    p.add_argument("--budget", choices=("quick", "full"), default=None,
                   help="quick smoke test or the full report (default: quick)")
    p.add_argument("--workers", type=int, default=None, help="training runs in parallel, >= 1 (default: 2)")
    p.add_argument("--out", help="output directory (default runs/evidence/<budget>)")
    p.add_argument("--report-only", action="store_true",
                   help="regenerate the reports from OUT/results.json alone (no --claims, no --workers)")
    p.add_argument("--write-docs", action=argparse.BooleanOptionalAction, default=None,
                   help="write docs/evidence.md, docs/evidence/results.json and plots (default: with --budget full)")
    p.add_argument("--list", action="store_true", help="print the claims (filtered by --claims) and their budgets, "
                   "run nothing (takes no other option)")
    p.set_defaults(fn=lambda a: __import__("polyrl.lab.evidence", fromlist=["cli_main"]).cli_main(a, console))

    p = sub.add_parser("warmstart", help="build and supervised-train the tiny model for a task (cached)")
    p.add_argument("--task", default="addition", help="task name")
    p.add_argument("--threshold", type=float, default=0.30, help="stop when held-out greedy accuracy crosses it")
    p.add_argument("--seed", type=int, default=0, help="seed")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.set_defaults(fn=cmd_warmstart)

    p = sub.add_parser("methods", help="list every preset with its parts")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--wide", action="store_true", help="one column per part (about 180 columns wide)")
    p.set_defaults(fn=cmd_methods)

    p = sub.add_parser("explain", help="show a preset's resolved parts, parameters, defaults and paper")
    p.add_argument("name", help="preset name (see `polyrl methods`)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_method_args(p)
    p.set_defaults(fn=cmd_explain)

    p = sub.add_parser("parts", help="list registered parts of one kind or of all kinds")
    p.add_argument("kind", nargs="?", help="one of: " + ", ".join(r.kind for r in ALL_REGISTRIES))
    p.set_defaults(fn=cmd_parts)

    p = sub.add_parser("docs", help="generate docs/methods.md and the catalog manifest from the presets and registries")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", metavar="PATH", help="write the markdown to PATH, and the catalog manifest")
    g.add_argument("--check", metavar="PATH",
                   help="exit 1 if PATH or the catalog manifest differs from the generated text")
    p.add_argument("--manifest", metavar="PATH",
                   help="the catalog manifest to write or check (default: polyrl/catalog.json in the package)")
    p.set_defaults(fn=cmd_docs)
    return parser


def _out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation that failed (torch's CPU or CUDA allocator, numpy, Python): a size too large
    for this machine, said in one line instead of a traceback from deep inside the step."""
    text = str(e)
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or any(
        s in text for s in ("can't allocate memory", "not enough memory", "array is too big", "out of memory"))


def _rank_label() -> str:
    """'rank N: ' for a rank other than 0 of a launch (its refusal may be its own, so it is printed, and says whose),
    else ''."""
    from polyrl.launch import world

    rank = world()[0]
    return f"rank {rank}: " if rank else ""


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = argv  # `polyrl train --nproc N` runs the same command in N processes
    from polyrl.families import FAMILIES

    if args.command in FAMILIES or args.command == "safety":  # its real parser may import torch: built only now
        parser = build_parser(family=args.command)
        args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command != "compare":
            parser.error(parser.unrecognized(args, extra))
        args.extra = extra  # shared `polyrl train` flags, validated per method before any run
    try:
        for dest in ("run_dir", "out"):  # "" would mean the default run directory (then --overwrite deletes it)
            value = getattr(args, dest, None)
            if isinstance(value, str) and not value.strip():
                optional = any(a.dest == dest and a.option_strings for a in parser.command_parser(args)._actions)
                raise ConfigError(f"{dest} = {value!r} is not allowed: a directory path"
                                  + (" (leave the flag out for the default)" if optional else ""))
        for module in args.plugin:
            load_plugin(module)
        if args.plugin:  # every plugin has loaded: their presets may use each other's parts
            from polyrl.methods import check_presets

            check_presets()
        if not uses_manifest(args):
            import polyrl.methods  # noqa: F401  (registers every built-in part and preset; imports torch)

        return int(args.fn(args) or 0)
    except (PartError, ConfigError, CheckpointError, FileNotFoundError, RewardError) as e:
        if not getattr(e, "relayed", False):  # rank 0's error raised again on another rank (ranks.py) is said once
            print(f"polyrl: {_rank_label()}error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:  # the run itself failed, not its configuration
        if not getattr(e, "relayed", False):
            print(f"polyrl: {_rank_label()}training stopped: {e}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError, ValueError) as e:
        if not _out_of_memory(e):
            raise
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"polyrl: out of memory ({line[:200]}); lower the sizes that scale memory (batch, groups, group "
              "size, samples, hidden, layers, max new tokens)", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `polyrl methods --json | head`: the reader left; quiet, as rich's tables are
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that exit's flush cannot raise again
        return 1
    except Terminated as e:  # SIGTERM/SIGHUP while a command that unwinds on them ran (runs.signals_unwind)
        print(f"polyrl: terminated by a signal (exit code {e.code})", file=sys.stderr)
        return int(e.code)
    except KeyboardInterrupt:  # Ctrl-C: one line saying how to go on (checkpoints are written atomically)
        how = ""
        run_dir = getattr(args, "resolved_run_dir", None)  # set by cmd_train once the run directory is known
        if args.command == "compare" and getattr(args, "family", None) and not getattr(args, "checkpointed", None):
            how = "; run the same command again to go on (finished runs are kept, interrupted ones start over)"
        elif args.command == "compare":
            how = "; run the same command again to resume (finished runs are kept, interrupted ones resumed)"
        elif args.command == "train" and getattr(args, "restored_run", False):
            how = (f" before the new run started; the old run in {run_dir} is as it was (start again with "
                   "--overwrite)")
        elif args.command == "train" and run_dir is not None and Path(run_dir).is_dir():
            from polyrl.checkpoint import latest_checkpoint

            how = (f"; continue with --resume --run-dir {run_dir}" if latest_checkpoint(run_dir) is not None else
                   f" before the first checkpoint of {run_dir}; start again with --overwrite --run-dir {run_dir}")
        print(f"polyrl: interrupted{how}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
