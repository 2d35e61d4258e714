# Sourced by the device-call scripts (bench/device_robots.sh, bench/device_lone_robot.sh, bench/device_batching.sh):
# the wheels the lent machine lacks (.whl, carried beside the tree or one folder up when the tree travels as .snap,
# as bench/device_lib.sh finds them) and this build into /tmp/site-new, the build in .old (when carried) into
# /tmp/site-old, the base checkpoint at /tmp/base, bytecode under /tmp/pycache; then `left` says how many seconds of BUDGET_S remain
# (default DEFAULT_BUDGET_S, set by the caller).  Leaves the shell in /tmp with REPO, OUT and start set.
set -u
REPO=$(pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $(( ${BUDGET_S:-$DEFAULT_BUDGET_S} - ($(date +%s) - start) )); }
WHL=$REPO/.whl
[ -d "$WHL" ] || WHL=$REPO/../.whl
install() {  # install() SITE SRC: the wheels and the project at SRC, no dependencies, into SITE
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$1" "$WHL"/*.whl \
        >"$OUT/install.log" 2>&1 || { tail -5 "$OUT/install.log"; exit 1; }
    python3 -m pip install -q --no-deps --no-build-isolation --target "$1" "$2" >>"$OUT/install.log" 2>&1 \
        || { tail -5 "$OUT/install.log"; exit 1; }
}
install /tmp/site-new "$REPO"
[ -d "$REPO/.old" ] && install /tmp/site-old "$REPO/.old"
export PYTHONUNBUFFERED=1
# bytecode as an image built by runtime/Dockerfile has it (its compileall step): this machine's torch has none,
# and compiling it from source cost every server start 8.6-11.4 s (bench/load_profile.py); the import below
# writes most of it, the first server the modules compile imports lazily
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
PYTHONPATH=/tmp/site-new python3 -c "import torch, torch._dynamo, torch._inductor.compile_fx, triton, sympy, \
policy_operator.runtime.worker, policy_operator.runtime.serving.server" >/dev/null 2>&1
cd /tmp
PYTHONPATH=/tmp/site-new python3 -m policy_operator.cli checkpoint init /tmp/base --size base >/dev/null
echo "installed, checkpoint after $(( $(date +%s) - start )) s"
