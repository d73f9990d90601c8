"""How close the scaling curve's 32-token step runs its matmuls to this CPU's peak (not a test).

The 1.1M scaling model (hidden 128, MLP 512) trains on 64 rows x about 33 tokens: its forward and backward are
products of [2104, 128] by [128, 512] and the like. Each shape's float32 GFLOP/s on one thread, next to a 2048^3
product (the core's practical peak): when they are alike, the step's ``aten::mm`` time is set by its FLOPs, which
polyrl and TRL share per completion token.

    .venv/bin/python benchmarks/matmul_peak.py [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = [(2104, 128, 512), (2104, 512, 128), (2104, 128, 128), (512, 2104, 128), (64, 128, 512), (2048, 2048, 2048)]


def gflops(m: int, k: int, n: int, reps: int) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for m, k, n in SHAPES:
        reps = args.reps if m * k * n < 2**30 else max(3, args.reps // 10)
        print(f"[{m}, {k}] x [{k}, {n}]: {gflops(m, k, n, reps):.0f} GFLOP/s (1 thread, float32)")


if __name__ == "__main__":
    main()
