#! Owns PyTorch's side of engine/benches/attention.rs: the same ops and shapes, one thread.
"""Prints `op ns_per_call` lines like `cargo bench -p conveyor-engine --bench attention`:
F.scaled_dot_product_attention forward + backward on q, k, v [B, 4, T, head_dim] (B = 256, 32, 8
for T = 16, 128, 512; head_dim 8 and 64), and aten.max_pool2d_with_indices (2x2, stride 2) and
its backward on [256, 32, 8, 8] and [256, 8, 8, 8]; the median of 15 timed repetitions (5 for
calls over 50 ms), float32, torch.set_num_threads(1). The `attn_old_*` lines of the Rust bench
have no peer here."""
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)


def timed(f):
    start = time.perf_counter()
    f()
    once = max(time.perf_counter() - start, 1e-7)
    calls = min(max(int(0.02 / once), 1), 10_000)
    reps = 5 if once > 0.05 else 15
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            f()
        samples.append((time.perf_counter() - start) * 1e9 / calls)
    return sorted(samples)[len(samples) // 2]


def main():
    gen = torch.Generator().manual_seed(0)
    for tokens, batch in [(16, 256), (128, 32), (512, 8)]:
        for head_dim in [8, 64]:
            q, k, v = (torch.randn(batch, 4, tokens, head_dim, generator=gen).requires_grad_() for _ in range(3))
            dout = torch.randn(batch, 4, tokens, head_dim, generator=gen)

            def step():
                out = F.scaled_dot_product_attention(q, k, v)
                q.grad = k.grad = v.grad = None
                out.backward(dout)

            print(f"attn_t{tokens}_d{head_dim} {timed(step):.0f}")
    for name, channels in [("cnn", 32), ("resnet", 8)]:
        x = torch.randn(256, channels, 8, 8, generator=gen)
        dy = torch.randn(256, channels, 4, 4, generator=gen)
        fwd = timed(lambda: torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2]))
        _, idx = torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
        bwd = timed(lambda: torch.ops.aten.max_pool2d_with_indices_backward(dy, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx))
        print(f"maxpool_{name}_fwd {fwd:.0f}\nmaxpool_{name}_bwd {bwd:.0f}\nmaxpool_{name}_fwd_bwd {fwd + bwd:.0f}")


if __name__ == "__main__":
    main()
