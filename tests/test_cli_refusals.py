"""Bad `compare`, `warmstart` and `train` input, reward functions and plugins that exit, and Ctrl-C: one line each.

Every refusal here comes before any training: the tests stub out the training runs so that a regression fails fast.
"""

from __future__ import annotations

import json

import pytest

from polyrl.cli import main
from polyrl.errors import RewardError
from polyrl.tasks import get_task
from polyrl.tasks.rewards import RewardChannels, load_callable


@pytest.fixture(autouse=True)
def _scratch_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYRL_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def no_runs(monkeypatch):
    """`compare` must refuse before its first run: starting one fails the test."""

    def run_all(*a, **k):
        raise AssertionError("compare started its runs")

    monkeypatch.setattr("polyrl.lab.compare.run_all", run_all)


@pytest.fixture
def no_training(monkeypatch):
    def train(*a, **k):
        raise AssertionError("train started training")

    monkeypatch.setattr("polyrl.trainer.train", train)
    monkeypatch.setattr("polyrl.tinylm._train", train)


def one_line_error(capsys, *names: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("polyrl: "), err
    for name in names:
        assert name in err, err
    return err


def compare(tmp_path, *argv: str) -> list[str]:
    return ["compare", "--methods", "grpo", "--seeds", "1", "--out", str(tmp_path / "c"), "--steps", "2", *argv]


def test_compare_runs_load_the_plugins_compare_loaded(tmp_path, monkeypatch, tiny_model):
    """`polyrl --plugin my_parts.py compare ... --trust-region plugin_x` checked the flags with the plugin loaded, then
    started `polyrl train` runs without it: each failed with "unknown trust_region". Every run now gets --plugin
    (a file by its absolute path, so it resolves whatever the run's working directory)."""
    plugin = tmp_path / "my_parts.py"
    plugin.write_text("from polyrl.registry import TRUST_REGIONS\n\n\n"
                      "@TRUST_REGIONS.register('plugin_compare_tr')\n"
                      "def plugin_compare_tr(inp, log_ratio):\n"
                      "    '''Plain importance-weighted policy gradient.'''\n"
                      "    return -log_ratio.exp() * inp.adv, {}\n")
    started = []

    def run_all(specs, **kwargs):
        started.extend(specs)
        raise KeyboardInterrupt  # stop there: the runs' command lines are what this test reads

    monkeypatch.setattr("polyrl.lab.compare.run_all", run_all)
    monkeypatch.chdir(tmp_path)
    argv = compare(tmp_path, "--model", tiny_model, "--method-args", "grpo=--trust-region plugin_compare_tr")
    assert main(["--plugin", "my_parts.py", *argv]) == 130
    assert [spec.args[:3] for spec in started] == [["--plugin", str(plugin.resolve()), "train"]]


# 1. compare sets --run-dir, --seed, --method, --resume / --overwrite (and --model, --task) for every run itself


@pytest.mark.parametrize("extra, flag", [
    (["--run-dir", "PRECIOUS"], "--run-dir"),
    (["--run-dir=PRECIOUS"], "--run-dir"),
    (["--run-d", "PRECIOUS"], "--run-dir"),
    (["--overwrite"], "--overwrite"),
    (["--resume"], "--resume"),
    (["--resume-from", "PRECIOUS/checkpoints/step_000001"], "--resume-from"),
    (["--seed", "2"], "--seed"),  # argparse read it as --seeds 2 (an abbreviation) and ran two seeds
])
def test_compare_refuses_a_shared_flag_it_sets_per_run(tmp_path, capsys, no_runs, tiny_model, extra, flag):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("data")
    extra = [e.replace("PRECIOUS", str(precious)) for e in extra]
    assert main(compare(tmp_path, "--model", tiny_model, *extra)) == 2
    one_line_error(capsys, flag, "compare")
    assert [p.name for p in precious.iterdir()] == ["keep.txt"] and not (tmp_path / "c").exists()


@pytest.mark.parametrize("method_args, flag", [
    ("grpo=--run-dir PRECIOUS", "--run-dir"),
    ("grpo=--seed 3", "--seed"),
    ("grpo=--method dapo", "--method"),
    ("grpo=--overwrite", "--overwrite"),
    ("grpo=--lr 1e-4 --resume", "--resume"),
    ("grpo=--task countdown", "--task"),
    ("grpo=--model MODEL", "--model"),
])
def test_compare_refuses_a_method_flag_it_sets_per_run(tmp_path, capsys, no_runs, tiny_model, method_args, flag):
    method_args = method_args.replace("PRECIOUS", str(tmp_path / "precious")).replace("MODEL", tiny_model)
    assert main(compare(tmp_path, "--model", tiny_model, "--method-args", method_args)) == 2
    one_line_error(capsys, flag, "method_args")
    assert not (tmp_path / "precious").exists()


@pytest.mark.parametrize("methods, words", [
    ("a=grpo,a=dapo", ["'a' is given twice"]),
    ("grpo,grpo", ["'grpo' is given twice"]),
    ("=grpo", ["'=grpo' is not allowed"]),
    ("../esc=grpo", ["'../esc=grpo' is not allowed"]),
    ("x=", ["'x=' is not allowed"]),
    ("eps0.3=grpo", ["'eps0.3=grpo' is not allowed", "no '/' or '.'"]),  # every report cell of it was blank
])
def test_compare_refuses_labels_that_would_drop_or_misplace_a_method(tmp_path, capsys, no_runs, tiny_model, methods,
                                                                     words):
    """A repeated label silently dropped a method, an empty one wrote its runs straight into --out and then said
    every run failed, and ``../x`` wrote outside --out."""
    argv = compare(tmp_path, "--model", tiny_model)
    argv[argv.index("--methods") + 1] = methods
    assert main(argv) == 2
    one_line_error(capsys, "methods = ", *words)
    assert not (tmp_path / "c").exists() and not (tmp_path / "esc").exists()


def test_compare_with_no_finished_run_says_so_in_one_line(tmp_path, capsys, monkeypatch, tiny_model):
    monkeypatch.setattr("polyrl.lab.compare.run_all", lambda specs, **k: [(s, 1, 0.0) for s in specs])
    assert main(compare(tmp_path, "--model", tiny_model)) == 1
    one_line_error(capsys, "no run", "train.log")


def test_compare_checks_an_interrupted_run_before_any_run_starts(tmp_path, capsys, no_runs, tiny_model):
    """An interrupted run asked for another --lr (or fewer steps than its checkpoint) started anyway; its resume was
    refused in the child, and the report then ranked the interrupted run's old rows as this command's."""
    run = tmp_path / "c" / "grpo" / "seed0"
    small = ["--model", tiny_model, "--prompts-per-step", "2", "--group-size", "2", "--eval-prompts", "4"]
    assert main(["train", *small, "--run-dir", str(run), "--steps", "2", "--checkpoint-every", "1"]) == 0
    (run / "summary.json").unlink()  # as a run stopped after its checkpoint at step 2 leaves it
    capsys.readouterr()
    assert main(compare(tmp_path, *small, "--lr", "3e-4")) == 2
    one_line_error(capsys, "seed0 stopped with lr = 0.0001, and this compare gives lr = 0.0003")
    assert main(compare(tmp_path, *small, "--steps", "1")) == 2  # the last --steps is the one taken
    one_line_error(capsys, "seed0 stopped with steps", "its checkpoint at step 2", "gives steps = 1")
    assert not (tmp_path / "c" / "grpo" / "seed0.train.log").exists()


def test_compare_refuses_an_out_of_someone_elses_files(tmp_path, capsys, no_runs, tiny_model):
    """The report's results.json and report.html would overwrite files of that name in a folder that holds no
    compare run."""
    out = tmp_path / "c"
    out.mkdir()
    (out / "results.json").write_text("precious")
    assert main(compare(tmp_path, "--model", tiny_model)) == 2
    one_line_error(capsys, "out = ", "results.json", "no compare run")
    assert (out / "results.json").read_text() == "precious"


@pytest.mark.parametrize("key, value", [("task", '"calculator"'), ("seed", "3"), ("run_dir", '"elsewhere"'),
                                        ("model", '"/nowhere"')])
def test_compare_refuses_a_toml_that_sets_what_compare_sets_per_run(tmp_path, capsys, no_runs, tiny_model, key,
                                                                    value):
    """compare's own --task (default addition), --seed, --run-dir and --model would win over the TOML's unseen."""
    (tmp_path / "run.toml").write_text(f"{key} = {value}\nlr = 1e-4\n")
    assert main(compare(tmp_path, "--model", tiny_model, "--config", str(tmp_path / "run.toml"))) == 2
    one_line_error(capsys, f"{key} = ", "not allowed in compare")


@pytest.mark.parametrize("extra, toml, threads", [
    ([], "", "2"),  # not given: compare splits the 4 cores between 2 workers
    (["--threads=3"], "", "3"), (["--threads", "3"], "", "3"),  # an abbreviation (--thread) is refused now
    ([], "threads = 3", "3"),
])
def test_compare_keeps_a_thread_count_given_in_any_form(tmp_path, monkeypatch, tiny_model, extra, toml, threads):
    """Before, only the literal token ``--threads`` was seen: ``--threads=3`` or a TOML's threads lost to compare's
    own count, appended after them."""
    seen = []
    monkeypatch.setattr("polyrl.lab.compare.run_all", lambda specs, **k: seen.extend(specs) or [])
    monkeypatch.setattr("polyrl.runs.cores", lambda: 4)
    (tmp_path / "run.toml").write_text(toml + "\n")
    main(compare(tmp_path, "--model", tiny_model, "--workers", "2", "--config", str(tmp_path / "run.toml"), *extra))
    from polyrl.cli import build_parser

    args = build_parser().parse_args(seen[0].args)
    from polyrl.build import resolve_train

    assert str(resolve_train(args).cfg.threads) == threads


def test_a_rerun_keeps_only_the_finished_runs_it_asks_for(tmp_path, capsys, tiny_model):
    """A finished run made with other settings is refused (it was reported as the new command's), one asked to run
    longer is resumed, and the report holds this command's methods only."""
    import json

    small = ["--model", tiny_model, "--prompts-per-step", "2", "--group-size", "2", "--eval-prompts", "2",
             "--max-new-tokens", "4", "--threads", "1", "--no-tensorboard"]
    out = tmp_path / "c"
    assert main(compare(tmp_path, *small)) == 0
    capsys.readouterr()
    assert main(compare(tmp_path, *small, "--lr", "1e-3")) == 2
    one_line_error(capsys, f"{out / 'grpo' / 'seed0'} finished with lr = ", "this compare gives lr = 0.001")
    assert main(compare(tmp_path, *small, "--steps", "1")) == 2  # fewer steps than it ran
    one_line_error(capsys, "finished with steps = 2")
    assert main(compare(tmp_path, *small, "--steps", "3")) == 0  # more: resumed, not kept as it was
    assert json.loads((out / "grpo" / "seed0" / "summary.json").read_text())["steps"] == 3
    argv = compare(tmp_path, *small, "--steps", "1")
    argv[argv.index("--methods") + 1] = "dapo"
    assert main(argv) == 0
    assert "1 other run(s)" in capsys.readouterr().out
    assert list(json.loads((out / "results.json").read_text())["methods"]) == ["dapo"]


def test_a_second_compare_on_an_out_in_use_is_refused(tmp_path, capsys, no_runs, tiny_model):
    """Before, it truncated the running compare's logs and wrote a report of its half-done runs."""
    from polyrl.runs import run_lock

    with run_lock(tmp_path / "c", "out"):
        assert main(compare(tmp_path, "--model", tiny_model)) == 2
    one_line_error(capsys, "out = ", "is in use by another polyrl command")


def test_a_stopped_compare_stops_the_runs_it_started(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM (an exception in run_all): the running child gets SIGTERM, no further run starts. Before,
    a SIGTERM left the child training on, and the rerun the message asks for wrote into its run directory too."""
    import signal
    import subprocess
    import sys
    import time

    from rich.console import Console

    from polyrl.lab import compare as lab

    started, real = [], subprocess.Popen

    def popen(argv, **kw):  # a run that would go on for a minute
        started.append(real([sys.executable, "-c", "import time; time.sleep(60)"], **kw))
        return started[-1]

    monkeypatch.setattr(lab.subprocess, "Popen", popen)
    monkeypatch.setattr(lab, "STOP_GRACE_S", 5.0)
    specs = [lab.RunSpec("grpo", k, tmp_path / "grpo" / f"seed{k}", ["train"]) for k in range(2)]

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            lab.run_all(specs, workers=1, console=Console(quiet=True))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - t0 < 10
    assert len(started) == 1 and started[0].poll() == -signal.SIGTERM  # stopped, not left running
    assert not (tmp_path / "grpo" / "seed1.train.log").exists()  # the second run never started


def test_a_resumed_run_keeps_its_interrupted_log_and_a_new_one_starts_afresh(tmp_path, monkeypatch):
    """compare opened each run's train.log with "w": resuming an interrupted run replaced the log of how it stopped."""
    import subprocess
    import sys

    from rich.console import Console

    from polyrl.lab import compare as lab

    real = subprocess.Popen
    monkeypatch.setattr(lab.subprocess, "Popen",
                        lambda argv, **kw: real([sys.executable, "-c", "print('this attempt')"], **kw))
    log = tmp_path / "grpo" / "seed0.train.log"
    log.parent.mkdir()
    log.write_text("step 75: Terminated\n")
    resumed = lab.RunSpec("grpo", 0, tmp_path / "grpo" / "seed0", ["train", "--resume"])
    assert [code for _, code, _ in lab.run_all([resumed], workers=1, console=Console(quiet=True))] == [0]
    lines = log.read_text().splitlines()
    assert lines[0] == "step 75: Terminated" and lines[1].startswith("--- resumed by compare: polyrl train --resume")
    assert lines[2] == "this attempt"
    fresh = lab.RunSpec("grpo", 0, tmp_path / "grpo" / "seed0", ["train", "--overwrite"])
    lab.run_all([fresh], workers=1, console=Console(quiet=True))
    assert log.read_text() == "this attempt\n"


def test_concurrent_compare_runs_get_their_own_gpus(tmp_path, monkeypatch):
    """With several GPUs, each worker slot's runs see their own (every concurrent run trained on GPU 0 before);
    with one GPU or one worker the environment is left as it is."""
    import subprocess
    import sys

    from rich.console import Console

    from polyrl.lab import compare as lab

    seen, real = [], subprocess.Popen

    def popen(argv, **kw):  # each run prints the GPUs it was given, then lasts long enough to overlap the other
        seen.append(kw["env"].get("CUDA_VISIBLE_DEVICES"))
        return real([sys.executable, "-c", "import time; time.sleep(0.5)"], **kw)

    monkeypatch.setattr(lab.subprocess, "Popen", popen)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    specs = [lab.RunSpec("grpo", k, tmp_path / "grpo" / f"seed{k}", ["train"]) for k in range(4)]
    assert [code for _, code, _ in lab.run_all(specs, workers=2, console=Console(quiet=True))] == [0] * 4
    assert sorted(seen) == ["0,1", "0,1", "2,3", "2,3"] and seen[0] != seen[1]  # the first two ran side by side
    assert lab.gpu_slots(["0", "1"], 3) == ["0", "1", "0"] and lab.gpu_slots(["7"], 2) == []
    assert lab.gpu_slots(["0", "1"], 1) == []
    seen.clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    lab.run_all(specs[:2], workers=2, console=Console(quiet=True))
    assert seen == ["5", "5"]  # one GPU: the environment as it was


# 2. the analysis settings are checked before the first run


@pytest.mark.parametrize("flag, value", [
    ("--ci", "5"), ("--ci", "0"), ("--ci", "1"), ("--ci", "nan"),
    ("--collapse-drop", "0"), ("--collapse-drop", "-3"), ("--collapse-drop", "1.5"), ("--collapse-drop", "nan"),
    ("--threshold", "nan"), ("--threshold", "inf"), ("--threshold", "2"), ("--threshold", "-0.5"),
])
def test_compare_checks_its_analysis_settings_before_any_run(tmp_path, capsys, no_runs, tiny_model, flag, value):
    assert main(compare(tmp_path, "--model", tiny_model, flag, value)) == 2
    one_line_error(capsys, flag.lstrip("-").replace("-", "_"), value)


# 3. an unbalanced quote in --method-args


def test_compare_method_args_with_an_unbalanced_quote(tmp_path, capsys, no_runs, tiny_model):
    assert main(compare(tmp_path, "--model", tiny_model, "--method-args", "grpo=--lr '1")) == 2
    one_line_error(capsys, "method_args", "No closing quotation")


# 4. a reward function or a plugin that calls sys.exit


def test_a_reward_function_that_exits_is_a_reward_error(tmp_path):
    (tmp_path / "rf_exits.py").write_text("import sys\ndef exits(prompts, completions, **kw):\n    sys.exit(0)\n")
    task = get_task("addition")
    rewards = RewardChannels(task, [f"{tmp_path / 'rf_exits.py'}:exits"])
    prompts = task.prompts("train", 2, 0)
    with pytest.raises(RewardError, match=r"sys\.exit\(0\)"):
        rewards(prompts, ["1", "2"])


def test_a_reward_module_that_exits_on_import_is_refused(tmp_path):
    (tmp_path / "rf_exit_import.py").write_text("import sys\nsys.exit(0)\ndef f(prompts, completions, **kw):\n"
                                                "    return [0.0] * len(completions)\n")
    with pytest.raises(ValueError, match=r"sys\.exit\(0\)"):
        load_callable(f"{tmp_path / 'rf_exit_import.py'}:f")


def test_a_plugin_that_exits_on_import_is_refused(tmp_path, capsys):
    (tmp_path / "plugin_exits.py").write_text("import sys\nsys.exit(0)\n")
    assert main(["--plugin", str(tmp_path / "plugin_exits.py"), "methods"]) == 2
    one_line_error(capsys, "plugin_exits.py", "sys.exit(0)")


def test_a_plugin_that_takes_a_built_in_name_is_one_line_naming_its_file(tmp_path):
    """A plugin registering trust region 'clip' ran before the built-ins, so the built-in module raised: a traceback
    through polyrl's own code that did not name the plugin."""
    import subprocess
    import sys

    plugin = tmp_path / "dup.py"
    plugin.write_text("from polyrl.registry import TRUST_REGIONS\n\n@TRUST_REGIONS.register('clip')\n"
                      "def clip(inp, lr):\n    return lr, {}\n")
    proc = subprocess.run([sys.executable, "-m", "polyrl.cli", "--plugin", str(plugin), "methods"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "trust_region 'clip' is registered twice" in proc.stderr, proc.stderr
    assert str(plugin) in proc.stderr and "polyrl.objectives.trust_regions" in proc.stderr, proc.stderr


def test_output_into_a_closed_pipe_ends_quietly():
    """`polyrl methods --json | head -1` ended in a BrokenPipeError traceback (rich's tables already exit quietly)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "polyrl.cli", "methods", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "["
    proc.stdout.close()  # as head does after its line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and err == "", err


def test_train_with_a_reward_module_that_exits_on_import(tmp_path, capsys, no_training, tiny_model):
    (tmp_path / "rf_exit_train.py").write_text("import sys\nsys.exit(0)\n")
    assert main(["train", "--model", tiny_model, "--run-dir", str(tmp_path / "r"),
                 "--reward-funcs", f"{tmp_path / 'rf_exit_train.py'}:f"]) == 2
    one_line_error(capsys, "rf_exit_train.py", "sys.exit(0)")


# 5. a task read from --data-file has no warm start


@pytest.fixture
def math_file(tmp_path) -> str:
    path = tmp_path / "good.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(60)))
    return str(path)


def test_train_math_without_a_model_asks_for_one(tmp_path, capsys, no_training, math_file):
    assert main(["train", "--task", "math", "--data-file", math_file, "--run-dir", str(tmp_path / "r")]) == 2
    one_line_error(capsys, "task = 'math'", "--model")
    assert not (tmp_path / "r").exists()


def test_train_math_without_a_model_keeps_the_run_it_would_overwrite(tmp_path, capsys, no_training, math_file):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.json").write_text("{}")
    argv = ["train", "--task", "math", "--data-file", math_file, "--run-dir", str(tmp_path / "r"), "--overwrite"]
    assert main(argv) == 2
    one_line_error(capsys, "task = 'math'", "--model")
    assert (tmp_path / "r" / "config.json").read_text() == "{}"


def test_compare_math_without_a_model_asks_for_one(tmp_path, capsys, no_runs, math_file):
    assert main(compare(tmp_path, "--task", "math", "--data-file", math_file)) == 2
    one_line_error(capsys, "task = 'math'", "--model")


def test_compare_with_an_unknown_task_is_refused_before_a_warm_start(tmp_path, capsys, no_runs, no_training):
    assert main(compare(tmp_path, "--task", "nosuch")) == 2
    one_line_error(capsys, "task = 'nosuch'", "addition")


# 6. warmstart settings


@pytest.mark.parametrize("argv, field", [
    (["--task", "nosuch"], "task"),
    (["--task", "math"], "task"),
    (["--threshold", "2"], "threshold"),
    (["--threshold", "-0.1"], "threshold"),
    (["--threshold", "nan"], "threshold"),
    (["--hidden", "0"], "hidden"),
    (["--hidden", "-4"], "hidden"),
    (["--hidden", "130"], "hidden"),
    (["--hidden", "12"], "hidden"),  # 4 heads of 3: rotary embeddings need an even head size
    (["--layers", "0"], "layers"),
    (["--seed", "-1"], "seed"),
])
def test_warmstart_refuses_bad_settings(capsys, no_training, argv, field):
    assert main(["warmstart", *argv]) == 2
    err = capsys.readouterr().err
    assert f"{field} = " in err and len(err.strip().splitlines()) == 1, err
    if argv == ["--task", "math"]:  # it named warmstart's --model, which warmstart does not have
        assert "`polyrl train --task math --data-file F --model DIR`" in err, err


def test_warmstart_that_does_not_reach_its_threshold_is_one_line(capsys, monkeypatch):
    from polyrl.tinylm import WarmstartError

    def fails(*a, **k):
        raise WarmstartError("warm-start of 'addition' did not reach held-out greedy accuracy 1.00")

    monkeypatch.setattr("polyrl.tinylm.warmstart", fails)
    assert main(["warmstart", "--threshold", "1"]) == 1
    one_line_error(capsys, "did not reach")


# 7. --run-dir that is a file


@pytest.mark.parametrize("sub", ["", "sub"])
def test_train_run_dir_that_is_a_file(tmp_path, capsys, no_training, tiny_model, sub):
    file = tmp_path / "a_file"
    file.write_text("data")
    run_dir = file / sub if sub else file
    assert main(["train", "--model", tiny_model, "--run-dir", str(run_dir)]) == 2
    one_line_error(capsys, "run_dir", str(file))
    assert file.read_text() == "data"


# 8. Ctrl-C


@pytest.mark.parametrize("checkpoint", [False, True])
def test_train_interrupted_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch, tiny_model, checkpoint):
    run_dir = tmp_path / "r"

    def interrupted(*a, **k):
        if checkpoint:
            (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)
            (run_dir / "checkpoints" / "step_000001" / "meta.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr("polyrl.trainer.train", interrupted)
    try:
        code = main(["train", "--model", tiny_model, "--run-dir", str(run_dir)])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main")
    assert code == 130
    err = one_line_error(capsys, "interrupted", str(run_dir))
    assert ("--resume" in err) == checkpoint and ("--overwrite" in err) != checkpoint
    assert (run_dir / "config.json").is_file()  # nothing of the run is removed


def test_compare_interrupted_says_how_to_go_on(tmp_path, capsys, monkeypatch, tiny_model):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("polyrl.lab.compare.run_all", interrupted)
    try:
        code = main(compare(tmp_path, "--model", tiny_model))
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main")
    assert code == 130
    one_line_error(capsys, "interrupted", "run the same command again", "interrupted ones resumed")
    # a family's runs restart from scratch (plan_runs gives them --overwrite): the line does not promise a resume
    code = main(["compare", "--family", "flow", "--methods", "flow_dppo", "--seeds", "1", "--out",
                 str(tmp_path / "f"), "--steps", "1"])
    assert code == 130
    one_line_error(capsys, "interrupted", "run the same command again", "interrupted ones start over")


@pytest.mark.parametrize("argv", [
    ["q", "search", "--out", "FILE/x"],
    ["duplex", "report", "--seeds", "1", "--out", "FILE"],
    ["marl", "report", "--seeds", "1", "--out", "FILE"],
    ["compare", "--family", "flow", "--methods", "flow_dppo", "--seeds", "1", "--out", "FILE"],
])
def test_an_out_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, argv):
    """These wrote into a file's path: a traceback after the search (q search) or before the first run."""
    (tmp_path / "f").write_text("keep")
    assert main([a.replace("FILE", str(tmp_path / "f")) for a in argv]) == 2
    one_line_error(capsys, "--out = ", "is a file, not a directory")
    assert (tmp_path / "f").read_text() == "keep"
    if "FILE" in argv:  # an empty --out meant the current directory
        assert main([a.replace("FILE", "") for a in argv]) == 2
        one_line_error(capsys, "out = ''", "is not allowed")


@pytest.mark.parametrize("argv", [
    ["q", "search", "--out", "OUT"],
    ["duplex", "report", "--seeds", "1", "--out", "OUT"],
    ["marl", "report", "--seeds", "1", "--out", "OUT"],
])
def test_an_out_that_cannot_be_made_or_is_in_use_is_refused_in_one_line(tmp_path, capsys, argv):
    """An --out on a file system that refuses it was a PermissionError or FileNotFoundError traceback; a second
    report on an --out in use deleted the first one's runs (start_run_dir) and mixed the two."""
    from polyrl.runs import run_lock

    assert main([a.replace("OUT", "/proc/polyrl-no-such/x") for a in argv]) == 2
    one_line_error(capsys, "--out = '/proc/polyrl-no-such/x' cannot be created")
    if argv[0] == "q":  # q search refuses an existing --out anyway
        return
    out = tmp_path / "r"
    with run_lock(out, "out"):
        assert main([a.replace("OUT", str(out)) for a in argv]) == 2
        one_line_error(capsys, f"out = '{out}' is in use by another polyrl command")
    assert not out.exists()


@pytest.mark.parametrize("argv", [
    ["train", "--steps", "1"],
    ["duplex", "train", "--steps", "1"],
    ["marl", "train", "--steps", "1"],
    ["safety", "unlearn", "--seeds", "1"],
])
def test_more_threads_than_four_per_core_are_refused_before_any_work(tmp_path, capsys, monkeypatch, argv):
    """``--threads 100000`` crashed duplex, marl and the safety tools (a segfault, libgomp failing to start
    threads, an overflow traceback); thousands crawled. At most 4 per core, here 2 cores."""
    monkeypatch.setattr("polyrl.runs.cores", lambda: 2)
    out = tmp_path / "out"
    flag = "--out" if argv[0] == "safety" else "--run-dir"
    assert main([*argv, flag, str(out), "--threads", "9"]) == 2
    one_line_error(capsys, "threads = 9", "[", ", 8]", "4 per core")
    assert not out.exists()


@pytest.mark.parametrize("argv, words", [
    (["flow", "train", "--lr", "1e300"], ["lr = 1e+300 is not allowed", "at most 3.4e+38"]),
    (["marl", "train", "--lr", "1e39"], ["lr = 1e+39 is not allowed", "at most 3.4e+38"]),
    (["duplex", "train", "--imitation-lr", "1e39"], ["imitation_lr = 1e+39 is not allowed", "float32"]),
    (["duplex", "train", "--natural-noise", "49"], ["natural_noise = 49 is not allowed", "[0, frames = 48]"]),
    # within float32 but not Adam's first step, 10 x lr: the same overflow traceback
    (["marl", "train", "--lr", "1e38"], ["lr = 1e+38 is not allowed", "at most 3.4e+37", "Adam's first step"]),
    (["flow", "train", "--lr", "1e38"], ["lr = 1e+38 is not allowed", "at most 3.4e+37"]),
    (["duplex", "train", "--imitation-lr", "1e38"], ["imitation_lr = 1e+38 is not allowed", "at most 3.4e+37"]),
])
def test_family_settings_beyond_float32_are_refused_before_any_work(tmp_path, capsys, argv, words):
    """Finite, but inf in the family's float32 tensors: an overflow traceback from the optimizer in step 1 (and an
    --overwrite then lost the run it replaced); natural_noise 1e300 was numpy's 'high is out of bounds'."""
    assert main([*argv, "--run-dir", str(tmp_path / "r")]) == 2
    one_line_error(capsys, *words)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv, words", [
    (["warmstart", "--hidden", "8", "--layers", "1025"], ["layers = 1025 is not allowed: at most 1024"]),
    (["warmstart", "--hidden", "1000000"], ["hidden = 1000000 x layers = 4", "GiB"]),
    (["safety", "probe", "--hidden", "1000000", "--out", "OUT"], ["--hidden = 1000000 x --layers", "GiB"]),
    (["safety", "probe", "--sae-features", "1000000000", "--out", "OUT"], ["--sae-features = 1000000000", "GiB"]),
    (["safety", "probe", "--eval-prompts", "1000000000", "--out", "OUT"], ["--eval-prompts = 1000000000"]),
])
def test_tiny_models_too_deep_or_large_to_train_are_refused_before_any_work(tmp_path, capsys, argv, words):
    """warmstart --layers 1000000 built layers for minutes with no output, --hidden 1000000 ended in an out-of-memory
    line naming no option; so did the probe's model and SAE sizes, and --eval-prompts 1e9 ran on silently."""
    assert main([a.replace("OUT", str(tmp_path / "out")) for a in argv]) == 2
    one_line_error(capsys, *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, words", [
    (["bias-probe", "--group", "100000000"], ["--sim-seeds x --group = 20000000000 drawn answers", "GiB"]),
    (["bias-probe", "--options", "10000000"], ["--sim-seeds x --options = 2000000000 logits", "GiB"]),
    (["bias-probe", "--lm-group", "1000000000"], ["--lm-group = 1000000000 drawn answers", "GiB"]),
    (["unlearn", "--episodes", "3000000"], ["--episodes = 3000000 with --poison-ratio = 3", "GiB"]),
    (["unlearn", "--poison-ratio", "1e9"], ["--episodes = 150 with --poison-ratio = 1e+09", "GiB"]),
    (["redteam", "--group-size", "1000000"], ["--group-size = 1000000 is not allowed here", "GiB"]),
])
def test_safety_sizes_beyond_this_machines_memory_are_refused_before_any_work(tmp_path, capsys, monkeypatch, argv,
                                                                              words):
    """These sizes ended in the generic out-of-memory line naming no option, or in the kernel's OOM killer with no
    line at all (redteam --group-size 800000 held 12.7 GB and growing after 12 minutes). Each tool now estimates the
    bytes from its measured bytes per unit; the machine is pinned at 24 GiB so the test does not depend on this one."""
    monkeypatch.setattr("polyrl.runs.memory_bytes", lambda: 24 * 2**30)
    assert main(["safety", *argv, "--out", str(tmp_path / "out")]) == 2
    one_line_error(capsys, *words, "more than the 24.0 GiB")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, words", [
    (["flow", "train", "--seed", "-1", "--run-dir", "OUT"], ["seed = -1 is not allowed", "[0, 2**32)"]),
    (["marl", "train", "--seed", "-1", "--run-dir", "OUT"], ["seed = -1 is not allowed", "[0, 2**32)"]),
    (["flow", "pretrain", "--seed", "-1"], ["seed = -1 is not allowed"]),  # it wrote a cache entry 'seed-1'
    (["marl", "report", "--seeds", "100000000", "--out", "OUT"], ["seeds = 100000000 is not allowed", "[1, 1000]"]),
    (["duplex", "report", "--seeds", "1001", "--out", "OUT"], ["seeds = 1001 is not allowed", "[1, 1000]"]),
    (["compare", "--methods", "grpo", "--seeds", "1001", "--out", "OUT"], ["seeds must be in [1, 1000]"]),
])
def test_seeds_out_of_range_are_refused_before_any_work(tmp_path, capsys, argv, words):
    """flow and marl took --seed -1 (q and duplex refused it); a report of 10^8 seeds checked its seed directories
    for minutes with no output."""
    assert main([a.replace("OUT", str(tmp_path / "out")) for a in argv]) == 2
    one_line_error(capsys, *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["train"], ["flow", "train"], ["marl", "train"], ["duplex", "train"]])
def test_a_toml_value_of_the_wrong_type_is_refused_even_under_a_flag(tmp_path, capsys, command):
    """`steps = "3"` in a TOML ran when --steps was given too: the flag replaced it before its type was checked."""
    (tmp_path / "c.toml").write_text('steps = "3"\n')
    assert main([*command, "--config", str(tmp_path / "c.toml"), "--steps", "1", "--run-dir", str(tmp_path / "r")]) == 2
    one_line_error(capsys, "c.toml': steps = '3' must be int")
    assert not (tmp_path / "r").exists()


def test_an_allocation_that_fails_is_one_line_and_other_errors_still_raise(tmp_path, capsys, monkeypatch):
    """`q train --size 1000000`, `duplex train --hidden 10000000`: numpy's and torch's allocation errors were
    tracebacks from deep inside the step. A bug that is no allocation failure keeps its traceback."""
    for error in (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"),
                  ValueError("array is too big; `arr.size * arr.dtype.itemsize` is larger than the maximum"),
                  MemoryError()):
        def fails(*a, error=error, **k):
            raise error

        monkeypatch.setattr("polyrl.families.q.train.train_q", fails)
        assert main(["q", "train", "--run-dir", str(tmp_path / "q")]) == 1
        one_line_error(capsys, "polyrl: out of memory", "lower the sizes")
        assert not (tmp_path / "q").exists()

    def bug(*a, **k):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr("polyrl.families.q.train.train_q", bug)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(["q", "train", "--run-dir", str(tmp_path / "q")])


@pytest.mark.parametrize("argv, words", [(["--methods", "grpo", "--lrr", "3"], ["--lrr", "did you mean --lr?"]),
                                         (["--methods", "grpoo"], ["unknown method 'grpoo'", "did you mean 'grpo'"]),
                                         (["--methods", "grpo", "--method-args", "grpo=--epochz 2"], ["--epochz"]),
                                         (["--methods", "grpo", "--trust-region", "clip:eps_hgih=0.3"],
                                          ["unknown parameter 'eps_hgih'"]),
                                         (["--methods", "grpo", "--method-args", "grpo=--kl-coef -1"],
                                          ["kl_coef = -1"])])
def test_compare_refuses_a_misspelt_flag_or_preset_before_the_warm_start_trains(tmp_path, capsys, monkeypatch, argv,
                                                                              words):
    """`compare --task countdown --lrr 3` trained the countdown warm start (minutes) before it said --lrr is no flag."""
    monkeypatch.setattr("polyrl.tinylm.warmstart", lambda *a, **k: pytest.fail("the warm start was built"))
    assert main(["compare", *argv, "--task", "countdown", "--out", str(tmp_path / "c")]) == 2
    one_line_error(capsys, *words)


def test_compare_keeps_a_thread_count_a_methods_own_config_sets(tmp_path, monkeypatch, tiny_model):
    """Only the shared flags were asked whether they set threads: a method's --config with `threads = 1` got
    `--threads N` added before it on its command line, and the flag beat the file."""
    import polyrl.lab.compare as lab

    toml = tmp_path / "t.toml"
    toml.write_text("threads = 1\n")
    planned = []
    monkeypatch.setattr(lab, "run_all", lambda specs, **k: planned.extend(specs) or [])
    main(["compare", "--methods", "grpo,dapo", "--seeds", "1", "--model", tiny_model, "--out", str(tmp_path / "c"),
          "--method-args", f"grpo=--config {toml}"])
    argv = {s.method: s.args for s in planned}
    assert "--threads" not in argv["grpo"] and argv["dapo"][argv["dapo"].index("--threads") + 1].isdigit()


def test_a_failed_compare_run_names_its_log_where_it_is(tmp_path, monkeypatch):
    """The line said "see seed0.train.log"; the log is OUT/<method>/seed0.train.log."""
    import io
    import subprocess
    import sys

    from rich.console import Console

    from polyrl.lab import compare as lab

    real = subprocess.Popen
    monkeypatch.setattr(lab.subprocess, "Popen",
                        lambda argv, **kw: real([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], **kw))
    spec = lab.RunSpec("grpo", 0, tmp_path / "grpo" / "seed0", ["train"])
    text = io.StringIO()
    assert [code for _, code, _ in lab.run_all([spec], workers=1, console=Console(file=text, width=300))] == [3]
    assert f"FAILED (exit 3, see {tmp_path / 'grpo' / 'seed0.train.log'})" in text.getvalue()
    assert (tmp_path / "grpo" / "seed0.train.log").read_text().strip().endswith("boom")


@pytest.mark.parametrize("body, words", [
    # it silently replaced the built-in: `--method grpo` ran the plugin's RLOO
    ("@preset\ndef grpo():\n    '''Mine.'''\n    return build_method('grpo', advantage='rloo', trust_region='clip', "
     "aggregation='token_mean')\n", ["preset 'grpo' is registered twice, by polyrl.methods and by"]),
    # built lazily, it broke `methods`, `parts` and `docs` with a message naming neither the preset nor the file
    ("@preset\ndef bad():\n    '''Bad.'''\n    return build_method('bad', advantage='grpo', "
     "trust_region='clip:eps_hgih=0.3', aggregation='token_mean')\n",
     ["preset 'bad' (", "unknown parameter 'eps_hgih'"]),
    # listed by `methods` as bar, unknown to `explain bar`
    ("@preset\ndef foo():\n    '''Foo.'''\n    return build_method('bar', advantage='grpo', trust_region='clip', "
     "aggregation='token_mean')\n", ["preset 'foo' (", "builds a method named 'bar'"]),
])
def test_a_plugin_preset_that_cannot_be_used_as_given_is_refused_where_it_is_defined(tmp_path, body, words):
    import subprocess
    import sys

    plugin = tmp_path / "presets.py"
    plugin.write_text("from polyrl.methods import preset\nfrom polyrl.objectives import build_method\n\n" + body)
    proc = subprocess.run([sys.executable, "-m", "polyrl.cli", "--plugin", str(plugin), "parts", "advantage"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert str(plugin) in proc.stderr and all(w in proc.stderr for w in words), proc.stderr


def test_plugin_usage_mistakes_say_what_to_do(tmp_path, capsys, monkeypatch):
    """`polyrl train --plugin x.py` said only "unrecognized arguments: --plugin" (it goes before the command; in
    compare it was an AttributeError traceback), and `polyrl --plugin my_parts` for ./my_parts.py "No module named"
    (the console script does not import from the current directory)."""
    with pytest.raises(SystemExit) as e:  # argparse's usage error
        main(["train", "--plugin", "x.py", "--steps", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --plugin (it goes before the command: polyrl --plugin MODULE train ...)" in err
    assert main(["compare", "--methods", "grpo", "--plugin", "x.py", "--out", str(tmp_path / "c")]) == 2
    one_line_error(capsys, "--plugin (it goes before the command")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_local_parts.py").write_text("X = 1\n")
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".", str(tmp_path))])
    assert main(["--plugin", "my_local_parts", "methods"]) == 2
    one_line_error(capsys, "No module named 'my_local_parts'", "give the file, --plugin my_local_parts.py")


def test_a_plugin_preset_may_use_the_parts_of_a_plugin_loaded_after_it(tmp_path):
    """Presets are checked once every --plugin has loaded: built when registered, a preset plugin given before the
    plugin of its parts was refused ("unknown trust_region")."""
    import subprocess
    import sys

    (tmp_path / "later_parts.py").write_text(
        "from polyrl.registry import TRUST_REGIONS\n\n@TRUST_REGIONS.register('later_tr')\n"
        "def later_tr(inp, log_ratio):\n    return -log_ratio.exp() * inp.adv, {}\n")
    (tmp_path / "early_presets.py").write_text(
        "from polyrl.methods import preset\nfrom polyrl.objectives import build_method\n\n@preset\ndef mine():\n"
        "    '''Mine.'''\n    return build_method('mine', advantage='grpo', trust_region='later_tr', "
        "aggregation='token_mean')\n")
    proc = subprocess.run([sys.executable, "-m", "polyrl.cli", "--plugin", str(tmp_path / "early_presets.py"),
                           "--plugin", str(tmp_path / "later_parts.py"), "explain", "mine"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "later_tr" in proc.stdout, proc.stderr
