"""The issue-5 rollout modes end to end through `train`: tree sampler, agency transfer, async pipeline, tool use."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from polyrl.cli import main
from polyrl.config import TrainConfig, build_config
from polyrl.learner import LocalLearner
from polyrl.methods import get_method
from polyrl.objectives import override
from polyrl.tasks import CalculatorTask
from polyrl.tasks.arithmetic import AdditionTask
from polyrl.tinylm import build_tiny_llama
from polyrl.trainer import train

QUIET = Console(file=io.StringIO(), width=120)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    learner = build_tiny_llama(root / "learner", hidden=32, layers=2, heads=2, seed=0)
    baseline = build_tiny_llama(root / "baseline", hidden=32, layers=2, heads=2, seed=1)
    return str(learner), str(baseline)


def _cfg(**kw) -> TrainConfig:
    base = dict(steps=3, prompts_per_step=2, group_size=4, max_new_tokens=6, eval_prompts=8, eval_every=0,
                checkpoint_every=0, tensorboard=False, log_every=0, lr=1e-3, warmup_steps=0, threads=1)
    return build_config({**base, "reward_funcs": DENSE, **kw})


DENSE = "tests.reward_fns:digit_fraction"  # a dense reward: every group has variance


def _task():
    return AdditionTask()


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("predictor,branch", [("history", True), ("likelihood", False)])
def test_tree_sampler_keeps_the_rollout_budget(models, tmp_path, predictor, branch):
    dense = DENSE if predictor == "history" else None  # likelihood: a reward that is the exact answer
    task = _task()
    train(_cfg(sampler="tree", train_prompts=4, tree_predictor=predictor, tree_branch=branch, reward_funcs=dense),
          get_method("grpo"),
          model_dir=models[0], task=task, run_dir=str(tmp_path), console=QUIET)
    steps = [r for r in _rows(tmp_path) if "reward/mean" in r]
    assert len(steps) == 3
    for r in steps:
        assert r["rollout/generated"] <= 2 * 4  # equal budget: prompts_per_step x group_size
        assert "tree/roots" in r and 0.0 <= r["rollout/utilization"] <= 1.0


def test_agency_ends_with_the_standalone_learner(models, tmp_path):
    cfg = _cfg(steps=4, agency=models[1], agency_schedule="linear:steps=2", eval_every=1)
    summary = train(cfg, override(get_method("grpo"), corrections=["tis"]), model_dir=models[0], task=_task(),
                    run_dir=str(tmp_path), console=QUIET)
    steps = [r for r in _rows(tmp_path) if "agency/baseline_share" in r]
    assert [r["agency/beta"] for r in steps] == [1.0, 0.5, 0.0, 0.0]
    assert steps[0]["agency/baseline_share"] == 1.0 and steps[-1]["agency/baseline_share"] == 0.0
    assert summary["agency_beta_after"] == 0.0 and summary["learner_eval_after"] == summary["eval_after"]


def test_async_staleness_never_exceeds_k(models, tmp_path, monkeypatch):
    reference_passes = []
    forward = LocalLearner.logprobs_nograd

    def counted(self, batch, *, topk=0, model=None):
        reference_passes.append(model is not None)
        return forward(self, batch, topk=topk, model=model)

    monkeypatch.setattr(LocalLearner, "logprobs_nograd", counted)
    train(_cfg(steps=5, async_staleness=2), get_method("grpo"), model_dir=models[0], task=_task(),
          run_dir=str(tmp_path), console=QUIET)
    steps = [r for r in _rows(tmp_path) if "async/staleness_max" in r]
    assert len(steps) == 5 and max(r["async/staleness_max"] for r in steps) <= 2
    # GRPO's KL needs the frozen reference: the rollout worker scored every batch it generated (step 0's too),
    # so the trainer never ran the reference
    assert reference_passes.count(True) == 0


def test_calculator_task_trains_with_the_turn_ratio(models, tmp_path):
    summary = train(_cfg(max_new_tokens=12, reward_funcs=None), get_method("grpo", ratio="turn"), model_dir=models[0],
                    task=CalculatorTask(), run_dir=str(tmp_path), console=QUIET)
    assert summary["steps"] == 3 and summary["skipped_steps"] == 0


def test_bad_rollout_settings_are_one_line_errors(models, tmp_path, capsys):
    base = ["train", "--model", models[0], "--run-dir", str(tmp_path / "x"), "--steps", "1"]
    cases = [(["--sampler", "tree", "--method", "dapo"], "sampler = 'tree' needs a group advantage"),
             (["--agency", str(tmp_path / "none")], "agency = "),
             (["--agency", models[1], "--agency-schedule", "cosine:steps=3"], "agency_schedule = 'cosine:steps=3'"),
             (["--async-staleness", "1", "--sampler", "tree"], "async_staleness = 1"),
             (["--async-staleness", "1", "--method", "dppo_tv", "--trust-region", "dppo_topk_kl"],
              "async_staleness = 1 is not allowed with trust region 'dppo_topk_kl'"),
             (["--tree-candidates", "4"], "tree_candidates = 4.0 is not allowed; only applies with sampler = 'tree'"),
             (["--sampler", "tree", "--tree-predictor", "likelihood", "--task", "countdown"],
              "tree_predictor = 'likelihood' is not allowed with task = 'countdown'"),
             (["--sampler", "tree", "--tree-predictor", "likelihood", "--tree-half-life", "20"],
              "tree_half_life = 20.0 is not allowed; ages pass-rate histories"),
             (["--sampler", "tree", "--tree-predictor", "likelihood", "--agency", models[1]],
              "tree_predictor = 'likelihood' is not allowed; is the learner's success rate"),
             (["--sampler", "tree", "--tree-roots", "sample", "--no-tree-branch", "--tree-prune", "0.1"],
              "tree_prune = 0.1 is not allowed; prunes only prefixes"),
             (["--no-tree-branch"], "tree_branch = False is not allowed; only applies with sampler = 'tree'"),
             (["--sampler", "tree", "--tree-max-group", "3"], "tree_max_group = 3 is not allowed; must be 0"),
             (["--sampler", "tree", "--tree-roots", "sample", "--tree-probe", "groups"],
              "tree_probe = 'groups' is not allowed; only applies with tree_roots = 'dp'"),
             (["--agency-mode", "sequence"], "agency_mode = 'sequence' is not allowed; only applies with agency")]
    for flags, message in cases:
        assert main([*base, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
