"""The formation family: geometry, reward, permutation invariance, resume, CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from polyrl.config import ConfigError
from polyrl.families.marl import env as E
from polyrl.families.marl.cli import check_train_flags
from polyrl.families.marl.methods import get_marl_method
from polyrl.families.marl.nets import Actor, CentralCritic
from polyrl.families.marl.train import MarlTrainConfig, train_marl, validate_config

SQUARE = torch.tensor([[[-1.0, -1.0], [1.0, -1.0], [1.0, 1.0], [-1.0, 1.0]]])
BIG = torch.tensor([[[-2.0, -2.0], [2.0, -2.0], [2.0, 2.0], [-2.0, 2.0], [-2.0, 2.0]]])  # padded: last repeated


def margin(points, c, mask=None):
    p = torch.tensor([points], dtype=torch.float32)
    m = torch.ones(p.shape[:2], dtype=torch.bool) if mask is None else torch.tensor([mask])
    return E.support_margin(p, m, torch.tensor([c], dtype=torch.float32)).item()


def test_support_margin_hand_values():
    sq = SQUARE[0].tolist()
    assert margin(sq, [0, 0]) == pytest.approx(1.0)
    assert margin(sq, [0.5, 0.2]) == pytest.approx(0.5)
    assert margin(sq, [1.0, 0.0]) == pytest.approx(0.0, abs=1e-6)
    assert margin(sq, [3.0, 0.0]) == pytest.approx(-2.0)
    assert margin(sq, [2.0, 2.0]) == pytest.approx(-math.sqrt(2))
    # an interior point and a masked-out far point change nothing; a segment gives <= 0; nothing gives -1
    assert margin([*sq, [0.0, 0.0], [9.0, 9.0]], [0.5, 0.2], [True] * 5 + [False]) == pytest.approx(0.5)
    assert margin([[-1.0, 0.0], [1.0, 0.0]], [0.0, 0.0]) == pytest.approx(0.0, abs=1e-6)
    assert margin([[-1.0, 0.0], [1.0, 0.0]], [0.0, 0.5]) == pytest.approx(-0.5)
    assert margin([[0.0, 0.0]], [3.0, 4.0]) == pytest.approx(-5.0)
    assert margin([[0.0, 0.0]], [3.0, 4.0], [False]) == -1.0


def test_support_margin_positive_iff_strictly_inside_hull():
    from scipy.spatial import ConvexHull, Delaunay

    g = torch.Generator().manual_seed(0)
    pts = torch.rand(200, 6, 2, generator=g) * 2 - 1
    c = torch.rand(200, 2, generator=g) * 2 - 1
    m = E.support_margin(pts, torch.ones(200, 6, dtype=torch.bool), c)
    for b in range(200):
        hull = ConvexHull(pts[b].numpy())
        eq = hull.equations  # n.x + d <= 0 inside, unit normals
        depth = (-(eq[:, :2] @ c[b].numpy() + eq[:, 2])).min()
        inside = Delaunay(pts[b].numpy()).find_simplex(c[b].numpy()) >= 0
        assert (m[b].item() > 0) == inside
        if inside:
            assert m[b].item() == pytest.approx(depth, abs=1e-5)


def test_polygon_inside_and_distance_with_padding():
    p = torch.tensor([[[0.0, 0.0], [1.5, 0.0], [3.0, 1.0], [-2.5, 0.3]]])
    assert E.inside_polygon(p, BIG).tolist() == [[True, True, False, False]]
    d, vec = E.polygon_distance(p, BIG)
    assert d[0].tolist() == pytest.approx([2.0, 0.5, 1.0, 0.5])
    assert vec[0, 1].tolist() == pytest.approx([1.0, 0.0])


def test_load_shares_balance():
    tri = torch.tensor([[[1.0, 0.0], [-0.5, math.sqrt(3) / 2], [-0.5, -math.sqrt(3) / 2]]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    f = E.load_shares(tri, mask, torch.zeros(1, 2))
    assert f[0].tolist() == pytest.approx([1 / 3] * 3, abs=1e-5)
    assert E.imbalance(tri, mask, torch.zeros(1, 2)).item() == pytest.approx(0.0, abs=1e-5)
    c = torch.tensor([[0.5, 0.0]])
    f = E.load_shares(tri, mask, c)
    assert f.sum().item() == pytest.approx(1.0, abs=1e-5)
    assert (f[0] @ tri[0]).tolist() == pytest.approx([0.5, 0.0], abs=1e-5)  # static balance: sum f s = c
    assert E.imbalance(tri, mask, c).item() > 0.2


def _state(pos, com):
    pos = torch.tensor([pos])
    return E.State(pos=pos, alive=torch.ones(pos.shape[:2], dtype=torch.bool), poly=BIG, com=torch.tensor([com]),
                   obs_c=torch.tensor([[[5.0, 5.0]]]), obs_r=torch.tensor([[0.1]]))


def test_balanced_formation_scores_higher_than_unbalanced_with_same_mean():
    com = [0.0, 0.3]
    balanced = [[-0.6, -0.2], [0.6, -0.2], [0.0, 1.0]]  # a triangle around the centre of mass
    unbalanced = [[-0.6, 0.2], [0.0, 0.2], [0.6, 0.2]]  # a line below it
    assert np.mean(balanced, 0) == pytest.approx(np.mean(unbalanced, 0))
    rb, ib = E.reward(_state(balanced, com))
    ru, iu = E.reward(_state(unbalanced, com))
    assert ib["margin"].item() > 0 > iu["margin"].item()
    assert rb.item() > ru.item()
    assert ib["success"].item() and not iu["success"].item()
    # a collision costs reward and success at the same positions' mean
    crowded = [[-0.6, -0.2], [0.6, -0.2], [0.0, 0.5], [0.0, 0.55]]
    spread = [[-0.6, -0.2], [0.6, -0.2], [0.0, 0.25], [0.0, 0.8]]
    rc, ic = E.reward(_state(crowded, com))
    rs, is_ = E.reward(_state(spread, com))
    assert ic["collisions"].item() == 1 and is_["collisions"].item() == 0
    assert rs.item() > rc.item()


def test_obstacle_pushes_robot_to_rim():
    s = _state([[0.0, 0.0]], [0.0, 0.0])
    s.obs_c, s.obs_r = torch.tensor([[[0.2, 0.0]]]), torch.tensor([[0.1]])
    ns, _, _ = E.step(s, torch.tensor([[[1.0, 0.0]]]))  # moves to x = 0.12, inside the disc
    assert (ns.pos[0, 0] - s.obs_c[0, 0]).norm().item() == pytest.approx(0.1 + E.ROBOT_R)


def _obs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = E.reset(2, n, E.Distribution(teams=(n,)), g)
    own, nbr = E.observe(s, 30)
    return s, own, nbr


def test_actor_and_central_critic_are_permutation_equivariant():
    torch.manual_seed(0)
    actor, critic = Actor(32), CentralCritic(32)
    s, own, nbr = _obs(5)
    nm, team = E.neighbour_mask(s.alive), torch.randn(2, 3)
    perm = torch.tensor([3, 0, 4, 1, 2])
    mu = actor.dist(own, nbr, nm).mean
    mu_p = actor.dist(own[:, perm], nbr[:, perm][:, :, perm], nm[:, perm][:, :, perm]).mean
    assert torch.allclose(mu[:, perm], mu_p, atol=1e-6)
    v = critic(own, nbr, nm, s.alive, team)
    v_p = critic(own[:, perm], nbr[:, perm][:, :, perm], nm[:, perm][:, :, perm], s.alive[:, perm], team)
    assert torch.allclose(v[:, perm], v_p, atol=1e-6)


@pytest.mark.parametrize("n", [3, 5, 8])
def test_same_weights_run_for_any_team_size_and_padding_is_inert(n):
    torch.manual_seed(0)
    actor = Actor(32)
    s, own, nbr = _obs(n, seed=n)
    mu = actor.dist(own, nbr, E.neighbour_mask(s.alive)).mean
    # the same teams padded to 8 agents with junk in the padded slots
    pad = 8 - n
    own_p = torch.cat([own, torch.randn(2, pad, own.shape[-1])], 1)
    nbr_p = torch.randn(2, 8, 8, nbr.shape[-1])
    nbr_p[:, :n, :n] = nbr
    alive = torch.arange(8)[None].expand(2, 8) < n
    mu_p = actor.dist(own_p, nbr_p, E.neighbour_mask(alive)).mean
    assert torch.allclose(mu, mu_p[:, :n], atol=1e-6)


TINY = dict(envs=4, horizon=6, hidden=16, eval_every=2, eval_episodes=4, minibatches=2, epochs=2)


@pytest.mark.parametrize("eval_every", [None, 3])
def test_resume_2_plus_2_equals_4(tmp_path, eval_every):
    """With eval_every 3 the first segment evaluates at its last step (2), off the schedule: the resumed run's
    history and file drop that evaluation, as the unbroken run never made it."""
    m, tiny = get_marl_method("mappo"), {**TINY, **({} if eval_every is None else {"eval_every": eval_every})}
    full = train_marl(MarlTrainConfig(steps=4, **tiny), m, run_dir=tmp_path / "full", table_every=0)
    train_marl(MarlTrainConfig(steps=2, **tiny), m, run_dir=tmp_path / "half", table_every=0)
    resumed = train_marl(MarlTrainConfig(steps=4, **tiny), m, run_dir=tmp_path / "half", resume=True, table_every=0)
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "half" / "checkpoint.pt", weights_only=False)
    for k, v in a["agent"].items():
        assert torch.equal(v, b["agent"][k]), k
    assert torch.equal(a["rng"], b["rng"]) and a["step"] == b["step"] == 4
    drop = ("perf/step_seconds",)
    strip = [[{k: v for k, v in r.items() if k not in drop} for r in h["history"]] for h in (full, resumed)]
    assert strip[0] == strip[1]
    rows = [json.loads(x) for x in (tmp_path / "half" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    full_rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(r) for r in rows] == [sorted(r) for r in full_rows]


def test_resuming_a_finished_run_keeps_its_final_evaluation_and_its_checkpoint_leftover_is_its_own(tmp_path,
                                                                                                     monkeypatch):
    """A resume with no steps left dropped the last row's off-schedule evaluation and evaluated nothing again, so
    summary.json's success numbers came from the evaluation before; an interrupted save left checkpoint.tmp, which
    --overwrite refused as a file no run writes."""
    from polyrl.runs import replaceable

    m, tiny = get_marl_method("mappo"), {**TINY, "eval_every": 2}
    done = train_marl(MarlTrainConfig(steps=3, **tiny), m, run_dir=tmp_path, table_every=0)
    again = train_marl(MarlTrainConfig(steps=3, **tiny), m, run_dir=tmp_path, resume=True, table_every=0)
    assert "eval/accuracy" in again["history"][-1] and again["history"][-1]["step"] == 3
    assert again["success_heldout"] == done["success_heldout"] == done["history"][-1]["eval/accuracy"]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [2, 3]
    import polyrl.families.marl.train as marl_train

    def interrupted(obj, path):
        Path(path).write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt

    agent = marl_train.Agent(m, 16)
    monkeypatch.setattr(marl_train.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        marl_train.save_checkpoint(tmp_path / "checkpoint.pt", agent, torch.optim.Adam(agent.parameters()),
                                   torch.Generator(), 3, [])
    assert (tmp_path / "checkpoint.pt.tmp").exists() and replaceable(tmp_path)


def test_ippo_critic_differs_and_trains(tmp_path):
    s = train_marl(MarlTrainConfig(steps=2, **TINY), get_marl_method("ippo"), run_dir=tmp_path, table_every=0)
    assert s["critic"] == "local" and 0.0 <= s["success_heldout"] <= 1.0


@pytest.mark.parametrize("flags, field", [
    (["--teams", "3,9"], "teams"), (["--teams", "a"], "teams"),
    (["--teams", "5"], "teams = '5' is not allowed (held out: 5)"), (["--lr", "-1"], "lr"), (["--gamma", "2"], "gamma"),
    (["--envs", "0"], "envs"), (["--hidden", "1"], "hidden = 1 is not allowed; allowed: an integer >= 2"),
    (["--method", "qmix"], "method"), (["--minibatches", "99"], "minibatches")])
def test_bad_settings_one_line_errors(flags, field):
    with pytest.raises(ConfigError) as e:
        check_train_flags(flags)
    assert "\n" not in str(e.value) and str(e.value).startswith(field)


@pytest.mark.parametrize("flags, field", [(["--envs", "4000"], "envs x horizon = 4000 x 30"),
                                          (["--horizon", "3000"], "envs x horizon = 48 x 3000"),
                                          (["--eval-episodes", "20000"], "eval_episodes x horizon = 20000 x 30"),
                                          (["--hidden", "4096"], "at hidden 4096")])
def test_sizes_past_the_machines_memory_are_refused_in_one_line(monkeypatch, flags, field):
    """With 2 GiB of memory: 1,000 episodes of 30 steps train within it (1.2 GiB measured), four times that does
    not."""
    monkeypatch.setattr("polyrl.runs.memory_bytes", lambda: 2 * 2**30)
    check_train_flags(["--envs", "1000"])
    with pytest.raises(ConfigError) as e:
        check_train_flags(flags)
    assert field in str(e.value) and "GiB" in str(e.value) and "\n" not in str(e.value)


def test_check_train_flags_accepts_presets():
    check_train_flags(["--method", "ippo", "--steps", "5", "--seed", "1", "--run-dir", "x", "--overwrite"])
    with pytest.raises(ValueError):
        validate_config(MarlTrainConfig(clip_eps=0.0))


def test_train_help_documents_every_field():
    out = subprocess.run([sys.executable, "-m", "polyrl", "marl", "train", "--help"], capture_output=True,
                         text=True, check=True).stdout
    from dataclasses import fields

    for f in fields(MarlTrainConfig):
        assert "--" + f.name.replace("_", "-") in out, f.name
    assert "--resume" in out


def test_resume_config_allows_only_run_control_changes(tmp_path):
    from dataclasses import asdict

    from polyrl.families.marl.cli import resume_config

    (tmp_path / "checkpoint.pt").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"config": asdict(MarlTrainConfig(steps=2)), "method": "ippo"}))
    cfg, method, changes = resume_config(tmp_path, {"steps": 6, "seed": 0})
    assert cfg.steps == 6 and method == "ippo" and changes == {"steps": [2, 6]}
    with pytest.raises(ConfigError, match="^lr = 0.1 differs"):
        resume_config(tmp_path, {"lr": 0.1})
    with pytest.raises(ConfigError, match="holds no run \\(no config.json\\) to resume"):
        resume_config(tmp_path / "missing", {})
