"""`polyrl train --nproc 2` end to end: two FSDP2 processes train like one, and their checkpoint resumes in one.

Each command runs as a user would type it (a subprocess; the launcher is torch.distributed.run, gloo on
127.0.0.1). The batches are the same in both runs (rank 0 generates with the same keyed sampling), so the
logged rewards agree exactly and the losses and gradient norms up to float reduction order.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from polyrl.tinylm import build_tiny_llama

TIMEOUT_S = 240


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", hidden=32, layers=2, heads=2, seed=0))


def _train(run_dir, model, *flags):
    cmd = [sys.executable, "-m", "polyrl", "train", "--model", model, "--run-dir", str(run_dir), "--steps", "3",
           "--prompts-per-step", "3", "--group-size", "4", "--max-new-tokens", "6", "--micro-batch-size", "5",
           "--eval-every", "0", "--eval-prompts", "8", "--checkpoint-every", "2", "--no-tensorboard",
           "--reward-funcs", "tests.reward_fns:digit_fraction", "--lr", "1e-3", "--warmup-steps", "0", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _steps(rows):
    return [r for r in rows if "reward/mean" in r]


@pytest.fixture(scope="module")
def one(model, tmp_path_factory):
    """The metrics of the same run in one process."""
    return _steps(_train(tmp_path_factory.mktemp("one"), model))


def test_two_processes_train_like_one_and_resume_in_one(model, one, tmp_path):
    two = _steps(_train(tmp_path / "two", model, "--nproc", "2"))
    assert [r["reward/mean"] for r in two] == [r["reward/mean"] for r in one]
    for a, b in zip(one, two):
        assert b["objective/loss"] == pytest.approx(a["objective/loss"], abs=1e-6)
        assert b["perf/grad_norm"] == pytest.approx(a["perf/grad_norm"], rel=1e-4)
    assert (tmp_path / "two" / "checkpoints" / "step_000002" / "dcp").is_dir()  # sharded (torch.distributed.checkpoint)
    # the 2-process run's step-2 checkpoint, continued in one process, ends where the 1-process run ended
    resumed = _steps(_train(tmp_path / "two", model, "--nproc", "1", "--resume",
                            "--resume-from", str(tmp_path / "two" / "checkpoints" / "step_000002")))
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed[-1]["reward/mean"] == one[-1]["reward/mean"]
    assert resumed[-1]["perf/grad_norm"] == pytest.approx(one[-1]["perf/grad_norm"], rel=1e-4)


def test_two_processes_with_a_ray_rollout_worker_train_like_one(model, one, tmp_path):
    """Trainer ranks and a generator actor compose: rank 0 drives the actor with the full state dict."""
    both = _steps(_train(tmp_path / "both", model, "--nproc", "2", "--rollout-workers", "1", "--ray-cpus", "2"))
    assert [r["reward/mean"] for r in both] == [r["reward/mean"] for r in one]
    for a, b in zip(one, both):
        assert b["perf/grad_norm"] == pytest.approx(a["perf/grad_norm"], rel=1e-4)
    assert all(r["rollout/worker_restarts"] == 0 and r["perf/weight_sync_s"] > 0 for r in both)


def test_an_empty_step_keeps_every_process_in_step(model, tmp_path):
    """dapo drops every zero-variance group: with a constant reward no step has a batch, and rank 0's empty step
    reaches the other rank whole (no hang, no unpicklable exception)."""
    rows = _train(tmp_path / "empty", model, "--nproc", "2", "--method", "dapo", "--reward-funcs",
                  "tests.reward_fns:zero", "--max-gen-rounds", "1")
    steps = [r for r in rows if "rollout/empty_steps" in r]
    assert [r["rollout/empty_steps"] for r in steps] == [1, 2, 3]


def _ranks_of(run_dir) -> list[int]:
    """The pids of processes whose command line names ``run_dir`` (the launcher and its ranks)."""
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run_dir) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_a_failing_run_exits_with_one_processs_code_and_a_killed_launcher_takes_its_ranks(model, tmp_path):
    """Every outcome of `--nproc 2` was exit 1 ("a training process failed (ChildFailedError)"), a refusal printed
    once per rank; a SIGKILLed launcher left both ranks training on, re-parented, holding the run directory."""
    import os
    import signal
    import time

    bad = tmp_path / "raising_reward.py"
    bad.write_text("def boom(prompts, completions, **kw):\n    raise ValueError('boom')\n")
    cmd = [sys.executable, "-m", "polyrl", "train", "--model", model, "--steps", "50", "--prompts-per-step", "2",
           "--group-size", "2", "--max-new-tokens", "4", "--eval-every", "0", "--no-tensorboard", "--nproc", "2"]
    done = subprocess.run([*cmd, "--run-dir", str(tmp_path / "bad"), "--reward-funcs", f"{bad}:boom"],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(re.findall(r"^polyrl: (rank \d+: )?error:", done.stderr, re.M)) == 1, done.stderr[-3000:]
    run = tmp_path / "killed"
    launcher = subprocess.Popen([*cmd, "--run-dir", str(run)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + TIMEOUT_S
    while not (run / "metrics.jsonl").exists() or '"step": 1' not in (run / "metrics.jsonl").read_text():
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    ranks = [p for p in _ranks_of(run) if p != launcher.pid]
    assert len(ranks) == 2
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    while any(p in _ranks_of(run) for p in ranks):
        assert time.monotonic() < deadline + 30, "the ranks outlived their launcher"
        time.sleep(0.2)
    # SIGTERM to the launcher: it stops the ranks and exits as one process would (143, not 1)
    run = tmp_path / "terminated"
    launcher = subprocess.Popen([*cmd, "--run-dir", str(run)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (run / "metrics.jsonl").exists() or '"step": 1' not in (run / "metrics.jsonl").read_text():
        assert launcher.poll() is None and time.monotonic() < deadline + 60
        time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=120) == 128 + signal.SIGTERM
    assert not _ranks_of(run)


def test_a_process_with_rank_variables_but_no_launcher_outlives_its_parent(tmp_path):
    """Rank variables alone (set by other tools: a job scheduler, MPI) armed the end-with-the-parent signal, so a run
    backgrounded by a script that then exited was killed with it."""
    import os
    import time

    alive = tmp_path / "alive"
    code = (f"from polyrl.launch import die_with_launcher; die_with_launcher(); import time; time.sleep(2); "
            f"open({str(alive)!r}, 'w').close()")
    subprocess.run(["sh", "-c", f"{sys.executable} -c \"{code}\" & sleep 0.5; exit 0"], timeout=60,
                   env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"})
    deadline = time.monotonic() + 30
    while not alive.exists():
        assert time.monotonic() < deadline, "the process died with the script that started it"
        time.sleep(0.2)
