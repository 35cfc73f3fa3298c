#!/usr/bin/env bash
# Owns the interleaved comparison of engine/benches/attention.rs with its PyTorch peer:
# ROUNDS (default 3) rounds of Conveyor then PyTorch, one thread each, and per op the median over
# rounds of (PyTorch time / Conveyor time): above 1 means Conveyor is faster.
# Run from the repository root: engine/benches/attention_compare.sh
set -euo pipefail
rounds=${ROUNDS:-3}
cargo bench -p conveyor-engine --bench attention --no-run >/dev/null 2>&1
bench=$(cargo bench -p conveyor-engine --bench attention --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and "attention" in m["executable"]][0])')
dir=$(mktemp -d)
for round in $(seq "$rounds"); do
    "$bench" >"$dir/conveyor.$round"
    python3 engine/benches/attention_torch.py 2>/dev/null >"$dir/torch.$round"
done
python3 - "$dir" "$rounds" <<'PY'
import statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
read = lambda p: dict((l.split()[0], float(l.split()[1])) for l in open(p) if l.strip())
runs = [(read(f"{d}/conveyor.{r}"), read(f"{d}/torch.{r}")) for r in range(1, rounds + 1)]
print(f"{'op':<24}{'conveyor ns':>14}{'torch ns':>14}{'torch/conveyor':>16}")
for op in runs[0][0]:
    if op not in runs[0][1]:
        print(f"{op:<24}{statistics.median(c[op] for c, _ in runs):>14.0f}{'-':>14}{'-':>16}")
        continue
    ratios = [t[op] / c[op] for c, t in runs]
    print(f"{op:<24}{statistics.median(c[op] for c, _ in runs):>14.0f}{statistics.median(t[op] for _, t in runs):>14.0f}{statistics.median(ratios):>16.2f}")
PY
