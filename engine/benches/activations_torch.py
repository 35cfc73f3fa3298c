#! Owns PyTorch's side of engine/benches/activations.rs: the same ops and shapes, one thread.
"""Prints `op ns_per_call` lines like `cargo bench -p conveyor-engine --bench activations`:
F.gelu forward and aten.gelu_backward on [4096, 128] (exact and approximate='tanh'), and
torch.softmax over rows of 16, 64 and 512 (256 Ki elements each), the median of 15 timed
repetitions, float32, torch.set_num_threads(1)."""
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)


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


def main():
    gen = torch.Generator().manual_seed(0)
    n = 4096 * 128
    x = torch.randn(4096, 128, generator=gen)
    dy = torch.randn(4096, 128, generator=gen)
    fwd = timed(lambda: F.gelu(x))
    bwd = timed(lambda: torch.ops.aten.gelu_backward(dy, x))
    print(f"gelu_fwd {fwd:.0f}\ngelu_bwd {bwd:.0f}\ngelu_fwd_bwd {fwd + bwd:.0f}")
    fwd = timed(lambda: F.gelu(x, approximate="tanh"))
    bwd = timed(lambda: torch.ops.aten.gelu_backward(dy, x, approximate="tanh"))
    print(f"gelu_tanh_fwd_bwd {fwd + bwd:.0f}")
    for width in [16, 64, 512]:
        logits = 3 * torch.randn(n // 2 // width, width, generator=gen)
        print(f"softmax{width} {timed(lambda: torch.softmax(logits, -1)):.0f}")


if __name__ == "__main__":
    main()
