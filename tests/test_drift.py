"""The drift meter (`--drift-prompts`): zero at the starting policy, positive once the policy moves, measured
against the run's own starting point even across a resume."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from polyrl.config import ConfigError, build_config, validate
from polyrl.methods import get_method
from polyrl.tasks.arithmetic import AdditionTask
from polyrl.trainer import train

QUIET = Console(file=io.StringIO(), width=120)
KEYS = ("drift/kl_k1", "drift/kl_k3", "drift/hidden_cos", "drift/hidden_shift")


def _cfg(**kw):
    base = dict(steps=4, prompts_per_step=2, group_size=4, max_new_tokens=6, eval_prompts=8, eval_every=2,
                checkpoint_every=2, tensorboard=False, log_every=0, lr=1e-2, warmup_steps=0, threads=1,
                reward_funcs="tests.reward_fns:digit_fraction", drift_prompts=6)
    return build_config({**base, **kw})


def _evals(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "drift/kl_k3" in r]


def test_drift_is_zero_at_the_start_and_grows_as_the_policy_moves(tiny_model, tmp_path):
    summary = train(_cfg(), get_method("grpo"), model_dir=tiny_model, task=AdditionTask(), run_dir=str(tmp_path),
                    console=QUIET)
    rows = _evals(tmp_path)
    assert [r["step"] for r in rows] == [0, 2, 4]
    start = rows[0]
    assert start["drift/kl_k1"] == pytest.approx(0.0, abs=1e-6) and start["drift/kl_k3"] == pytest.approx(0.0, abs=1e-6)
    assert start["drift/hidden_cos"] == pytest.approx(1.0, abs=1e-5) and start["drift/hidden_shift"] < 1e-5
    for r in rows[1:]:
        assert r["drift/kl_k3"] > 1e-4 and r["drift/hidden_shift"] > 1e-4 and r["drift/hidden_cos"] < 1.0
    assert summary["drift_kl_k3_after"] == rows[-1]["drift/kl_k3"]


def test_drift_after_a_resume_is_measured_from_the_run_start(tiny_model, tmp_path):
    method = get_method("grpo")
    train(_cfg(), method, model_dir=tiny_model, task=AdditionTask(), run_dir=str(tmp_path / "a"), console=QUIET)
    train(_cfg(steps=2), method, model_dir=tiny_model, task=AdditionTask(), run_dir=str(tmp_path / "b"), console=QUIET)
    train(_cfg(resume=True), method, model_dir=tiny_model, task=AdditionTask(), run_dir=str(tmp_path / "b"),
          console=QUIET)
    a, b = _evals(tmp_path / "a")[-1], _evals(tmp_path / "b")[-1]
    assert a["step"] == b["step"] == 4
    for key in KEYS:
        assert a[key] == pytest.approx(b[key], abs=1e-6), key


def test_drift_is_refused_where_it_cannot_measure():
    for values, needle in (({"drift_prompts": -1}, "must be an integer in [0, 1000000]"),
                           ({"drift_prompts": 4, "nproc": 2}, "does not combine with nproc > 1")):
        with pytest.raises(ConfigError) as e:
            validate(build_config(values))
        assert needle in str(e.value) and str(e.value).startswith("drift_prompts")


def test_drift_probes_are_distinct_prompts_scored_in_micro_batches(tiny_model, tmp_path, monkeypatch):
    """A held-out split smaller than --drift-prompts gives each prompt once (the split used to be cycled, weighing
    some probes twice); the probe pass runs in micro-batches (it was one forward over every probe), each row's hidden
    state still taken at its own prompt's end."""
    import polyrl.drift
    from polyrl.tasks.math import MathTask

    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(40)))
    task = MathTask(str(data), heldout_percent=10)
    held = len(task._pools["test"])
    assert 0 < held < 30
    seen, built = [], polyrl.drift.DriftMeter.__init__

    def record(self, evaluate, learner, runner, prompts, *args):
        seen.extend(p.text for p in prompts)
        built(self, evaluate, learner, runner, prompts, *args)

    monkeypatch.setattr(polyrl.drift.DriftMeter, "__init__", record)
    train(_cfg(drift_prompts=30, micro_batch_size=2, steps=2, reward_funcs="task"), get_method("grpo"),
          model_dir=tiny_model, task=task, run_dir=str(tmp_path / "run"), console=QUIET)
    assert len(seen) == len(set(seen)) == held
    start = _evals(tmp_path / "run")[0]
    assert start["drift/hidden_cos"] == pytest.approx(1.0, abs=1e-5)
    assert start["drift/kl_k3"] == pytest.approx(0, abs=1e-6)


def test_drift_prompts_are_bounded():
    with pytest.raises(ConfigError, match=r"drift_prompts = 1000001 is not allowed; must be an integer in \[0, 10+\]"):
        validate(build_config({"drift_prompts": 10**6 + 1}))

