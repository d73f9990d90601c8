"""pass@k of a finished run's final policy on held-out prompts (issue 22, the ``maxrl_passk`` claim).

counts = sample_counts("runs/x/seed0", n=16, prompts=100)   # successes per held-out prompt, n samples each
curve = pass_at_k_curve(counts, 16, (1, 2, 4, 8))             # {1: ..., 2: ..., 4: ..., 8: ...}

The estimator is the unbiased one of Chen et al. 2021 (arXiv:2107.03374): with n samples of a prompt of which c
pass, pass@k = 1 - C(n - c, k) / C(n, k), averaged over prompts.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SAMPLE_SEED = 0  # the sampling seed of every pass@k evaluation: arms paired by seed see the same random numbers


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from n samples with c successes: 1 - C(n - c, k) / C(n, k).

    Computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i) (Chen et al. 2021, arXiv:2107.03374, Fig. 3), which is
    exact and needs no big binomials; n - c < k gives 1 (every k-subset holds a success). Needs 1 <= k <= n and
    0 <= c <= n.
    """
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=float)))


def pass_at_k_curve(counts: Sequence[int], n: int, ks: Sequence[int]) -> dict[int, float]:
    """Mean over prompts of ``pass_at_k(n, c, k)`` for each k; ``counts`` = successes per prompt (n samples)."""
    if not counts:
        raise ValueError("pass_at_k_curve needs at least one prompt")
    return {int(k): float(np.mean([pass_at_k(n, int(c), int(k)) for c in counts])) for k in ks}


def sample_counts(run_dir: str | Path, *, n: int, prompts: int | None = None, threads: int = 1) -> list[int]:
    """Successes out of ``n`` samples (temperature 1, no top-p/top-k) per held-out prompt of the run's final policy.

    The run's newest checkpoint (a finished run's is its final step) is exported with polyrl's own
    ``export_hf`` (any checkpoint layout) and loaded with ``load_policy``; the held-out prompts are the run's own
    evaluation prompts (``held_out_prompts(task, prompts)``, each once; ``prompts`` default: the run's ``eval_prompts``,
    rendered as the run rendered them). Cached in
    ``RUN_DIR/passk_n{n}_p{prompts}.json`` next to the checkpoint step it was computed from.
    """
    from polyrl.checkpoint import latest_checkpoint
    from polyrl.learner.sharded import export_hf
    from polyrl.model import load_policy
    from polyrl.rollout.episodes import EpisodeRunner
    from polyrl.rollout.generator import SamplingParams
    from polyrl.rollout.hf import HFGenerator
    from polyrl.rollout.score import succeeded
    from polyrl.tasks import get_task
    from polyrl.tasks.base import held_out_prompts
    from polyrl.tasks.chat import PromptFormat, formatted_task

    run_dir = Path(run_dir)
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise FileNotFoundError(f"run {run_dir}: no checkpoint to evaluate pass@k on")
    cfg = json.loads((run_dir / "config.json").read_text())["config"]
    prompts = int(cfg["eval_prompts"]) if prompts is None else prompts
    cache = run_dir / f"passk_n{n}_p{prompts}.json"
    if cache.exists() and (saved := json.loads(cache.read_text())).get("checkpoint") == checkpoint.name:
        return [int(c) for c in saved["counts"]]
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = load_policy(export_hf(checkpoint, tmp, cfg["model"]), dtype=cfg.get("dtype", "float32"),
                                       threads=threads)
    task = get_task(cfg["task"], data_file=cfg.get("data_file"), heldout_percent=cfg.get("heldout_percent", 10))
    task = formatted_task(task, PromptFormat(tokenizer, cfg.get("chat_template", "auto"), cfg.get("system_prompt"),
                                             model=f"model {cfg['model']!r}"))
    held_out = held_out_prompts(task, prompts)
    runner = EpisodeRunner(HFGenerator(model, tokenizer), tokenizer, task)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=int(cfg["max_new_tokens"]), seed=SAMPLE_SEED)
    counts = [0] * len(held_out)
    for s in runner.sample(held_out, params):
        counts[s.prompt_index] += int(succeeded(task.reward(held_out[s.prompt_index], s.text)[0]))
    cache.write_text(json.dumps({"checkpoint": checkpoint.name, "n": n, "prompts": prompts, "counts": counts}))
    return counts
