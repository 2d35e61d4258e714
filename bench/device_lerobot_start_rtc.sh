#!/usr/bin/env bash
# On the H200: SmolVLA and pi0.5 against LeRobot's own, issue 24's robots table, a second pod's start and RTC's cost (issues 22, 24, 25), each stage bounded so a slow one leaves the others' tables.
# Wheels the device image lacks travel in .whl/ (lerobot 0.6.1 and the versions it pins, websockets, pydantic...;
# docs/benchmarks.md lists them); they and the project are installed with --no-deps into /tmp/site.
#   run(command="bash bench/device_lerobot_start_rtc.sh a", carry=[".whl"])   # SmolVLA vs LeRobot; issue 24's robots table
#   run(command="bash bench/device_lerobot_start_rtc.sh b", carry=[".whl"])   # pi0.5 vs LeRobot; fast start; RTC cost
DEFAULT_BUDGET_S=575
source "$(dirname "$0")/device_lib.sh"
base() { [ -d /tmp/base ] || python3 -m policy_operator.cli checkpoint init /tmp/base --size base >/dev/null; }
COMMON=(--device cuda --size base --steps 10 --dtype bfloat16 --compile reduce-overhead --checkpoint /tmp/base)
case "${1:-a}" in
a)
    stage lerobot-h200-smolvla 330 python3 "$REPO/bench/lerobot_vs_server.py" --device cuda --compile reduce-overhead \
        --families smolvla --out "$OUT/lerobot-h200-smolvla.md"
    base
    stage h200-robots 5 python3 "$REPO/bench/runtime.py" "${COMMON[@]}" --tables robots \
        --robot-max-batch "${MAX_BATCH:-1,8,32}" --robots "${ROBOTS:-1,8,16,32}" --robot-n "${ROBOT_N:-40}" \
        --batch-window-ms 2 --out "$OUT/h200-robots.md"
    ;;
b)
    stage lerobot-h200-pi05 300 python3 "$REPO/bench/lerobot_vs_server.py" --device cuda --compile reduce-overhead \
        --families pi05 --out "$OUT/lerobot-h200-pi05.md"
    base
    stage rtc-h200 180 python3 "$REPO/bench/rtc.py" --device cuda --size base --dtype bfloat16 --compile reduce-overhead \
        --sizes 1,8 --reps 20 --checkpoint /tmp/base --out "$OUT/rtc-h200.md"
    stage h200-start-mb8 5 python3 "$REPO/bench/start.py" --device cuda --size base --dtype bfloat16 \
        --compile reduce-overhead --max-batch 8 --out "$OUT/h200-start-mb8.md"
    ;;
esac
