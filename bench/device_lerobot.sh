#!/usr/bin/env bash
# Issue 37's device calls: pi0.5 and SmolVLA at published sizes (random weights), this server against LeRobot.
# The tree travels as a snapshot (.snap: HEAD's files plus this session's, other sessions' edits left out) with the
# wheels the image lacks (.whl: lerobot 0.6.1 and its pins, websockets, pydantic; docs/benchmarks.md lists them):
#   run(command="cd .snap && bash bench/device_lerobot.sh pi05", carry=[".whl", ".snap"])
#   run(command="cd .snap && bash bench/device_lerobot.sh smolvla", carry=[".whl", ".snap"])
#   run(command="cd .snap && BUDGET_S=400 bash bench/device_lerobot.sh load", carry=[".whl", ".snap"])
# Each stage is bounded so that a slow one leaves the others' tables; every table lands in $OUT.
DEFAULT_BUDGET_S=580
source "$(dirname "$0")/device_lib.sh"
FAST=(--device cuda --dtype bfloat16 --compile reduce-overhead)
case "${1:-pi05}" in
pi05 | smolvla)  # in one call: in-process against LeRobot eager, over the WebSocket, LeRobot compile_model=True
    fam=$1
    stage "lerobot-$fam" "${SPARE_INPROC:-330}" python3 "$REPO/bench/lerobot_vs_server.py" "${FAST[@]}" \
        --families "$fam" --workdir /tmp/ck --reps 20 --out "$OUT/lerobot-$fam.md"
    stage "robots-$fam" "${SPARE_ROBOTS:-100}" python3 "$REPO/bench/lerobot_robots.py" --checkpoint "/tmp/ck/$fam" \
        --robots 1,8 --n 30 --logs "$OUT" --label "$fam (published size, random weights)" \
        --out "$OUT/robots-$fam.md" --variant "bf16 graphs, buckets 1 and 8=${FAST[*]} --max-batch 8 --batch-buckets 1,8"
    [ -n "${THEN:-}" ] && stage "lerobot-$THEN" 5 python3 "$REPO/bench/lerobot_vs_server.py" "${FAST[@]}" \
        --families "$THEN" --workdir /tmp/ck --reps 20 --out "$OUT/lerobot-$THEN.md"
    stage "lerobot-compiled-$fam" 5 python3 "$REPO/bench/lerobot_vs_server.py" --device cuda --families "$fam" \
        --workdir /tmp/ck --reps 10 --lerobot-compile-only --out "$OUT/lerobot-compiled-$fam.md"
    ;;
kernels)  # where the prefix and a step spend the GPU per variant, then the shipped one as served (lerobot_kernels.py)
    stage "kernels-pi05" "${SPARE_PI05:-240}" python3 "$REPO/bench/lerobot_kernels.py" --family pi05 \
        --variants lerobot,tf32,vision-bf16 --compile vision-bf16 --workdir /tmp/ck --out "$OUT/kernels-pi05.md"
    stage "kernels-smolvla" 10 python3 "$REPO/bench/lerobot_kernels.py" --family smolvla --variants tf32 \
        --compile tf32 --compile-prefix --workdir /tmp/ck --out "$OUT/kernels-smolvla.md"
    ;;
next)  # the lever round 3 measured eager (grouped attention: 1.96 ms less a step at batch 8), compiled as served,
    # against the shipped step in the same call (pi0.5; batch 8 only: two compiles fit one call)
    variants=vision-bf16,grouped-attention
    stage "next-pi05" 10 python3 "$REPO/bench/lerobot_kernels.py" --family pi05 --variants $variants \
        --compile $variants --batches "${BATCHES:-8}" --workdir /tmp/ck --out "$OUT/next-pi05.md"
    ;;
one-graph)  # the next lever for one robot, measured: the whole request (cameras, prefix, every step) as one CUDA
    # graph, against the shipped graphs (one for the prefix, one per step) in the same process (pi0.5)
    # (FAMILY=smolvla: its shipped step, TF32 products and the prefix compiled)
    fam=${FAMILY:-pi05}
    case "$fam" in
    pi05) variant=grouped-attention ;;
    *) variant=tf32 ;;
    esac
    stage "one-graph-$fam" 5 python3 "$REPO/bench/lerobot_kernels.py" --family "$fam" --variants $variant \
        --compile $variant --one-graph --batches "${BATCHES:-1}" --workdir /tmp/ck --out "$OUT/one-graph-$fam.md"
    ;;
load)  # where a pod's load goes (bench/lerobot_load.py: fresh processes, pi0.5 and SmolVLA), then the step variants
    # built after the last call, eager, against the shipped one in the same process
    stage "lerobot-load" "${SPARE_LOAD:-110}" python3 "$REPO/bench/lerobot_load.py" --families pi05,smolvla \
        --workdir /tmp/ck --out "$OUT/lerobot-load.md"
    stage "next-pi05" 5 python3 "$REPO/bench/lerobot_kernels.py" --family pi05 \
        --variants vision-bf16,lerobot-step,grouped-attention --workdir /tmp/ck --out "$OUT/next-pi05.md"
    ;;
imports)  # serve's imports of LeRobot (pi0.5) in fresh processes, from the sources as installed here (--no-compile),
    # then after compileall as the image ships them (runtime/Dockerfile)
    probe='import time; t = time.perf_counter(); import torch; a = time.perf_counter()
from lerobot.policies.factory import get_policy_class, make_pre_post_processors; get_policy_class("pi05")
from policy_operator.runtime.policy.lerobot.policy import LeRobotPolicy
import sys; print(f"{sys.argv[1]}: import torch {a - t:.2f} s, LeRobot (pi0.5) {time.perf_counter() - a:.2f} s")'
    python3 -c 'import sys; print("dont_write_bytecode", sys.dont_write_bytecode)'
    for i in 1 2; do python3 -c "$probe" "sources, process $i"; done
    python3 -m compileall -q -j 16 "$SITE" >/dev/null 2>&1
    echo "compileall done after $(( $(date +%s) - start )) s"
    for i in 1 2; do python3 -c "$probe" "bytecode, process $i"; done
    ;;
esac
