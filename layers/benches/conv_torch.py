"""PyTorch peer of `layers/benches/conv.rs`: F.conv2d and aten.convolution_backward (input gradient,
weight+bias gradient separately) on the same shapes, batch 256, one thread.

Run: `python3 layers/benches/conv_torch.py [--reps N]`; prints `in->out@HxW op median_us` lines.
"""
import sys
import time

import torch
import torch.nn.functional as F

BATCH = 256
CASES = [(1, 8, 8), (8, 8, 8), (1, 16, 8), (16, 32, 8), (1, 8, 32), (8, 8, 32), (1, 16, 32), (16, 32, 32)]


def report(name, op, reps, f):
    f()
    times = []
    for _ in range(max(reps, 1)):
        start = time.perf_counter()
        f()
        times.append((time.perf_counter() - start) * 1e6)
    times.sort()
    print(f"{name} {op} {times[len(times) // 2]:.1f}", flush=True)


def main():
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 7
    torch.set_num_threads(1)
    torch.manual_seed(1)
    with torch.no_grad():
        for cin, cout, side in CASES:
            x = torch.rand(BATCH, cin, side, side) * 2 - 1
            w = (torch.rand(cout, cin, 3, 3) * 2 - 1) / (cin * 9) ** 0.5
            b = torch.rand(cout) * 0.1
            y = F.conv2d(x, w, b, padding=1)
            dy = torch.rand_like(y) * 2 - 1
            name = f"{cin}->{cout}@{side}x{side}"

            def backward(mask):
                return torch.ops.aten.convolution_backward(
                    dy, x, w, [cout], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, mask
                )

            report(name, "forward", reps, lambda: F.conv2d(x, w, b, padding=1))
            report(name, "input_grad", reps, lambda: backward([True, False, False]))
            report(name, "weight_grad", reps, lambda: backward([False, True, True]))


if __name__ == "__main__":
    main()
