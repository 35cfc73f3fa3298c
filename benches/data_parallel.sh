#!/usr/bin/env bash
# Data-parallel replicas (issue 19's benchmark): the 8 x 1024 MLP (8 x Linear(1024) + ReLU, then
# Linear(1024, 10)), batch 256, SGD, trained by `conveyor train` on one device and as 2 replicas on
# cpu:2 (one micro-batch each), and by PyTorch DistributedDataParallel with 2 processes (gloo, one
# thread each; benches/ddp_torch.py) when torch is installed. Rounds rotate which runs first; the
# figures are the medians of the per-round ratios of the samples/s each run reports. The column
# "ceiling" is twice one device's rate on half the batch over its rate on the whole batch: what 2
# replicas would reach if each had a core to itself and the all-reduce were free (a replica's
# GEMMs have half the rows, which run fewer GFLOP/s, and each replica still takes the whole
# optimizer step). Run on a quiet machine:
#   cargo build --release && bash benches/data_parallel.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
BIN=target/release/conveyor
MODEL=mlp:1024,1024,1024,1024,1024,1024,1024,1024,1024,10
ARGS=(--model "$MODEL" --data synthetic:4096,1024,10 --batch 256 --optimizer sgd --steps 30 --log-every 0)
rate() { grep -o '[0-9.]* samples/s' | tail -1 | cut -d' ' -f1; }
one() { "$BIN" train "${ARGS[@]}" --devices cpu:1 --microbatches 1 2>/dev/null | rate; }
two() { "$BIN" train "${ARGS[@]}" --devices cpu:2 --data-parallel 2 --microbatches 1 2>/dev/null | rate; }
half() { "$BIN" train "${ARGS[@]/256/128}" --devices cpu:1 --microbatches 1 2>/dev/null | rate; }
torch_ddp() {
    if python3 -c 'import torch' 2>/dev/null; then python3 benches/ddp_torch.py 20 2>/dev/null | rate; else echo 0; fi
}
speedups=(); versus=(); ceilings=()
printf '%-6s %12s %12s %12s %12s %9s %9s %9s\n' round "1 device" "half batch" "2 replicas" "torch DDP" speedup ceiling "vs DDP"
for round in $(seq 1 "$ROUNDS"); do
    case $((round % 3)) in
        1) a=$(one); h=$(half); b=$(two); c=$(torch_ddp) ;;
        2) b=$(two); c=$(torch_ddp); a=$(one); h=$(half) ;;
        0) c=$(torch_ddp); h=$(half); a=$(one); b=$(two) ;;
    esac
    s=$(python3 -c "print(f'{$b / $a:.3f}')")
    e=$(python3 -c "print(f'{2 * $h / $a:.3f}')")
    v=$(python3 -c "print(f'{$b / $c:.3f}' if $c > 0 else 'n/a')")
    speedups+=("$s"); versus+=("$v"); ceilings+=("$e")
    printf '%-6s %12s %12s %12s %12s %9s %9s %9s\n' "$round" "$a" "$h" "$b" "$c" "$s" "$e" "$v"
done
python3 - "${speedups[@]}" -- "${versus[@]}" -- "${ceilings[@]}" <<'PY'
import statistics, sys
args = sys.argv[1:]
cut = args.index("--")
speedups = [float(a) for a in args[:cut]]
rest = args[cut + 1:]
cut = rest.index("--")
versus = [float(a) for a in rest[:cut] if a != "n/a"]
ceilings = [float(a) for a in rest[cut + 1:]]
print("median speedup of 2 replicas over 1 device:", statistics.median(speedups))
print("median ceiling (2 x one device on half the batch):", statistics.median(ceilings))
if versus:
    print("median ratio of 2 replicas to torch DDP (2 processes, gloo):", statistics.median(versus))
PY
