"""Ray rollout workers through ``train``: a worker killed mid-call loses nothing, a stopped run resumes exactly.

Each run starts and stops its own local Ray instance, as a user's run does (this file has no shared
instance, so that the resumed run is seen to start a fresh one).
"""

from __future__ import annotations

import io
import json
import os
import signal

import pytest
import torch
from rich.console import Console

from polyrl.config import build_config
from polyrl.methods import get_method
from polyrl.rollout.group import GroupSource
from polyrl.rollout.remote import WorkerPool
from polyrl.tasks.arithmetic import AdditionTask
from polyrl.tinylm import build_tiny_llama
from polyrl.trainer import train

ray = pytest.importorskip("ray")
QUIET = Console(file=io.StringIO(), width=120)
DENSE = "tests.reward_fns:digit_fraction"  # every group has variance: no group is filtered out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return (str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "learner", hidden=32, layers=2, heads=2,
                                 seed=0)),)


def _cfg(run_dir, **kw):
    base = dict(steps=4, prompts_per_step=2, group_size=4, max_new_tokens=6, eval_prompts=8, eval_every=0,
                checkpoint_every=2, tensorboard=False, log_every=0, lr=1e-3, warmup_steps=0, threads=1,
                reward_funcs=DENSE, rollout_workers=2, ray_cpus=2, run_dir=str(run_dir))
    return build_config({**base, **kw})


def _rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


@pytest.fixture(scope="module")
def plain(models, tmp_path_factory):
    """The metrics of an undisturbed run with two rollout workers."""
    run = tmp_path_factory.mktemp("plain")
    before = signal.getsignal(signal.SIGTERM)
    train(_cfg(run), get_method("grpo"), model_dir=models[0], task=AdditionTask(), run_dir=str(run), console=QUIET)
    assert not ray.is_initialized()  # the run stopped the Ray instance it started
    assert signal.getsignal(signal.SIGTERM) is before  # and took back the SIGTERM handler ray.init installs
    return _rows(run)


def test_a_worker_killed_mid_call_loses_nothing(models, plain, tmp_path, monkeypatch):
    task, method = AdditionTask(), get_method("grpo")

    waits = []
    real_wait = WorkerPool.wait

    def kill_one_in_flight(self, pending):
        waits.append(1)
        if len(waits) == 3:  # step 2's call is in flight
            os.kill(self.pids_seen[0], signal.SIGKILL)
        return real_wait(self, pending)

    real_submit = WorkerPool.submit

    def remember_pids(self, *a, **kw):
        if not hasattr(self, "pids_seen"):
            self.pids_seen = self.pids()
        return real_submit(self, *a, **kw)

    monkeypatch.setattr(WorkerPool, "wait", kill_one_in_flight)
    monkeypatch.setattr(WorkerPool, "submit", remember_pids)
    train(_cfg(tmp_path / "killed"), method, model_dir=models[0], task=task, run_dir=str(tmp_path / "killed"),
          console=QUIET)
    monkeypatch.undo()
    killed = _rows(tmp_path / "killed")
    assert [r["rollout/worker_restarts"] for r in killed] == [0, 0, 1, 1]
    assert [r["rollout/generated"] for r in killed] == [r["rollout/generated"] for r in plain]
    assert [r["reward/mean"] for r in killed] == [r["reward/mean"] for r in plain]


def _stopped_at_step_3(monkeypatch, cfg, model_dir: str, run) -> None:
    """Train ``cfg`` into ``run`` until the driver is stopped (KeyboardInterrupt) while it collects step 3, after its
    step-2 checkpoint."""
    real_collect = GroupSource.collect

    def die_at_step_3(self, method, stream, step):
        if step == 3:
            raise KeyboardInterrupt
        return real_collect(self, method, stream, step)

    monkeypatch.setattr(GroupSource, "collect", die_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, get_method("grpo"), model_dir=model_dir, task=AdditionTask(), run_dir=str(run), console=QUIET)
    monkeypatch.undo()


def test_a_stopped_driver_resumes_exactly_with_workers_on_a_fresh_instance(models, plain, tmp_path, monkeypatch):
    task, method = AdditionTask(), get_method("grpo")
    # the driver dies after its step-2 checkpoint (stopped while collecting step 3) ...
    run = tmp_path / "resumed"
    _stopped_at_step_3(monkeypatch, _cfg(run), models[0], run)
    assert not ray.is_initialized()  # the run stopped its Ray instance on the way out
    # ... and resumes from it with new workers on a fresh Ray instance
    train(_cfg(run, resume=True), method, model_dir=models[0], task=task, run_dir=str(run), console=QUIET)
    resumed = _rows(run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["reward/mean"] for r in resumed] == [r["reward/mean"] for r in plain]


def test_an_asynchronous_run_resumes_exactly(models, tmp_path, monkeypatch):
    """The batches in flight at a checkpoint are saved with it: the resumed run trains on the very samples the
    unbroken one did, drawn with the same stale weights (staleness 2 at the first step after the resume, not 0)."""
    task, method = AdditionTask(), get_method("grpo")
    unbroken = tmp_path / "unbroken"
    train(_cfg(unbroken, async_staleness=2, rollout_workers=1), method, model_dir=models[0], task=task,
          run_dir=str(unbroken), console=QUIET)
    run = tmp_path / "resumed"
    _stopped_at_step_3(monkeypatch, _cfg(run, async_staleness=2, rollout_workers=1), models[0], run)
    train(_cfg(run, async_staleness=2, rollout_workers=1, resume=True), method, model_dir=models[0], task=task,
          run_dir=str(run), console=QUIET)
    keys = ("reward/mean", "async/staleness_max", "async/staleness_mean", "objective/loss", "rollout/mean_len")
    want = [[r[k] for k in keys] for r in _rows(unbroken)]
    assert [r["async/staleness_max"] for r in _rows(unbroken)] == [0, 1, 2, 2]
    assert [[r[k] for k in keys] for r in _rows(run)] == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU this machine must lack")
def test_a_refused_pool_stops_the_ray_instance_it_started(models):
    """A pool refused after it started Ray (actors asking for a GPU the machine lacks) stops that instance: left
    running, it made every later run in the process fail ("Ray is already running in this process")."""
    from polyrl.rollout.remote import WorkerError, WorkerSpec

    with pytest.raises(WorkerError, match="need 1 GPU"):
        WorkerPool(WorkerSpec(models[0], AdditionTask()), workers=1, cpus=2, gpus_per_worker=1, weights=dict)
    assert not ray.is_initialized()


def test_a_build_that_fails_after_the_workers_started_stops_them_and_ray(models, monkeypatch):
    """train() owns the workers only once the parts are built: a failure building the source after the rollout
    runner left its actors and the Ray instance it started running in the process."""
    import polyrl.build as build

    def broken(*args, **kwargs):
        raise RuntimeError("the source could not be built")

    monkeypatch.setattr(build, "_group_source", broken)
    with pytest.raises(RuntimeError, match="could not be built"):
        train(_cfg(None, steps=1), get_method("grpo"), model_dir=models[0], task=AdditionTask(),
              run_dir="/nonexistent-never-written", console=QUIET)
    assert not ray.is_initialized()
