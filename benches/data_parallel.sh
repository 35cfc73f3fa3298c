#!/usr/bin/env bash
# Data-parallel replicas (issue 19's benchmark): the 8 x 1024 MLP (8 x Linear(1024) + ReLU, then
# Linear(1024, 10)), batch 256, SGD, trained by `conveyor train` on one device and as 2 replicas on
# cpu:2 (one micro-batch each), and by PyTorch DistributedDataParallel with 2 processes (gloo, one
# thread each; benches/ddp_torch.py) when torch is installed. The replicas run twice: with the
# all-reduce in buckets during the backward pass and at the optimizer step (--bucket-size off). Rounds rotate which runs first; the
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
# Two replicas with the all-reduce in buckets (BUCKETS, default 4MiB: the model's 33 MB of
# gradients in 9 buckets) and the share of its time under compute (device 0, last steps), then
# with the all-reduce at the optimizer step.
BUCKETS=${BUCKETS:-4MiB}
two() {
    local out
    out=$("$BIN" train "${ARGS[@]}" --devices cpu:2 --data-parallel 2 --microbatches 1 --bucket-size "$BUCKETS" 2>/dev/null)
    echo "$(echo "$out" | rate) $(echo "$out" | grep -o '[0-9]*% of it under compute' | head -1 | cut -d'%' -f1)"
}
two_off() { "$BIN" train "${ARGS[@]}" --devices cpu:2 --data-parallel 2 --microbatches 1 --bucket-size off 2>/dev/null | rate; }
half() { "$BIN" train "${ARGS[@]/256/128}" --devices cpu:1 --microbatches 1 2>/dev/null | rate; }
torch_ddp() {
    if python3 -c 'import torch' 2>/dev/null; then python3 benches/ddp_torch.py 20 2>/dev/null | rate; else echo 0; fi
}
speedups=(); versus=(); ceilings=(); offs=(); hidden=()
printf '%-6s %11s %11s %11s %11s %11s %8s %8s %8s %8s %7s\n' round "1 device" "half batch" "2 replicas" "2, at step" \
    "torch DDP" speedup "at step" ceiling "vs DDP" hidden%
for round in $(seq 1 "$ROUNDS"); do
    case $((round % 3)) in
        1) a=$(one); h=$(half); read -r b p <<<"$(two)"; o=$(two_off); c=$(torch_ddp) ;;
        2) read -r b p <<<"$(two)"; c=$(torch_ddp); o=$(two_off); a=$(one); h=$(half) ;;
        0) c=$(torch_ddp); o=$(two_off); h=$(half); a=$(one); read -r b p <<<"$(two)" ;;
    esac
    s=$(python3 -c "print(f'{$b / $a:.3f}')")
    f=$(python3 -c "print(f'{$o / $a:.3f}')")
    e=$(python3 -c "print(f'{2 * $h / $a:.3f}')")
    v=$(python3 -c "print(f'{$b / $c:.3f}' if $c > 0 else 'n/a')")
    speedups+=("$s"); versus+=("$v"); ceilings+=("$e"); offs+=("$f"); hidden+=("${p:-0}")
    printf '%-6s %11s %11s %11s %11s %11s %8s %8s %8s %8s %7s\n' "$round" "$a" "$h" "$b" "$o" "$c" "$s" "$f" "$e" "$v" "${p:-0}"
done
python3 - "${speedups[@]}" -- "${versus[@]}" -- "${ceilings[@]}" -- "${offs[@]}" -- "${hidden[@]}" <<'PY'
import statistics, sys
groups, part = [], []
for a in sys.argv[1:] + ["--"]:
    if a == "--":
        groups.append(part)
        part = []
    else:
        part.append(a)
speedups, versus, ceilings, offs, hidden = ([float(a) for a in g if a != "n/a"] for g in groups)
print("median speedup of 2 replicas (buckets) over 1 device:", statistics.median(speedups))
print("median speedup of 2 replicas (all-reduce at the step) over 1 device:", statistics.median(offs))
print("median ceiling (2 x one device on half the batch):", statistics.median(ceilings))
print("median share of the all-reduce's time under compute (buckets, device 0):", statistics.median(hidden), "%")
if versus:
    print("median ratio of 2 replicas to torch DDP (2 processes, gloo):", statistics.median(versus))
PY
