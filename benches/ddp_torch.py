"""PyTorch's peer for benches/data_parallel.sh: DistributedDataParallel with 2 processes (gloo, one
thread each) on the 8 x 1024 MLP (8 x Linear(1024) + ReLU, then Linear(1024, 10)), a global batch
of 256 (128 rows per process), SGD, cross-entropy. Prints `N samples/s` (global samples)."""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def model():
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(1024, 10))
    return torch.nn.Sequential(*layers)


def run(rank, world, steps, queue):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    rows = 256 // world
    x = torch.randn(rows, 1024)
    y = torch.randint(0, 10, (rows,))

    def step():
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    elapsed = time.perf_counter() - started
    if rank == 0:
        queue.put(256 * steps / elapsed)
    dist.destroy_process_group()


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(run, args=(2, steps, queue), nprocs=2, join=True)
    print(f"{queue.get():.0f} samples/s")
