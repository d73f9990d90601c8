"""Every preset x {uniform, tree} x {sync, async} x {KL in the loss, KL in the reward} (asynchronous runs with the
preset's own placement): it trains with its parts active, or it is refused before training in one line.

A combination the builder accepts runs two steps on a tiny model with two reward channels (the task's checker
and a dense one, so every group has signal), and the run shows each part at work: the KL term is nonzero once
the policy has moved (in the loss: ``objective/kl``; in the reward: ``reward/kl_penalty``), a critic takes value
steps, the channels reach the batch, the tree and the prefetching process report their statistics. A refused
combination is a ConfigError or PartError of one line that names a setting.
"""

from __future__ import annotations

import argparse
import io
import json
import math

import pytest
from rich.console import Console

from polyrl.build import add_train_args, resolve_train
from polyrl.config import ConfigError
from polyrl.methods import PRESETS, get_method
from polyrl.registry import PartError
from polyrl.trainer import train

QUIET = Console(file=io.StringIO(), width=120)
CHANNELS = "task,tests.reward_fns:digit_fraction"


def _combinations():
    for name in sorted(PRESETS):
        placements = ["loss", "reward"] if get_method(name).kl is not None else [None]
        for sampler in ("uniform", "tree"):
            for mode in ("sync", "async"):
                # Asynchronous runs take the preset's own placement: where the KL term goes does not depend on how
                # stale the batch is (both read the reference log-probs the workers computed), and each placement
                # is run synchronously; an asynchronous run costs a Ray worker's start (about 6 s).
                for placement in placements if mode == "sync" else [None]:
                    yield pytest.param(name, sampler, mode, placement, id=f"{name}-{sampler}-{mode}-{placement}",
                                       marks=[pytest.mark.slow] if mode == "async" else [])


@pytest.fixture(scope="module")
def shared_ray():
    """One local Ray instance for this module's asynchronous runs: each run's rollout worker joins it instead of
    starting and stopping an instance of its own (about 4 s a run; starting one is what tests/test_rollout_workers_
    train.py checks)."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("name,sampler,mode,placement", list(_combinations()))
def test_every_combination_trains_with_its_parts_active_or_is_refused(tiny_model, tmp_path, request, name, sampler,
                                                                      mode, placement):
    argv = ["--method", name, "--model", tiny_model, "--sampler", sampler, "--reward-funcs", CHANNELS,
            "--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4",
            "--eval-prompts", "4", "--eval-every", "0", "--checkpoint-every", "0", "--no-tensorboard",
            "--log-every", "0", "--threads", "1", "--lr", "1e-2", "--warmup-steps", "0", "--run-dir", str(tmp_path)]
    argv += ["--async-staleness", "1"] if mode == "async" else []
    argv += ["--kl-placement", placement] if placement else []
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    try:
        plan = resolve_train(parser.parse_args(argv))
    except (ConfigError, PartError) as e:  # refused before anything is loaded: one line naming a setting
        assert "\n" not in str(e) and " = " in str(e) or "--" in str(e), str(e)
        return
    if mode == "async":
        request.getfixturevalue("shared_ray")
    summary = train(plan.cfg, plan.method, model_dir=tiny_model, task=plan.task, run_dir=str(tmp_path),
                    console=QUIET)
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all(math.isfinite(v) for r in steps for v in r.values())
    method = plan.method
    if method.kl is not None and method.kl_coef > 0:  # the policy moved at step 1: the KL term is nonzero at step 2
        key = "reward/kl_penalty" if method.kl_placement == "reward" else "objective/kl"
        if method.ref_sync_every == 1:  # Humanline: the reference is the policy as the step starts
            assert steps[1][key] == 0.0, (key, steps[1].get(key))
        else:  # a sampled estimate (k1 can be negative on a batch): the property is that it is nonzero
            assert steps[1][key] != 0, (key, steps[1].get(key))
    if method.needs_values:
        assert all("critic/value_loss" in r for r in steps)
    if sampler == "tree":
        assert all("tree/roots" in r for r in steps)
    else:  # the reward channels reach the batch (GDPO normalises each one)
        assert all("reward/channel1_mean" in r for r in steps)
    if mode == "async":
        assert all(r["async/staleness_max"] <= 1 for r in steps)
    assert any(r["objective/adv_abs_mean"] > 0 for r in steps)  # the update had a signal to follow
