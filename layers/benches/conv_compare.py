"""Interleaved rounds of the Conveyor convolution bench and its PyTorch peer; prints per case the
median over rounds of the per-round speed ratio Conveyor / PyTorch (= PyTorch time / Conveyor time,
above 1 means Conveyor is faster), and the median times.

Run: `python3 layers/benches/conv_compare.py --rounds 7 LABEL=PATH_TO_CONV_BENCH [LABEL=PATH ...]`
(build the bench with `cargo bench -p conveyor-layers --bench conv --no-run`; several labels
compare builds, e.g. before=... after=...). Each round runs every binary once, then PyTorch once.
"""
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def parse(text):
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and "@" in parts[0]:
            out[(parts[0], parts[1])] = float(parts[2])
    return out


def main():
    args = sys.argv[1:]
    rounds, reps = 7, 5
    if "--rounds" in args:
        i = args.index("--rounds")
        rounds = int(args[i + 1])
        del args[i : i + 2]
    if "--reps" in args:
        i = args.index("--reps")
        reps = int(args[i + 1])
        del args[i : i + 2]
    binaries = [a.split("=", 1) for a in args]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    times = {label: [] for label, _ in binaries}
    times["torch"] = []
    for _ in range(rounds):
        for label, path in binaries:
            times[label].append(parse(subprocess.run([path, "--reps", str(reps)], capture_output=True, text=True, check=True).stdout))
        torch_run = subprocess.run(
            [sys.executable, os.path.join(HERE, "conv_torch.py"), "--reps", str(reps)],
            capture_output=True, text=True, check=True, env=env,
        )
        times["torch"].append(parse(torch_run.stdout))
    keys = list(times["torch"][0].keys())
    header = f"{'case':<14} {'op':<12} {'torch_us':>9}"
    for label, _ in binaries:
        header += f" {label + '_us':>11} {label + '_ratio':>12}"
    print(header)
    for key in keys:
        row = f"{key[0]:<14} {key[1]:<12} {statistics.median(r[key] for r in times['torch']):>9.1f}"
        for label, _ in binaries:
            ratios = [t[key] / c[key] for t, c in zip(times["torch"], times[label])]
            row += f" {statistics.median(c[key] for c in times[label]):>11.1f} {statistics.median(ratios):>12.2f}"
        print(row)


if __name__ == "__main__":
    main()
