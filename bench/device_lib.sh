# Sourced by the LeRobot device-call scripts (bench/device_lerobot.sh, device_lerobot_cfg.sh,
# device_lerobot_start_rtc.sh): the wheels the lent machine lacks (.whl, carried beside the tree or one folder up
# when the tree travels as .snap) and this tree into $SITE with --no-deps, then `left` (seconds of BUDGET_S, default
# DEFAULT_BUDGET_S, still to go) and `stage` (one bounded step whose table lands in $OUT).  Leaves the shell in /tmp
# with REPO, OUT, SITE and start set.
set -u
REPO=$(pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SITE=/tmp/site
start=$(date +%s)
left() { echo $(( ${BUDGET_S:-${DEFAULT_BUDGET_S:-580}} - ($(date +%s) - start) )); }
WHL=$REPO/.whl
[ -d "$WHL" ] || WHL=$REPO/../.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHL"/*.whl >"$OUT/install.log" 2>&1 || { tail -5 "$OUT/install.log"; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation --target "$SITE" "$REPO" >>"$OUT/install.log" 2>&1 \
    || { tail -5 "$OUT/install.log"; exit 1; }
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1
cd /tmp
python3 -c "import torch, lerobot, transformers; print('torch', torch.__version__, torch.cuda.get_device_name(), \
'lerobot', lerobot.__version__, 'transformers', transformers.__version__)"
echo "installed after $(( $(date +%s) - start )) s"
# stage NAME SECONDS_TO_LEAVE_OVER CMD...: runs CMD until that many seconds of the budget are left, then prints the
# table lines of $OUT/NAME.md (or the log's tail)
stage() {
    local name=$1 spare=$2
    shift 2
    timeout $(( $(left) - spare )) "$@" >"$OUT/$name.log" 2>&1
    echo "$name rc=$? after $(( $(date +%s) - start )) s"
    grep '^|\|^- ' "$OUT/$name.md" 2>/dev/null || tail -6 "$OUT/$name.log"
}
