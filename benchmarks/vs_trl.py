"""polyrl vs TRL's GRPOTrainer, side by side on one machine, with matched objectives (not a test).

    make trl-venv                                  # TRL in its own pinned virtualenv: .venv-trl
    .venv/bin/python benchmarks/vs_trl.py demo     # the demo settings: per-phase medians, paired ratios
    .venv/bin/python benchmarks/vs_trl.py scaling  # completion length 8..512 and model size ~1M..66M, with plots
                                                   # (--stop natural: completions end at EOS; --stop fixed: never)
                                                   # and each framework's marginal cost of length
    .venv/bin/python benchmarks/vs_trl.py replot   # redraw the plots and the decomposition from the results files
    .venv/bin/python benchmarks/vs_trl.py accuracy # held-out accuracy after 200 steps, 3 seeds each
    .venv/bin/python benchmarks/vs_trl.py memory   # peak memory of one training step, ~50M model, vocab 152k, T=512
    .venv/bin/python benchmarks/vs_trl.py profile  # torch.profiler's operator table of both, over the timed steps
    .venv/bin/python benchmarks/vs_trl.py switch --polyrl-set skip_zero_adv=no  # polyrl alone, as is vs one
                                                   # setting changed, alternated at the demo settings
                                                   # (--switch-size 320x8: on a scaling model instead, at
                                                   # --size-length tokens and --stop lengths)
    python3 benchmarks/vs_trl.py demo --device cuda --trl-python python3  # on one GPU (benchmarks/gpu_checks.sh)

What is matched: the same saved model directory, prompts, reward and sampling (temperature 1, no top-p/top-k);
the objective is GRPO with group z-scored advantages (std + 1e-4, TRL's ``scale_rewards="group"``), PPO clip 0.2,
no KL (``beta=0``), losses averaged over every completion token of the batch (TRL ``loss_type="dapo"``, polyrl
aggregation ``token_mean``), one optimizer step per batch, AdamW at a constant learning rate (no warm-up, no decay),
gradient-norm clip 1.0, float32 (TRL ``bf16=False``: its CPU default autocasts to bfloat16),
``gradient_checkpointing=False``, one CPU thread each. Each framework runs in its own process (TRL from
``--trl-python``, default ``.venv-trl/bin/python``), the two alternate round by round, and what is reported is the
median of each phase and the per-round ratio polyrl/TRL of seconds per step (median, min, max): compare the two
numbers of one run, not numbers across runs.

``--device cuda``: both train on one GPU in one process, TRL as accelerate places it (``use_cpu=False``), polyrl
with ``--device cuda``; both still float32 and one CPU thread. Results go to ``results/vs_trl_cuda/``.

The scaling models are random-initialised tiny Llamas (``scaling_model``); the reward is the completion's share of
digits, so advantages are not zero. ``--stop natural`` (the default): EOS is one of the 86 tokens, so completions
end at EOS with lengths that vary up to ``max_new_tokens``, as a policy's do. ``--stop fixed``: the tokenizer's EOS id
lies outside the model's vocabulary, so every completion is exactly ``max_new_tokens`` long on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "vs_trl"
DIGITS = set("0123456789")


# ----------------------------------------------------------------------------------------------- the two workers
def exact_reward(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == answer else 0.0


def digit_reward(completion: str, answer: str) -> float:
    return sum(c in DIGITS for c in completion) / max(1, len(completion))


REWARDS = {"exact": exact_reward, "digits": digit_reward}


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_step_peak() -> None:
    """Start a new resident-memory high-water mark (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def step_peak_mib() -> float:
    """Peak resident memory since ``reset_step_peak`` (VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class StepProfiler:
    """``torch.profiler`` over the timed steps only (the first ``warmup`` steps are skipped); ``path`` None: off.

    ``step()`` is called after every RL step; ``finish()`` writes the operators' table, sorted by self CPU time,
    to ``path`` (the same table for both frameworks, so the two files compare line by line)."""

    def __init__(self, path: str | None, warmup: int, steps: int):
        self.path, self.prof = path, None
        if path:
            from torch.profiler import ProfilerActivity, profile, schedule

            self.prof = profile(activities=[ProfilerActivity.CPU],
                                schedule=schedule(wait=warmup, warmup=0, active=steps, repeat=1))
            self.prof.start()

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def finish(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            ops = self.prof.key_averages()
            Path(self.path).write_text(ops.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
                                       + "\n")


def worker_polyrl(spec: dict) -> dict:
    """Train with polyrl in this process; per-step phase times from its metrics file."""
    import io

    from rich.console import Console

    from polyrl.config import build_config
    from polyrl.methods import get_method
    from polyrl.tasks.base import Prompt
    from polyrl.trainer import train

    rows = json.loads(Path(spec["prompts"]).read_text())
    reward = REWARDS[spec["reward"]]
    import polyrl.trainer

    step_peaks: list[float] = []
    rl_step = polyrl.trainer.rl_step
    profiler = StepProfiler(spec.get("profile"), spec["warmup"], spec["steps"])

    def measured_step(*a, **k):  # each RL step's own resident-memory peak
        reset_step_peak()
        try:
            return rl_step(*a, **k)
        finally:
            step_peaks.append(step_peak_mib())
            profiler.step()

    polyrl.trainer.rl_step = measured_step

    class BenchTask:
        name = "bench"

        def prompts(self, split, n, seed):
            pool = rows["train" if split == "train" else "test"]
            return [Prompt(id=f"bench/{split}/{i}", text=r["prompt"], answer=r["answer"]) for i, r in
                    enumerate(pool[:n])]

        def reward(self, prompt, completion_text):
            return reward(completion_text, prompt.answer), {}

    cfg = build_config(dict(
        checkpoint_every=0 if spec.get("save_final") else 10**6,
        steps=spec["warmup"] + spec["steps"], prompts_per_step=spec["prompts_per_step"], group_size=spec["group"],
        max_new_tokens=spec["max_new_tokens"], lr=spec["lr"], warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
        seed=spec["seed"], eval_prompts=spec.get("eval_prompts", 8), eval_every=0,
        tensorboard=False, log_every=0, threads=1, train_prompts=len(rows["train"]), device=spec.get("device", "cpu"),
        **spec.get("polyrl_settings", {}),
    ))
    method = get_method("grpo", kl=None, kl_coef=0.0, aggregation="token_mean", advantage="grpo:eps=0.0001")
    run_dir = spec["out_dir"]
    summary = train(cfg, method, model_dir=spec["model"], task=BenchTask(), run_dir=run_dir,
                    console=Console(file=io.StringIO()))
    profiler.finish()
    metrics = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "perf/step_seconds" in m][spec["warmup"]:]
    out = {
        "step_s": [m["perf/step_seconds"] for m in steps],
        "generate_s": [m["perf/generate_s"] for m in steps],
        "score_s": [m["perf/score_s"] for m in steps],
        "update_s": [m["perf/train_s"] for m in steps],
        "forward_only_frac": [m.get("perf/forward_only_frac", 0.0) for m in steps],
        "gen_tokens": [m["rollout/mean_len"] * spec["prompts_per_step"] * spec["group"] for m in steps],
        "summary": {k: v for k, v in summary.items() if isinstance(v, (int, float, str))},
        "peak_rss_mib": peak_rss_mib(),
        "step_peak_mib": step_peaks[spec["warmup"]:],
    }
    if spec.get("save_final"):
        from polyrl.learner.sharded import export_hf

        newest = sorted((Path(run_dir) / "checkpoints").glob("step_*"))[-1]
        export_hf(newest, spec["save_final"], spec["model"])
    return out


def worker_trl(spec: dict) -> dict:
    """Train with TRL's GRPOTrainer in this process (TRL's virtualenv); per-step phase times by wrapping its
    generation and reward methods and timing each optimizer step with a callback."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    rows = json.loads(Path(spec["prompts"]).read_text())
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows["train"]])
    reward = REWARDS[spec["reward"]]

    def reward_fn(completions, answer, **kwargs):
        return [reward(c, a) for c, a in zip(completions, answer)]

    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    n = spec["prompts_per_step"] * spec["group"]
    cfg = GRPOConfig(
        output_dir=spec["out_dir"], per_device_train_batch_size=n, num_generations=spec["group"],
        max_completion_length=spec["max_new_tokens"], max_steps=spec["warmup"] + spec["steps"],
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        loss_type="dapo", beta=0.0, scale_rewards="group", epsilon=0.2, num_iterations=1,
        temperature=1.0, top_p=1.0, bf16=False, fp16=False, gradient_checkpointing=False,
        use_cpu=spec.get("device", "cpu") == "cpu",
        logging_steps=10**6, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        gradient_accumulation_steps=1, seed=spec["seed"], log_completions=False,
    )
    phases: dict[str, list[float]] = {"generate_s": [], "score_s": [], "prepare_s": []}
    step_s: list[float] = []

    step_peaks: list[float] = []
    profiler = StepProfiler(spec.get("profile"), spec["warmup"], spec["steps"])

    sync = torch.cuda.synchronize if spec.get("device") == "cuda" else (lambda: None)

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            reset_step_peak()
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()  # the optimizer step's kernels are done (polyrl's step reads its loss, which waits for them)
            step_s.append(time.perf_counter() - self.t0)
            step_peaks.append(step_peak_mib())
            profiler.step()

    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[Clock()])

    def timed(name: str, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name].append(time.perf_counter() - t0)
        return wrapper

    trainer._generate = timed("generate_s", trainer._generate)
    trainer._calculate_rewards = timed("score_s", trainer._calculate_rewards)
    tokens: list[float] = []
    prepare = timed("prepare_s", trainer._generate_and_score_completions)

    def counted(*a, **k):
        out = prepare(*a, **k)
        tokens.append(float(out["completion_mask"].sum()))
        return out

    trainer._generate_and_score_completions = counted
    trainer.train()
    profiler.finish()
    w = spec["warmup"]
    out = {
        "step_s": step_s[w:],
        "generate_s": phases["generate_s"][w:],
        "score_s": phases["score_s"][w:],
        "update_s": [s - p for s, p in zip(step_s[w:], phases["prepare_s"][w:])],
        "gen_tokens": tokens[w:],
        "peak_rss_mib": peak_rss_mib(),
        "step_peak_mib": step_peaks[w:],
    }
    if spec.get("save_final"):
        trainer.save_model(spec["save_final"])
        tok.save_pretrained(spec["save_final"])
    return out


# ------------------------------------------------------------------------------------------- orchestration
def run_worker(framework: str, spec: dict, python: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {**spec, "out_dir": str(Path(tmp) / "run")}
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_file.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run([python, str(Path(__file__).resolve()), f"_{framework}", str(spec_file), str(out_file)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{framework} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out_file.read_text())


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def paired(spec: dict, rounds: int, trl_python: str, label: str) -> dict:
    """Alternate polyrl and TRL ``rounds`` times on ``spec``; medians per phase and the per-round ratios.

    Round r runs both frameworks with seed ``spec["seed"] + r``: the two draw from different random streams, so
    with one seed every round would repeat one draw of completion lengths on each side (at 32 natural tokens one
    such draw gave polyrl 8 % more tokens than TRL); over rounds the draws average out."""
    from rich.progress import track

    per_round = []
    for r in track(range(rounds), description=f"{label}: {rounds} rounds"):
        order = ("polyrl", "trl") if r % 2 == 0 else ("trl", "polyrl")
        seeded = {**spec, "seed": spec["seed"] + r}
        got = {fw: run_worker(fw, seeded, sys.executable if fw == "polyrl" else trl_python) for fw in order}
        per_round.append(got)
    out: dict = {"spec": {k: v for k, v in spec.items() if k != "prompts"}, "rounds": rounds}
    for fw in ("polyrl", "trl"):
        for phase in ("step_s", "generate_s", "score_s", "update_s"):
            out[f"{fw}_{phase}"] = med([x for r in per_round for x in r[fw][phase]])
    ratios = [med(r["polyrl"]["step_s"]) / med(r["trl"]["step_s"]) for r in per_round]
    out.update(ratio_median=med(ratios), ratio_min=min(ratios), ratio_max=max(ratios), ratios=ratios)
    for fw in ("polyrl", "trl"):  # generated tokens per second of whole step, each framework counting its own
        out[f"{fw}_gen_tokens"] = med([x for r in per_round for x in r[fw]["gen_tokens"]])
        out[f"{fw}_tokens_per_s"] = out[f"{fw}_gen_tokens"] / out[f"{fw}_step_s"]
    return out


def switched(spec: dict, rounds: int, changes: dict) -> dict:
    """polyrl as is and with ``changes`` (TrainConfig settings), alternated ``rounds`` times on ``spec``: per-phase
    medians of each and the per-round ratio changed / as is of seconds per step."""
    from rich.progress import track

    per_round = []
    for r in track(range(rounds), description=f"{changes}: {rounds} rounds"):
        order = ("as_is", "changed") if r % 2 == 0 else ("changed", "as_is")
        per_round.append({k: run_worker("polyrl", {**spec, "seed": spec["seed"] + r,  # as in ``paired``
                                                   "polyrl_settings": changes if k == "changed" else {}},
                                        sys.executable) for k in order})
    out: dict = {"spec": {k: v for k, v in spec.items() if k != "prompts"}, "changes": changes, "rounds": rounds}
    for k in ("as_is", "changed"):
        for phase in ("step_s", "generate_s", "update_s", "forward_only_frac"):
            out[f"{k}_{phase}"] = med([x for r in per_round for x in r[k][phase]])
    ratios = [med(r["changed"]["step_s"]) / med(r["as_is"]["step_s"]) for r in per_round]
    out.update(ratio_median=med(ratios), ratio_min=min(ratios), ratio_max=max(ratios), ratios=ratios)
    return out


def addition_rows(n_train: int = 4096, n_test: int = 200) -> dict:
    rng = random.Random(0)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    make = lambda ps: [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ps]  # noqa: E731
    return {"train": make(pairs[:n_train]), "test": make(pairs[n_train:n_train + n_test])}


def demo_model() -> str:
    """The demo's warm start (built and cached by polyrl warmstart when missing)."""
    out = subprocess.run([sys.executable, "-m", "polyrl", "warmstart", "--task", "addition"], capture_output=True,
                         text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def scaling_model(out: Path, hidden: int, layers: int, vocab_pad: int = 0, fixed: bool = True) -> str:
    """A random-init tiny Llama. ``fixed``: its tokenizer's EOS id is outside the model's vocabulary, so every
    completion runs to ``max_new_tokens`` on both sides; else EOS is one of its 86 tokens (near-uniform logits: a
    row stops with p ~ 1/86 per token, lengths as a geometric law capped at max_new_tokens, as a real policy's
    vary). ``vocab_pad``: grow the model's vocabulary to this size (memory runs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl.tinylm import build_tiny_llama

    path = build_tiny_llama(out, hidden=hidden, layers=layers, heads=max(1, hidden // 64), max_positions=1024)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    if vocab_pad:
        model.resize_token_embeddings(vocab_pad, mean_resizing=False)
    if not fixed:
        return str(path)
    tok.add_special_tokens({"eos_token": "<never>"})  # its id is len(vocab): past the model's own, never sampled
    # (with ``vocab_pad`` it is inside the grown vocabulary but one of 152k: a row stops early with p ~ 3 %)
    assert vocab_pad or tok.eos_token_id >= model.config.vocab_size
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def params_m(model_dir: str) -> float:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(str(Path(model_dir) / "model.safetensors")).values()) / 1e6


def greedy_accuracy(model_dir: str, rows: list[dict]) -> float:
    """Held-out exact-match accuracy of greedy decoding, the same code for both frameworks' final models."""
    from polyrl.model import load_policy
    from polyrl.rollout.generator import SamplingParams
    from polyrl.rollout.hf import HFGenerator

    model, tok = load_policy(model_dir, threads=1)
    samples = HFGenerator(model, tok).generate([r["prompt"] for r in rows],
                                               SamplingParams(n=1, max_new_tokens=8, temperature=0.0, seed=0))
    return sum(exact_reward(s.text, r["answer"]) for s, r in zip(samples, rows)) / len(rows)


def plot_scaling(points: list[dict], path: Path, stop: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for col, sweep, key, label in ((0, "length", "max_new_tokens", "completion length (tokens)"),
                                   (1, "size", "params_m", "parameters (M)")):
        pts = [p for p in points if p["sweep"] == sweep]
        if not pts:
            continue
        xs = [p[key] for p in pts]
        for fw, style in (("polyrl", "o-"), ("trl", "s--")):
            axes[0, col].plot(xs, [p[f"{fw}_tokens_per_s"] for p in pts], style, label=fw)
        axes[1, col].plot(xs, [p["ratio_median"] for p in pts], "o-", color="k")
        axes[1, col].fill_between(xs, [p["ratio_min"] for p in pts], [p["ratio_max"] for p in pts], alpha=0.2)
        axes[1, col].axhline(1.0, color="grey", lw=0.8)
        for row in (0, 1):
            axes[row, col].set_xscale("log")
            axes[row, col].set_xlabel(label)
        axes[0, col].set_yscale("log")
        axes[0, col].set_ylabel("generated tokens / s (whole step)")
        axes[1, col].set_ylabel("polyrl / TRL seconds per step")
        axes[0, col].legend()
    fig.suptitle(f"polyrl vs TRL GRPO step, 1 CPU thread, float32 ({stop} completion lengths)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(name: str, result: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))


def decompose(points: list[dict]) -> dict:
    """Where a step's time goes as completions grow, from the length sweep.

    Between consecutive lengths: each framework's extra seconds per extra generated token (the step's marginal cost
    of length; each framework counts its own tokens) and their ratio. At the shortest length: the part of a step that
    does not grow with length, its seconds minus its tokens times that first marginal cost (prompt, optimizer step,
    the framework's own per-step work). A whole step's ratio lies between the fixed parts' ratio and the marginal
    ratio, and moves toward the marginal ratio as completions grow. A pair of lengths where either framework
    generated no more tokens at the longer one (a repeated length, natural lengths that came out equal) tells
    nothing and is left out."""
    pts = sorted((p for p in points if p["sweep"] == "length"), key=lambda p: p["max_new_tokens"])
    steps = []
    for a, b in zip(pts, pts[1:]):
        extra = {fw: b[f"{fw}_gen_tokens"] - a[f"{fw}_gen_tokens"] for fw in ("polyrl", "trl")}
        if min(extra.values()) <= 0:
            continue
        row: dict = {"from": a["max_new_tokens"], "to": b["max_new_tokens"]}
        for fw in ("polyrl", "trl"):
            row[f"{fw}_ms_per_token"] = 1e3 * (b[f"{fw}_step_s"] - a[f"{fw}_step_s"]) / extra[fw]
        row["ratio"] = row["polyrl_ms_per_token"] / row["trl_ms_per_token"]
        steps.append(row)
    if not steps:
        return {"marginal": [], "fixed": {}}
    first = next(p for p in pts if p["max_new_tokens"] == steps[0]["from"])
    fixed = {fw: first[f"{fw}_step_s"] - first[f"{fw}_gen_tokens"] * steps[0][f"{fw}_ms_per_token"] / 1e3
             for fw in ("polyrl", "trl")}
    fixed["at"] = first["max_new_tokens"]
    return {"marginal": steps, "fixed": fixed}


def show_decomposition(parts: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    if not parts["marginal"]:
        return
    table = Table(title="marginal cost of length: extra seconds per extra generated token (whole step)")
    for col in ("lengths", "polyrl ms/token", "TRL ms/token", "polyrl/TRL"):
        table.add_column(col)
    for r in parts["marginal"]:
        table.add_row(f"{r['from']} -> {r['to']}", f"{r['polyrl_ms_per_token']:.3f}", f"{r['trl_ms_per_token']:.3f}",
                      f"{r['ratio']:.2f}")
    console = Console()
    console.print(table)
    f = parts["fixed"]
    console.print(f"part of a step that does not grow with length (at {f['at']} tokens): polyrl {f['polyrl']:.3f} s, "
                  f"TRL {f['trl']:.3f} s")


def show(title: str, rows: list[tuple[str, dict]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("point", "polyrl s/step", "TRL s/step", "ratio median [min, max]", "polyrl gen/score/update",
                "TRL gen/score/update", "polyrl tok/s", "TRL tok/s"):
        table.add_column(col)
    for label, r in rows:
        table.add_row(label, f"{r['polyrl_step_s']:.3f}", f"{r['trl_step_s']:.3f}",
                      f"{r['ratio_median']:.2f} [{r['ratio_min']:.2f}, {r['ratio_max']:.2f}]",
                      "/".join(f"{r[f'polyrl_{p}']:.3f}" for p in ("generate_s", "score_s", "update_s")),
                      "/".join(f"{r[f'trl_{p}']:.3f}" for p in ("generate_s", "score_s", "update_s")),
                      f"{r['polyrl_tokens_per_s']:.0f}", f"{r['trl_tokens_per_s']:.0f}")
    Console().print(table)


def _size(text: str) -> tuple[int, int]:
    """A --switch-size value: HIDDENxLAYERS, two positive integers."""
    parts = text.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not HIDDENxLAYERS (e.g. 320x8)")
    return int(parts[0]), int(parts[1])


def _value(text: str):
    """A --polyrl-set value: a JSON number or boolean, else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    global RESULTS
    if len(sys.argv) == 4 and sys.argv[1] in ("_polyrl", "_trl"):  # a worker process
        spec = json.loads(Path(sys.argv[2]).read_text())
        fn = worker_polyrl if sys.argv[1] == "_polyrl" else worker_trl
        Path(sys.argv[3]).write_text(json.dumps(fn(spec)))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("demo", "scaling", "accuracy", "memory", "profile", "switch", "replot"))
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both frameworks train")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps per round")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seeds", type=int, default=3, help="accuracy: seeds per framework")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",") if x], default=[8, 32, 128, 512])
    ap.add_argument("--sizes", type=lambda s: [tuple(int(v) for v in x.split("x")) for x in s.split(",") if x],
                    default=[(128, 4), (320, 8), (640, 10)], help="hidden x layers, e.g. 128x4,320x8,640x10")
    ap.add_argument("--size-length", type=int, default=32, help="completion length of the size sweep")
    ap.add_argument("--stop", choices=("natural", "fixed"), default="natural",
                    help="scaling: completions stop at EOS (natural) or always run to the length (fixed)")
    ap.add_argument("--profile-length", type=int, default=0,
                    help="profile: 0 profiles the demo settings, N > 0 the natural-length scaling model at N tokens")
    ap.add_argument("--polyrl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="switch: a polyrl TrainConfig setting to change (repeatable), e.g. skip_zero_adv=no")
    ap.add_argument("--switch-size", type=_size, default=None,
                    metavar="HIDDENxLAYERS", help="switch: a scaling model (digit reward, --size-length tokens, "
                    "--stop lengths) instead of the demo's warm start")
    ap.add_argument("--mem-hidden", type=int, default=640)
    ap.add_argument("--mem-layers", type=int, default=10)
    ap.add_argument("--mem-vocab", type=int, default=152064)
    ap.add_argument("--mem-length", type=int, default=512)
    args = ap.parse_args()
    if args.what == "replot":  # redraw the scaling plots from their results files; print where the time goes
        for path in sorted(RESULTS.glob("scaling-*.json")):
            result = json.loads(path.read_text())
            plot_scaling(result["points"], path.with_suffix(".png"), result["stop"])
            result["decomposition"] = decompose(result["points"])
            path.write_text(json.dumps(result, indent=2))
            print(f"{path.name}:")
            show_decomposition(result["decomposition"])
        return
    if not Path(args.trl_python).exists() and not shutil.which(args.trl_python):
        sys.exit(f"--trl-python {args.trl_python} not found: run `make trl-venv` first")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no CUDA device here")
        RESULTS = HERE / "results" / "vs_trl_cuda"
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.json"
        prompts.write_text(json.dumps(addition_rows()))
        base = dict(prompts=str(prompts), reward="exact", prompts_per_step=8, group=8, max_new_tokens=8,
                    steps=args.steps, warmup=args.warmup, lr=args.lr, seed=0, device=args.device)
        if args.what == "demo":
            result = paired({**base, "model": demo_model()}, args.rounds, args.trl_python, "demo")
            write("demo", result)
            show("polyrl vs TRL at the demo settings (8 prompts x 8, 8 new tokens, 1 thread)", [("demo", result)])
        elif args.what == "scaling":
            points, fixed = [], args.stop == "fixed"
            for length in args.lengths:
                model = scaling_model(Path(tmp) / f"len{length}", 128, 4, fixed=fixed)
                spec = {**base, "model": model, "reward": "digits", "max_new_tokens": length}
                points.append({"sweep": "length", "params_m": params_m(model),
                               **paired(spec, args.rounds, args.trl_python, f"length {length}")})
            for hidden, layers in args.sizes:
                model = scaling_model(Path(tmp) / f"h{hidden}", hidden, layers, fixed=fixed)
                spec = {**base, "model": model, "reward": "digits", "max_new_tokens": args.size_length}
                points.append({"sweep": "size", "params_m": params_m(model), "max_new_tokens": args.size_length,
                               **paired(spec, args.rounds, args.trl_python, f"hidden {hidden} x {layers} layers")})
            for p in points:
                p.setdefault("max_new_tokens", p["spec"]["max_new_tokens"])
            parts = decompose(points)  # pure arithmetic that skips what it cannot divide: cannot lose the points
            write(f"scaling-{args.stop}", {"stop": args.stop, "points": points, "decomposition": parts})
            plot_scaling(points, RESULTS / f"scaling-{args.stop}.png", args.stop)
            show(f"polyrl vs TRL ({args.stop} lengths): completion length (~1M model) and model size "
                 f"({args.size_length} tokens)",
                 [(f"{p['sweep']} {p['max_new_tokens']} tok, {p['params_m']:.1f}M", p) for p in points])
            show_decomposition(parts)
        elif args.what == "accuracy":
            rows = json.loads(prompts.read_text())["test"]
            result: dict = {"steps": args.steps, "seeds": args.seeds, "polyrl": [], "trl": []}
            for seed in range(args.seeds):
                for fw in ("polyrl", "trl"):
                    final = Path(tmp) / f"{fw}{seed}"
                    spec = {**base, "model": demo_model(), "steps": args.steps, "warmup": 0, "seed": seed,
                            "save_final": str(final)}
                    run_worker(fw, spec, sys.executable if fw == "polyrl" else args.trl_python)
                    result[fw].append(greedy_accuracy(str(final), rows))
                    print(f"seed {seed} {fw}: held-out greedy accuracy {result[fw][-1]:.3f}")
            result["start"] = greedy_accuracy(demo_model(), rows)
            write("accuracy", result)
            print(json.dumps(result, indent=2))
        elif args.what == "profile":
            if args.profile_length:
                model = scaling_model(Path(tmp) / "prof", 128, 4, fixed=False)
                spec = {**base, "model": model, "reward": "digits", "max_new_tokens": args.profile_length}
            else:
                spec = {**base, "model": demo_model()}
            name = f"profile-{args.profile_length or 'demo'}"
            RESULTS.mkdir(parents=True, exist_ok=True)
            for fw in ("polyrl", "trl"):
                table = RESULTS / f"{name}-{fw}.txt"
                got = run_worker(fw, {**spec, "profile": str(table)}, sys.executable if fw == "polyrl" else
                                 args.trl_python)
                print(f"{fw}: {med(got['step_s']):.3f} s/step under the profiler "
                      f"(generate {med(got['generate_s']):.3f} s, update {med(got['update_s']):.3f} s)")
                print(table.read_text())
        elif args.what == "switch":
            if not args.polyrl_set or not all("=" in kv for kv in args.polyrl_set):
                sys.exit("switch needs --polyrl-set KEY=VALUE (e.g. skip_zero_adv=no)")
            changes = {k: _value(v) for k, v in (kv.split("=", 1) for kv in args.polyrl_set)}
            if args.switch_size:
                model = scaling_model(Path(tmp) / "switch", *args.switch_size, fixed=args.stop == "fixed")
                spec = {**base, "model": model, "reward": "digits", "max_new_tokens": args.size_length, "lr": args.lr}
                spec["model_label"] = f"{'x'.join(map(str, args.switch_size))}, {args.stop} lengths"
            else:
                spec = {**base, "model": demo_model(), "lr": args.lr, "model_label": "demo warm start"}
            result = switched(spec, args.rounds, changes)
            write("switch", result)
            print(json.dumps({k: v for k, v in result.items() if k != "spec"}, indent=2))
        elif args.what == "memory":
            model = scaling_model(Path(tmp) / "mem", args.mem_hidden, args.mem_layers, vocab_pad=args.mem_vocab)
            spec = {**base, "model": model, "reward": "digits", "max_new_tokens": args.mem_length,
                    "prompts_per_step": 2, "group": 4, "steps": 1, "warmup": 0, "eval_prompts": 1}
            result = {"params_m": params_m(model), "vocab": args.mem_vocab, "max_new_tokens": args.mem_length,
                      "rows": 8}
            for fw in ("polyrl", "trl"):
                got = run_worker(fw, spec, sys.executable if fw == "polyrl" else args.trl_python)
                result[f"{fw}_step_peak_mib"] = got["step_peak_mib"][0]  # the training step's own peak
                result[f"{fw}_process_peak_rss_mib"] = got["peak_rss_mib"]  # loading, evaluation, saving included
                result[f"{fw}_step_s"] = got["step_s"][0]
            write("memory", result)
            print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
