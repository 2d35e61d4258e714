#!/usr/bin/env bash
# Issue 37's device calls: pi0.5 and SmolVLA at published sizes (random weights), this server against LeRobot.
# The tree travels as a snapshot (.snap: HEAD's files plus this session's, other sessions' edits left out) with the
# wheels the image lacks (.whl: lerobot 0.6.1 and its pins, websockets, pydantic; docs/benchmarks.md lists them):
#   run(command="cd .snap && bash bench/device_lerobot.sh pi05", carry=[".whl", ".snap"])
#   run(command="cd .snap && bash bench/device_lerobot.sh smolvla", carry=[".whl", ".snap"])
# Each stage is bounded so that a slow one leaves the others' tables; every table lands in $OUT.
set -u
REPO=$(pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SITE=/tmp/site
start=$(date +%s)
left() { echo $(( ${BUDGET_S:-580} - ($(date +%s) - start) )); }
WHL=$REPO/.whl
[ -d "$WHL" ] || WHL=$REPO/../.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHL"/*.whl >"$OUT/install.log" 2>&1 || { tail -5 "$OUT/install.log"; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation --target "$SITE" "$REPO" >>"$OUT/install.log" 2>&1 \
    || { tail -5 "$OUT/install.log"; exit 1; }
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1
cd /tmp
python3 -c "import torch, lerobot, transformers; print(torch.__version__, torch.cuda.get_device_name(), \
'lerobot', lerobot.__version__, 'transformers', transformers.__version__)"
echo "installed after $(( $(date +%s) - start )) s"
# stage NAME SECONDS_TO_LEAVE_OVER CMD...: runs CMD until that many seconds of the budget are left
stage() {
    local name=$1 spare=$2
    shift 2
    timeout $(( $(left) - spare )) "$@" >"$OUT/$name.log" 2>&1
    echo "$name rc=$? after $(( $(date +%s) - start )) s"
    grep '^|\|^- ' "$OUT/$name.md" 2>/dev/null || tail -6 "$OUT/$name.log"
}
FAST=(--device cuda --dtype bfloat16 --compile reduce-overhead)
case "${1:-pi05}" in
pi05 | smolvla)  # in one call: in-process against LeRobot eager, over the WebSocket, LeRobot compile_model=True
    fam=$1
    stage "lerobot-$fam" "${SPARE_INPROC:-330}" python3 "$REPO/bench/lerobot_vs_server.py" "${FAST[@]}" \
        --families "$fam" --workdir /tmp/ck --reps 20 --out "$OUT/lerobot-$fam.md"
    stage "robots-$fam" "${SPARE_ROBOTS:-100}" python3 "$REPO/bench/lerobot_robots.py" --checkpoint "/tmp/ck/$fam" \
        --robots 1,8 --n 30 --logs "$OUT" --label "$fam (published size, random weights)" \
        --out "$OUT/robots-$fam.md" --variant "bf16 graphs, max-batch 8=${FAST[*]} --max-batch 8"
    stage "lerobot-compiled-$fam" 5 python3 "$REPO/bench/lerobot_vs_server.py" --device cuda --families "$fam" \
        --workdir /tmp/ck --reps 10 --lerobot-compile-only --out "$OUT/lerobot-compiled-$fam.md"
    ;;
esac
