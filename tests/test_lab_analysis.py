"""polyrl.lab analysis: collapse rule (offline and online), bootstrap, curves, thresholds, sigmoid fit, ranking."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from polyrl.collapse import CollapseMonitor, CollapseRule, first_collapse
from polyrl.lab.analysis import Run, analyse, analyse_runs, load_runs, read_rows
from polyrl.lab.stats import bootstrap_ci, fit_sigmoid, sigmoid_law

# ---------------------------------------------------------------- synthetic compare directories


def write_run(run_dir: Path, rows: list[dict], *, finished: bool = True, raw_tail: str = "") -> Path:
    """A run directory in the trainer's format: metrics.jsonl, config.json and summary.json when finished."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + raw_tail)
    (run_dir / "config.json").write_text(json.dumps({"config": {"steps": max(r["step"] for r in rows)}, "method": {}}))
    if finished:
        evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
        summary = {"eval_before": evals[0] if evals else None, "eval_after": evals[-1] if evals else None}
        (run_dir / "summary.json").write_text(json.dumps({**summary, "steps": rows[-1]["step"], "wall_seconds": 1.0}))
    return run_dir


def train_row(step: int, reward: float, *, generated: float = 8.0, tokens: float | None = 40.0, **extra) -> dict:
    row = {"step": step, "reward/mean": reward, "rollout/generated": generated, "rollout/mean_len": 5.0}
    if tokens is not None:
        row["rollout/gen_tokens"] = tokens
    row.update({"objective/entropy": 1.0, "objective/approx_kl": 0.01, "perf/step_seconds": 0.1})
    row.update(extra)
    return row


def rows_from_accuracy(acc: dict[int, float], steps: int, **train_kw) -> list[dict]:
    """Training rows for steps 1..steps (reward = latest accuracy) and separate eval rows at the given steps."""
    rows, last = [], acc.get(0, 0.0)
    if 0 in acc:
        rows.append({"step": 0, "eval/accuracy": acc[0]})
    for s in range(1, steps + 1):
        last = acc.get(s, last)
        rows.append(train_row(s, last, **train_kw))
        if s in acc:
            rows.append({"step": s, "eval/accuracy": acc[s]})
    return rows


def sigmoid_runs(root: Path, method: str, *, a: float, b: float, cmid: float, r0: float = 0.2, seeds=(0, 1, 2)):
    """Runs whose held-out accuracy follows the sigmoid law in cumulative tokens (100 tokens/step) plus noise."""
    for seed in seeds:
        rng = np.random.default_rng(seed)
        acc = {0: r0}
        for s in range(10, 201, 10):
            acc[s] = float(sigmoid_law(100.0 * s, a, b, cmid, r0) + rng.normal(0, 0.005))
        write_run(root / method / f"seed{seed}", rows_from_accuracy(acc, 200, tokens=100.0))


# ---------------------------------------------------------------- collapse


def eval_rows(values: list[float], every: int = 10) -> list[dict]:
    return [{"step": i * every, "eval/accuracy": v} for i, v in enumerate(values)]


def both(rows: list[dict], rule: CollapseRule | None = None):
    """first_collapse(rows, rule) after checking that the online monitor reports the same (step, reason)."""
    monitor = CollapseMonitor(rule)
    for row in rows:
        monitor.update(row["step"], row)
    offline = first_collapse(rows, rule)
    assert monitor.collapsed == offline
    return offline


def test_collapse_when_accuracy_halves_at_the_right_step():
    rows = eval_rows([0.3, 0.5, 0.7, 0.8, 0.6, 0.35, 0.3])  # best 0.8 -> limit 0.4, first below at step 50
    step, reason = both(rows, CollapseRule())
    assert step == 50 and "eval/accuracy" in reason and "0.35" in reason
    assert both(rows, CollapseRule(patience=2))[0] == 60
    assert both(rows, CollapseRule(patience=3)) is None
    assert both(rows, CollapseRule(drop_fraction=0.25))[0] == 40  # 0.6 < 0.75 * 0.8
    assert both(eval_rows([0.3, 0.5, 0.7, 0.8, 0.6, 0.41]), CollapseRule()) is None
    assert both(eval_rows([0.3, 0.8, 0.4]), CollapseRule()) is None  # strictly below half the best
    assert both(eval_rows([0.3, 0.8, 0.399]), CollapseRule())[0] == 20


def test_no_collapse_below_min_best():
    assert both(eval_rows([0.1, 0.18, 0.02]), CollapseRule()) is None
    assert both(eval_rows([0.1, 0.18, 0.02]), CollapseRule(min_best=0.15))[0] == 20


def test_reward_fallback_only_until_accuracy_is_logged():
    rows = [{"step": s, "reward/mean": r} for s, r in [(1, 0.5), (2, 0.9), (3, 0.2)]]
    assert both(rows, CollapseRule())[0] == 3
    assert "reward/mean" in both(rows, CollapseRule())[1]
    assert both(rows, CollapseRule(fallback=None)) is None
    # accuracy logged first: the reward drop is ignored and accuracy is the metric
    assert both([{"step": 0, "eval/accuracy": 0.3}, *rows], CollapseRule()) is None
    # the switch restarts the best: an accuracy lower than the earlier reward is not a collapse
    assert both([*rows[:2], {"step": 2, "eval/accuracy": 0.3}, {"step": 3, "eval/accuracy": 0.3}]) is None


def test_entropy_and_kl_spikes():
    ent = [{"step": s, "objective/entropy": e} for s, e in enumerate([1.0, 1.2, 0.9, 1.0, 3.5], start=1)]
    step, reason = both(ent, CollapseRule())
    assert step == 5 and "entropy" in reason  # 3.5 > 3 x median(1.0, 1.2, 0.9, 1.0) = 3.0
    assert both(ent, CollapseRule(entropy_spike=4.0)) is None
    assert both(ent, CollapseRule(entropy_spike=None)) is None
    assert both(ent, CollapseRule(min_history=5)) is None
    kl = [{"step": s, "objective/approx_kl": k} for s, k in enumerate([0.01, 0.4, 0.7, 0.01], start=1)]
    assert both(kl, CollapseRule())[0] == 3
    assert both(kl, CollapseRule(kl_spike=None)) is None
    assert both(kl, CollapseRule(kl_spike=0.3))[0] == 2
    assert both(kl, CollapseRule(kl_spike=0.3, patience=2))[0] == 3


def test_invalid_rules_raise():
    for bad in (dict(drop_fraction=0.0), dict(drop_fraction=1.5), dict(patience=0), dict(entropy_spike=0.5)):
        with pytest.raises(ValueError):
            CollapseRule(**bad)
    with pytest.raises(ValueError):
        CollapseRule(kl_spike=-1.0)


def _random_log(rng: random.Random) -> list[dict]:
    rows, acc, ent = [], rng.uniform(0, 0.6), 1.0
    eval_from = rng.choice([0, 5, 10**9])
    for s in range(rng.randint(1, 30)):
        row: dict = {"step": s}
        if rng.random() < 0.9:
            row["reward/mean"] = rng.uniform(0, 1)
        if rng.random() < 0.8:
            ent *= rng.choice([0.8, 1.0, 1.2, 4.0]) if rng.random() < 0.9 else float("nan")
            row["objective/entropy"] = ent
        if rng.random() < 0.7:
            row["objective/approx_kl"] = rng.choice([0.01, 0.2, 0.6, float("inf")])
        rows.append(row)
        if s >= eval_from and rng.random() < 0.5:
            acc = max(0.0, acc + rng.uniform(-0.35, 0.25))
            rows.append({"step": s, "eval/accuracy": acc})
    return rows


def test_monitor_agrees_with_first_collapse_on_random_logs():
    rng = random.Random(0)
    fired = 0
    for _ in range(300):
        rule = CollapseRule(
            drop_fraction=rng.choice([0.2, 0.5, 0.9]),
            min_best=rng.choice([0.0, 0.2, 0.5]),
            patience=rng.randint(1, 3),
            entropy_spike=rng.choice([None, 2.0, 3.0]),
            min_history=rng.randint(1, 4),
            kl_spike=rng.choice([None, 0.5]),
        )
        rows = _random_log(rng)
        monitor, online = CollapseMonitor(rule), None
        for row in rows:
            reason = monitor.update(row["step"], row)
            if reason is not None and online is None:
                online = (row["step"], reason)
            elif online is not None:
                assert reason is None  # only the first collapse is reported
        assert online == first_collapse(rows, rule) == monitor.collapsed
        fired += online is not None
    assert 50 < fired < 280  # both outcomes are exercised


# ---------------------------------------------------------------- loading


def test_load_runs_flags_unfinished_and_skips_junk(tmp_path):
    write_run(tmp_path / "grpo" / "seed1", eval_rows([0.2, 0.4]))
    write_run(tmp_path / "grpo" / "seed0", eval_rows([0.3, 0.5]), finished=False, raw_tail='{"step": 20, "eval/acc')
    write_run(tmp_path / "dapo" / "seed0", eval_rows([0.1]))
    (tmp_path / "grpo" / "notes").mkdir()
    (tmp_path / "grpo" / "seedX").mkdir()
    (tmp_path / "report").mkdir()
    runs = load_runs(tmp_path)
    assert list(runs) == ["dapo", "grpo"]
    assert [r.seed for r in runs["grpo"]] == [0, 1]
    assert [r.finished for r in runs["grpo"]] == [False, True]
    assert runs["grpo"][0].summary is None and runs["grpo"][1].summary["eval_after"] == 0.4
    assert [r["step"] for r in runs["grpo"][0].rows] == [0, 10]  # the truncated line is skipped
    res = analyse(tmp_path, n_boot=50)
    assert res["methods"]["grpo"]["unfinished_seeds"] == [0]
    assert res["methods"]["grpo"]["final"]["per_seed"] == [0.4] and res["methods"]["grpo"]["final"]["finished_only"]
    with pytest.raises(ValueError, match="no runs"):
        analyse(tmp_path / "report")


def test_read_rows_keeps_the_resumed_copy(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "reward/mean": float(s)} for s in (1, 2, 3)]
    rows += [{"step": s, "reward/mean": -s} for s in (2, 3, 4)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": "x"}\n[]\n')
    assert [(r["step"], r["reward/mean"]) for r in read_rows(path)] == [(1, 1.0), (2, -2), (3, -3), (4, -4)]


# ---------------------------------------------------------------- statistics


def test_bootstrap_ci_properties():
    assert bootstrap_ci([0.42]) == (0.42, 0.42)
    assert bootstrap_ci([0.3, 0.3, 0.3]) == (0.3, 0.3)
    small = np.array([0.4, 0.5, 0.65])
    large = np.tile(small, 10)  # same spread, ten times the seeds: the interval must shrink (~1/sqrt(10))
    lo_s, hi_s = bootstrap_ci(small, level=0.9)
    lo_l, hi_l = bootstrap_ci(large, level=0.9)
    assert lo_s <= small.mean() <= hi_s and lo_l <= large.mean() <= hi_l
    assert hi_l - lo_l < 0.5 * (hi_s - lo_s)
    assert lo_s < hi_s and lo_l < hi_l
    assert bootstrap_ci(small, seed=3) == bootstrap_ci(small, seed=3)
    lo_w, hi_w = bootstrap_ci(large, level=0.99)
    assert lo_w < lo_l and hi_w > hi_l
    with pytest.raises(ValueError):
        bootstrap_ci(small, level=1.0)
    # many seeds: the bootstrap distribution of the mean is close to normal with sd = std(v) / sqrt(n)
    v = np.linspace(0.0, 1.0, 60)
    lo, hi = bootstrap_ci(v, level=0.9, n_boot=4000)
    half = 1.6449 * v.std() / np.sqrt(v.size)
    assert lo == pytest.approx(v.mean() - half, abs=0.1 * half) and hi == pytest.approx(v.mean() + half, abs=0.1 * half)


def test_sigmoid_law_limits():
    a, b, cmid, r0 = 0.8, 1.5, 1e4, 0.2
    assert sigmoid_law(cmid, a, b, cmid, r0) == pytest.approx(r0 + (a - r0) / 2)
    assert sigmoid_law(1e12, a, b, cmid, r0) == pytest.approx(a, abs=1e-9)
    assert sigmoid_law(0.0, a, b, cmid, r0) == pytest.approx(r0)
    assert sigmoid_law(2e3, a, b, cmid, r0) == pytest.approx(r0 + (a - r0) / (1 + 5**1.5))
    assert np.all(np.diff(sigmoid_law(np.geomspace(1, 1e8, 50), a, b, cmid, r0)) > 0)


def test_sigmoid_fit_recovers_known_parameters():
    rng = np.random.default_rng(0)
    c = np.tile(np.geomspace(1e3, 1e6, 25), 3)
    r = sigmoid_law(c, 0.75, 1.2, 4e4, 0.25) + rng.normal(0, 0.01, c.size)
    fit, reason = fit_sigmoid(c, r, r0=0.25)
    assert reason is None
    assert fit["A"] == pytest.approx(0.75, abs=0.02)
    assert fit["B"] == pytest.approx(1.2, rel=0.1)
    assert fit["Cmid"] == pytest.approx(4e4, rel=0.1)
    for k in ("A", "B", "Cmid"):
        assert 0 < fit[k + "_se"] < 0.1 * fit[k]
        assert abs(fit[k] - {"A": 0.75, "B": 1.2, "Cmid": 4e4}[k]) < 5 * fit[k + "_se"]


def test_sigmoid_fit_failures_return_a_reason():
    c = np.geomspace(1e3, 1e6, 10)
    assert fit_sigmoid(c[:3], c[:3] * 0 + 0.5, r0=0.2) == (None, "only 3 points with compute > 0 (need 4)")
    fit, reason = fit_sigmoid(np.repeat(c[:3], 3), np.full(9, 0.5), r0=0.2)
    assert fit is None and "3 distinct" in reason
    fit, reason = fit_sigmoid(c, np.full(10, 0.2), r0=0.2)
    assert fit is None and "no gain" in reason
    fit, reason = fit_sigmoid(c, np.full(10, 0.9), r0=1.0)
    assert fit is None and "upper bound" in reason
    for far_below in (-0.5, -5.0):  # a reward curve (no upper bound) below R0, near it or far: the same reason
        fit, reason = fit_sigmoid(c, np.full(10, far_below), r0=0.0, a_max=None)
        assert fit is None and "no gain" in reason, reason
    fit, reason = fit_sigmoid(c, np.full(10, np.nan), r0=0.2)
    assert fit is None and reason


# ---------------------------------------------------------------- analyse


def test_threshold_crossings_by_hand(tmp_path):
    write_run(tmp_path / "m" / "seed0", rows_from_accuracy({0: 0.2, 10: 0.4, 20: 0.6, 30: 0.7}, 30))
    write_run(tmp_path / "m" / "seed1", rows_from_accuracy({0: 0.2, 10: 0.5, 20: 0.45, 30: 0.7}, 30))  # >= counts
    write_run(tmp_path / "m" / "seed2", rows_from_accuracy({0: 0.2, 10: 0.3, 20: 0.4, 30: 0.45}, 30))
    th = analyse(tmp_path, threshold=0.5, n_boot=50)["methods"]["m"]["threshold"]
    assert [e["step"] for e in th["per_seed"]] == [20, 10, None]
    assert th["steps_mean"] == 15.0 and th["seeds_reached"] == 2 and th["n_seeds"] == 3
    assert th["rollouts_mean"] == pytest.approx((20 * 8 + 10 * 8) / 2)
    assert th["tokens_mean"] == pytest.approx((20 * 40 + 10 * 40) / 2)
    th = analyse(tmp_path, threshold=0.9, n_boot=50)["methods"]["m"]["threshold"]
    assert th["seeds_reached"] == 0 and th["steps_mean"] is None


def test_curves_align_steps_and_interpolate_compute(tmp_path):
    # seed0: 40 tokens/step for 20 steps; seed1: 80 tokens/step, stopped after step 5 (unfinished)
    write_run(tmp_path / "m" / "seed0", rows_from_accuracy({0: 0.2, 10: 0.4, 20: 0.6}, 20, tokens=40.0))
    write_run(tmp_path / "m" / "seed1", rows_from_accuracy({0: 0.3, 5: 0.5}, 5, tokens=80.0), finished=False)
    runs = load_runs(tmp_path)
    curves = analyse_runs(runs, n_boot=50)["methods"]["m"]["curves"]
    acc = curves["eval/accuracy"]
    assert acc["steps"]["x"] == [0, 5, 10, 20]
    assert acc["steps"]["mean"] == pytest.approx([0.25, 0.5, 0.4, 0.6])
    assert acc["steps"]["n"] == [2, 1, 1, 1]
    assert acc["steps"]["lo"][2] == acc["steps"]["hi"][2] == pytest.approx(0.4)  # one seed: interval collapses
    # tokens: seed0 evals at 0/400/800 tokens, seed1 at 0/400; grid 0, 400, 800; seed1 absent past 400
    assert acc["tokens"]["x"] == pytest.approx([0, 400, 800])
    assert acc["tokens"]["mean"] == pytest.approx([0.25, (0.4 + 0.5) / 2, 0.6])
    assert acc["tokens"]["n"] == [2, 2, 1]
    # rollouts: seed1 ends at 40, a point of its own (seed0 interpolated there: 0.3)
    assert acc["rollouts"]["x"] == pytest.approx([0, 40, 80, 160]) and acc["rollouts"]["n"] == [2, 2, 1, 1]
    assert acc["rollouts"]["mean"] == pytest.approx([0.25, (0.3 + 0.5) / 2, 0.4, 0.6])
    reward = curves["reward/mean"]["steps"]
    assert reward["x"][0] == 1 and reward["n"][:5] == [2] * 5 and reward["n"][5:] == [1] * 15


def test_missing_metrics_and_token_estimate(tmp_path):
    rows = [{"step": s, "reward/mean": 0.1 * s, "rollout/generated": 4.0, "rollout/mean_len": 3.0} for s in range(1, 6)]
    write_run(tmp_path / "bare" / "seed0", rows)
    res = analyse(tmp_path, threshold=0.3, n_boot=50)
    m = res["methods"]["bare"]
    assert res["settings"]["perf_metric"] == "reward/mean"  # no run logs eval/accuracy
    assert m["curves"]["objective/entropy"]["steps"] is None and m["zero_grad"] is None
    assert m["curves"]["eval/accuracy"]["steps"] is None
    assert m["tokens_estimated"] and m["threshold"]["tokens_mean"] == pytest.approx(3 * 12.0)
    assert m["sigmoid"]["metric"] == "reward/mean"
    assert m["final"]["reward_last10"]["mean"] == pytest.approx(0.3)
    json.dumps(res, allow_nan=False)


def test_zero_grad_by_position_averaged_over_training():
    rows = [
        {"step": s, **{f"position/zero_grad_frac_q{q}": 0.1 * q + 0.01 * s for q in range(1, 5)}} for s in range(1, 4)
    ]
    res = analyse_runs({"m": [Run("m", 0, rows, {"x": 1}), Run("m", 1, [{"step": 1, "reward/mean": 0.1}], {})]})
    zg = res["methods"]["m"]["zero_grad"]
    assert zg["q1"]["mean"] == pytest.approx(0.12) and zg["q4"]["mean"] == pytest.approx(0.42)
    assert zg["q1"]["n"] == 1


def test_collapse_rate_ranking_and_sigmoid_through_analyse(tmp_path):
    sigmoid_runs(tmp_path, "good", a=0.8, b=1.5, cmid=5000.0)
    sigmoid_runs(tmp_path, "slow", a=0.7, b=1.0, cmid=8000.0)
    halves = {0: 0.2, 10: 0.5, 20: 0.7, 30: 0.3, 40: 0.7}
    write_run(tmp_path / "crash" / "seed0", rows_from_accuracy(halves, 40))
    write_run(tmp_path / "crash" / "seed1", rows_from_accuracy({0: 0.2, 10: 0.5, 20: 0.7, 30: 0.7, 40: 0.7}, 40))
    res = analyse(tmp_path, n_boot=100)
    json.dumps(res, allow_nan=False)
    crash = res["methods"]["crash"]["collapse"]
    assert crash["count"] == 1 and crash["rate"] == 0.5 and crash["per_seed"][0]["step"] == 30
    assert res["methods"]["good"]["collapse"]["count"] == 0
    sg = res["methods"]["good"]["sigmoid"]
    assert sg["ok"] and sg["compute"] == "tokens" and sg["R0"] == pytest.approx(0.2)
    assert sg["A"] == pytest.approx(0.8, abs=0.03) and sg["B"] == pytest.approx(1.5, rel=0.15)
    assert sg["Cmid"] == pytest.approx(5000.0, rel=0.1)
    # final accuracies: good ~0.733 (law at 20k tokens), crash 0.7 (both seeds end at 0.7), slow ~0.557
    assert [r["method"] for r in res["ranking"]] == ["good", "crash", "slow"]
    assert res["ranking"][1]["final_mean"] == pytest.approx(0.7)


def test_ranking_ties_broken_by_area_under_curve():
    fast = [{"step": 0, "eval/accuracy": 0.2}, {"step": 10, "eval/accuracy": 0.6}, {"step": 20, "eval/accuracy": 0.6}]
    slow = [{"step": 0, "eval/accuracy": 0.2}, {"step": 10, "eval/accuracy": 0.3}, {"step": 20, "eval/accuracy": 0.6}]
    res = analyse_runs({"a_slow": [Run("a_slow", 0, slow, {})], "b_fast": [Run("b_fast", 0, fast, {})]}, n_boot=20)
    assert [r["method"] for r in res["ranking"]] == ["b_fast", "a_slow"]
    assert res["ranking"][0]["auc"] == pytest.approx((0.4 * 10 + 0.6 * 10) / 20)
    assert res["ranking"][1]["auc"] == pytest.approx((0.25 * 10 + 0.45 * 10) / 20)
    assert math.isclose(res["ranking"][0]["final_mean"], res["ranking"][1]["final_mean"])


def test_read_rows_keeps_the_step_a_guard_rolled_back_to(tmp_path):
    """trainer.py logs {guard/rollbacks, guard/lr} at the restored step s after a rollback: steps after s are redone,
    but step s's own row (its rollouts, its evaluation) belongs to the kept history."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "rollout/generated": 10, "reward/mean": s} for s in range(1, 6)]
    rows[3]["eval/accuracy"] = 0.6  # step 4, the checkpoint
    rows.append({"step": 4, "guard/rollbacks": 1, "guard/lr": 5e-4})
    rows += [{"step": s, "rollout/generated": 10, "reward/mean": -s} for s in (5, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = read_rows(path)
    assert [(r["step"], r.get("reward/mean")) for r in got] == [(1, 1), (2, 2), (3, 3), (4, 4), (4, None), (5, -5),
                                                                  (6, -6)]
    assert got[3]["eval/accuracy"] == 0.6 and sum(r.get("rollout/generated", 0) for r in got) == 60


def test_an_interpolated_curve_ends_where_each_seed_ends():
    """On a tokens axis seeds end at different x: each one's last value is a point of the curve (a grid of evenly
    spaced x alone left seed 1's final evaluation out, its last shared point two-thirds of the way)."""
    from polyrl.lab.stats import curve

    seeds = [(np.array([0.0, 929.0, 1859.0, 2788.0]), np.array([0.1, 0.2, 0.3, 0.5])),
             (np.array([0.0, 900.0, 1800.0, 2769.0]), np.array([0.1, 0.2, 0.3, 0.4375]))]
    out = curve(seeds, True, {"level": 0.9, "n_boot": 200, "seed": 0})
    end = out["x"].index(2769.0)
    assert out["n"][end] == 2 and out["mean"][end] == pytest.approx((0.4375 + 0.3 + 0.2 * (2769 - 1859) / 929) / 2)


def test_the_token_axis_counts_every_generated_token_where_a_run_logs_them(tmp_path):
    """rollout/gen_tokens is the trained batch's: a filtering method's regenerated groups were missing from the token
    axis (DAPO drawn as cheaper than GRPO). rollout/generated_tokens, where logged, is what the axis sums."""

    rows = [train_row(s, 0.1 * s, tokens=40.0, **{"rollout/generated_tokens": 55.0}) for s in (1, 2, 3)]
    write_run(tmp_path / "dapo" / "seed0", rows)
    write_run(tmp_path / "grpo" / "seed0", [train_row(s, 0.1 * s, tokens=40.0) for s in (1, 2, 3)])
    runs = load_runs(tmp_path)
    assert runs["dapo"][0].compute()["tokens"].tolist() == [55.0, 110.0, 165.0]
    assert runs["grpo"][0].compute()["tokens"].tolist() == [40.0, 80.0, 120.0]  # no generated_tokens: the batch's


def test_the_sigmoid_axis_is_one_the_runs_log(tmp_path):
    """`compare --family flow|q`: the fit's axis was always tokens, which no family logs ("no fit: no reward/mean points
    with tokens logged" for every method); it is now the first of tokens, rollouts, steps that every run logs."""
    rows = {"q": [{"step": s, "reward/mean": 0.1 * s, "rollout/generated": 8.0} for s in range(1, 9)],
            "flow": [{"step": s, "reward/mean": 0.1 * s} for s in range(1, 9)],
            "lm": [train_row(s, 0.1 * s) for s in range(1, 9)]}
    for family, axis in (("q", "rollouts"), ("flow", "steps"), ("lm", "tokens")):
        write_run(tmp_path / family / "m" / "seed0", rows[family])
        res = analyse(tmp_path / family, n_boot=50)
        assert res["settings"]["compute"] == axis and res["methods"]["m"]["sigmoid"]["compute"] == axis
        assert "logged" not in res["methods"]["m"]["sigmoid"].get("reason", "")
    assert analyse(tmp_path / "lm", n_boot=50, compute="steps")["settings"]["compute"] == "steps"  # asked for
    write_run(tmp_path / "lm" / "m" / "seed1", [{"step": 0, "eval/accuracy": 0.1}], finished=False)  # failed at once
    assert analyse(tmp_path / "lm", n_boot=50)["settings"]["compute"] == "tokens"  # not every method on steps


def test_an_unidentified_accuracy_fit_is_no_fit_in_the_compare_results(tmp_path):
    """A curve still climbing steeply at its last point fits A at the bound 1 with Cmid beyond the data: the ranking
    showed A = 1.000 (standard error ~1000) as an asymptote; the evidence report's per-seed fits call it failed."""
    sigmoid_runs(tmp_path, "climbing", a=1.0, b=2.0, cmid=60000.0, r0=0.05)  # data end at 20,000 tokens
    sigmoid_runs(tmp_path, "bent", a=0.8, b=1.5, cmid=5000.0)
    res = analyse(tmp_path, n_boot=50)
    climbing, bent = res["methods"]["climbing"]["sigmoid"], res["methods"]["bent"]["sigmoid"]
    assert not climbing["ok"] and climbing["reason"].startswith("unidentified"), climbing
    assert bent["ok"] and bent["A"] == pytest.approx(0.8, abs=0.05)
