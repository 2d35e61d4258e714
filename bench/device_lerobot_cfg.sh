#!/usr/bin/env bash
# Issue 42 item 4: LingBot-VA at the published size (random weights) on one GPU, sequential CFG vs batched CFG vs
# cfgp=2 over gloo on the same GPU (--share-gpu: functional), 1 and 8 robots (bench/lerobot_cfg.py); with
# "two-gpus" on a kind with two GPUs, also cfgp=2 over NCCL, one branch per GPU. The tree and the wheels travel
# as for bench/device_lerobot.sh (.snap, .whl):
#   run(command="cd .snap && bash bench/device_lerobot_cfg.sh", carry=[".whl", ".snap"])
#   run(command="cd .snap && bash bench/device_lerobot_cfg.sh two-gpus", carry=[".whl", ".snap"], kind="nvidia-h100-x2")
# LAYERS=N cuts the transformer (published: 30) when the call has less time left; VARIANTS, ROBOTS, N and WARMUP
# pick the layouts and the load (bench/lerobot_cfg.py).
DEFAULT_BUDGET_S=580
source "$(dirname "$0")/device_lib.sh"
extra=()
[ "${1:-}" = "two-gpus" ] && extra+=(--two-gpus)
timeout "$(left)" python3 "$REPO/bench/lerobot_cfg.py" --device cuda \
    --layers "${LAYERS:-0}" --robots "${ROBOTS:-1,8}" --n "${N:-10}" --warmup "${WARMUP:-2}" \
    --variants "${VARIANTS:-sequential,batched,cfgp2}" --logs "$OUT" --out "$OUT/lerobot-cfg.md" "${extra[@]}" \
    >"$OUT/lerobot-cfg.log" 2>&1
echo "rc=$? after $(( $(date +%s) - start )) s"
grep '^|\|^- ' "$OUT/lerobot-cfg.md" 2>/dev/null || tail -20 "$OUT/lerobot-cfg.log"
