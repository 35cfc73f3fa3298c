#!/usr/bin/env bash
#! Owns the per-model benchmark against PyTorch (issue 26): zoo models trained by `conveyor train` vs benches/zoo_torch.py.
#
# Samples/s of one SGD training step (forward, backward, optimizer step) for the zoo models cnn,
# resnet and transformer at batch 32 and 256:
#   - Conveyor on 1 device (`--devices cpu:1 --microbatches 1`) vs PyTorch with 1 thread;
#   - Conveyor's best 2-device pipeline on `--devices cpu:2` vs PyTorch with 2 threads.
#
# Run from the repository root (needs python3 with torch):
#   cargo build --release --bin conveyor
#   ROUNDS=3 benches/zoo_vs_torch.sh
# Environment:
#   ROUNDS=5              interleaved measurement rounds
#   MODELS="cnn resnet transformer"   BATCHES="32 256"
#   CONVEYOR=...          the binary (default: $CARGO_TARGET_DIR or target, release/conveyor)
#   STEP_ROWS=12288       steps per run = STEP_ROWS / batch (384 at 32, 48 at 256), plus WARMUP=5
#   SCHEDULES="1f1b zb-h2"  MICROBATCHES="2 4 8"  PLACEMENTS="auto time"   the 2-device search space
#   TWO_DEVICE="1f1b,4,time"  skip the search: use this schedule,micro-batches,placement everywhere
#   OVERLAP=on            Conveyor's runs with --overlap-steps on (default off)
#   MODELS="mlp"          also issue 25's 8 x Linear(1024) MLP (synthetic 1024-feature rows)
#
# Method. Every figure is the batch divided by the MEDIAN step time of the steps after the first
# WARMUP ones (Conveyor: `step_s` of `--metrics`, the trainer's wall time of a whole step;
# PyTorch: zero_grad + forward + loss + backward + step timed the same way), which resists the
# other users of a shared machine better than a total. First, a search runs each 2-device
# configuration (schedule x micro-batches x placement) once per model and batch and keeps the
# fastest; then ROUNDS rounds each run, per model and batch, Conveyor 1 device, PyTorch 1 thread,
# Conveyor 2 devices, PyTorch 2 threads, in that order (interleaved, so slow phases of the machine
# hit both sides). The table gives the median samples/s of each side and the median of the
# per-round ratios Conveyor / PyTorch (> 1: Conveyor faster).
#
# Data: cnn and resnet train on the built-in digits (1,437 rows of 1x8x8); the transformer on
# `tokens:4096,16,32,10`; PyTorch on random data of the same shapes (the data does not change
# the work). Dropout, SGD lr 0.05, constant learning rate, mean CrossEntropyLoss on both sides.
set -euo pipefail

ROUNDS=${ROUNDS:-5}
MODELS=${MODELS:-"cnn resnet transformer"}
BATCHES=${BATCHES:-"32 256"}
STEP_ROWS=${STEP_ROWS:-12288}
WARMUP=${WARMUP:-5}
SCHEDULES=${SCHEDULES:-"1f1b zb-h2"}
MICROBATCHES=${MICROBATCHES:-"2 4 8"}
PLACEMENTS=${PLACEMENTS:-"auto time"}
TWO_DEVICE=${TWO_DEVICE:-}
OVERLAP=${OVERLAP:-off}
CONVEYOR=${CONVEYOR:-${CARGO_TARGET_DIR:-target}/release/conveyor}
HERE=$(cd "$(dirname "$0")" && pwd)

[[ -x $CONVEYOR ]] || { echo "no $CONVEYOR: run cargo build --release --bin conveyor (or set CONVEYOR)" >&2; exit 2; }
python3 -c 'import torch' 2>/dev/null || { echo "python3 cannot import torch" >&2; exit 2; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
RESULTS=$WORK/results.tsv

data_for() {
    case $1 in
        transformer) echo "tokens:4096,16,32,10" ;;
        mlp) echo "synthetic:2560,1024,10" ;;
        *) echo digits ;;
    esac
}
# The model spec `conveyor train` takes: `mlp` is issue 25's 8 x Linear(1024) MLP.
spec_for() { [[ $1 == mlp ]] && echo "mlp:1024,1024,1024,1024,1024,1024,1024,1024,1024,10" || echo "$1"; }
steps_for() { echo $((STEP_ROWS / $1 > 10 ? STEP_ROWS / $1 : 10)); }

# conveyor MODEL BATCH DEVICES SCHEDULE MICROBATCHES PLACEMENT -> samples/s (median step after warm-up)
conveyor() {
    local model=$1 batch=$2 devices=$3 schedule=$4 micro=$5 placement=$6 steps
    steps=$(steps_for "$batch")
    "$CONVEYOR" train --model "$(spec_for "$model")" --data "$(data_for "$model")" --devices "$devices" \
        --schedule "$schedule" --microbatches "$micro" --placement "$placement" --batch "$batch" \
        --steps $((steps + WARMUP)) --optimizer sgd --lr 0.05 --lr-schedule constant --log-every 0 \
        --overlap-steps "$OVERLAP" \
        --metrics "$WORK/metrics.jsonl" >/dev/null 2>"$WORK/stderr" || { cat "$WORK/stderr" >&2; return 1; }
    python3 - "$WORK/metrics.jsonl" "$batch" "$WARMUP" <<'EOF'
import json, statistics, sys
path, batch, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
steps = [json.loads(line) for line in open(path)]
times = [s["step_s"] for s in steps if not s.get("summary") and not s.get("skipped")][warmup:]
print(f"{batch / statistics.median(times):.1f}")
EOF
}

# torch MODEL BATCH THREADS -> samples/s
torch_run() {
    OMP_NUM_THREADS=$3 python3 "$HERE/zoo_torch.py" --model "$1" --batch "$2" --threads "$3" \
        --steps "$(steps_for "$2")" --warmup "$WARMUP" 2>/dev/null | awk '/^samples_per_s/ { print $2 }'
}

declare -A BEST
for model in $MODELS; do
    for batch in $BATCHES; do
        if [[ -n $TWO_DEVICE ]]; then
            BEST[$model/$batch]=$TWO_DEVICE
            continue
        fi
        best_rate=0
        for schedule in $SCHEDULES; do
            for micro in $MICROBATCHES; do
                for placement in $PLACEMENTS; do
                    rate=$(conveyor "$model" "$batch" cpu:2 "$schedule" "$micro" "$placement") || continue
                    echo "search $model batch $batch: $schedule, $micro micro-batches, --placement $placement: $rate samples/s" >&2
                    if python3 -c "import sys; sys.exit(0 if $rate > $best_rate else 1)"; then
                        best_rate=$rate
                        BEST[$model/$batch]="$schedule,$micro,$placement"
                    fi
                done
            done
        done
    done
done

for round in $(seq 1 "$ROUNDS"); do
    for model in $MODELS; do
        for batch in $BATCHES; do
            IFS=, read -r schedule micro placement <<<"${BEST[$model/$batch]}"
            c1=$(conveyor "$model" "$batch" cpu:1 1f1b 1 auto)
            t1=$(torch_run "$model" "$batch" 1)
            c2=$(conveyor "$model" "$batch" cpu:2 "$schedule" "$micro" "$placement")
            t2=$(torch_run "$model" "$batch" 2)
            printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$model" "$batch" "${BEST[$model/$batch]}" "$c1" "$t1" "$c2" "$t2" \
                | tee -a "$RESULTS" | sed "s/^/round $round: /" >&2
        done
    done
done

python3 - "$RESULTS" "$ROUNDS" <<'EOF'
import collections, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    model, batch, best, c1, t1, c2, t2 = line.split("\t")
    rows[(model, int(batch), best)].append(tuple(map(float, (c1, t1, c2, t2))))
med = statistics.median
print(f"\nMedians of {sys.argv[2]} interleaved rounds (samples/s; ratio = median of per-round Conveyor/PyTorch):\n")
print("| model | batch | Conveyor 1 device | PyTorch 1 thread | ratio | best 2-device config (schedule, micro-batches, placement) | Conveyor 2 devices | PyTorch 2 threads | ratio |")
print("|---|---|---|---|---|---|---|---|---|")
for (model, batch, best), runs in rows.items():
    c1, t1, c2, t2 = (med(r[i] for r in runs) for i in range(4))
    r1 = med(r[0] / r[1] for r in runs)
    r2 = med(r[2] / r[3] for r in runs)
    print(f"| {model} | {batch} | {c1:,.0f} | {t1:,.0f} | {r1:.2f} | {best.replace(',', ', ')} | {c2:,.0f} | {t2:,.0f} | {r2:.2f} |")
EOF
