"""Flow presets, their validation (one-line errors), the `polyrl flow` command line and the pretraining cache."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.cli import main
from polyrl.families.flow.methods import FLOW_METHODS, build_flow_method, get_flow_method
from polyrl.families.flow.policy import PretrainSettings, pretrain
from polyrl.families.flow.train import FlowTrainConfig, validate_config
from polyrl.registry import PartError

torch.set_num_threads(1)


def test_presets_name_their_parts():
    want = {"flow_grpo": ("grpo", "flow_clip"), "flow_dppo": ("group_centered_batch_std", "flow_dppo"),
            "grpo_guard": ("grpo", "grpo_guard"), "loop": ("rloo", "flow_clip"), "fpo": ("grpo", "fpo"),
            "dance_grpo": ("grpo", "flow_clip")}
    assert set(FLOW_METHODS) == set(want)
    for name, (adv, loss) in want.items():
        m = get_flow_method(name)
        assert (m.advantage.name, m.loss.name) == (adv, loss) and m.summary and m.paper.startswith("arXiv:")
    assert get_flow_method("dance_grpo").schedule == "dance" and get_flow_method("fpo").cfm_samples == 8
    assert get_flow_method("fpo").needs_cfm and not get_flow_method("fpo").needs_steps
    assert get_flow_method("flow_dppo").needs_steps and not get_flow_method("flow_dppo").needs_cfm


def test_overrides_keep_other_parameters_and_revalidate():
    m = get_flow_method("flow_dppo", loss="flow_dppo:kl_threshold=1e-4", schedule="cps", eta=0.5)
    assert m.loss.params == {"kl_threshold": 1e-4, "kl_reduce": None} and m.schedule == "cps" and m.eta == 0.5
    m = get_flow_method("flow_grpo", loss="flow_clip:kl_beta=0.01", advantage="rloo", reduce="sum")
    assert m.loss.params["clip"] == 0.02 and m.loss.params["kl_beta"] == 0.01 and m.advantage.name == "rloo"


@pytest.mark.parametrize("call, fragment", [
    (lambda: get_flow_method("flow_dpo"), "unknown flow method 'flow_dpo' (did you mean 'flow_dppo'?)"),
    (lambda: get_flow_method("flow_grpo", schedule="ddim"), "schedule = 'ddim'; allowed: 'flow_grpo', 'dance', 'cps'"),
    (lambda: get_flow_method("flow_grpo", schedule="cps", eta=1.5), "eta = 1.5 is out of range for schedule 'cps'"),
    (lambda: get_flow_method("flow_grpo", eta=-0.1), "eta = -0.1 is out of range; allowed: > 0"),
    (lambda: get_flow_method("flow_grpo", reduce="max"), "reduce = 'max'; allowed: 'mean', 'sum'"),
    (lambda: get_flow_method("fpo", cfm_samples=0), "loss 'fpo' needs cfm_samples >= 1, got 0"),
    (lambda: get_flow_method("flow_grpo", advantage="gae"), "advantage = 'gae' is not per-sample"),
    (lambda: get_flow_method("flow_grpo", clip=0.1), "cannot override 'clip'"),
    (lambda: get_flow_method("flow_grpo", loss="flow_clip:clip=0"), "'clip' = 0.0 is out of range; allowed: >0"),
    (lambda: build_flow_method("x", advantage="grpo", loss="nope"), "unknown flow_loss 'nope'"),
    (lambda: get_flow_method("flow_dppo", cfm_samples=5),
     "cfm_samples = 5 has no effect with loss 'flow_dppo'; allowed only with a loss tagged 'cfm': fpo"),
    (lambda: get_flow_method("fpo", loss="flow_clip", cfm_samples=8), "cfm_samples = 8 has no effect"),
    (lambda: get_flow_method("fpo", reduce="sum"), "reduce = 'sum' has no effect with loss 'fpo'"),
    (lambda: get_flow_method("fpo", reduce="mean"), "reduce = 'mean' has no effect with loss 'fpo'"),
    (lambda: build_flow_method("x", advantage="grpo", loss="flow_clip", cfm_samples=3),
     "cfm_samples = 3 does not apply to loss 'flow_clip'"),
    (lambda: get_flow_method("flow_dppo", sde_steps=-1), "sde_steps = -1 must be an integer >= 0"),
    (lambda: get_flow_method("flow_dppo", sde_steps=3, sde_window=0), "sde_window = 0.0 is out of range"),
    (lambda: get_flow_method("flow_dppo", sde_window=0.5), "sde_window = 0.5 has no effect with sde_steps = 0"),
])
def test_bad_values_are_one_line_errors_naming_field_and_value(call, fragment):
    with pytest.raises(PartError) as e:
        call()
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_settings_the_loss_reads_are_kept_and_a_dropped_preset_value_is_not_recorded():
    assert get_flow_method("fpo", cfm_samples=3).cfm_samples == 3
    assert get_flow_method("flow_dppo", reduce="sum").reduce == "sum"
    # fpo's own 8 (t, eps) pairs would be recorded but never read once the loss is a per-step one
    assert get_flow_method("fpo", loss="flow_clip").cfm_samples == 0
    assert get_flow_method("flow_dppo", loss="fpo", cfm_samples=4).cfm_samples == 4


def test_minibatches_above_the_actions_per_batch_are_refused():
    validate_config(FlowTrainConfig(groups=1, group_size=2, minibatches=2))
    with pytest.raises(ValueError, match=r"minibatches = 3 is not allowed; allowed: 1 to 2, the actions per batch"):
        validate_config(FlowTrainConfig(groups=1, group_size=2, minibatches=3))
    validate_config(FlowTrainConfig(task="reach", groups=1, group_size=2, minibatches=10))  # horizon 5
    with pytest.raises(ValueError, match="minibatches = 11 .* reach horizon 5"):
        validate_config(FlowTrainConfig(task="reach", groups=1, group_size=2, minibatches=11))


def test_config_validation_names_the_field():
    for change, fragment in [({"steps": 0}, "steps = 0"), ({"lr": -1.0}, "lr = -1.0"),
                             ({"task": "pong"}, "task = 'pong'; allowed: ring_modes"),
                             ({"group_size": 1.5}, "group_size = 1.5")]:
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
            validate_config(FlowTrainConfig(**change))


def test_pretrain_is_cached(tmp_path):
    s = PretrainSettings(steps=30, hidden=16, layers=1, batch_size=64)
    first = pretrain(s, cache=tmp_path)
    second = pretrain(s, cache=tmp_path)
    assert not first.cached and second.cached and first.path == second.path
    for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values()):
        assert torch.equal(a, b)
    assert pretrain(PretrainSettings(steps=31, hidden=16, layers=1, batch_size=64), cache=tmp_path).path != first.path


@pytest.mark.parametrize("argv, fragment", [
    (["flow", "train", "--method", "nope"], "unknown flow method 'nope'"),
    (["flow", "train", "--steps", "0"], "steps = 0"),
    (["flow", "train", "--loss", "flow_dppo:kl_threshold=-1"], "'kl_threshold' = -1.0 is out of range"),
    (["flow", "train", "--task", "pong"], "task = 'pong'"),
    (["flow", "train", "--method", "flow_dppo", "--cfm-samples", "5"], "cfm_samples = 5 has no effect"),
    (["flow", "train", "--method", "fpo", "--reduce", "sum"], "reduce = 'sum' has no effect with loss 'fpo'"),
    (["flow", "train", "--groups", "1", "--group-size", "2", "--minibatches", "50"], "minibatches = 50"),
    (["flow", "train", "--sde-steps", "6", "--sde-window", "0.5"],
     "sde_steps = 6 is not allowed with sampler_steps = 10 and sde_window = 0.5; allowed: 1 to 5"),
])
def test_cli_errors_are_one_line_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0]


def test_cli_train_writes_run_files_and_refuses_to_overwrite(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["flow", "train", "--method", "flow_grpo", "--steps", "3", "--groups", "2", "--group-size", "4",
            "--eval-samples", "64", "--run-dir", str(run_dir), "--updates-per-batch", "2", "--lr", "1e-3",
            "--seed", "1"]
    assert main(argv) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["method"] == "flow_grpo" and summary["steps"] == 3 and summary["updates_per_batch"] == 2
    assert {"reward_before", "reward_after", "kl_after", "wall_seconds"} <= set(summary)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["objective/kl"] == 0.0
    assert {"reward/mean", "objective/loss", "objective/clip_frac"} <= set(rows[0])
    assert (run_dir / "samples.png").stat().st_size > 0 and any((run_dir / "tb").iterdir())
    assert "mean reward before" in capsys.readouterr().out
    assert main(argv) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--no-tensorboard"]) == 0


def test_cli_methods_and_pretrain(capsys):
    assert main(["flow", "methods"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in FLOW_METHODS)
    with pytest.raises(SystemExit) as e:
        main(["flow", "pretrain", "--target", "ring9"])
    assert e.value.code == 2 and "target = 'ring9'; allowed: 'ring8', 'ring8_cond'" in capsys.readouterr().err
    assert main(["flow", "pretrain", "--steps", "0"]) == 2
    assert "steps = 0" in capsys.readouterr().err


def test_a_flow_or_duplex_preset_cannot_take_a_taken_name_or_build_another_method():
    """A plugin's @flow_preset flow_grpo silently swapped in its own method (as polyrl's @preset grpo did), and one
    building a method named otherwise was listed under that name."""
    from polyrl.families.duplex.methods import DUPLEX_METHODS, duplex_preset
    from polyrl.families.flow.methods import FLOW_METHODS, build_flow_method, flow_preset
    from polyrl.registry import PartError

    def flow_grpo():
        return build_flow_method("flow_grpo", advantage="grpo", loss="flow_clip")

    with pytest.raises(PartError, match="flow preset 'flow_grpo' is registered twice"):
        flow_preset(flow_grpo)

    def grpo():
        return None

    with pytest.raises(PartError, match="duplex preset 'grpo' is registered twice"):
        duplex_preset(grpo)

    def flow_renamed():
        """Renamed."""
        return build_flow_method("something_else", advantage="grpo", loss="flow_clip")

    flow_preset(flow_renamed)
    try:
        with pytest.raises(PartError, match="flow preset 'flow_renamed' .* builds a method named 'something_else'"):
            FLOW_METHODS["flow_renamed"]()
    finally:
        del FLOW_METHODS["flow_renamed"]
    assert "grpo" in DUPLEX_METHODS and FLOW_METHODS["flow_grpo"]().summary.startswith("Flow-GRPO")
