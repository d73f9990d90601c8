"""The q family: λ-target linear Q-learning (arXiv:2606.10835, spec §5)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from polyrl.config import ConfigError
from polyrl.families.q.core import (
    LinearMDP,
    LinearQLearner,
    lambda_linear_part,
    lambda_target_gain,
    lambda_target_gain_series,
    lambda_target_map,
    online_map,
    spectral_radius,
)
from polyrl.families.q.methods import get_q_method
from polyrl.families.q.search import iterate_target_map, search_counterexample
from polyrl.families.q.tasks import Gridworld, TileFeatures
from polyrl.families.q.train import QTrainConfig, train_q


def _spd(d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(d, d))
    return x @ x.T / d + 0.1 * np.eye(d)


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.9])
def test_closed_form_gain_equals_truncated_series(lam):
    A = _spd(3, 0)
    alpha = 0.9 / np.linalg.eigvalsh(A).max()
    K = lambda_target_gain(A, alpha, lam)
    S = lambda_target_gain_series(A, alpha, lam, terms=2000)
    assert np.max(np.abs(K - S)) < 1e-10
    assert np.max(np.abs(K)) > 1e-3  # not trivially zero


def test_gain_limits():
    A = _spd(4, 1)
    alpha = 0.5 / np.linalg.eigvalsh(A).max()
    B = np.eye(4) - alpha * A
    assert np.allclose(lambda_target_gain(A, alpha, 0.0), B, atol=1e-14)
    norms = [np.linalg.norm(lambda_target_gain(A, alpha, lam)) for lam in (0.9, 0.99, 0.999, 0.99999, 1 - 1e-8)]
    assert all(a > b for a, b in zip(norms, norms[1:]))  # shrinks monotonically
    assert norms[-1] < 1e-5
    with pytest.raises(ValueError, match="lam"):
        lambda_target_gain(A, alpha, 1.0)


def _cx():
    return search_counterexample(0)


def test_target_map_is_the_geometric_average_of_online_maps():
    cx = _cx()
    A, b, M, g = cx.mdp.A, cx.mdp.b, cx.mdp.M, cx.mdp.gamma
    theta = np.array([0.3, -1.2])
    lam = 0.8
    series = sum((1 - lam) * lam ** (m - 1) * online_map(theta, A, b, M, cx.alpha, m, gamma=g) for m in range(1, 400))
    exact = lambda_target_map(theta, A, b, M, cx.alpha, lam, gamma=g)
    assert np.max(np.abs(series - exact)) < 1e-10
    # lambda = 0 is one online step; every T_lambda fixes the projected fixed point
    assert np.allclose(lambda_target_map(theta, A, b, M, cx.alpha, 0.0, gamma=g),
                       online_map(theta, A, b, M, cx.alpha, 1, gamma=g), atol=1e-13)
    fp = cx.fixed_point
    assert np.allclose(lambda_target_map(fp, A, b, M, cx.alpha, 0.9, gamma=g), fp, atol=1e-10)
    # the linear part at lambda = 0 is the every-step map I + alpha (gamma M - A)
    M0 = cx.M
    assert np.allclose(lambda_linear_part(A, M0, g, cx.alpha, 0.0), np.eye(2) + cx.alpha * (g * M0 - A), atol=1e-13)


def test_searched_mdp_every_step_diverges_and_lambda_0999_converges():
    cx = _cx()
    A, M, g = cx.mdp.A, cx.M, cx.mdp.gamma
    assert cx.mdp.phi.shape == (3, 1, 2)
    assert np.max(np.linalg.eigvals(g * M - A).real) > 0
    assert spectral_radius(np.linalg.solve(A, g * M)) < 1
    # every-step Q-learning, run by the learner on the expected dynamics, diverges (at this and a tiny alpha)
    for alpha in (cx.alpha, cx.alpha / 20):
        learner = LinearQLearner(_MDPFeatures(cx.mdp), 1, g, alpha, "every_step")
        learner.theta = learner.target = np.array([0.1, 0.1])
        for _ in range(50000):
            learner.expected_step(cx.mdp)
            if np.linalg.norm(learner.theta) > 1e8:
                break
        assert np.linalg.norm(learner.theta) > 1e8
    # lambda = 0.999: the exact target iteration converges to the projected fixed point
    traj = iterate_target_map(cx, 0.999, 3000, theta0=np.array([5.0, -5.0]))
    assert np.linalg.norm(traj[-1] - cx.fixed_point) < 1e-8
    assert cx.rho(0.0) > 1 > cx.rho(0.999)


class _MDPFeatures:
    def __init__(self, mdp: LinearMDP):
        self.mdp, self.dim, self.n_actions = mdp, mdp.phi.shape[-1], mdp.phi.shape[1]

    def __call__(self, state):
        return self.mdp.phi[state]


def test_geometric_copy_rule_expected_map_is_T_lambda():
    """Monte Carlo: the target after the first random copy, averaged over seeds, equals T_lambda(theta_minus)."""
    cx = _cx()
    lam, x = 0.8, np.array([1.0, -2.0])
    outs = []
    for seed in range(4000):
        learner = LinearQLearner(_MDPFeatures(cx.mdp), 1, cx.mdp.gamma, cx.alpha, "lambda_geometric", lam=lam,
                                 seed=seed)
        learner.theta, learner.target = x.copy(), x.copy()
        while learner.refreshes == 0:
            learner.expected_step(cx.mdp)
        outs.append(learner.target)
    outs = np.array(outs)
    mean, se = outs.mean(0), outs.std(0) / np.sqrt(len(outs))
    exact = lambda_target_map(x, cx.mdp.A, cx.mdp.b, cx.mdp.M, cx.alpha, lam, gamma=cx.mdp.gamma)
    assert np.all(np.abs(mean - exact) < 4 * se + 1e-12)
    # and it is not the one-step or the limit map (the test can tell them apart)
    one = online_map(x, cx.mdp.A, cx.mdp.b, cx.mdp.M, cx.alpha, 1, gamma=cx.mdp.gamma)
    assert np.any(np.abs(mean - one) > 10 * se)


def test_lambda_exact_window_matches_truncated_map():
    cx = _cx()
    lam = 0.5
    learner = LinearQLearner(_MDPFeatures(cx.mdp), 1, cx.mdp.gamma, cx.alpha, "lambda_exact", lam=lam)
    x = np.array([0.7, 0.2])
    learner.theta, learner.target = x.copy(), x.copy()
    for _ in range(learner.window):
        learner.expected_step(cx.mdp)
    H = learner.window
    w = [(1 - lam) * lam ** (m - 1) / (1 - lam ** H) for m in range(1, H + 1)]
    ref = sum(wm * online_map(x, cx.mdp.A, cx.mdp.b, cx.mdp.M, cx.alpha, m, gamma=cx.mdp.gamma)
              for m, wm in enumerate(w, 1))
    assert learner.refreshes == 1 and np.allclose(learner.target, ref, atol=1e-12)
    assert np.array_equal(learner.theta, learner.target)


def test_periodic_and_every_step_refresh_counts():
    env = Gridworld(4, 0.0)
    feats = TileFeatures(env)
    for mode, period, expect in (("every_step", 1, 30), ("periodic", 7, 4)):
        learner = LinearQLearner(feats, 4, 0.9, 0.1, mode, period=period)
        for _ in range(30):
            learner.td_step(0, 1, 0.5, 1, False)
        assert learner.refreshes == expect
    # periodic: the target lags the online weights between copies
    assert not np.array_equal(learner.theta, learner.target)


def test_td_step_hand_computed():
    env = Gridworld(3, 0.0)
    feats = TileFeatures(env)
    learner = LinearQLearner(feats, 4, 0.5, 0.2, "periodic", period=100)
    learner.target = np.ones(feats.dim)  # every target Q = 2 tiles * 0.5 = 1
    delta = learner.td_step(0, 2, 1.0, 3, False)
    assert delta == pytest.approx(1.0 + 0.5 * 1.0 - 0.0)
    phi = feats(0)[2]
    assert np.allclose(learner.theta, 0.2 * 1.5 * phi)
    q_before = float(phi @ learner.theta)  # 0.3 * |phi|^2 = 0.3 * (2 * 0.25)
    assert q_before == pytest.approx(0.15)
    assert learner.td_step(0, 2, 0.0, 8, True) == pytest.approx(-q_before)  # terminal: no bootstrap


def test_gridworld_model_matches_sampler():
    env = Gridworld(3, 0.3)
    P, R, _ = env.model()
    assert np.allclose(P.sum(-1), 1)
    rng = np.random.default_rng(0)
    counts = np.zeros(env.n_states)
    for _ in range(20000):
        counts[env.step(4, 1, rng)[0]] += 1
    assert np.allclose(counts / 20000, P[4, 1], atol=0.015)
    q = env.optimal_q(0.9)
    assert env.greedy_return(q, 0.9) == pytest.approx(q[env.start].max(), rel=1e-6)


def _cfg(**kw):
    base = dict(size=4, steps=4, samples_per_step=60, checkpoint_every=1)
    base.update(kw)
    return QTrainConfig(**base)


@pytest.mark.parametrize("name", ["lambda_geometric", "lambda_exact"])
def test_resume_2_plus_2_equals_4(tmp_path, name):
    method = get_q_method(name, lam=0.9)
    full = train_q(_cfg(), method, run_dir=tmp_path / "full")
    train_q(_cfg(steps=2), method, run_dir=tmp_path / "part")
    resumed = train_q(_cfg(steps=4), method, run_dir=tmp_path / "part", resume=True)
    a, b = full["learner"].state_dict(), resumed["learner"].state_dict()
    assert np.array_equal(a["theta"], b["theta"]) and np.array_equal(a["target"], b["target"])
    assert a["rng"] == b["rng"] and a["steps"] == b["steps"] == 240 and a["refreshes"] == b["refreshes"]
    rows = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    full_rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["q/td_abs"] for r in rows] == [r["q/td_abs"] for r in full_rows]


def test_training_learns_and_methods_differ(tmp_path):
    cfg = QTrainConfig(size=4, steps=10, samples_per_step=200, features="onehot", alpha=0.3)
    res = {m: train_q(cfg, get_q_method(m), run_dir=tmp_path / m) for m in ("periodic", "lambda_geometric")}
    for s in res.values():
        assert not s["diverged"] and s["reward_final"] > 0.95 * s["optimal_return"]
    assert res["periodic"]["target_refreshes"] == 2000 // 100
    n = res["lambda_geometric"]["target_refreshes"]  # Binomial(2000, 0.01): 20 +- 4.4
    assert 20 - 4 * 4.45 < n < 20 + 4 * 4.45
    summary = json.loads((tmp_path / "periodic" / "summary.json").read_text())
    assert summary["samples"] == 2000


def _cli(*args):
    """`polyrl ARGS` in a subprocess (the real entry point)."""
    return subprocess.run([sys.executable, "-m", "polyrl", *args], capture_output=True, text=True)


def _main(capsys, *args) -> tuple[int, str]:
    """`polyrl ARGS` in this process: (exit code, stdout + stderr)."""
    from polyrl.cli import main

    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def test_cli_help_documents_every_field_and_bad_values_are_one_line(tmp_path, capsys):
    from dataclasses import fields

    r = _cli("q", "train", "--help")
    assert r.returncode == 0
    for f in fields(QTrainConfig):
        assert "--" + f.name.replace("_", "-") in r.stdout
    for bad, field in ((["--lam", "1.5"], "lam"), (["--alpha", "-1"], "alpha"), (["--method", "nope"], "method"),
                       (["--period", "0", "--method", "periodic"], "period"), (["--gamma", "1.0"], "gamma"),
                       (["--features", "bogus"], "features")):
        rc, out = _main(capsys, "q", "train", *bad, "--run-dir", str(tmp_path / "x"))
        lines = [ln for ln in out.strip().splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1 and field in lines[0], lines


def test_check_train_flags_for_compare():
    from polyrl.families.q.cli import check_train_flags

    check_train_flags(["--method", "periodic", "--steps", "3"])
    with pytest.raises(ConfigError, match="lam"):
        check_train_flags(["--method", "lambda_geometric", "--lam", "-0.1"])
    with pytest.raises(ConfigError, match="lam = 0.5 does not apply"):
        check_train_flags(["--method", "periodic", "--lam", "0.5"])
    with pytest.raises(ConfigError, match="unrecognized"):
        check_train_flags(["--method", "periodic", "--bogus", "1"])


def test_cli_resume_continues_the_run_exactly(tmp_path, capsys):
    flags = ["--method", "periodic", "--period", "7", "--size", "4", "--samples-per-step", "50"]
    run = str(tmp_path / "cli")
    assert _main(capsys, "q", "train", *flags, "--steps", "2", "--run-dir", run)[0] == 0
    rc, out = _main(capsys, "q", "train", "--resume", "--steps", "4", "--run-dir", run)
    assert rc == 0, out
    full = train_q(QTrainConfig(size=4, samples_per_step=50, steps=4), get_q_method("periodic", period=7),
                   run_dir=tmp_path / "full")
    rows = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [r["q/td_abs"] for r in rows] == [r["q/td_abs"] for r in full["history"]]
    assert "steps" in (tmp_path / "cli" / "config_history.jsonl").read_text()
    rc, out = _main(capsys, "q", "train", "--resume", "--alpha", "0.5", "--run-dir", run)
    assert rc == 2 and "alpha = 0.5 differs" in out


def test_cli_resume_finds_the_default_run_directory(tmp_path, capsys, monkeypatch):
    """`q train --resume` without --run-dir said "run_dir = None holds no run"; like `duplex train`, it continues
    the run the same command without --run-dir made."""
    monkeypatch.chdir(tmp_path)
    flags = ["--method", "periodic", "--period", "7", "--size", "4", "--samples-per-step", "50"]
    assert _main(capsys, "q", "train", *flags, "--steps", "2")[0] == 0
    rc, out = _main(capsys, "q", "train", "--resume", "--method", "periodic", "--steps", "3")
    assert rc == 0, out
    assert (tmp_path / "runs" / "q" / "periodic-gridworld-s0" / "config_history.jsonl").is_file()


def test_negative_seed_is_refused_before_the_run_dir_is_written(tmp_path, capsys):
    from polyrl.families.q.train import validate_config

    with pytest.raises(ConfigError, match=r"^seed = -1 is not allowed; allowed: an integer in \[0, 2\*\*32\)$"):
        validate_config(QTrainConfig(seed=-1))
    with pytest.raises(ConfigError, match=r"^seed = 4294967296 is not allowed"):  # q alone took it (numpy's 2**63)
        validate_config(QTrainConfig(seed=2**32))
    validate_config(QTrainConfig(seed=2**32 - 1))
    run = tmp_path / "run"
    rc, out = _main(capsys, "q", "train", "--seed", "-1", "--run-dir", str(run))
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert "seed = -1 is not allowed; allowed: an integer in [0, 2**32)" in lines[0], lines
    assert not run.exists()  # no config.json left behind: a rerun needs no --overwrite


def test_a_grid_too_large_for_the_exact_model_is_refused_before_the_run_dir_is_written(tmp_path, capsys):
    """--size 60 computed its dense model and Q* for minutes before step 1 (2.6 GB); --size 1000 asked for 58 TiB."""
    from polyrl.families.q.train import MAX_SIZE, validate_config

    validate_config(QTrainConfig(size=MAX_SIZE))
    run = tmp_path / "run"
    rc, out = _main(capsys, "q", "train", "--size", str(MAX_SIZE + 1), "--run-dir", str(run))
    assert rc == 2 and f"size = {MAX_SIZE + 1} is not allowed; allowed: an integer in [2, {MAX_SIZE}]" in out, out
    assert not run.exists()


def test_search_refuses_a_negative_seed_and_an_existing_result(tmp_path, capsys):
    out = tmp_path / "search"
    rc, text = _main(capsys, "q", "search", "--seed", "-1", "--out", str(out))
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert "seed = -1 is not allowed; allowed: an integer in [0, 2**32)" in lines[0], lines
    assert not out.exists()
    out.mkdir()
    (out / "search.json").write_text('{"seed": 0}')
    rc, text = _main(capsys, "q", "search", "--seed", "3", "--out", str(out))
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "already holds search.json; pass --overwrite" in lines[0], lines
    assert json.loads((out / "search.json").read_text()) == {"seed": 0}
    rc, text = _main(capsys, "q", "search", "--seed", "3", "--out", str(out), "--overwrite")
    assert rc == 0, text
    assert json.loads((out / "search.json").read_text())["seed"] == 3


def test_q_resume_refuses_fewer_steps_and_damaged_files_in_one_line(tmp_path, capsys):
    """q accepted --resume --steps 2 after 3 steps (a summary saying 2 steps beside 3 logged); a truncated
    checkpoint.pkl or a record without its parts was a traceback, and the history line was appended anyway."""
    from tests.helpers import cli, one_line

    run = tmp_path / "q"
    assert cli(capsys, "q", "train", "--steps", "3", "--run-dir", str(run))[0] == 0
    history = run / "config_history.jsonl"
    code, err = cli(capsys, "q", "train", "--steps", "2", "--run-dir", str(run), "--resume")
    assert code == 2 and not history.exists()
    one_line(err, "steps = 2", ">= 3")
    pkl = (run / "checkpoint.pkl").read_bytes()
    (run / "checkpoint.pkl").write_bytes(pkl[:100])
    code, err = cli(capsys, "q", "train", "--steps", "4", "--run-dir", str(run), "--resume")
    assert code == 2 and not history.exists()
    one_line(err, "checkpoint.pkl cannot be read")
    (run / "checkpoint.pkl").write_bytes(pkl)
    record = json.loads((run / "config.json").read_text())
    del record["parts"]
    (run / "config.json").write_text(json.dumps(record))
    code, err = cli(capsys, "q", "train", "--steps", "4", "--run-dir", str(run), "--resume")
    assert code == 2
    one_line(err, "no target_mode, period, lam")


def test_q_resume_accepts_the_settings_it_already_has(tmp_path, capsys):
    """`compare --family q` repeats --config and a method's --period on --resume; both were refused, so an interrupted
    run could never finish. The same values are no change; another value is still refused in one line."""
    from tests.helpers import cli, one_line

    run, toml = tmp_path / "q", tmp_path / "q.toml"
    toml.write_text("size = 4\n")
    base = ["q", "train", "--method", "periodic", "--period", "3", "--config", str(toml), "--run-dir", str(run)]
    assert cli(capsys, *base, "--steps", "2", "--checkpoint-every", "1")[0] == 0
    assert cli(capsys, *base, "--steps", "3", "--resume")[0] == 0
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][-1] == 3
    code, err = cli(capsys, *[a if a != "3" else "4" for a in base], "--steps", "4", "--resume")
    assert code == 2
    one_line(err, "period = 4 differs from the run's own period = 3")
    toml.write_text("size = 5\n")
    code, err = cli(capsys, *base, "--steps", "4", "--resume")
    assert code == 2
    one_line(err, "size = 5 differs")
