#!/usr/bin/env bash
# Owns the interleaved comparison of engine/benches/gemm.rs with its PyTorch peer:
# ROUNDS (default 5) rounds of Conveyor then PyTorch, one thread each, and per op the median over
# rounds of (Conveyor GFLOP/s / PyTorch GFLOP/s) = (PyTorch time / Conveyor time): above 1 means
# Conveyor is faster. A packed op (`x_wt_packed_R`) is compared with PyTorch's unpacked one.
# Run from the repository root: engine/benches/gemm_compare.sh, which builds and runs this
# checkout's bench; or engine/benches/gemm_compare.sh before=<bench binary> after=<bench binary>
# (each built by `cargo bench -p conveyor-engine --bench gemm --no-run` at some commit), which
# runs every binary in each round and prints a column pair per binary. BENCH_ONLY=<prefix> limits
# both sides to the ops so named.
set -euo pipefail
rounds=${ROUNDS:-5}
if [ $# -eq 0 ]; then
    cargo bench -p conveyor-engine --bench gemm --no-run >/dev/null 2>&1
    bench=$(cargo bench -p conveyor-engine --bench gemm --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and "gemm" in m["executable"]][0])')
    set -- "conveyor=$bench"
fi
dir=$(mktemp -d)
for round in $(seq "$rounds"); do
    for named in "$@"; do
        "${named#*=}" >"$dir/${named%%=*}.$round"
    done
    python3 engine/benches/gemm_torch.py 2>/dev/null >"$dir/torch.$round"
done
python3 - "$dir" "$rounds" "${@%%=*}" <<'PY'
import statistics, sys
d, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
read = lambda p: dict((l.split()[0], float(l.split()[1])) for l in open(p) if l.strip())
runs = {name: [read(f"{d}/{name}.{r}") for r in range(1, rounds + 1)] for name in names}
torch = [read(f"{d}/torch.{r}") for r in range(1, rounds + 1)]
gflops = lambda op, ns: 2 * int(op.rsplit("_", 1)[1]) * 1024 * 1024 / ns
print(f"{'op':<24}{'torch GFLOP/s':>14}" + "".join(f"{name + ' GFLOP/s':>22}{'ratio':>8}" for name in names))
for op in runs[names[0]][0]:
    peer = op.replace("_packed", "")
    if peer not in torch[0]:
        print(f"{op:<24}{'-':>14}" + "".join(f"{statistics.median(r[op] for r in runs[n]):>19.0f} ns{'-':>8}" for n in names))
        continue
    line = f"{op:<24}{statistics.median(gflops(peer, t[peer]) for t in torch):>14.1f}"
    for name in names:
        rate = statistics.median(gflops(op, r[op]) for r in runs[name])
        ratio = statistics.median(t[peer] / r[op] for r, t in zip(runs[name], torch))
        line += f"{rate:>22.1f}{ratio:>8.2f}"
    print(line)
PY
