#!/usr/bin/env bash
# MPI ranks against in-process threads on the same pipeline (issue 18's benchmark): the 8 x 1024
# MLP (8 x Linear(1024) + ReLU, then Linear(1024, 10)), batch 256, 4 micro-batches, SGD, 2 stages,
# trained by `conveyor train` as 2 threads of one process and as 2 MPI ranks. Rounds alternate
# which runs first; the figure is the median of the per-round ratios (MPI / in-process) of the
# samples/s each run reports. Run on a quiet machine:
#   cargo build --release --features mpi && bash benches/mpi_transport.sh [ROUNDS] [SCHEDULE]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-7}
SCHEDULE=${2:-1f1b}
BIN=target/release/conveyor
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MODEL=mlp:1024,1024,1024,1024,1024,1024,1024,1024,1024,10
ARGS=(--model "$MODEL" --data synthetic:4096,1024,10 --batch 256 --microbatches 4 --schedule "$SCHEDULE"
      --optimizer sgd --steps 40 --log-every 0 --devices cpu:2)
rate() { grep -o '[0-9.]* samples/s' | tail -1 | cut -d' ' -f1; }
in_process() { "$BIN" train "${ARGS[@]}" --transport in-process 2>/dev/null | rate; }
mpi() { mpirun -n 2 ${MPIRUN_FLAGS:-} "$BIN" train "${ARGS[@]}" --transport mpi 2>/dev/null | rate; }
mpirun -n 2 "$BIN" train "${ARGS[@]}" --transport mpi --steps 1 2>/dev/null | grep '^transport:' || true
ratios=()
printf '%-6s %14s %14s %8s\n' round in-process mpi ratio
for round in $(seq 1 "$ROUNDS"); do
    if (( round % 2 )); then a=$(in_process); b=$(mpi); else b=$(mpi); a=$(in_process); fi
    r=$(python3 -c "print(f'{$b / $a:.3f}')")
    ratios+=("$r")
    printf '%-6s %14s %14s %8s\n' "$round" "$a" "$b" "$r"
done
python3 -c "import statistics,sys; print('median ratio (mpi / in-process):', statistics.median(map(float, sys.argv[1:])))" "${ratios[@]}"
