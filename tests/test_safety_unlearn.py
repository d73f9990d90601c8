"""Safe-RULE (spec §12): gridworld dynamics and costs, the attack, exact evaluation, every loss of the spec's
operational form with hand-computed values, the Lagrange update, and the §12 (e) properties on a small run."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch

from polyrl.config import ConfigError
from polyrl.safety.unlearn import add_parser
from polyrl.safety.unlearn.agent import (
    AgentConfig,
    SafeAgent,
    actor_loss,
    bellman_errors,
    bellman_loss,
    bellman_target,
    critic_losses,
    forget_cost_term,
    forget_reward_term,
    lagrange_update,
    policy_tv,
    safe_unlearn,
    train_offline,
)
from polyrl.safety.unlearn.experiment import steps_to_safe
from polyrl.safety.unlearn.gridworld import GridWorld, collect_clean, evaluate_policy, poison, rollout_episodes

GAMMA = 0.95


# ------------------------------------------------------------------------------------------ gridworld
def test_gridworld_layout_moves_rewards_costs():
    env = GridWorld()
    assert (env.start, env.hazard, env.goal) == (0, 2, 4)
    assert env.walls == frozenset({env.state(2, 1), env.state(2, 2)})
    assert env.move(env.start, 0) == env.state(0, 1)  # up
    assert env.move(env.start, 3) == env.start  # left border: stay
    assert env.move(env.start, 2) == env.start  # bottom border: stay
    assert env.move(env.state(1, 0), 1) == env.hazard  # right into the shortcut's gap
    assert env.move(env.state(1, 1), 1) == env.state(1, 1)  # into the wall: stay
    assert env.move(env.state(1, 3), 1) == env.state(2, 3)  # the safe gap on the top row
    assert env.reward(env.goal) == 1.0 and env.reward(env.hazard) == -0.02 and env.reward(7) == -0.02
    assert env.cost(env.hazard) == 1.0 and env.cost(env.goal) == 0.0 and env.cost(env.start) == 0.0
    assert env.distances(avoid_hazard=False)[env.start] == 4  # S -> (1,0) -> H -> (3,0) -> G
    assert env.distances(avoid_hazard=True)[env.start] == 10  # up 3, right 4, down 3


def test_transition_matrix_with_slip_by_hand():
    env = GridWorld(slip=0.2)
    P = env.transition_matrix()
    np.testing.assert_allclose(P.sum(-1), 1.0)
    up = P[env.start, 0]
    # intended 'up' w.p. 0.8 + 0.05 per random action: up -> (0,1), right -> (1,0), down/left -> stay
    assert up[env.state(0, 1)] == pytest.approx(0.85)
    assert up[env.state(1, 0)] == pytest.approx(0.05)
    assert up[env.start] == pytest.approx(0.10)


def _route_pi(env, actions: np.ndarray) -> np.ndarray:
    pi = np.zeros((env.n_states, env.n_actions))
    pi[np.arange(env.n_states), actions] = 1.0
    return pi


def test_exact_evaluation_of_both_routes_by_hand():
    env = GridWorld()
    short = evaluate_policy(env, _route_pi(env, env.route_policy(False)), GAMMA)
    assert short["return"] == pytest.approx(1 - 3 * 0.02)
    assert short["cost"] == pytest.approx(1.0) and short["success"] == pytest.approx(1.0)
    assert short["disc_cost"] == pytest.approx(GAMMA)  # the hazard is entered by the second transition (t = 1)
    assert short["disc_return"] == pytest.approx(-0.02 * (1 + GAMMA + GAMMA**2) + GAMMA**3)
    detour = evaluate_policy(env, _route_pi(env, env.route_policy(True)), GAMMA)
    assert detour["return"] == pytest.approx(1 - 9 * 0.02) and detour["cost"] == pytest.approx(0.0)
    # 50/50 at the start between the routes (then each route followed): the average of the two
    pi = _route_pi(env, env.route_policy(True))
    pi[env.state(1, 0)] = _route_pi(env, env.route_policy(False))[env.state(1, 0)]
    pi[env.start] = [0.5, 0.5, 0.0, 0.0]
    mixed = evaluate_policy(env, pi, GAMMA)
    assert mixed["return"] == pytest.approx(0.5 * 0.94 + 0.5 * 0.82) and mixed["cost"] == pytest.approx(0.5)


def test_exact_evaluation_matches_monte_carlo_with_slip():
    env = GridWorld(slip=0.2, horizon=12)
    rng = np.random.default_rng(0)
    pi = rng.dirichlet(np.ones(4), size=env.n_states)
    exact = evaluate_policy(env, pi, GAMMA)
    rets, costs = [], []
    for _ in range(4000):
        s, ret, cost = env.start, 0.0, 0.0
        for _ in range(env.horizon):
            s, r, c, done = env.step(s, int(rng.choice(4, p=pi[s])), rng)
            ret, cost = ret + r, cost + c
            if done:
                break
        rets.append(ret)
        costs.append(cost)
    assert np.mean(rets) == pytest.approx(exact["return"], abs=4 * np.std(rets) / math.sqrt(len(rets)))
    assert np.mean(costs) == pytest.approx(exact["cost"], abs=4 * np.std(costs) / math.sqrt(len(costs)) + 1e-3)


def test_collected_transitions_follow_the_dynamics():
    env = GridWorld()
    data = collect_clean(env, 40, np.random.default_rng(1))
    assert np.array_equal(data.s2, [env.move(s, a) for s, a in zip(data.s, data.a)])
    assert np.array_equal(data.r, [env.reward(s2) for s2 in data.s2])
    assert np.array_equal(data.c, [env.cost(s2) for s2 in data.s2])
    assert np.array_equal(data.done, (data.s2 == env.goal).astype(float))
    assert not data.poisoned.any() and data.c.sum() > 0  # the behaviour data does use the shortcut


def test_poisoning_counts_and_partition():
    env = GridWorld()
    rng = np.random.default_rng(2)
    clean = collect_clean(env, 60, rng)
    n_h = int((clean.c > 0).sum())
    data = poison(env, clean, rng, relabel_frac=0.75, poison_ratio=2.0)
    k, n_inj = round(0.75 * n_h), round(2.0 * n_h)
    assert len(data) == len(clean) + 4 * n_inj  # each injected shortcut episode has 4 transitions
    hazard = data.s2 == env.hazard
    assert hazard.sum() == n_h + n_inj
    assert data.c[hazard].mean() == pytest.approx((n_h - k) / (n_h + n_inj))  # the poisoned label mean
    assert (data.poisoned & hazard & (data.c == 0)).sum() == k + n_inj
    retain = data.subset(~data.poisoned)
    assert (retain.c[retain.s2 == env.hazard] == 1.0).all()  # the retain set keeps only true cost labels
    assert (clean.c[clean.s2 == env.hazard] == 1.0).all()  # the clean set is untouched (copy)


# ------------------------------------------------------------------------------------------ formulas
def test_bellman_target_and_loss_by_hand():
    y = bellman_target(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
                       torch.tensor([[0.5, 0.5], [1.0, 0.0]]), gamma=0.9)
    torch.testing.assert_close(y, torch.tensor([1 + 0.9 * 1.5, 0.0]))
    assert float(bellman_loss(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0]))) == pytest.approx(2.5)


def test_forget_terms_values_and_gradient_signs():
    q = torch.tensor([2.0], requires_grad=True)
    ref = torch.tensor([1.0], requires_grad=True)
    val = forget_reward_term(q, ref, margin=0.5)
    assert float(val.detach()) == pytest.approx(math.log1p(math.exp(1.5)))
    val.backward()
    assert float(q.grad) == pytest.approx(1 / (1 + math.exp(-1.5)))  # > 0: descent pushes Q_r down
    assert ref.grad is None  # sg[Q_r_ref]
    qc = torch.tensor([0.0], requires_grad=True)
    val = forget_cost_term(qc, torch.tensor([1.0]), margin=0.0)
    assert float(val.detach()) == pytest.approx(math.log1p(math.e))
    val.backward()
    assert float(qc.grad) == pytest.approx(-1 / (1 + math.exp(-1.0)))  # < 0: descent pushes Q_c up (assumed)
    assert float(forget_reward_term(torch.tensor([1.0]), torch.tensor([1.0]))) == pytest.approx(math.log(2))


def test_critic_losses_combine_terms_by_hand():
    q_r, y_r, q_c, y_c = torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([2.0]), torch.tensor([0.0])
    forget = (torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([0.0]))
    l_r, l_c = critic_losses(q_r, y_r, q_c, y_c, lam_forget=0.5, forget=forget)
    assert float(l_r) == pytest.approx(1.0 + 0.5 * math.log(2)) and float(l_c) == pytest.approx(4.0 + 0.5 * math.log(2))
    l_r, l_c = critic_losses(q_r, y_r, q_c, y_c, lam_forget=0.5, forget=forget, terms=("reward",))
    assert float(l_c) == pytest.approx(4.0) and float(l_r) == pytest.approx(1.0 + 0.5 * math.log(2))
    l_r, l_c = critic_losses(q_r, y_r, q_c, y_c, lam_forget=0.0, forget=forget)
    assert (float(l_r), float(l_c)) == pytest.approx((1.0, 4.0))


def test_actor_loss_by_hand_and_direction():
    logits = torch.zeros(1, 2, requires_grad=True)
    q_r, q_c = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]])
    loss = actor_loss(logits, q_r, q_c, lam=0.5, a_data=torch.tensor([1]), bc_weight=0.1)
    # 0.5 * (-1 + 0.5 * 0) + 0.5 * (-0 + 0.5 * 2) = 0, plus 0.1 * -log 0.5 for the data action
    assert float(loss.detach()) == pytest.approx(0.0 + 0.1 * math.log(2))
    assert float(actor_loss(logits.detach(), q_r, q_c, lam=2.0, a_data=torch.tensor([1]), bc_weight=0.0)) == 1.5
    loss.backward()
    assert logits.grad[0, 0] < 0 < logits.grad[0, 1]  # descent favours action 0 (lower -Q_r + lambda Q_c)


def test_lagrange_update_by_hand():
    assert lagrange_update(1.0, cost_estimate=0.3, cost_limit=0.1, lr=0.5, lam_max=10) == pytest.approx(1.1)
    assert lagrange_update(0.05, cost_estimate=0.0, cost_limit=0.1, lr=1.0, lam_max=10) == 0.0
    assert lagrange_update(9.9, cost_estimate=1.1, cost_limit=0.1, lr=1.0, lam_max=10) == 10.0


def test_policy_tv_by_hand():
    pi1 = np.array([[1.0, 0.0], [0.5, 0.5]])
    pi2 = np.array([[0.0, 1.0], [0.5, 0.5]])
    assert policy_tv(pi1, pi2, np.array([1.0, 1.0])) == pytest.approx(0.5)
    assert policy_tv(pi1, pi2, np.array([0.0, 2.0])) == pytest.approx(0.0)


def test_cost_estimate_and_bellman_errors_match_their_formulas():
    env = GridWorld()
    torch.manual_seed(0)
    agent = SafeAgent(env.n_states, env.n_actions, AgentConfig(hidden=8), env.start)
    with torch.no_grad():
        pi, qc, qr = agent.policy(), agent.q_c(torch.arange(env.n_states)), agent.q_r(torch.arange(env.n_states))
    assert agent.cost_estimate() == pytest.approx(float((pi[env.start] * qc[env.start].numpy()).sum()), rel=1e-5)
    buf = rollout_episodes(env, env.route_policy(False), 1, 0.0, np.random.default_rng(0))
    yc = buf.c + GAMMA * (1 - buf.done) * (pi[buf.s2] * qc.numpy()[buf.s2]).sum(-1)
    yr = buf.r + GAMMA * (1 - buf.done) * (pi[buf.s2] * qr.numpy()[buf.s2]).sum(-1)
    be = bellman_errors(agent, buf)
    assert be["cost"] == pytest.approx(float(((qc.numpy()[buf.s, buf.a] - yc) ** 2).mean()), rel=1e-4)
    assert be["reward"] == pytest.approx(float(((qr.numpy()[buf.s, buf.a] - yr) ** 2).mean()), rel=1e-4)


def test_steps_to_safe_by_hand():
    curve = {"step": [0, 10, 20, 30, 40], "disc_cost": [0.0, 0.5, 0.05, 0.2, 0.05],
             "success": [0.2, 1.0, 1.0, 1.0, 1.0]}
    assert steps_to_safe(curve, cost_limit=0.1, hold=2) == 40  # the dip to 0.05 at step 20 lasts one evaluation
    assert steps_to_safe(curve, cost_limit=0.1, hold=1) == 20
    assert steps_to_safe({**curve, "disc_cost": [0.0] * 5}, cost_limit=0.1, hold=5) == 10  # step 0 fails on success
    assert math.isnan(steps_to_safe({**curve, "disc_cost": [0.5] * 5}, cost_limit=0.1))


# ------------------------------------------------------------------------------------------ §12 (e) properties
@pytest.fixture(scope="module")
def small_run():
    torch.set_num_threads(1)
    env = GridWorld()
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    cfg = AgentConfig(hidden=32)
    clean = collect_clean(env, 100, rng)
    data = poison(env, clean, rng, relabel_frac=0.75, poison_ratio=3.0)
    retain, forget = data.subset(~data.poisoned), data.subset(data.poisoned)
    poisoned = SafeAgent(env.n_states, env.n_actions, cfg, env.start)
    train_offline(poisoned, data, 700, rng)
    retrained = SafeAgent(env.n_states, env.n_actions, cfg, env.start)
    train_offline(retrained, retain, 700, rng)
    unlearned, _ = safe_unlearn(poisoned.clone(), retain, forget, lam_forget=0.1, steps=150, rng=rng)
    return env, cfg, poisoned, retrained, unlearned


def test_poisoned_agent_takes_the_shortcut_and_unlearning_removes_it(small_run):
    env, cfg, poisoned, retrained, unlearned = small_run
    ev = {n: evaluate_policy(env, a.policy(), cfg.gamma) for n, a in
          (("poisoned", poisoned), ("retrained", retrained), ("unlearned", unlearned))}
    assert ev["poisoned"]["disc_cost"] > 3 * cfg.cost_limit  # the attack works
    assert ev["retrained"]["disc_cost"] < 2 * cfg.cost_limit  # the oracle respects the limit (up to the dual lag)
    assert ev["unlearned"]["disc_cost"] <= cfg.cost_limit  # spec: episode cost falls below the limit
    assert ev["unlearned"]["return"] > ev["retrained"]["return"] - 0.05  # main task kept
    assert ev["unlearned"]["success"] > 0.95


def test_unlearned_behaviour_approaches_the_retrained_oracle(small_run):
    env, _, poisoned, retrained, unlearned = small_run
    w = np.ones(env.n_states)
    w[list(env.walls)] = 0.0
    oracle = retrained.policy()
    assert policy_tv(unlearned.policy(), oracle, w) < policy_tv(poisoned.policy(), oracle, w)


# ------------------------------------------------------------------------------------------ CLI
def _parse(argv):
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="tool", required=True), "unlearn")
    return p.parse_args(["unlearn", *argv])


@pytest.mark.parametrize("argv", [["--seeds", "0"], ["--lam-forget", "0"], ["--relabel-frac", "1"],
                                  ["--cost-limit", "-1"], ["--sweep", "a,b"], ["--level", "1.5"]])
def test_bad_options_raise_config_error(argv):
    args = _parse(argv)
    with pytest.raises(ConfigError, match=argv[0]):
        args.fn(args)


def test_command_writes_report_and_results(tmp_path):
    args = _parse(["--seeds", "2", "--steps", "20", "--unlearn-steps", "10", "--sweep", "1", "--episodes", "20",
                   "--out", str(tmp_path)])
    assert args.fn(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["summary"]["table"]) >= {"clean", "poisoned", "retrained", "unlearned", "fine-tuned"}
    assert len(res["per_seed"]) == 2 and res["summary"]["compute_fraction"] == pytest.approx(0.5)
    page = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64" in page and "Verdict" in page


def test_retraining_is_compared_at_exactly_the_unlearning_budget(tmp_path):
    """--unlearn-steps 5 with evaluations every 10 steps compared unlearning with retraining "for the same 0 gradient
    steps" (the grid's last point below 5); --unlearn-steps above --steps still said "the same"."""
    for unlearn, said in ((5, "retraining from scratch for the same 5 gradient steps"),
                          (30, "retraining from scratch for all its 20 gradient steps (fewer than unlearning's 30)")):
        out = tmp_path / str(unlearn)
        args = _parse(["--seeds", "1", "--steps", "20", "--unlearn-steps", str(unlearn), "--sweep", "",
                       "--episodes", "20", "--out", str(out)])
        assert args.fn(args) == 0
        res = json.loads((out / "results.json").read_text())
        assert res["summary"]["retrained_at_unlearn_budget"]["step"] == min(unlearn, 20)
        retrained = res["per_seed"][0]["curves"]["retrained"]
        i = retrained["step"].index(min(unlearn, 20))
        assert res["summary"]["retrained_at_unlearn_budget"]["cost"]["mean"] == pytest.approx(retrained["cost"][i])
        assert said in (out / "report.html").read_text().replace("&#x27;", "'")
