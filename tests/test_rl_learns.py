"""RL improves a warm-started model: GRPO from the committed warm-start fixture, several seeds.

The shipped warm start (polyrl/warmstarts/addition) is the output of `polyrl warmstart --task addition`
(hidden 128, 4 layers, held-out greedy accuracy 0.375 when it first crossed 0.30).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from polyrl.config import build_config
from polyrl.methods import get_method
from polyrl.tasks import get_task
from polyrl.trainer import train

FIXTURE = Path(__file__).parent.parent / "polyrl" / "warmstarts" / "addition"


@pytest.mark.slow
def test_grpo_raises_heldout_accuracy_by_10_points_over_seeds(tmp_path):
    gains = []
    for seed in (0, 1, 2):
        # one thread: `make test` runs two workers on two cores, and two threads each made this test 7x slower
        cfg = build_config(dict(steps=30, eval_every=0, eval_prompts=200, checkpoint_every=0, tensorboard=False,
                                log_every=0, seed=seed, threads=1))
        summary = train(cfg, get_method("grpo"), model_dir=str(FIXTURE), task=get_task("addition"),
                        run_dir=str(tmp_path / f"s{seed}"), console=Console(file=io.StringIO()))
        gains.append(summary["eval_after"] - summary["eval_before"])
    (tmp_path / "gains.json").write_text(json.dumps(gains))
    assert sum(gains) / len(gains) >= 0.10, gains
    assert min(gains) > 0.0, gains
