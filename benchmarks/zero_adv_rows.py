"""Update time with and without forward-only zero-advantage rows (``--skip-zero-adv``), side by side (not a test).

A GRPO group whose completions all score alike has advantage 0 on every row; with a method whose trust region is
tagged ``zero_adv_inert`` those rows get no gradient, so ``update_policy`` can run them forward only (pi_old and the
metrics) once they fill a micro-batch. This times ``update_policy`` alone on a synthetic batch of a random-init tiny
Llama: G groups of 8 rows sharing a prompt, completion lengths drawn up to ``--length``, a share ``--zero`` of the
groups at A = 0, the DAPO objective without its filter (clip, token-mean, no KL), pi_old from the update's own
forward. Each round runs ``--skip-zero-adv no`` and ``--skip`` (auto or yes; alternating which goes first) from the
same weights; printed: the share of rows that ran forward only, the median update seconds of each and the median
per-round ratio.

    .venv/bin/python benchmarks/zero_adv_rows.py                          # 1.1M model, 64 rows x 128 tokens
    .venv/bin/python benchmarks/zero_adv_rows.py --hidden 320 --layers 8 --length 32
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from types import SimpleNamespace


def scored_batch(groups: int, prompt: int, length: int, zero: float, seed: int = 0):
    import torch

    from polyrl.batch import TokenBatch
    from polyrl.update import Scored

    g = torch.Generator().manual_seed(seed)
    rows = groups * 8
    prompts = torch.randint(4, 80, (groups, prompt), generator=g).repeat_interleave(8, 0)
    lengths = torch.randint(length // 4, length + 1, (rows,), generator=g)
    comp = (torch.arange(length)[None] < lengths[:, None]).float()
    ids = torch.cat([prompts, torch.randint(4, 80, (rows, length), generator=g)], 1)
    tb = TokenBatch(ids, torch.cat([torch.ones(rows, prompt).long(), comp.long()], 1), comp,
                    -torch.rand(rows, length, generator=g) * comp, comp.clone(),
                    torch.zeros(rows, length, dtype=torch.long))
    adv = torch.randn(rows, generator=g)
    adv[: round(zero * groups) * 8] = 0.0  # whole groups: all their completions scored alike
    return Scored(tb=tb, mask=tb.loss_mask, adv=adv[:, None].expand(rows, length).clone(),
                  group_ids=torch.arange(rows) // 8, segment_ids=torch.zeros(rows, length, dtype=torch.long),
                  old_logp=torch.zeros(rows, length), old_topk=None, ref_logp=None)


def timed_update(model, scored, skip: str, micro_batch_tokens: int) -> tuple[float, float]:
    from polyrl.learner.local import LocalLearner
    from polyrl.methods import get_method
    from polyrl.update import update_policy

    learner = LocalLearner(model, lr=1e-5, weight_decay=0.0, warmup_steps=0, max_grad_norm=1.0, temperature=1.0,
                           top_p=1.0, top_k=0, fp32_head=False, micro_batch_size=64, share_prompts=True,
                           fused_adam=True)
    start = time.perf_counter()
    metrics = update_policy(learner, get_method("dapo", filters=[]), scored,
                            SimpleNamespace(bad_steps=0, skipped_total=0), epochs=1, minibatches=1,
                            micro_batch_size=64, horizon=scored.mask.shape[1], topk=0, reuse_old=True, seed=0,
                            max_bad_steps=3, micro_batch_tokens=micro_batch_tokens, skip_zero_adv=skip)
    return time.perf_counter() - start, metrics.get("perf/forward_only_frac", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--zero", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.25, 0.5])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--skip", choices=("auto", "yes"), default="auto", help="the setting compared with 'no'")
    args = ap.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoModelForCausalLM

    from polyrl.tinylm import build_tiny_llama

    torch.set_num_threads(1)
    path = build_tiny_llama(tempfile.mkdtemp(), hidden=args.hidden, layers=args.layers,
                            heads=max(1, args.hidden // 64), max_positions=args.prompt + args.length + 8)
    start = AutoModelForCausalLM.from_pretrained(path)
    table = Table(title=f"update_policy, {sum(p.numel() for p in start.parameters()) / 1e6:.1f}M params, "
                        f"{args.groups * 8} rows x {args.length} tokens (1 thread)")
    for col in ("zero-advantage groups", "forward-only rows", "no s", f"{args.skip} s", f"{args.skip} / no [min, max]"):
        table.add_column(col)
    for zero in args.zero:
        scored = scored_batch(args.groups, args.prompt, args.length, zero)
        plain, skip, ratios, frac = [], [], [], 0.0
        for r in range(args.rounds + 1):  # round 0 warms up
            got = {}
            for flag in ((False, True) if r % 2 else (True, False)):
                got[flag], f = timed_update(copy.deepcopy(start), copy.deepcopy(scored), args.skip if flag else "no",
                                            args.micro_batch_tokens)
                frac = f if flag else frac
            if r:
                plain.append(got[False])
                skip.append(got[True])
                ratios.append(got[True] / got[False])
        table.add_row(f"{zero:.0%}", f"{frac:.0%}", f"{statistics.median(plain):.3f}",
                      f"{statistics.median(skip):.3f}",
                      f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")
    Console().print(table)


if __name__ == "__main__":
    main()
