#! Owns the PyTorch peer of benches/zoo_vs_torch.sh: the zoo models (src/zoo.rs) in torch, timed per training step.
"""PyTorch twins of Conveyor's zoo models (src/zoo.rs), and the time of one SGD training step.

    python3 benches/zoo_torch.py --model cnn --batch 256 --threads 1 --steps 48 --warmup 5
    python3 benches/zoo_torch.py --params          # parameter counts, to compare with `conveyor train`

prints `samples_per_s <batch / median step time>` for the steps after the warm-up. A step is what
Conveyor's trainer times as one step: zero_grad, forward, CrossEntropyLoss (mean), backward and
SGD(lr=0.05).step(), on a batch gathered from a shuffled in-memory data set of the model's input
shape (1x8x8 images in [0, 1) or 16 token ids in 0..32, 10 classes), in float32 on the CPU.

The modules follow src/zoo.rs layer by layer, with the same state-dict names, so the parameter
counts are those `conveyor train` prints: cnn 38,282, resnet 3,706, transformer 27,338.
"""
import argparse
import statistics
import time

import torch
from torch import nn

CLASSES = 10


class Cnn(nn.Module):
    """zoo::cnn: conv(1→16) relu → conv(16→32) relu pool → flatten → fc(512→64) relu dropout(0.3) → fc(64→10)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.dropout = nn.Dropout(0.3)
        self.fc2 = nn.Linear(64, CLASSES)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(self.dropout(x))


class ResBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        a = self.conv2(torch.relu(self.conv1(x)))
        return torch.relu(a + x)


class Resnet(nn.Module):
    """zoo::resnet: stem conv(1→8) relu, two residual blocks of conv(8→8) relu conv(8→8) + skip, relu, pool, fc(128→10)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.block1 = ResBlock(8)
        self.block2 = ResBlock(8)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc = nn.Linear(8 * 4 * 4, CLASSES)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = self.block2(self.block1(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class Block(nn.Module):
    """One pre-norm block of zoo::transformer: x + attn(ln1(x)), then + fc2(gelu(fc1(ln2(·))))."""

    def __init__(self, dim, n_heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, n_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    """zoo::transformer with the default `transformer:32,16,32,4,2,10`: embedding, learned positions, L blocks, ln_f, mean over tokens, head."""

    def __init__(self, vocab=32, tokens=16, dim=32, n_heads=4, n_layers=2, classes=CLASSES):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(tokens, dim)  # `pos.weight` [T, D], added to every sample
        self.blocks = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids):
        x = self.embed(ids) + self.pos.weight
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x).mean(dim=1))


class Mlp(nn.Sequential):
    """zoo::mlp:1024,...,1024,10 (issue 25's model): eight Linear(1024, 1024) + ReLU, then Linear(1024, 10)."""

    def __init__(self):
        layers = []
        for _ in range(8):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        super().__init__(*layers, nn.Linear(1024, CLASSES))


MODELS = {"cnn": Cnn, "resnet": Resnet, "transformer": Transformer, "mlp": Mlp}


def data(model, rows):
    """A data set of the model's input shape: what `conveyor train` gets from digits or `tokens:N,16,32,10`."""
    if model == "transformer":
        inputs = torch.randint(0, 32, (rows, 16), dtype=torch.int64)
    elif model == "mlp":
        inputs = torch.rand(rows, 1024) * 2 - 1
    else:
        inputs = torch.rand(rows, 1, 8, 8)
    return inputs, torch.randint(0, CLASSES, (rows,), dtype=torch.int64)


def step_times(model_name, batch, steps, warmup, seed=0):
    torch.manual_seed(seed)
    model = MODELS[model_name]().train()
    inputs, labels = data(model_name, max(4096, batch))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    order, at = torch.randperm(len(labels)), 0
    times = []
    for _ in range(warmup + steps):
        if at + batch > len(order):
            order, at = torch.randperm(len(labels)), 0
        rows = order[at : at + batch]
        at += batch
        started = time.perf_counter()
        x, y = inputs[rows], labels[rows]
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return times[warmup:]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--params", action="store_true", help="print each model's parameter count and exit")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.params:
        for name, make in MODELS.items():
            print(name, sum(p.numel() for p in make().parameters()))
        return
    if args.model is None:
        parser.error("--model is required (or --params)")
    times = step_times(args.model, args.batch, args.steps, args.warmup)
    print(f"samples_per_s {args.batch / statistics.median(times):.1f}")


if __name__ == "__main__":
    main()
