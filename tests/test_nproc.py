"""`polyrl train --nproc 2` end to end: two FSDP2 processes train like one, and their checkpoint resumes in one.

Each command runs as a user would type it (a subprocess; the launcher is torch.distributed.run, gloo on
127.0.0.1). The batches are the same in both runs (rank 0 generates with the same keyed sampling), so the
logged rewards agree exactly and the losses and gradient norms up to float reduction order.
"""

from __future__ import annotations

import json
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


def test_two_processes_train_like_one_and_resume_in_one(model, tmp_path):
    one = _steps(_train(tmp_path / "one", model))
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
