"""What ``torch.compile`` would buy at the scaling curve's 32-token point on this CPU (not a test, not a feature).

polyrl does not compile; this measures the best case for it, with fixed shapes (one compile per shape, so no
recompilation costs), on the 1.1M tiny Llama of ``vs_trl.py scaling`` (hidden 128, 4 layers), one thread:

- the training forward+backward of 64 rows x 39 tokens (log-softmax, gather, mean; TRL's layout: no shared
  prompt), eager vs ``torch.compile(model, dynamic=False)``;
- a 64-row decode step: polyrl's sampler as it runs (``HFGenerator``: in-place KV cache, sampling; seconds per
  generated column of a 32-token call), and a bare greedy step on transformers' ``StaticCache`` (attends over all
  39 slots; the shape never changes, so it compiles once), eager vs compiled.

    .venv/bin/python benchmarks/compile_probe.py [--rounds 7]

Median over ``--rounds`` after warm-up calls; the compile time is the first call's. Compare figures of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROWS, PROMPT, NEW = 64, 7, 32


def median_ms(fn, rounds: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def first_call_s(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def train_step(model, ids):
    """Forward, per-token log-prob of the next token, mean, backward (gradients accumulate; nothing steps)."""
    logits = model(input_ids=ids).logits[:, :-1]
    logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).mean().backward()


def static_decode(model, ids) -> None:
    """Prefill ``ids`` into a ``StaticCache``, then NEW - 1 greedy one-token steps."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=PROMPT + NEW)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(PROMPT))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for step in range(NEW - 1):
            position = torch.tensor([PROMPT + step])
            out = model(input_ids=token, past_key_values=cache, use_cache=True, cache_position=position,
                        position_ids=position.expand(ids.shape[0], 1))
            token = out.logits[:, -1].argmax(-1, keepdim=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "compile_probe.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from vs_trl import scaling_model

    from polyrl.model import load_policy
    from polyrl.rollout.generator import SamplingParams
    from polyrl.rollout.hf import HFGenerator

    with tempfile.TemporaryDirectory() as tmp:
        path = scaling_model(Path(tmp) / "model", hidden=128, layers=4, fixed=True)  # every row runs to NEW
        model = AutoModelForCausalLM.from_pretrained(path)
        policy, tokenizer = load_policy(path, threads=1)
    ids = torch.randint(0, 80, (ROWS, PROMPT + NEW), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, dynamic=False)
    out: dict[str, float] = {}
    out["train_eager_ms"] = median_ms(lambda: train_step(model, ids), args.rounds)
    out["train_compile_s"] = first_call_s(lambda: train_step(compiled, ids))
    out["train_compiled_ms"] = median_ms(lambda: train_step(compiled, ids), args.rounds)

    sampler = HFGenerator(policy, tokenizer)
    prompts = [f"{i}+{i + 3}=" for i in range(ROWS // 8)]
    params = SamplingParams(n=8, max_new_tokens=NEW, temperature=1.0, seed=0)
    out["decode_polyrl_ms"] = median_ms(lambda: sampler.generate(prompts, params), args.rounds) / NEW
    prompt_ids = ids[:, :PROMPT]
    model.eval()
    out["decode_static_eager_ms"] = median_ms(lambda: static_decode(model, prompt_ids), args.rounds) / NEW
    compiled = torch.compile(model, dynamic=False, fullgraph=True)
    out["decode_compile_s"] = first_call_s(lambda: static_decode(compiled, prompt_ids))
    out["decode_static_compiled_ms"] = median_ms(lambda: static_decode(compiled, prompt_ids), args.rounds) / NEW

    print(f"training forward+backward, {ROWS} x {PROMPT + NEW} tokens: eager {out['train_eager_ms']:.1f} ms, "
          f"compiled {out['train_compiled_ms']:.1f} ms ({out['train_compiled_ms'] / out['train_eager_ms']:.2f}; "
          f"compile {out['train_compile_s']:.0f} s)")
    print(f"decode, ms per {ROWS}-row step: polyrl's sampler {out['decode_polyrl_ms']:.2f}, StaticCache eager "
          f"{out['decode_static_eager_ms']:.2f}, compiled {out['decode_static_compiled_ms']:.2f} "
          f"({out['decode_static_compiled_ms'] / out['decode_polyrl_ms']:.2f} of polyrl's; "
          f"compile {out['decode_compile_s']:.0f} s)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
