"""The flow RL loop: mean reward rises for every method; FPO learns the reach task from scratch; tasks.

Runs use the cached pretrained ring policies ($POLYRL_CACHE/flow, built in seconds on first use) and
few, small steps so that the whole file stays well under a minute on one thread.
"""

from __future__ import annotations

import pytest
import torch

from polyrl.families.flow.methods import FLOW_METHODS, get_flow_method
from polyrl.families.flow.policy import one_hot
from polyrl.families.flow.sampler import sample_sde
from polyrl.families.flow.tasks import get_task, mode_reward
from polyrl.families.flow.train import FlowTrainConfig, _train_step, initial_policy, train_flow

torch.set_num_threads(1)


def short_run(method: str, tmp_path, **changes):
    cfg = dict(task="ring_modes", steps=12, groups=8, group_size=16, updates_per_batch=2, lr=1e-3, eval_samples=512,
               tensorboard=False)
    cfg.update(changes)
    return train_flow(FlowTrainConfig(**cfg), get_flow_method(method), run_dir=tmp_path / method, table_every=0)


@pytest.mark.parametrize("method", sorted(FLOW_METHODS))
def test_mean_reward_rises_for_every_method(method, tmp_path):
    s = short_run(method, tmp_path)
    assert s["reward_after"] > s["reward_before"] + 0.1, (s["reward_before"], s["reward_after"])
    hist = s["history"]
    assert hist[0]["objective/kl"] == 0.0 and hist[-1]["objective/kl"] > 0  # path KL to pretrained starts at 0
    assert s["kl_before"] == 0.0 and s["kl_after"] > 0


def test_fpo_trains_reach_from_scratch(tmp_path):
    s = short_run("fpo", tmp_path, task="reach", steps=12, eval_samples=256)
    assert s["pretrained"] is None
    assert s["reward_after"] > s["reward_before"] + 0.15, (s["reward_before"], s["reward_after"])


class CountingAdam(torch.optim.Adam):
    """Adam that counts its steps (the optimizer steps of one rollout batch)."""

    steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


def test_every_pass_takes_exactly_minibatches_steps():
    # 1 group x 2 episodes x reach's horizon 5 = 10 actions in 6 minibatches: chunk gave 5 pieces of 2
    from polyrl.families.flow.losses import FLOW_LOSSES
    from polyrl.registry import ADVANTAGES

    cfg = FlowTrainConfig(task="reach", groups=1, group_size=2, minibatches=6, updates_per_batch=2, sampler_steps=2)
    task, method = get_task("reach"), get_flow_method("fpo")
    policy, _ = initial_policy(task, 0)
    opt = CountingAdam(policy.parameters(), lr=1e-3)
    _train_step(policy, policy, task, method, cfg, opt, FLOW_LOSSES.fn("fpo"), ADVANTAGES.fn("grpo"),
                torch.Generator().manual_seed(0))
    assert opt.steps == 12


def test_reach_points_rebuild_the_final_position():
    task = get_task("reach")
    ctx = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.5, -0.5, 0.0, 0.0]])
    actions = iter([torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([[0.5, 0.5], [-1.0, 0.0]])])

    def act(obs, n):
        a = next(actions)
        return sample_sde(lambda x, t, c: torch.zeros_like(x), a, steps=1, eta=1e-9, schedule="dance")

    task.horizon = 2
    trajs, rewards = task.episode(act, ctx, 2, torch.Generator())
    pos1 = ctx[:, :2] + task.step_size * trajs[0].samples.clamp(-1, 1)
    pos2 = pos1 + task.step_size * trajs[1].samples.clamp(-1, 1)
    want = -((pos1 - ctx[:, 2:]).norm(dim=-1) + (pos2 - ctx[:, 2:]).norm(dim=-1)) / 2
    assert torch.allclose(rewards, want, atol=1e-6)
    from polyrl.families.flow.train import _cat

    assert torch.allclose(task.points(_cat(trajs), ctx, 2), pos2 - ctx[:, 2:], atol=1e-6)


def test_mode_reward_by_hand():
    centres = torch.tensor([[0.0, 0.0], [3.0, 0.0]])
    x = torch.tensor([[0.0, 0.0], [3.0, 0.4], [1.5, 0.0]])
    r = mode_reward(x, centres, 0.4)
    assert r.tolist() == pytest.approx([1.0, pytest.approx(torch.exp(torch.tensor(-0.5)).item()),
                                        torch.exp(torch.tensor(-1.5**2 / 0.32)).item()])


def test_conditional_policy_reads_its_context():
    task = get_task("ring_modes_cond")
    policy, _ = initial_policy(task, 0)
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(4).repeat_interleave(500)
    ctx = one_hot(ids, 4)
    x = sample_sde(policy, torch.randn(2000, 2, generator=g), context=ctx, generator=g).samples
    own = mode_reward(x, task.modes(ctx), task.width).mean()
    other = mode_reward(x, task.modes(one_hot((ids + 1) % 4, 4)), task.width).mean()
    assert own > other + 0.05, (own, other)  # the pretrained target weights the asked modes twice


def test_cps_with_one_sampler_step_is_refused(tmp_path, capsys):
    """cps's last step is noise-free: with one step nothing was sampled, the gradient was 0 and the run 'trained'
    with objective/ratio_max -3.4e38; `compare --family flow` checks it before its first run too."""
    from polyrl.cli import main
    from polyrl.families.flow.cli import check_train_flags

    argv = ["--task", "reach", "--steps", "1", "--groups", "2", "--group-size", "2", "--eval-samples", "4",
            "--schedule", "cps", "--sampler-steps", "1"]
    assert main(["flow", "train", *argv, "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "sampler_steps = 1 is not allowed with schedule 'cps'" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()
    with pytest.raises(Exception, match="sampler_steps = 1"):
        check_train_flags(argv)
    check_train_flags([*argv[:-1], "2"])


@pytest.mark.parametrize("flags, field", [
    (["--groups", "100", "--group-size", "60", "--sampler-steps", "10"], "groups x group_size x sampler_steps = 60000"),
    (["--task", "reach", "--groups", "100", "--group-size", "12", "--sampler-steps", "10"],
     "groups x group_size x sampler_steps = 60000"),  # 5 actions per episode
    (["--method", "fpo", "--cfm-samples", "200", "--groups", "30", "--group-size", "10"], "cfm_samples = 200"),
    (["--eval-samples", "20000", "--sampler-steps", "80"], "eval_samples x sampler_steps = 1600000"),
])
def test_sizes_past_the_machines_memory_are_refused_in_one_line(monkeypatch, flags, field):
    """With 200 MiB of memory: 40,000 action steps train within it (160 MB at 4 KB measured), 60,000 do not; flow
    had only a cap of 10^6 samples, and 10^6 samples of 10 steps were OOM-killed after minutes."""
    from polyrl.config import ConfigError
    from polyrl.families.flow.cli import check_train_flags

    monkeypatch.setattr("polyrl.runs.memory_bytes", lambda: 200 * 2**20)
    check_train_flags(["--groups", "100", "--group-size", "40", "--sampler-steps", "10"])
    with pytest.raises(ConfigError) as e:
        check_train_flags(flags)
    assert field in str(e.value) and "GiB" in str(e.value) and "\n" not in str(e.value)


def test_a_damaged_cached_policy_is_trained_again_and_an_unwritable_cache_is_one_line(tmp_path, capsys):
    """A truncated velocity.pt (or flow_meta.json) in the cache stopped every flow command with EOFError /
    JSONDecodeError; POLYRL_CACHE naming a file failed with NotADirectoryError after pretraining."""
    from polyrl.errors import ConfigError
    from polyrl.families.flow.policy import META_FILE, WEIGHTS_FILE, PretrainSettings, pretrain

    settings = PretrainSettings(steps=2, hidden=8, layers=1)
    first = pretrain(settings, cache=tmp_path)
    assert not first.cached and pretrain(settings, cache=tmp_path).cached
    weights = tmp_path / first.path.rsplit("/", 1)[-1] / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:50])
    again = pretrain(settings, cache=tmp_path)
    assert not again.cached and "cannot be read" in capsys.readouterr().err
    assert pretrain(settings, cache=tmp_path).cached
    (weights.parent / META_FILE).write_text("{")
    assert not pretrain(settings, cache=tmp_path).cached
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot be created"):
        pretrain(settings, cache=tmp_path / "file")


def test_cps_with_one_sampler_step_still_trains_a_cfm_loss():
    """FPO's CFM loss learns from the initial noise even when cps's only step is noise-free: not refused."""
    from polyrl.families.flow.cli import check_train_flags

    check_train_flags(["--method", "fpo", "--schedule", "cps", "--eta", "0.5", "--sampler-steps", "1"])


def test_sizes_past_a_million_samples_are_refused():
    """`flow train --groups 1000000000` passed validation; on this machine the OOM killer then ended the process
    (overcommit let the allocation through), with no line saying why."""
    from dataclasses import replace

    from polyrl.families.flow.train import validate_config

    cfg = FlowTrainConfig(task="reach")
    validate_config(cfg)
    for bad in (dict(groups=10**9), dict(eval_samples=10**12), dict(groups=1001, group_size=1000)):
        with pytest.raises(ValueError, match="at most 1000000 samples at once"):
            validate_config(replace(cfg, **bad))


def test_a_diverging_run_names_the_settings_that_scale_its_steps(tmp_path, capsys):
    """A noise level past what the step log-probs hold makes every loss non-finite: the one-line stop names --eta
    with its value beside --lr, not the learning rate alone."""
    from polyrl.cli import main

    argv = ["--task", "reach", "--steps", "3", "--groups", "2", "--group-size", "2", "--eval-samples", "4",
            "--eta", "1e30", "--run-dir", str(tmp_path / "r")]
    assert main(["flow", "train", *argv]) == 1
    err = capsys.readouterr().err
    assert "non-finite loss at 3 steps in a row" in err and "lower --lr (0.0005) or --eta (1e+30)" in err, err
    assert err.count("\n") == 1, err


def test_a_lone_sample_per_group_is_refused_for_group_advantages_only():
    """`flow train --group-size 1` ran and trained nothing: a group estimator gives a lone sample A = 0 (KL 0.000 at
    every step). An estimator that is not group-relative (reinforce) still learns from one sample a context."""
    from polyrl.config import ConfigError
    from polyrl.families.flow.cli import check_train_flags

    with pytest.raises(ConfigError, match=r"group_size = 1 is not allowed with advantage 'group_centered_batch_std'"):
        check_train_flags(["--group-size", "1"])
    with pytest.raises(ConfigError, match=r"group_size = 1 is not allowed with advantage 'grpo'"):
        check_train_flags(["--group-size", "1", "--advantage", "grpo"])
    check_train_flags(["--group-size", "1", "--advantage", "reinforce"])
    check_train_flags(["--group-size", "2"])


def test_pretrain_past_the_machines_memory_is_refused_and_run_files_are_what_was_written(tmp_path, capsys,
                                                                                        monkeypatch):
    """`flow pretrain --layers 100000` had no memory check: the OOM killer ended it with no line (19.5 GB resident).
    `flow train --no-tensorboard` listed a tb/ it never wrote among its run files."""
    from polyrl.cli import main

    assert main(["flow", "pretrain", "--layers", "100000"]) == 2
    err = capsys.readouterr().err
    assert "hidden = 128 x layers = 100000 is not allowed here" in err and err.count("\n") == 1, err
    monkeypatch.setenv("POLYRL_CACHE", str(tmp_path / "cache"))
    argv = ["--task", "reach", "--steps", "1", "--groups", "2", "--group-size", "2", "--eval-samples", "4",
            "--no-tensorboard", "--run-dir", str(tmp_path / "r")]
    assert main(["flow", "train", *argv]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("run files:"))
    assert "tb/" not in line and "summary.json" in line and "curves.png" in line, line


def test_an_sde_window_trains_only_its_noisy_steps():
    """UniRL's Flow-DPPO recipe (3 noisy steps in the first half of 10): every action has exactly 3 stochastic steps,
    all in the window, and only they reach the loss (its mask is the stochastic steps)."""
    from polyrl.families.flow.losses import FLOW_LOSSES
    from polyrl.families.flow.train import play
    from polyrl.registry import ADVANTAGES

    task, method = get_task("ring_modes"), get_flow_method("flow_dppo", sde_steps=3, sde_window=0.5)
    policy, _ = initial_policy(task, 0)
    traj, _, _ = play(policy, task, method, None, 32, 10, torch.Generator().manual_seed(0))
    assert (traj.stochastic.sum(-1) == 3).all() and not traj.stochastic[:, 5:].any()
    seen = []
    loss = FLOW_LOSSES.fn("flow_dppo")

    def spy(inp, **params):
        seen.append(inp.mask.clone())
        return loss(inp, **params)

    cfg = FlowTrainConfig(task="ring_modes", groups=2, group_size=4, minibatches=1, updates_per_batch=1)
    _train_step(policy, policy, task, method, cfg, torch.optim.Adam(policy.parameters(), lr=1e-3), spy,
                ADVANTAGES.fn("group_centered_batch_std"), torch.Generator().manual_seed(1))
    assert len(seen) == 1 and (seen[0].sum(-1) == 3).all()
