#!/usr/bin/env bash
# Issue 24 target 3 (one robot at every max-batch): where a lone robot's time goes, this build against the build
# of the last round that served one client in ~16 ms (4353282), with the same client, in one device call.
#   git archive 4353282 | tar -x -C .old     # .old is ignored by git; carried with the call
#   run(command="bash bench/device_lone_robot.sh", carry=[".whl", ".old"])
#   run(command="bash bench/device_lone_robot.sh split", carry=[".whl"])    # condition/denoise split per process
#   run(command="bash bench/device_lone_robot.sh robots", carry=[".whl"])   # robots table, both front-ends
DEFAULT_BUDGET_S=580
source "$(dirname "${BASH_SOURCE[0]}")/device_setup.sh"
COMMON=(--device cuda --size base --steps 10 --dtype bfloat16 --compile reduce-overhead --checkpoint /tmp/base)
# stage NAME SITE SRC SECONDS_TO_LEAVE_OVER ARGS...: bench/runtime.py of SRC on SITE's install
stage() {
    local name=$1 site=$2 src=$3 spare=$4
    shift 4
    PYTHONPATH=$site timeout $(( $(left) - spare )) python3 "$src/bench/runtime.py" "${COMMON[@]}" \
        --out "$OUT/$name.md" "$@" >"$OUT/$name.log" 2>&1
    echo "$name rc=$? after $(( $(date +%s) - start )) s"
    grep '^|' "$OUT/$name.md" 2>/dev/null || tail -6 "$OUT/$name.log"
}
if [ "${1:-}" = robots ]; then
    # issue 24's robots table, both front-ends side by side (compile artifacts shared through one cache
    # directory, so the second server of a spec loads them), then one robot at max-batch 1
    stage robots-frontends /tmp/site-new "$REPO" 130 --tables robots --robot-max-batch 8,32 --robots 1,8,16,32 \
        --robot-n 30 --frontend inline,process --batch-window-ms 2 --serve-args "--compile-cache-dir /tmp/cc"
    stage robots-mb1 /tmp/site-new "$REPO" 5 --tables robots --robot-max-batch 1 --robots 1 --robot-n 40 \
        --frontend inline,process --batch-window-ms 2 --serve-args "--compile-cache-dir /tmp/cc"
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
if [ "${1:-}" = split ]; then
    # the same build in fresh processes: condition / denoise / postprocess split, with and without marking steps
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,utilization.gpu,temperature.gpu,power.draw --format=csv
    for i in 1 2 3; do
        for flags in "" --no-pin "--profile --sizes 1"; do
            echo "process $i ${flags:-plain}"
            PYTHONPATH=/tmp/site-new timeout 120 python3 "$REPO/bench/gpu_split.py" --checkpoint /tmp/base --sizes 1,8 \
                $flags 2>>"$OUT/split.err"
        done
    done
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,utilization.gpu,temperature.gpu,power.draw --format=csv
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
stage batching-new /tmp/site-new "$REPO" 330 --tables batching --n 25 --max-batch 1,8 --batch-clients 1,8 \
    --batch-window-ms 2 --no-asyncio-column
[ -d "$REPO/.old" ] && stage batching-old /tmp/site-old "$REPO/.old" 200 --tables batching --n 25 --max-batch 1,8 \
    --batch-clients 1,8 --batch-window-ms 2 --no-asyncio-column
stage robots-new /tmp/site-new "$REPO" 5 --tables robots --robot-max-batch 1,8 --robots 1,8 --robot-n 40 \
    --batch-window-ms 2
echo "done after $(( $(date +%s) - start )) s"
