"""Trustworthy runs: resume with the run's own settings, logs without repeated steps, one-line reward errors."""

from __future__ import annotations

import io
import json
import os
import shutil

import pytest
from rich.console import Console

from polyrl.cli import main
from polyrl.logging import StepProgress


def _small(model, run):
    return ["train", "--model", model, "--prompts-per-step", "2", "--group-size", "2", "--eval-prompts", "4",
            "--max-new-tokens", "4", "--run-dir", str(run), "--no-tensorboard", "--threads", "1", "--log-every", "0",
            "--eval-every", "0"]


def _cli(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.err.strip()


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _step_rows(run):
    return [r["step"] for r in _rows(run) if "reward/mean" in r]


def test_resume_in_the_readme_form_keeps_the_runs_settings(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert _cli([*_small(tiny_model, run), "--steps", "2", "--lr", "3e-4",
                 "--trust-region", "clip:eps_high=0.28"], capsys)[0] == 0
    record = (run / "config.json").read_bytes()
    code, err = _cli(["train", "--run-dir", str(run), "--resume", "--steps", "3"], capsys)
    assert code == 0, err
    assert (run / "config.json").read_bytes() == record  # the record of the original settings is kept
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert history[-1]["changes"] == {"steps": [2, 3]} and history[-1]["resumed_at_step"] == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == tiny_model and summary["steps"] == 3  # not the default warm start
    last = [r for r in _rows(run) if "reward/mean" in r][-1]
    assert last["rollout/generated"] == 4  # 2 prompts x 2, not the defaults' 8 x 8
    assert _step_rows(run) == [1, 2, 3]


@pytest.mark.parametrize("flag,fragment", [
    (["--lr", "0.01"], "lr = 0.01 differs from the run's own lr = 0.0001"),
    (["--group-size", "4"], "group_size = 4 differs from the run's own group_size = 2"),
    (["--trust-region", "clip:eps_high=0.3"], "--trust-region 'clip:eps_high=0.3' differs from the run's own"),
])
def test_resume_refuses_a_conflicting_flag(tiny_model, tmp_path, capsys, flag, fragment):
    run = tmp_path / "run"
    assert _cli([*_small(tiny_model, run), "--steps", "1"], capsys)[0] == 0
    code, err = _cli(["train", "--run-dir", str(run), "--resume", "--steps", "2", *flag], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and fragment in err, err
    assert "may change: steps" in err


def test_kill_and_resume_leaves_no_step_twice_and_no_partial_save(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert _cli([*_small(tiny_model, run), "--steps", "3", "--checkpoint-every", "2"], capsys)[0] == 0
    # The state a kill after logging step 3 leaves: no step-3 checkpoint, no summary, a half-written save.
    shutil.rmtree(run / "checkpoints" / "step_000003")
    (run / "summary.json").unlink()
    (run / "checkpoints" / ".tmp_step_000003_999").mkdir()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')  # a line cut short by the kill
    code, err = _cli(["train", "--run-dir", str(run), "--resume", "--steps", "4"], capsys)
    assert code == 0, err
    steps = _step_rows(run)
    assert steps == [1, 2, 3, 4], steps
    assert not list((run / "checkpoints").glob(".tmp_*"))


def test_corrupt_newest_checkpoint_names_the_newest_intact_one(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert _cli([*_small(tiny_model, run), "--steps", "2", "--checkpoint-every", "1"], capsys)[0] == 0
    with open(run / "checkpoints" / "step_000002" / "model.safetensors", "r+b") as f:
        f.seek(-3, 2)
        f.write(b"xyz")
    code, err = _cli(["train", "--run-dir", str(run), "--resume", "--steps", "3"], capsys)
    intact = run / "checkpoints" / "step_000001"
    assert code == 2 and len(err.splitlines()) == 1
    assert "does not match its checksum" in err and f"--resume-from {intact}" in err, err
    code, err = _cli(["train", "--run-dir", str(run), "--resume-from", str(intact), "--steps", "3"], capsys)
    assert code == 0, err
    assert _step_rows(run) == [1, 2, 3]


REWARDS = '''
import math, os

def nan_third(prompts, completions, **kw):
    return [math.nan if i == 3 else 0.5 for i in range(len(completions))]

def raises(prompts, completions, **kw):
    return 1 / 0

def short(prompts, completions, **kw):
    return [1.0]

def strings(prompts, completions, **kw):
    return ["high"] * len(completions)

def keyed(prompts, completions, **kw):
    return {i: 0.0 for i in range(len(completions))}

def huge(prompts, completions, **kw):
    return [1e300 if i == 2 else 0.0 for i in range(len(completions))]

def huge_int(prompts, completions, **kw):
    return [10 ** 5000 if i == 1 else 0 for i in range(len(completions))]

def huge_fraction(prompts, completions, **kw):
    from fractions import Fraction
    return [Fraction(10 ** 400, 3) if i == 0 else 0 for i in range(len(completions))]

def constant(prompts, completions, **kw):
    return [1.0] * len(completions)

def counted(prompts, completions, answers, **kw):
    with open(os.environ["POLYRL_TEST_CALLS"], "a") as f:
        f.write(f"{len(prompts)} {len(completions)} {len(answers)}\\n")
    return [float(len(c)) for c in completions]
'''


@pytest.mark.parametrize("fn,fragment", [
    ("nan_third", "returned nan, not a finite float at step 0, completion 3 of prompt index 1"),
    ("raises", "raised ZeroDivisionError: division by zero at step 0"),
    ("short", "returned 1 values for 4 completions"),
    ("strings", "returned str 'high', not a float at step 0, completion 0 of prompt index 0"),
    ("keyed", "returned dict, not a list of floats"),  # its keys 0..3 would have been the rewards
    # finite in Python, inf as a float32 reward: the group's advantages became 0 and training did nothing
    ("huge", "returned 1e+300, beyond +-1e+15, where a batch's float32 statistics overflow (scale the rewards "
             "down) at step 0, completion 2"),
    # beyond float's range (float() raised OverflowError) and str()'s 4300 digits
    ("huge_int", "returned int of about 5001 digits, beyond +-1e+15, where a batch's float32 statistics "
                 "overflow (scale the rewards down) at step 0, completion 1"),
    ("huge_fraction", "returned Fraction of about 400 digits, beyond +-1e+15"),
])
def test_bad_reward_functions_stop_the_run_with_one_line(tiny_model, tmp_path, capsys, fn, fragment):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    run = tmp_path / "run"
    code, err = _cli([*_small(tiny_model, run), "--steps", "2", "--reward-funcs",
                      f"task,{tmp_path / 'my_rewards.py'}:{fn}"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"my_rewards.py:{fn}'" in err and fragment in err, err
    if fn == "raises":  # the function's traceback goes to the run directory, not the console
        assert "traceback in" in err and "ZeroDivisionError" in (run / "errors.log").read_text()
        assert "Traceback" in (run / "errors.log").read_text()


def test_weighted_rewards_beyond_float32_are_refused_naming_the_completion(tmp_path):
    from polyrl.errors import RewardError
    from polyrl.tasks import AdditionTask, Prompt
    from polyrl.tasks.rewards import RewardChannels

    (tmp_path / "my_rewards.py").write_text(REWARDS)
    prompts = [Prompt(id=f"p{i}", text="1+1=", answer="2") for i in range(2)]
    fine = RewardChannels(AdditionTask(), [f"{tmp_path / 'my_rewards.py'}:constant"], [1e15])
    assert fine(prompts, ["2", "3"]).total == [1e15, 1e15]
    channels = RewardChannels(AdditionTask(), [f"{tmp_path / 'my_rewards.py'}:constant", "task"], [1e15, 1e14])
    with pytest.raises(RewardError) as e:
        channels(prompts, ["3", "2"], prompt_index=[0, 1])
    assert "give 1.1e+15, beyond +-1e+15" in str(e.value) and "completion 1 of prompt index 1" in str(e.value)


def test_rewards_at_the_limit_keep_their_advantages():
    """At the limit a step's float32 statistics stay finite; at 1e30 GRPO's std overflowed and every advantage was 0
    (the run trained on nothing)."""
    import torch

    import polyrl.objectives  # noqa: F401  (registers the advantage estimators)
    from polyrl.registry import ADVANTAGES as PARTS
    from polyrl.tasks.rewards import REWARD_LIMIT

    rows = 10**6  # the most rollouts a step takes
    group = torch.arange(rows) // 8
    def advantages(name, v):
        fn = next(p for p in PARTS if p.name == name).fn
        return fn(torch.tensor([v, 0.0, -v, v] * (rows // 4)), group, torch.ones(rows, 1))

    for name in ("grpo", "group_centered_batch_std", "reinforce_pp_baseline"):
        adv = advantages(name, REWARD_LIMIT)
        assert bool(torch.isfinite(adv).all()) and adv.abs().max() > 1.0, name
    assert advantages("grpo", 1e30).abs().max() == 0


def test_a_reward_file_named_like_a_standard_module_does_not_replace_it(tmp_path):
    """A file ``math.py`` executed as a reward module is registered under a private name: the standard library's
    ``math`` stays what every later import gets, and the file runs once however often it is named."""
    import math
    import sys

    from polyrl.tasks.rewards import load_callable

    (tmp_path / "math.py").write_text("import math\nRUNS = []\nRUNS.append(1)\n"
                                      "def r(prompts, completions, **kw):\n"
                                      "    return [math.floor(1.5)] * len(completions)\n")
    fn = load_callable(f"{tmp_path / 'math.py'}:r")
    assert fn(prompts=["p"], completions=["a", "b"]) == [1, 1]
    assert sys.modules["math"] is math and math.ceil(1.5) == 2
    again = load_callable(f"{tmp_path / 'math.py'}:r")
    assert sys.modules[again.__module__].RUNS == [1]


def test_reward_functions_are_called_once_per_batch(tiny_model, tmp_path, capsys, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("POLYRL_TEST_CALLS", str(calls))
    code, err = _cli([*_small(tiny_model, tmp_path / "run"), "--steps", "2", "--prompts-per-step", "3",
                      "--reward-funcs", f"{tmp_path / 'my_rewards.py'}:counted"], capsys)
    assert code == 0, err
    assert calls.read_text().splitlines() == ["6 6 6", "6 6 6"]  # one call per step, lists of 3 prompts x 2


def test_heldout_accuracy_uses_the_tasks_verifier_not_the_reward_channels(tiny_model, tmp_path, capsys):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    plain, custom = tmp_path / "plain", tmp_path / "custom"
    assert _cli([*_small(tiny_model, plain), "--steps", "1"], capsys)[0] == 0
    assert _cli([*_small(tiny_model, custom), "--steps", "1", "--reward-funcs",
                 f"{tmp_path / 'my_rewards.py'}:constant"], capsys)[0] == 0
    before = [json.loads((d / "summary.json").read_text())["eval_before"] for d in (plain, custom)]
    assert before[0] == before[1] < 1.0  # the constant-1 channel would have made it 1.0
    assert [r["reward/mean"] for r in _rows(custom) if "reward/mean" in r] == [1.0]


def test_progress_prints_plain_lines_when_not_on_a_terminal():
    out = io.StringIO()
    console = Console(file=out, width=100)
    assert not console.is_terminal
    with StepProgress(console, "RL step", total=3, every_s=0.0) as bar:
        for k in (1, 2, 3):
            bar.update(k, info=f"reward {k / 10:.3f}")
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["1/3", "2/3", "3/3"] and "reward 0.300" in lines[-1]
    out = io.StringIO()
    with StepProgress(Console(file=out, width=40), "warm-start addition_mixed", total=1, every_s=0.0) as bar:
        bar.update(1, info="loss 0.967  acc 0.043  a line longer than the console")  # a pipe's width: 80
    assert len(out.getvalue().splitlines()) == 1  # not wrapped in two


def test_a_composed_method_is_labelled_as_composed(tiny_model, tmp_path, capsys, monkeypatch):
    from polyrl.methods import get_method

    assert get_method("grpo", trust_region="dppo_tv").name == "grpo+dppo_tv"
    assert get_method("grpo", trust_region="clip:eps_high=0.3").name == "grpo+clip:eps_high=0.3"
    assert get_method("dapo", filters=[]).name == "dapo+no_filters"
    assert get_method("grpo", trust_region="clip").name == "grpo"  # the preset's own part: nothing composed
    monkeypatch.chdir(tmp_path)
    args = [a for a in _small(tiny_model, "x") if a not in ("--run-dir", "x")]
    assert _cli([*args, "--steps", "1", "--trust-region", "dppo_tv"], capsys)[0] == 0
    summary = json.loads((tmp_path / "runs" / "grpo+dppo_tv-addition-s0" / "summary.json").read_text())
    assert summary["method"] == "grpo+dppo_tv"


def test_a_run_started_with_overwrite_resumes_and_keeps_each_resume_change(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert _cli([*_small(tiny_model, run), "--steps", "2", "--checkpoint-every", "1", "--overwrite"], capsys)[0] == 0
    code, err = _cli(["train", "--run-dir", str(run), "--resume", "--steps", "4"], capsys)
    assert code == 0, err
    # killed after step 3 of the extended run: its step-4 checkpoint and summary are gone
    shutil.rmtree(run / "checkpoints" / "step_000004")
    (run / "summary.json").unlink()
    code, err = _cli(["train", "--run-dir", str(run), "--resume"], capsys)
    assert code == 0, err
    assert json.loads((run / "summary.json").read_text())["steps"] == 4  # the extension recorded in the history
    assert _step_rows(run) == [1, 2, 3, 4]


def test_resume_takes_a_flag_that_asks_for_the_runs_own_value_however_it_is_written(tiny_model, tmp_path, capsys):
    """--reward-weights 1.0,0.20 against a saved '1,0.2', the preset's own --kl-coef or --trust-region clip, and
    --reward-funcs task (the default) were refused as differing: the check compared spellings, not what runs."""
    run = tmp_path / "run"
    assert _cli([*_small(tiny_model, run), "--steps", "1", "--reward-funcs", "task,task", "--reward-weights",
                 "1,0.2"], capsys)[0] == 0
    same = (["--reward-weights", "1.0,0.20"], ["--kl-coef", "0.04"], ["--trust-region", "clip"],
            ["--trust-region", "clip:eps_high=0.2"])
    for steps, flag in enumerate(same, start=2):
        code, err = _cli(["train", "--run-dir", str(run), "--resume", "--steps", str(steps), *flag], capsys)
        assert code == 0, (flag, err)
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert [h["changes"] for h in history] == [{"steps": [s - 1, s]} for s in range(2, 6)]
    for flag, fragment in ((["--reward-weights", "1,0.3"], "reward_weights = '1,0.3' differs"),
                           (["--kl-coef", "0.05"], "--kl-coef 0.05 differs")):
        code, err = _cli(["train", "--run-dir", str(run), "--resume", "--steps", "6", *flag], capsys)
        assert code == 2 and fragment in err, err
    plain = tmp_path / "plain"
    assert _cli([*_small(tiny_model, plain), "--steps", "1"], capsys)[0] == 0
    code, err = _cli(["train", "--run-dir", str(plain), "--resume", "--steps", "2", "--reward-funcs", "task"], capsys)
    assert code == 0, err


def test_resuming_a_finished_run_logs_its_final_evaluation_once_and_keeps_its_timing(tiny_model, tmp_path, capsys):
    """A resume that ran no step wrote seconds_per_step 0.0 and rollouts_per_second 0.0 over the run's figures, and
    an extended run's wall_seconds covered its last segment only."""
    run = tmp_path / "run"
    assert _cli([*_small(tiny_model, run), "--steps", "2"], capsys)[0] == 0
    first = json.loads((run / "summary.json").read_text())
    assert _cli(["train", "--run-dir", str(run), "--resume"], capsys)[0] == 0
    final = [r for r in _rows(run) if r["step"] == 2 and all(k == "step" or k.startswith("eval/") for k in r)]
    assert len(final) == 1
    again = json.loads((run / "summary.json").read_text())
    assert again["seconds_per_step"] == first["seconds_per_step"] > 0
    assert again["rollouts_per_second"] == first["rollouts_per_second"] > 0
    assert again["wall_seconds"] > first["wall_seconds"]  # plus this command's final evaluation
    assert _cli(["train", "--run-dir", str(run), "--resume", "--steps", "3"], capsys)[0] == 0
    third = json.loads((run / "summary.json").read_text())
    step_times = [r["perf/step_seconds"] for r in _rows(run) if "perf/step_seconds" in r]
    assert len(step_times) == 3 and third["seconds_per_step"] == pytest.approx(sum(step_times) / 3, rel=1e-6)
    assert third["wall_seconds"] > again["wall_seconds"]


def test_a_directory_that_holds_a_run_is_not_reused_without_overwrite(tiny_model, tmp_path, capsys):
    (tmp_path / "boom.py").write_text("def boom(prompts, completions, **kw):\n    raise RuntimeError('no')\n")
    run = tmp_path / "run"
    assert _cli([*_small(tiny_model, run), "--steps", "1", "--reward-funcs", f"{tmp_path / 'boom.py'}:boom"],
                capsys)[0] == 2  # failed at step 0: a config.json and an evaluation row, no checkpoint
    code, err = _cli([*_small(tiny_model, run), "--steps", "1"], capsys)
    assert code == 2 and "already holds a run with no checkpoint" in err and "--overwrite" in err
    assert _cli([*_small(tiny_model, run), "--steps", "1", "--overwrite"], capsys)[0] == 0
    assert json.loads((run / "config.json").read_text())["config"]["reward_funcs"] is None


def test_a_reward_file_that_fails_to_import_is_one_line(tiny_model, tmp_path, capsys):
    (tmp_path / "syn.py").write_text("def f(prompts, completions, **kw):\n    return [\n")
    (tmp_path / "raises.py").write_text("raise RuntimeError('set-up failed')\n")
    for spec, fragment in ((f"{tmp_path / 'syn.py'}:f", "SyntaxError"), (f"{tmp_path / 'raises.py'}:f",
                                                                            "RuntimeError: set-up failed")):
        code, err = _cli([*_small(tiny_model, tmp_path / "run"), "--steps", "1", "--reward-funcs", spec], capsys)
        assert code == 2 and len(err.splitlines()) == 1 and fragment in err and "cannot import" in err, err


def test_resuming_from_an_older_checkpoint_sets_the_newer_branch_aside(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert _cli([*_small(tiny_model, run), "--steps", "3", "--checkpoint-every", "1"], capsys)[0] == 0
    older = run / "checkpoints" / "step_000002"
    code, err = _cli(["train", "--run-dir", str(run), "--resume-from", str(older), "--steps", "3"], capsys)
    assert code == 0, err
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "superseded_step_000003" in names and "step_000003" in names  # the old branch kept, the new one saved
    assert _step_rows(run) == [1, 2, 3]


def test_a_resume_from_killed_between_branching_and_cutting_rows_continues_the_branch(tiny_model, tmp_path, capsys,
                                                                                      monkeypatch):
    """Killed right after the logs were cut, --resume-from left the newer checkpoint in place: the next --resume
    continued the abandoned branch past a gap in metrics.jsonl. The branch is now set aside first."""
    import polyrl.trainer

    run = tmp_path / "run"
    assert _cli([*_small(tiny_model, run), "--steps", "3", "--checkpoint-every", "1"], capsys)[0] == 0

    cut = polyrl.trainer.cut_logs

    def killed(*a, **k):
        cut(*a, **k)
        raise KeyboardInterrupt  # stands in for a SIGKILL right after the rows were cut

    monkeypatch.setattr(polyrl.trainer, "cut_logs", killed)
    older = run / "checkpoints" / "step_000002"
    assert _cli(["train", "--run-dir", str(run), "--resume-from", str(older), "--steps", "3"], capsys)[0] != 0
    assert _step_rows(run) == [1, 2]
    monkeypatch.undo()
    code, err = _cli(["train", "--run-dir", str(run), "--resume", "--steps", "3"], capsys)
    assert code == 0, err
    assert _step_rows(run) == [1, 2, 3]  # it resumed at step 2 (the branch chosen), not at 3 past a gap


def test_threads_follow_the_cores_the_process_may_run_on(tiny_model):
    """A process given one core of two (taskset, a Slurm or docker cpuset) sized torch to every core of the machine
    (os.cpu_count), oversubscribing the one it had; it now counts the cores of its affinity."""
    import subprocess
    import sys

    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs CPU affinity and two cores")
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); import torch; "
            "from polyrl.model import load_policy; from polyrl.runs import cores, max_threads; "
            f"load_policy({tiny_model!r}); print(cores(), max_threads(), torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["1", "4", "1"], out.stderr[-2000:]


def test_extending_a_run_keeps_the_evaluation_its_schedule_puts_at_the_checkpoint(tiny_model, tmp_path, capsys):
    """A resume dropped the final evaluation at the checkpoint's step as one the resumed run would redo, although
    the run went on past it and --eval-every put an evaluation there: the step had none, unlike an unbroken run."""
    run, whole = tmp_path / "run", tmp_path / "whole"
    assert _cli([*_small(tiny_model, run)[:-2], "--eval-every", "1", "--steps", "2"], capsys)[0] == 0
    assert _cli(["train", "--run-dir", str(run), "--resume", "--steps", "3"], capsys)[0] == 0
    assert _cli([*_small(tiny_model, whole)[:-2], "--eval-every", "1", "--steps", "3"], capsys)[0] == 0

    def evals(path):
        return [(r["step"], r["eval/accuracy"]) for r in _rows(path) if "eval/accuracy" in r]

    assert [s for s, _ in evals(run)] == [0, 1, 2, 3] and evals(run) == evals(whole)


def test_cut_logs_drops_a_final_evaluation_with_its_drift_probes(tmp_path):
    """The first segment's final evaluation is not the unbroken run's (it evaluates there only on --eval-every's
    schedule): cut at a resume, also when drift probes logged beside it (--drift-prompts)."""
    from polyrl.runs import cut_logs

    rows = [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.2},
            {"step": 2, "eval/accuracy": 0.5, "drift/k3": 0.01, "drift/hidden_cos": 0.99}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cut_logs(tmp_path, 2) == 1
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == rows[:2]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cut_logs(tmp_path, 2, keep_eval=True) == 0  # on the schedule of a run that goes on: the unbroken run's too
