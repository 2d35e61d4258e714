#!/usr/bin/env bash
# One device-tool call for issue 16 on a lent H200: install, then the batching benchmarks, each stage bounded
# so a slow one still leaves the others' tables in $OUT.  Wheels the device machine lacks travel in .whl/
# (carry it); the project is installed outside the repository so the installed package is what runs.
#   run(command="bash bench/device_batching.sh table", carry=[".whl"])   # the issue's tables
#   run(command="bash bench/device_batching.sh gil", carry=[".whl"])     # the table, and --gil-switch-ms 0.5
#   run(command="bash bench/device_batching.sh repeat", carry=[".whl"])  # the table, and max-batch 1 and 8 again
#   run(command="bash bench/device_batching.sh robots", carry=[".whl"])  # issue 24: robots x max-batch 1/8/32
DEFAULT_BUDGET_S=570
source "$(dirname "${BASH_SOURCE[0]}")/device_setup.sh"  # the wheels and this build, /tmp/base, left()
export PYTHONPATH=/tmp/site-new
python3 -c "import torch, uvloop; print('torch', torch.__version__, torch.cuda.get_device_name(), 'uvloop', uvloop.__version__)"

COMMON=(--device cuda --size base --steps 10 --dtype bfloat16 --compile reduce-overhead --checkpoint /tmp/base)
# one batching table into $OUT/h200-$1.md (stderr in $1.err); $2: seconds to leave over; the rest: runtime.py flags
batching_run() {
    local name=$1 spare=$2
    shift 2
    timeout $(( $(left) - spare )) python3 "$REPO/bench/runtime.py" "${COMMON[@]}" --n 25 --tables batching \
        --batch-window-ms 2 --out "$OUT/h200-$name.md" "$@" 2>"$OUT/$name.err" | grep -v '^|'
    echo "$name rc=$? after $(( $(date +%s) - start )) s"
}
# the issue's table: max-batch 1 vs 8 vs 16, side by side, 1..32 closed-loop clients; $1: seconds to leave over
batching_table() {
    batching_run batching "$1" --max-batch "${MAX_BATCH:-1,8,16}" --batch-clients "${CLIENTS:-1,4,8,16,32}"
}
case "${1:-table}" in
table)
    batching_table 150
    # in-process: what a batch of B costs, and how far a request in a batch is from it alone (bf16)
    timeout $(( $(left) - 20 )) python3 "$REPO/bench/batching.py" "${COMMON[@]}" --sizes 1,2,4,8,16 --reps 30 \
        --out "$OUT/h200-batching-inprocess.md" 2>"$OUT/batching-inprocess.err" | tail -12
    grep '^|' "$OUT/h200-batching.md"
    ;;
gil)
    # the table again, then rank 0's event loop and model thread sharing the GIL at a 0.5 ms switch interval
    # instead of Python's 5 ms (max-batch 8, where two batches alternate from 16 clients on)
    batching_table 60
    batching_run gil 5 --max-batch 8 --batch-clients "${GIL_CLIENTS:-1,8,16,32}" \
        --serve-args "--gil-switch-ms 0.5" --no-asyncio-column
    grep '^|' "$OUT/h200-batching.md"; echo "## --gil-switch-ms 0.5"; grep '^|' "$OUT/h200-gil.md"
    ;;
robots)
    # issue 24's table: 1/4/8/16/32 robots (one process each, closed loop, 5 warm-up + 40 requests per robot) x
    # max-batch 1/8/32, then the same model in-process for batches of 1..32, and the targets as ratios
    timeout $(( $(left) - 5 )) python3 "$REPO/bench/runtime.py" "${COMMON[@]}" --tables robots \
        --robot-max-batch "${MAX_BATCH:-1,8,32}" --robots "${ROBOTS:-1,4,8,16,32}" --robot-n "${ROBOT_N:-40}" \
        --batch-window-ms 2 --out "$OUT/h200-robots.md" 2>"$OUT/robots.err" | grep -v '^|'
    echo "robots rc=$? after $(( $(date +%s) - start )) s"
    grep '^|' "$OUT/h200-robots.md"
    ;;
repeat)
    # the table, then the rows the targets are read from once more: the spread between two runs of one build
    batching_table 60
    batching_run batching-repeat 5 --max-batch 1,8 --batch-clients 1,8 --no-asyncio-column
    grep '^|' "$OUT/h200-batching.md"; echo "## repeat"; grep '^|' "$OUT/h200-batching-repeat.md"
    ;;
esac
echo "done after $(( $(date +%s) - start )) s"
