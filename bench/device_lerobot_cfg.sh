#!/usr/bin/env bash
# Issue 42 item 4: LingBot-VA at the published size (random weights) on one GPU, sequential CFG vs batched CFG vs
# cfgp=2 over gloo on the same GPU (--share-gpu: functional), 1 and 8 robots (bench/lerobot_cfg.py); with
# "two-gpus" on a kind with two GPUs, also cfgp=2 over NCCL, one branch per GPU. The tree and the wheels travel
# as for bench/device_lerobot.sh (.snap, .whl):
#   run(command="cd .snap && bash bench/device_lerobot_cfg.sh", carry=[".whl", ".snap"])
#   run(command="cd .snap && bash bench/device_lerobot_cfg.sh two-gpus", carry=[".whl", ".snap"], kind="nvidia-h100-x2")
# LAYERS=N cuts the transformer (published: 30) when the call has less time left.
set -u
REPO=$(pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SITE=/tmp/site
start=$(date +%s)
WHL=$REPO/.whl
[ -d "$WHL" ] || WHL=$REPO/../.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHL"/*.whl >"$OUT/install.log" 2>&1 || { tail -5 "$OUT/install.log"; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation --target "$SITE" "$REPO" >>"$OUT/install.log" 2>&1 \
    || { tail -5 "$OUT/install.log"; exit 1; }
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1
cd /tmp
echo "installed after $(( $(date +%s) - start )) s"
extra=()
[ "${1:-}" = "two-gpus" ] && extra+=(--two-gpus)
timeout $(( ${BUDGET_S:-580} - ($(date +%s) - start) )) python3 "$REPO/bench/lerobot_cfg.py" --device cuda \
    --layers "${LAYERS:-0}" --robots 1,8 --n "${N:-10}" --logs "$OUT" --out "$OUT/lerobot-cfg.md" "${extra[@]}" \
    >"$OUT/lerobot-cfg.log" 2>&1
echo "rc=$? after $(( $(date +%s) - start )) s"
grep '^|\|^- ' "$OUT/lerobot-cfg.md" 2>/dev/null || tail -20 "$OUT/lerobot-cfg.log"
