#! Owns PyTorch's column of scripts/gpu-check: the step time of each zoo model on the CPU and the GPU.
"""PyTorch's step time for the models `examples/gpu_check.rs` trains, on the same batch size and
optimizer (SGD, lr 0.05, momentum 0.9), one CPU thread and every GPU PyTorch sees:

    python3 scripts/gpu_check_torch.py --batch 64 --steps 10 mlp:64,128,128,10 cnn resnet transformer

prints lines `MODEL DEVICE MS` (`DEVICE` is `cpu` or `cuda`; `MS` the median step time after one
warm-up step; a GPU step ends with `torch.cuda.synchronize()`). The cnn, resnet and transformer
are the twins in benches/zoo_torch.py; `mlp:A,B,...` is Linear/ReLU with those widths.
"""
import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches"))
import zoo_torch  # noqa: E402


def build(spec):
    if spec.startswith("mlp:"):
        dims = [int(d) for d in spec[4:].split(",")]
        layers = []
        for i, (a, b) in enumerate(zip(dims, dims[1:])):
            layers.append(nn.Linear(a, b))
            if i + 2 < len(dims):
                layers.append(nn.ReLU())
        return nn.Sequential(*layers), [dims[0]], dims[-1]
    model = zoo_torch.MODELS[spec]()
    shape = [16] if spec == "transformer" else [1, 8, 8]
    return model, shape, zoo_torch.CLASSES


def step_ms(spec, device, batch, steps):
    torch.manual_seed(0)
    model, shape, classes = build(spec)
    model = model.to(device).train()
    if spec == "transformer":
        x = torch.randint(0, 32, [batch, *shape], device=device)
    else:
        x = torch.rand([batch, *shape], device=device) * 2 - 1
    y = torch.randint(0, classes, (batch,), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times[1:] if len(times) > 1 else times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for spec in args.models:
        for device in devices:
            print(f"{spec} {device} {step_ms(spec, device, args.batch, args.steps):.3f}", flush=True)


if __name__ == "__main__":
    main()
