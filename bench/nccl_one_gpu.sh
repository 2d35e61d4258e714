#!/usr/bin/env bash
# Functional check on ONE GPU: can cfgp=2 run its per-step exchange over NCCL with both ranks on
# the same device?  (Not a speed claim.)  Prints the outcome and the first NCCL error, if any.
set -u
CKPT=${1:?checkpoint dir}; PORT=${2:-18200}; BACKEND=${3:-auto}
policyserver serve --checkpoint "$CKPT" --cfgp 2 --device cuda --backend "$BACKEND" --share-gpu --host 127.0.0.1 --port "$PORT" \
  > /tmp/nccl-$BACKEND.log 2>&1 &
PID=$!
for _ in $(seq 1 120); do
  if python3 -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:$PORT/readyz',timeout=1).status==200 else 1)" 2>/dev/null; then
    echo "backend=$BACKEND: ready"; policyserver client --url ws://127.0.0.1:$PORT --n 5; break
  fi
  kill -0 $PID 2>/dev/null || { echo "backend=$BACKEND: server exited"; break; }
  sleep 1
done
kill -TERM $PID 2>/dev/null; wait $PID; echo "backend=$BACKEND: exit $?"
grep -iE "nccl|duplicate|error" /tmp/nccl-$BACKEND.log | grep -v -i warn | head -8
