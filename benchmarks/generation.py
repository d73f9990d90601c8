"""Generation throughput (tokens/s): polyrl's HF KV-cache loop, transformers' batched `generate`, vLLM (not a test).

    .venv/bin/python benchmarks/generation.py [--shape demo|tiny|0.5b] [--prompts 8] [--group-size 4]
        [--max-new-tokens 32] [--rounds 2] [--temperature 1.0] [--top-p 1.0] [--top-k 0] [--dtype float32]
        [--train-steps 0] [--json benchmarks/results/generation.json]

The same prompts (the addition task's, tokenized by the model's tokenizer), group size and length cap go through
(a) ``HFGenerator.generate_ids`` -- the decode loop the trainer samples with, (b) ``model.generate(do_sample=True,
output_scores=True, return_dict_in_generate=True)`` on the same left-padded batch, and (c) ``VLLMGenerator`` when
a CUDA GPU and the vllm package are there (``pip install 'polyrl[vllm]'``). Tokens/s = sampled completion tokens
(EOS included, padding after it not) / wall seconds, median over ``--rounds`` after one untimed warm-up call.
Each backend's per-token log-probs are compared with the trainer's teacher-forced recomputation
(``polyrl.model.completion_logprobs`` at the same temperature/top-p/top-k): ``|logp - trainer|`` is the mean
absolute difference over completion tokens (for `generate`, the log-softmax of its processed ``scores``).

Models: ``demo`` = the addition task's shipped warm start (a 4-layer Llama); ``tiny`` = a random Qwen2 from
``polyrl.tinyhf.build_tiny`` (2 layers, hidden 64); ``0.5b`` = a random Qwen2 shaped like Qwen2-0.5B (hidden 896,
24 layers, 14 heads, 2 KV heads, intermediate 4864, the local BPE tokenizer's vocabulary) -- for a GPU. The model
runs on the GPU when there is one. ``--train-steps N`` (GPU + vllm) then runs
``polyrl train --generator vllm --steps N`` on the same model and reports its generation tokens/s and the mean
``rollout/logp_mismatch``, with the same run on ``--generator hf`` for comparison (the issue's acceptance run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _runs import read_metrics, run_train, step_rows
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

HERE = Path(__file__).resolve().parent
SHAPES = {
    "tiny": {},
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, max_position_embeddings=4096),
}


def model_dir(shape: str, out: Path) -> Path:
    """The demo warm start, or a random Qwen2 of ``shape`` written under ``out``."""
    if shape == "demo":
        import polyrl

        return Path(polyrl.__file__).resolve().parent / "warmstarts" / "addition"
    from polyrl.tinyhf import build_tiny

    return build_tiny("qwen2", out / f"qwen2-{shape}", seed=0, **SHAPES[shape])


def recompute(model, samples, pad_id: int, params) -> float:
    """Mean |reported - teacher-forced| log-prob over the samples' completion tokens (the trainer's function)."""
    from polyrl.batch import TokenBatch
    from polyrl.model import completion_logprobs

    tb = TokenBatch.from_samples(samples, pad_id)
    device = next(model.parameters()).device
    greedy = params.temperature == 0
    with torch.no_grad():
        out = completion_logprobs(model, tb.input_ids.to(device), tb.attention_mask.to(device),
                                  tb.completion_mask.to(device), temperature=params.temperature or 1.0,
                                  top_k=None if greedy else params.top_k, top_p=None if greedy else params.top_p,
                                  with_entropy=False)
    mask = tb.completion_mask
    return float(((out.logp.cpu() - tb.rollout_logp).abs() * mask).sum() / mask.sum())


def hf_generate(model, tokenizer, prompt_ids: list[list[int]], params, eos_ids: list[int], pad_id: int):
    """transformers' ``generate`` on the left-padded rows (each prompt ``n`` times); Samples with the log-softmax of
    its processed scores at the sampled tokens."""
    from polyrl.rollout.generator import Sample

    rows = [(i, ids) for i, ids in enumerate(prompt_ids) for _ in range(params.n)]
    width = max(len(ids) for _, ids in rows)
    device = next(model.parameters()).device
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (_, ids) in enumerate(rows):
        input_ids[r, width - len(ids):] = torch.tensor(ids)
        attention[r, width - len(ids):] = 1
    greedy = params.temperature == 0
    sampling = {} if greedy else dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or 0)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                             do_sample=not greedy, max_new_tokens=params.max_new_tokens, eos_token_id=eos_ids,
                             pad_token_id=pad_id, output_scores=True, return_dict_in_generate=True, **sampling)
    new = out.sequences[:, width:].cpu()
    logps = torch.stack([s.float().log_softmax(-1) for s in out.scores], 1).cpu()  # [N, S, V]
    picked = logps[:, : new.shape[1]].gather(-1, new[..., None]).squeeze(-1)
    samples = []
    for r, (i, ids) in enumerate(rows):
        tokens = new[r].tolist()
        end = next((t + 1 for t, tok in enumerate(tokens) if tok in eos_ids), len(tokens))
        samples.append(Sample(prompt_index=i, prompt_token_ids=list(ids), completion_token_ids=tokens[:end],
                              logprobs=picked[r, :end].tolist(), finish_reason="stop" if end < len(tokens) or
                              (tokens and tokens[-1] in eos_ids) else "length", text=""))
    return samples


def timed(call, rounds: int) -> tuple[float, list]:
    """Median seconds of ``rounds`` calls after one warm-up, and the last call's samples."""
    call()
    seconds, samples = [], None
    for _ in range(rounds):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        samples = call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), samples


def train_runs(model: Path, steps: int, out: Path, args) -> dict[str, dict[str, float]]:
    """`polyrl train --steps N` with each generator on ``model``: generation tokens/s and the log-prob mismatch."""
    result = {}
    for generator in ("vllm", "hf"):
        run_dir = out / f"train-{generator}"
        flags = ["--model", str(model), "--generator", generator, "--steps", str(steps), "--prompts-per-step",
                 str(args.prompts), "--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens),
                 "--dtype", args.dtype, "--eval-every", "0", "--checkpoint-every", "0"]
        wall = run_train(run_dir, flags)
        rows = step_rows(read_metrics(run_dir), skip=1)
        result[generator] = {
            "gen_tokens_per_s": statistics.median(r["perf/gen_tokens_per_second"] for r in rows),
            "logp_mismatch": statistics.mean(r["rollout/logp_mismatch"] for r in rows),
            "step_s": statistics.median(r["perf/step_seconds"] for r in rows), "wall_s": wall, "steps": steps,
        }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["demo", "tiny", "0.5b"], default="demo")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = all cores)")
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--train-steps", type=int, default=0, help="also run polyrl train --generator vllm|hf this long")
    p.add_argument("--json", default=str(HERE / "results" / "generation.json"))
    args = p.parse_args()
    console = Console()

    from polyrl.model import load_policy
    from polyrl.rollout.generator import SamplingParams
    from polyrl.rollout.hf import HFGenerator
    from polyrl.tasks import get_task

    gpu = torch.cuda.is_available()
    has_vllm = gpu and importlib.util.find_spec("vllm") is not None
    if args.train_steps and not has_vllm:
        p.error("--train-steps compares --generator vllm with hf: it needs a CUDA GPU and the vllm package")
    work = Path(tempfile.mkdtemp(prefix="polyrl-generation-"))
    path = model_dir(args.shape, work)
    model, tokenizer = load_policy(path, dtype=args.dtype, threads=args.threads or None)
    model.to("cuda" if gpu else "cpu")
    prompts = [q.text for q in get_task("addition").prompts("train", args.prompts, seed=0)]
    prompt_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    params = SamplingParams(n=args.group_size, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k or None, seed=0)
    loop = HFGenerator(model, tokenizer)
    backends = {
        "polyrl HF loop": lambda: loop.generate_ids(prompt_ids, params),
        "transformers generate": lambda: hf_generate(model, tokenizer, prompt_ids, params, loop.eos_ids, loop.pad_id),
    }
    if has_vllm:
        from polyrl.rollout.vllm import VLLMGenerator

        engine = VLLMGenerator(str(path), tokenizer, dtype=args.dtype, seed=0,
                               gpu_memory_utilization=args.vllm_gpu_memory_utilization)
        backends["vLLM"] = lambda: engine.generate_ids(prompt_ids, params)
    results: dict[str, Any] = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("generating", total=len(backends))
        for name, call in backends.items():
            progress.update(task, description=name)
            seconds, samples = timed(call, args.rounds)
            tokens = sum(len(s.completion_token_ids) for s in samples)
            results[name] = {"tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
                             "mean_len": tokens / len(samples),
                             "logp_vs_trainer": recompute(model, samples, loop.pad_id, params)}
            progress.advance(task)
    if args.train_steps:
        del backends
        results["train"] = train_runs(path, args.train_steps, work, args)

    device = torch.cuda.get_device_name() if gpu else f"CPU ({torch.get_num_threads()} threads)"
    caption = (f"{args.shape} model, {args.dtype}, {device}; {args.prompts} prompts x {args.group_size}, "
               f"<= {args.max_new_tokens} new tokens, T={args.temperature} top-p={args.top_p} top-k={args.top_k}; "
               f"median of {args.rounds}")
    table = Table(title="Generation throughput", caption=caption)
    for column in ("backend", "tokens/s", "s / call", "mean length", "|logp - trainer|"):
        table.add_column(column, justify="left" if column == "backend" else "right")
    for name, r in results.items():
        if name != "train":
            table.add_row(name, f"{r['tokens_per_s']:.0f}", f"{r['seconds']:.3f}", f"{r['mean_len']:.1f}",
                          f"{r['logp_vs_trainer']:.2e}")
    console.print(table)
    for generator, r in results.get("train", {}).items():
        console.print(f"polyrl train --generator {generator} --steps {r['steps']}: {r['gen_tokens_per_s']:.0f} gen "
                      f"tokens/s, {r['step_s']:.2f} s/step, mean rollout/logp_mismatch {r['logp_mismatch']:.2e}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "device": device, "argv": sys.argv[1:], "results": results},
                              indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
