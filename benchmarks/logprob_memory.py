"""Peak memory of chunked completion log-probs versus a full-logits computation (not a test).

Each measurement runs in a fresh subprocess: build a Llama with the given vocabulary and
``--layers`` decoder layers (default 0: embedding, final norm and LM head only, which isolates the
log-prob path from the activations of the transformer layers, identical in both paths), then do one
forward + backward of ``sum(logp * adv) + 0.01 * sum(entropy)`` over the completion
tokens, either with ``polyrl.model.completion_logprobs`` (chunked, checkpointed LM head) or with
the straightforward path (full [B, T, V] float32 logits -> log_softmax -> gather, entropy from the
full distribution). Reported: the growth of peak RSS during that pass (ru_maxrss after the pass
minus RSS before it), in MiB, and the wall time. Linux only (reads /proc/self/status). The workers
run with MALLOC_MMAP_THRESHOLD_=131072 so that glibc returns freed large blocks to the system at
once; with its default dynamic threshold, freed chunk buffers stay in the heap and peak RSS measures
allocator retention rather than live tensors (the chunked path then shows about 3x its real peak).

    .venv/bin/python benchmarks/logprob_memory.py                       # vocab 152064 and 4096
    .venv/bin/python benchmarks/logprob_memory.py --batch 4 --completion 512 --vocab 152064
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def worker(path: str, vocab: int, batch: int, prompt: int, completion: int, hidden: int, layers: int,
           threads: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from polyrl.model import completion_logprobs

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=prompt + completion)
    model = LlamaForCausalLM(config)

    def step(rows: int, width: int) -> float:
        ids = torch.randint(0, vocab, (rows, prompt + width))
        attention = torch.ones_like(ids)
        mask = torch.ones(rows, width)
        adv = torch.randn(rows, width)
        if path == "chunked":
            out = completion_logprobs(model, ids, attention, mask)
            logp, entropy = out.logp, out.entropy
        else:
            hidden_states = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
            logits = model.lm_head(hidden_states[:, -width - 1 : -1]).float()  # [B, T, V]
            logprobs = logits.log_softmax(-1)
            logp = logprobs.gather(-1, ids[:, -width:, None]).squeeze(-1)
            entropy = -(logprobs.exp() * logprobs).sum(-1)
        loss = (logp * adv * mask).sum() + 0.01 * (entropy * mask).sum()
        loss.backward()
        return float(loss)

    step(1, 4)  # warm-up: first-call costs (kernel code pages, thread pools, grad buffers) stay out
    before = _rss_mib()
    started = time.perf_counter()
    loss = step(batch, completion)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return dict(path=path, vocab=vocab, peak_growth_mib=peak - before, seconds=seconds, loss=loss)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[152064, 4096])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads in the workers (0: torch's default)")
    parser.add_argument("--worker", choices=["chunked", "full"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = dict(batch=args.batch, prompt=args.prompt, completion=args.completion, hidden=args.hidden,
                 layers=args.layers, threads=args.threads)
    if args.worker:
        print(json.dumps(worker(args.worker, args.vocab[0], **sizes)))
        return 0
    print(f"B={args.batch} prompt={args.prompt} T={args.completion} hidden={args.hidden} layers={args.layers} "
          f"threads={args.threads or 'default'} "
          f"(N={args.batch * args.completion} scored tokens); peak RSS growth of forward + backward")
    print(f"{'vocab':>8} {'full MiB':>10} {'chunked MiB':>12} {'ratio':>7} {'full s':>8} {'chunked s':>10}")
    for vocab in args.vocab:
        rows = {}
        for path in ("full", "chunked"):
            command = [sys.executable, __file__, "--worker", path, "--vocab", str(vocab)]
            command += [f"--{k}={v}" for k, v in sizes.items()]
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
            result = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
            rows[path] = json.loads(result.stdout.strip().splitlines()[-1])
        full, chunked = rows["full"], rows["chunked"]
        ratio = chunked["peak_growth_mib"] / full["peak_growth_mib"]
        print(f"{vocab:>8} {full['peak_growth_mib']:>10.1f} {chunked['peak_growth_mib']:>12.1f} {ratio:>7.3f} "
              f"{full['seconds']:>8.2f} {chunked['seconds']:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
