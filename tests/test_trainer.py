"""The training engine end to end on a tiny local model: every preset, exact resume, bad configs."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from polyrl.cli import main
from polyrl.combinations import check_combinations
from polyrl.config import ConfigError, TrainConfig, build_config
from polyrl.methods import PRESETS, get_method
from polyrl.registry import ADVANTAGES
from polyrl.tasks.arithmetic import AdditionTask
from polyrl.trainer import train

QUIET = Console(file=io.StringIO(), width=120)


def _cfg(**kw) -> TrainConfig:
    base = dict(steps=2, prompts_per_step=2, group_size=4, max_new_tokens=6, eval_prompts=8, eval_every=0,
                checkpoint_every=0, tensorboard=False, log_every=0, lr=1e-3, warmup_steps=0, threads=1)
    return build_config({**base, "reward_funcs": DENSE, **kw})


# A dense reward (share of digits) so that every group has variance even before any training.
DENSE = "tests.reward_fns:digit_fraction"


def _task():
    return AdditionTask()


def _weights(model_dir):
    from polyrl.model import load_policy

    return {k: v.clone() for k, v in load_policy(model_dir, threads=1)[0].state_dict().items()}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_trains_a_few_steps(name, tiny_model, tmp_path):
    method = get_method(name)
    pass_fail = "pass_fail" in ADVANTAGES.spec(method.advantage.name).tags  # pass@k: a 0/1 reward, groups of 2k
    cfg = _cfg(group_size=max(4, 2 * method.advantage.params.get("k", 0)),
               **({"reward_funcs": "tests.reward_fns:even_length"} if pass_fail else {}))
    try:
        check_combinations(cfg, method, _task())
    except ConfigError as e:  # only a preset that needs a teacher (tests/test_distill.py trains it with one)
        assert "needs --teacher" in str(e) and "\n" not in str(e), str(e)
        return
    summary = train(cfg, method, model_dir=tiny_model, task=_task(), run_dir=str(tmp_path), console=QUIET)
    assert summary["steps"] == 2 and summary["skipped_steps"] == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert "objective/loss" in r and "objective/ratio_mean" in r and "rollout/utilization" in r
        assert all(v == v for v in r.values()), r  # no NaN
        assert r["rollout/logp_mismatch"] < 1e-4  # recomputed old log-probs == sampler's
    from safetensors.torch import load_file

    ck = sorted((tmp_path / "checkpoints").glob("step_*"))[-1]
    trained = load_file(str(ck / "model.safetensors"))
    start = _weights(tiny_model)
    changed = sum(not torch.equal(trained[k], start[k]) for k in trained if k in start)
    assert changed > 0, "no parameter changed"
    assert (tmp_path / "summary.json").exists() and (tmp_path / "curves.png").exists()


@pytest.mark.parametrize("name,extra", [("grpo", {}), ("ppo", {}), ("grpo", {"sampler": "tree"}),
                                        ("grpo", {"sampler": "tree", "tree_predictor": "likelihood"})])
def test_resume_equals_uninterrupted_training_bit_for_bit(name, extra, tiny_model, tmp_path):
    method = get_method(name)
    train(_cfg(steps=4, **extra), method, model_dir=tiny_model, task=_task(), run_dir=str(tmp_path / "a"),
          console=QUIET)
    train(_cfg(steps=2, **extra), method, model_dir=tiny_model, task=_task(), run_dir=str(tmp_path / "b"),
          console=QUIET)
    train(_cfg(steps=4, resume=True, **extra), method, model_dir=tiny_model, task=_task(),
          run_dir=str(tmp_path / "b"), console=QUIET)
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "a" / "checkpoints" / "step_000004" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoints" / "step_000004" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _run_cli(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip()
    return code, err


def test_cli_train_smoke_in_a_subprocess(tiny_model, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "polyrl", "train", "--model", tiny_model, "--steps", "1",
                           "--prompts-per-step", "2", "--group-size", "2", "--eval-prompts", "4", "--threads", "1",
                           "--run-dir", str(tmp_path / "r"), "--trust-region", "clip:eps_high=0.28"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held-out accuracy before" in proc.stdout and "run files:" in proc.stdout
    assert list((tmp_path / "r" / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert saved["method"]["trust_region"]["params"]["eps_high"] == 0.28
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 1


def _bad_cases(tiny_model, tmp):
    no_tok = tmp / "no_tok"
    no_tok.mkdir()
    (no_tok / "config.json").write_text("{}")
    bad_data = tmp / "bad.jsonl"
    bad_data.write_text('{"question": "1+1?", "result": "2"}\n')
    toml_key = tmp / "key.toml"
    toml_key.write_text("learning_rate = 0.1\n")
    toml_type = tmp / "type.toml"
    toml_type.write_text('steps = "ten"\n')
    m = ["--model", tiny_model]
    return [
        (["train", "--method", "grpoo", *m], "unknown method 'grpoo'"),
        (["train", "--trust-region", "clip:eps=0.1", *m], "unknown parameter 'eps'"),
        (["train", "--lr", "-0.0001", *m], "lr = -0.0001"),
        (["train", "--group-size", "1", *m], "group_size = 1 is not allowed with advantage 'grpo'"),
        (["train", "--top-p", "1.5", *m], "top_p = 1.5"),
        (["train", "--model", str(tmp / "missing")], "must be an existing local model directory"),
        (["train", "--model", str(no_tok)], "no tokenizer"),
        (["train", "--task", "chess", *m], "unknown task 'chess'"),
        (["train", "--task", "math", "--data-file", str(bad_data), *m], "no answer column"),
        (["train", "--minibatches", "3", *m], "minibatches = 3"),
        (["train", "--config", str(toml_key), *m], "unknown field 'learning_rate'"),
        (["train", "--config", str(toml_type), *m], "steps = 'ten' must be int"),
        (["train", "--steps", "ten", *m], "argument --steps: invalid int value: 'ten'"),
        (["train", "--resume", "--run-dir", str(tmp / "empty_run"), *m], "has no checkpoint"),
        (["train", "--aggregation", "mean", *m], "unknown aggregation 'mean'"),
        (["train", "--temperature", "0", *m], "temperature = 0"),
    ]


def test_bad_configs_are_one_line_with_exit_code_2(tiny_model, tmp_path, capsys):
    cases = _bad_cases(tiny_model, tmp_path)
    assert len(cases) >= 12
    for args, fragment in cases:
        try:
            code, err = _run_cli(args, capsys)
        except SystemExit as e:  # argparse's own errors (one line too, see OneLineParser)
            code, err = e.code, capsys.readouterr().err.strip()
        assert code == 2, (args, err)
        lines = err.splitlines()
        assert len(lines) == 1 and fragment in lines[0], (args, err)


def test_corrupt_checkpoint_and_existing_run_dir(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--model", tiny_model, "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
            "--eval-prompts", "4", "--run-dir", str(run), "--no-tensorboard"]
    assert _run_cli(args, capsys)[0] == 0
    code, err = _run_cli(args, capsys)
    assert code == 2 and "already holds checkpoints" in err
    ck = sorted((run / "checkpoints").glob("step_*"))[-1]
    with open(ck / "model.safetensors", "r+b") as f:
        f.seek(-3, 2)
        f.write(b"xyz")
    code, err = _run_cli([*args, "--resume", "--steps", "2"], capsys)
    assert code == 2 and "does not match its checksum" in err and len(err.splitlines()) == 1



def test_non_finite_losses_skip_steps_then_stop_with_a_clear_error(tiny_model, tmp_path):
    from polyrl.errors import TrainingError
    from polyrl.objectives import build_method
    from polyrl.registry import TRUST_REGIONS

    if "test_nan" not in TRUST_REGIONS:
        @TRUST_REGIONS.register("test_nan")
        def test_nan(inp, log_ratio):
            """Return a NaN loss on every token (to exercise the trainer's guard)."""
            return log_ratio * float("nan"), {}

    method = build_method("nan", advantage="grpo", trust_region="test_nan", aggregation="token_mean")
    with pytest.raises(TrainingError, match="3 optimizer steps in a row had a non-finite loss"):
        train(_cfg(steps=5, max_bad_steps=3), method, model_dir=tiny_model, task=_task(), run_dir=str(tmp_path),
              console=QUIET)
    assert not (tmp_path / "checkpoints").exists()  # nothing half-trained was saved as if it were good


def test_zero_grad_by_quarter_counts_clipped_tokens_by_position():
    from polyrl.objectives import build_method, policy_loss
    from polyrl.objectives.objective import zero_grad_by_quarter
    from polyrl.types import LossInputs, Normalizer

    # One response of 8 tokens, A > 0: the last two tokens have ratio 2 (clipped by PPO), the rest ratio 1.
    logp = torch.zeros(1, 8, requires_grad=True)
    old = torch.zeros(1, 8)
    old[0, 6:] = -torch.log(torch.tensor(2.0))
    mask = torch.ones(1, 8)
    adv = torch.ones(1, 8)
    out = policy_loss(LossInputs(logp=logp * 1.0, old_logp=old, adv=adv, mask=mask,
                                 normalizer=Normalizer.from_batch(mask, torch.zeros(1))),
                      build_method("m", advantage="grpo", trust_region="clip", aggregation="token_mean"))
    counts = zero_grad_by_quarter(out.surrogate, logp, mask, adv)
    assert counts[1].tolist() == [2.0, 2.0, 2.0, 2.0]
    assert counts[0].tolist() == [0.0, 0.0, 0.0, 2.0]
    assert zero_grad_by_quarter(out.surrogate, logp, mask, adv * 0)[1].sum() == 0  # A = 0 is not "clipped"


def _collapse_once(when):
    """A stand-in for CollapseMonitor that reports one collapse, the first time ``when(step, metrics)`` holds."""

    class CollapseOnce:
        fired = False

        def __init__(self, rule):
            pass

        def update(self, step, metrics):
            if when(step, metrics) and not CollapseOnce.fired:
                CollapseOnce.fired = True
                return "eval/accuracy fell below half its best"
            return None

    return CollapseOnce


def test_guard_rolls_back_to_last_checkpoint_and_lowers_lr(tiny_model, tmp_path, monkeypatch):
    import polyrl.guard as guard_mod

    monkeypatch.setattr(guard_mod, "CollapseMonitor", _collapse_once(lambda step, metrics: step == 3))
    cfg = _cfg(steps=5, guard=True, checkpoint_every=2, guard_lr_factor=0.5, lr=1e-3)
    summary = train(cfg, get_method("grpo"), model_dir=tiny_model, task=_task(), run_dir=str(tmp_path), console=QUIET)
    assert summary["steps"] == 5
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    guard = [r for r in rows if "guard/rollbacks" in r]
    assert len(guard) == 1 and guard[0]["step"] == 2 and guard[0]["guard/rollbacks"] == 1
    lrs = [r["perf/lr"] for r in rows if "perf/lr" in r]
    assert lrs[-1] == pytest.approx(0.5e-3)  # the rest of the run uses half the learning rate
    steps = [r["step"] for r in rows if "reward/mean" in r]
    assert steps == [1, 2, 3, 3, 4, 5]  # step 3 was redone after the rollback to step 2


def test_the_guard_replays_only_the_live_history():
    """A rollback to step 2 left the branch that collapsed at step 3: a monitor rebuilt later (after another rollback,
    or on resume) does not replay it, so it is not latched and catches the next collapse."""
    from polyrl.guard import make_monitor

    acc = lambda step, a: {"step": step, "eval/accuracy": a}  # noqa: E731
    history = [acc(1, 0.6), acc(2, 0.6), acc(3, 0.1), {"step": 2, "guard/rollbacks": 1, "guard/lr": 5e-4},
               acc(3, 0.6), acc(4, 0.6), acc(5, 0.6)]
    monitor = make_monitor(history, 5)
    assert monitor.collapsed is None
    assert monitor.update(6, {"eval/accuracy": 0.1}) is not None


def test_the_guard_judges_the_final_evaluation(tiny_model, tmp_path, monkeypatch):
    """The last step's evaluation is made after the loop in an unguarded run; with --guard the monitor sees it before
    the final checkpoint, which would otherwise save the collapsed weights as the resume point."""
    import polyrl.guard as guard_mod

    monkeypatch.setattr(guard_mod, "CollapseMonitor",
                        _collapse_once(lambda step, metrics: step == 4 and "eval/accuracy" in metrics))
    cfg = _cfg(steps=4, guard=True, checkpoint_every=2, eval_every=0, lr=1e-3)
    summary = train(cfg, get_method("grpo"), model_dir=tiny_model, task=_task(), run_dir=str(tmp_path), console=QUIET)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "guard/rollbacks" in r] == [2] and summary["steps"] == 4
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4, 3, 4]
    evaluations = [r["step"] for r in rows if "eval/accuracy" in r]
    assert evaluations == [0, 4, 4]  # the start, the judged final evaluation, the final one after the rollback


def test_evaluation_splits_accuracy_into_retained_and_gained():
    """eval/retained and eval/gained follow each prompt, whatever order the runner returns the completions in."""
    from types import SimpleNamespace

    from polyrl.evaluation import Evaluator

    task = AdditionTask()
    prompts = task.prompts("test", 4, seed=0)
    answers = [prompts[0].answer + "9", prompts[1].answer, prompts[2].answer, "x"]  # wrong, right, right, wrong
    runner = SimpleNamespace(sample=lambda ps, params: [SimpleNamespace(prompt_index=i, text=answers[i])
                                                        for i in (3, 1, 0, 2)])
    evaluate = Evaluator(runner, task, prompts, 8)
    out, solved = evaluate(5, solved_before=[True, True, False, False])
    assert solved == [False, True, True, False]
    assert out == {"eval/accuracy": 0.5, "eval/reward_mean": 0.5, "eval/retained": 0.5, "eval/gained": 0.5}
    out, _ = evaluate(5, solved_before=[True, True, True, False])
    assert out["eval/retained"] == pytest.approx(2 / 3) and out["eval/gained"] == 0.0
    assert set(evaluate(0)[0]) == {"eval/accuracy", "eval/reward_mean"}


def test_accuracy_counts_a_partly_right_answer_as_every_success_count_does():
    """A score of 2/3 (a code problem passing 2 of 3 asserts) is one success: eval/accuracy 1 where retained and gained
    said solved; the mean score is eval/reward_mean. (Accuracy was the mean score: 0.667 beside gained 1.0.)"""
    from types import SimpleNamespace

    from polyrl.evaluation import Evaluator

    task = SimpleNamespace(reward=lambda prompt, text: (float(text), {}))
    runner = SimpleNamespace(sample=lambda ps, params: [SimpleNamespace(prompt_index=i, text=t)
                                                        for i, t in enumerate(("0.6667", "0.25"))])
    out, solved = Evaluator(runner, task, ["p", "q"], 8)(1, solved_before=[False, False])
    assert solved == [True, False] and out["eval/accuracy"] == 0.5 == out["eval/gained"]
    assert out["eval/reward_mean"] == pytest.approx((0.6667 + 0.25) / 2)


def test_a_resume_says_when_the_held_out_prompts_changed(tiny_model, tmp_path):
    """A checkpoint from another version (countdown's held-out split grew from 199 to 200 distinct prompts) holds which
    prompts the start solved for another set: retained/gained cannot be computed, and the resume says so."""
    train(_cfg(steps=2, checkpoint_every=1), get_method("grpo"), model_dir=tiny_model, task=_task(),
          run_dir=str(tmp_path), console=QUIET)
    path = tmp_path / "checkpoints" / "step_000002" / "trainer_state.pt"
    blob = torch.load(path, weights_only=False)
    blob["state"]["solved_before"] = blob["state"]["solved_before"][:-1]
    torch.save(blob, path)
    from polyrl.checkpoint import _sha256  # the checkpoint's own record of the file, as that version saved it

    meta = json.loads((path.parent / "meta.json").read_text())
    meta["files"]["trainer_state.pt"] = _sha256(path)
    (path.parent / "meta.json").write_text(json.dumps(meta))
    out = io.StringIO()
    train(_cfg(steps=3, resume=True), get_method("grpo"), model_dir=tiny_model, task=_task(), run_dir=str(tmp_path),
          console=Console(file=out, width=200))
    assert "8 held-out prompts now, 7 when the run started: eval/retained and eval/gained are not logged" in \
        out.getvalue()


def test_a_rollback_is_kept_by_a_resume_and_logs_the_learning_rate_it_set(tiny_model, tmp_path, monkeypatch):
    """The rollback count and the lowered lr lived only in memory until the next periodic save: a run killed after a
    rollback resumed at the full lr with the count back at 0 (kill/resume never reached guard_max_rollbacks); and
    guard/lr logged the lr from before the rollback."""
    import polyrl.guard as guard_mod
    from polyrl.checkpoint import latest_checkpoint

    monkeypatch.setattr(guard_mod, "CollapseMonitor", _collapse_once(lambda step, metrics: step == 3))
    cfg = _cfg(steps=3, guard=True, checkpoint_every=2, guard_lr_factor=0.5, lr=1e-3)

    class Killed(Exception):
        pass

    real_log = guard_mod.make_monitor
    calls = []

    def stop_after_rollback(history, step):  # the first call builds the monitor; the second follows the rollback
        calls.append(step)
        if len(calls) == 2:
            raise Killed
        return real_log(history, step)

    monkeypatch.setattr("polyrl.trainer.make_monitor", stop_after_rollback)
    with pytest.raises(Killed):
        train(cfg, get_method("grpo"), model_dir=tiny_model, task=_task(), run_dir=str(tmp_path), console=QUIET)
    monkeypatch.setattr("polyrl.trainer.make_monitor", real_log)
    saved = torch.load(latest_checkpoint(tmp_path) / "trainer_state.pt", weights_only=False)
    assert saved["state"]["step"] == 2 and saved["state"]["rollbacks"] == 1, saved["state"]
    assert saved["scheduler"]["base_lrs"] == [pytest.approx(0.5e-3)]  # the lower lr, which the resume keeps


def test_the_guard_can_roll_back_to_the_start_and_perf_lr_is_the_steps_own(tiny_model, tmp_path, monkeypatch):
    """No checkpoint before the first periodic one: a collapse at the first evaluation stopped the run with "no
    checkpoint to roll back to" and nothing saved; perf/lr was the next step's lr (one warm-up step ahead)."""
    import polyrl.guard as guard_mod

    monkeypatch.setattr(guard_mod, "CollapseMonitor", _collapse_once(lambda step, metrics: step == 2))
    cfg = _cfg(steps=3, guard=True, checkpoint_every=50, guard_lr_factor=0.5, lr=1e-3, warmup_steps=4)
    train(cfg, get_method("grpo"), model_dir=tiny_model, task=_task(), run_dir=str(tmp_path), console=QUIET)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    guard = [r for r in rows if "guard/rollbacks" in r]
    assert len(guard) == 1 and guard[0]["step"] == 0
    trained = [r for r in rows if "perf/lr" in r]
    assert [r["step"] for r in trained] == [1, 2, 1, 2, 3]
    assert trained[0]["perf/lr"] == pytest.approx(1e-3 / 5)  # step 1 trains at lambda(0) = 1/5 of the warm-up
    assert trained[2]["perf/lr"] == pytest.approx(0.5e-3 / 5)  # the run again from step 0, at half the lr
    assert guard[0]["guard/lr"] == pytest.approx(0.5e-3 / 5)  # the lr the rollback set, not the one before it


def test_a_rollback_leaves_only_the_surviving_branch_in_tensorboard_samples_and_curves(tiny_model, tmp_path,
                                                                                      monkeypatch):
    """TensorBoard, samples.jsonl and curves.png kept the branch a rollback left (step 3 three times in TensorBoard, a
    zig-zag in the plot); metrics.jsonl keeps it as the record, which its readers skip."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import polyrl.guard as guard_mod

    monkeypatch.setattr(guard_mod, "CollapseMonitor", _collapse_once(lambda step, metrics: step == 3))
    plotted = []
    monkeypatch.setattr("polyrl.trainer.plot_curves", lambda rows, path: plotted.append(rows))
    cfg = _cfg(steps=5, guard=True, checkpoint_every=2, tensorboard=True, log_every=1)
    train(cfg, get_method("grpo"), model_dir=tiny_model, task=_task(), run_dir=str(tmp_path), console=QUIET)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3, 4, 5]
    samples = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    per_step = {step: samples.count(step) for step in samples}
    assert sorted(per_step) == [1, 2, 3, 4, 5] and len(set(per_step.values())) == 1, per_step  # step 3 once
    assert [r["step"] for r in plotted[0] if "reward/mean" in r] == [1, 2, 3, 4, 5]
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged.count(3) > 1  # the record keeps the branch left


def test_the_guard_rolls_back_to_a_checkpoint_an_evaluation_passed(tiny_model, tmp_path, monkeypatch):
    """It took the newest checkpoint: saved after the last evaluation, never judged, it may already hold the collapse
    (three rollbacks in a row went to the same unevaluated step 6 while step 4, evaluated healthy, was on disk)."""
    import polyrl.guard as guard_mod

    monkeypatch.setattr(guard_mod, "CollapseMonitor", _collapse_once(lambda step, metrics: step == 8))
    cfg = _cfg(steps=9, guard=True, checkpoint_every=2, eval_every=4, eval_prompts=4)
    train(cfg, get_method("grpo"), model_dir=tiny_model, task=_task(), run_dir=str(tmp_path), console=QUIET)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "guard/rollbacks" in r] == [4]  # evaluated at 4; 6 never was
    # the branch left is set aside: no resume, export or later rollback picks up its step 6 (the new branch saved its
    # own step 6 since)
    assert (tmp_path / "checkpoints" / "superseded_step_000006").is_dir()


def test_a_second_rollback_never_goes_forward_onto_a_branch_left_before(tiny_model, tmp_path, monkeypatch):
    """A collapse at 7 rolled back to 3; a second, at 4 of the new branch with no evaluation since 3, fell back to the
    newest checkpoint on disk: step 6 of the branch left, so the run went on from weights it had abandoned."""
    import polyrl.guard as guard_mod

    fired = []

    class Twice:
        def __init__(self, rule):
            pass

        def update(self, step, metrics):
            due = {0: 7, 1: 4}.get(len(fired))
            if step == due:
                fired.append(step)
                return "eval/accuracy fell below half its best"
            return None

    monkeypatch.setattr(guard_mod, "CollapseMonitor", Twice)
    cfg = _cfg(steps=9, guard=True, checkpoint_every=3, eval_every=4, eval_prompts=4)
    train(cfg, get_method("grpo"), model_dir=tiny_model, task=_task(), run_dir=str(tmp_path), console=QUIET)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "guard/rollbacks" in r] == [3, 3]  # back to 3 both times, never to 6
