#! Owns PyTorch's side of engine/benches/gemm.rs: the same products and shapes, one thread.
"""Prints `op ns_per_call` lines like `cargo bench -p conveyor-engine --bench gemm`: for R in
16, 32, 64, 128, 256 rows and a 1024x1024 weight W [out, in], `x_wt_R` (x @ W.T, Linear's
forward), `x_w_R` (dy @ W, its input gradient) and `dyt_x_R` (dW.addmm_(dy.T, x), its weight
gradient, accumulated), float32, torch.set_num_threads(1), the median of 15 timed repetitions
(`BENCH_ONLY=<prefix>` runs the ops whose name starts so).
The packed ops of the Rust bench compare against the same lines."""
import os
import time

import torch

torch.set_num_threads(1)
ROWS = [16, 32, 64, 128, 256]
IN = OUT = 1024


def timed(f):
    start = time.perf_counter()
    f()
    once = max(time.perf_counter() - start, 1e-7)
    calls = min(max(int(0.02 / once), 1), 10_000)
    samples = []
    for _ in range(15):
        start = time.perf_counter()
        for _ in range(calls):
            f()
        samples.append((time.perf_counter() - start) * 1e9 / calls)
    return sorted(samples)[len(samples) // 2]


def report(op, f):
    if op.startswith(os.environ.get("BENCH_ONLY", "")):
        print(f"{op} {timed(f):.0f}", flush=True)


def main():
    gen = torch.Generator().manual_seed(0)
    w = 0.03 * torch.randn(OUT, IN, generator=gen)
    for rows in ROWS:
        x = torch.randn(rows, IN, generator=gen)
        dy = 0.1 * torch.randn(rows, OUT, generator=gen)
        y = torch.empty(rows, OUT)
        dx = torch.empty(rows, IN)
        dw = torch.zeros(OUT, IN)
        report(f"x_wt_{rows}", lambda: torch.matmul(x, w.T, out=y))
        report(f"x_w_{rows}", lambda: torch.matmul(dy, w, out=dx))
        report(f"dyt_x_{rows}", lambda: dw.addmm_(dy.T, x))


if __name__ == "__main__":
    main()
