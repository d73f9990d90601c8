"""TRL GRPOTrainer throughput at the demo settings, for a side-by-side comparison with polyrl.

Run it with a Python that has TRL installed (a separate environment; polyrl does not depend on TRL):

    python benchmarks/trl_grpo_throughput.py --model MODEL_DIR --steps 20 --json out.json

Settings mirror benchmarks/step_throughput.py: 8 prompts x 8 generations, 8 new tokens, one optimizer
step per batch, CPU, float32. The reward is the same exact-match 2-digit addition check.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(4096)]
    data = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs])

    def exact(completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    cfg = GRPOConfig(
        output_dir="/tmp/trl_bench_out", per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, max_completion_length=args.new_tokens, max_steps=args.warmup + args.steps,
        learning_rate=1e-4, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
        temperature=1.0, beta=args.beta, gradient_accumulation_steps=1, dataloader_num_workers=0, seed=0,
    )

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    trainer = GRPOTrainer(model=model, reward_funcs=exact, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    timed = stamps[args.warmup:]
    sec_per_step = (timed[-1] - timed[0]) / max(1, len(timed) - 1)
    rollouts = args.prompts * args.group
    out = {"framework": "trl", "trl_seconds_per_step": sec_per_step, "trl_rollouts_per_second": rollouts / sec_per_step,
           "steps_timed": len(timed) - 1}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
