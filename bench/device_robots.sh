#!/usr/bin/env bash
# Issue 24 target 1 (req/s holds past max-batch): where the time goes at max-batch 8 with 8/16/32 robots, in one
# device call -- this build with both front-ends, the process front-end of the build before its ring copy changed
# (a803712^: the second H200 call saw its 16/32-robot rows halve), and the inline front-end with one OpenMP thread.
#   rm -rf .old && mkdir .old && git archive a803712^ | tar -x -C .old     # .old is ignored by git
#   run(command="bash bench/device_robots.sh", carry=[".whl", ".old"])
#   run(command="bash bench/device_robots.sh full", carry=[".whl"])      # the whole table at this build
#   run(command="bash bench/device_robots.sh window", carry=[".whl"])    # max-batch 32, 32 robots, windows 2/5/10 ms
#   run(command="bash bench/device_robots.sh start", carry=[".whl", ".old"])  # start to Ready, .old against this
#   run(command="bash bench/device_robots.sh phases", carry=[".whl"])   # a start's phases, compiled and from artifacts
#   run(command="bash bench/device_robots.sh dynamic", carry=[".whl", ".old"])  # second-pod start, .old against this
#   run(command="bash bench/device_robots.sh share", carry=[".whl"])    # second pod with and without shared kernel caches
#   run(command="bash bench/device_robots.sh share burn", carry=[".whl"])   # ... then a lone robot beside busy cores
#   run(command="bash bench/device_robots.sh profile", carry=[".whl"])  # a second pod's load under cProfile
#   run(command="bash bench/device_robots.sh final", carry=[".whl"])    # issue 24's whole table, inline, one run
#   run(command="bash bench/device_robots.sh rtc", carry=[".whl"])      # RTC in-process on the dynamic step
#   run(command="bash bench/device_robots.sh frontends", carry=[".whl"])  # max-batch 32: inline, 1, 2, 4 front-ends
#   run(command="bash bench/device_robots.sh rtc-static", carry=[".whl"])  # guided RTC: symbolic batch vs per size
#   run(command="PYSPY=$(pwd)/pyspy bash bench/device_robots.sh lone", carry=[".whl", ".old", "pyspy"])  # one robot
#   run(command="bash bench/device_robots.sh targets", carry=[".whl", ".old"])  # issue 24's open targets, one call
#   run(command="bash bench/device_robots.sh trace", carry=[".whl"])    # max-batch 32: the turnaround, stage by stage
DEFAULT_BUDGET_S=585
source "$(dirname "${BASH_SOURCE[0]}")/device_setup.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,utilization.gpu,temperature.gpu,power.draw --format=csv,noheader
COMMON=(--device cuda --size base --steps 10 --dtype bfloat16 --compile reduce-overhead --checkpoint /tmp/base
    --tables robots --robot-n 30)
# stage NAME SITE SECONDS_TO_LEAVE_OVER ARGS...: this build's bench/runtime.py against SITE's server
stage() {
    local name=$1 site=$2 spare=$3
    shift 3
    local t=$(( $(left) - spare ))
    [ "$t" -gt 60 ] || { echo "$name skipped: $t s left"; return; }
    PYTHONPATH=$site timeout $t python3 "$REPO/bench/runtime.py" "${COMMON[@]}" --out "$OUT/$name.md" "$@" \
        >"$OUT/$name.log" 2>&1
    echo "$name rc=$? after $(( $(date +%s) - start )) s"
    grep "^| robots\|^| [0-9]" "$OUT/$name.md" 2>/dev/null || grep -E "robots|Error|error" "$OUT/$name.log" | tail -8
}
if [ "${1:-}" = trace ]; then
    # where a closed loop's turnaround goes at max-batch 32 (bench/cycle_trace.py): 1, 8 and 32 robots, inline
    # and 4 and 8 front-end processes (FRONTENDS); later servers start from the first one's compile artifacts
    PYTHONPATH=/tmp/site-new timeout $(( $(left) - 5 )) python3 "$REPO/bench/cycle_trace.py" --checkpoint /tmp/base \
        --max-batch 32 --robots 1,8,32 --frontend "${FRONTENDS:-inline,process:4,process:8}" --out "$OUT/cycle-trace.md" \
        --serve-args "--device cuda --dtype bfloat16 --compile reduce-overhead --steps 10 --guidance 3.0 \
--cfg-mode batched --compile-cache-dir /tmp/cc" >"$OUT/cycle-trace.log" 2>&1
    echo "trace rc=$? after $(( $(date +%s) - start )) s"
    cat "$OUT/cycle-trace.md" 2>/dev/null || tail -20 "$OUT/cycle-trace.log"
    exit 0
fi
if [ "${1:-}" = full ]; then
    # issue 24's robots table at this build (one intra-op thread per rank by default on a GPU): both front-ends,
    # max-batch 8 and 32, then one robot at max-batch 1; the compile cache is shared, so the second server of a
    # spec (process after inline) starts from the first one's artifacts
    stage full /tmp/site-new 100 --robot-max-batch 8,32 --robots 1,8,16,32 --frontend inline,process \
        --serve-args "--compile-cache-dir /tmp/cc"
    stage full-mb1 /tmp/site-new 5 --robot-max-batch 1 --robots 1 --robot-n 40 --frontend inline,process \
        --serve-args "--compile-cache-dir /tmp/cc"
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
if [ "${1:-}" = start ]; then
    # start to Ready of a max-batch 1 server (load + warm-up), the build in .old against this one, interleaved,
    # twice each (the second loads its own first run's compile artifacts)
    for i in 1 2; do
        for b in old new; do
            stage "start-$b-$i" /tmp/site-$b 5 --robot-max-batch 1 --robots 1 --robot-n 5 --robot-warmup 1 \
                --frontend inline --no-in-process --serve-args "--compile-cache-dir /tmp/cc-$b"
            grep -A3 "ready s" "$OUT/start-$b-$i.md" | tail -1
        done
    done
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
if [ "${1:-}" = phases ]; then
    # where a start's time goes at max-batch 8: the first server of the spec compiles, the second loads its
    # artifacts; each logs its phases (process start, weights, compile cache, each bucket, artifacts saved)
    stage phases /tmp/site-new 5 --robot-max-batch 8 --robots 1 --robot-n 5 --robot-warmup 1 \
        --frontend inline,process --no-in-process --server-log "$OUT/server-logs" \
        --serve-args "--compile-cache-dir /tmp/cc"
    grep -A3 "Each server" "$OUT/phases.md"
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
if [ "${1:-}" = dynamic ]; then
    # a second pod's start at max-batch 8, the build in .old against this one, interleaved: each build's first
    # server compiles into its own --compile-cache-dir; its second server starts with empty inductor and Triton
    # caches of its own, as a pod on another node does, and loads the artifacts; then 1 and 8 robots on it
    # (the batch times of the two builds' graphs)
    for n in 1 2; do
        for b in old new; do
            TORCHINDUCTOR_CACHE_DIR=/tmp/ind-$b-$n TRITON_CACHE_DIR=/tmp/tri-$b-$n stage "dynamic-$b-$n" /tmp/site-$b 5 \
                --robot-max-batch 8 --robots "$( [ $n = 2 ] && echo 1,8 || echo 1)" --robot-warmup 3 --frontend inline \
                --no-in-process --server-log "$OUT/server-logs-$b-$n" --serve-args "--compile-cache-dir /tmp/cc-$b"
            grep -h "warmed up" "$OUT/server-logs-$b-$n"/*.log | sed 's/.*replica 0 //'
        done
    done
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
if [ "${1:-}" = share ]; then
    # a second pod's start when torch's and Triton's caches are beside the artifacts (the opt-in of
    # docs/runtime.md; the runtime's default at b39dfe6, the build of the results) against one with caches of its
    # own (the default); max-batch 8, then 32 (with 1 and 32 robots and the in-process batches on its second server)
    for mb in 8 32; do
        TORCHINDUCTOR_CACHE_DIR=/tmp/cc-$mb/inductor TRITON_CACHE_DIR=/tmp/cc-$mb/triton stage "share-$mb-first" \
            /tmp/site-new 5 --robot-max-batch $mb --robots 1 --robot-n 5 --robot-warmup 1 --frontend inline --no-in-process --server-log "$OUT/logs-$mb-first" --serve-args "--compile-cache-dir /tmp/cc-$mb"
        TORCHINDUCTOR_CACHE_DIR=/tmp/cc-$mb/inductor TRITON_CACHE_DIR=/tmp/cc-$mb/triton stage "share-$mb-shared" \
            /tmp/site-new 5 --robot-max-batch $mb --robots "$( [ $mb = 32 ] && echo 1,32 || echo 1)" \
            --robot-warmup 3 --frontend inline $( [ $mb = 32 ] && echo --in-process || echo --no-in-process) \
            --server-log "$OUT/logs-$mb-shared" --serve-args "--compile-cache-dir /tmp/cc-$mb"
        [ $mb = 8 ] && TORCHINDUCTOR_CACHE_DIR=/tmp/ind-own TRITON_CACHE_DIR=/tmp/tri-own stage "share-$mb-own" /tmp/site-new 5 \
            --robot-max-batch $mb --robots 1 --robot-n 5 --robot-warmup 1 --frontend inline --no-in-process \
            --server-log "$OUT/logs-$mb-own" --serve-args "--compile-cache-dir /tmp/cc-$mb"
        grep -h "warmed up" "$OUT"/logs-$mb-*/*.log | sed 's/.*INFO //'
    done
    [ "${2:-}" = burn ] || { echo "done after $(( $(date +%s) - start )) s"; exit 0; }
    # `share burn`: then one robot with 14 busy processes beside it (does the host's idle-core wake-up cost the
    # lone robot its round trip?)
    for i in $(seq 14); do timeout 120 python3 -c "while True: pass" & done
    stage burn /tmp/site-new 5 --robot-max-batch 8 --robots 1 --robot-n 40 --robot-warmup 5 --frontend inline \
        --no-in-process --serve-args "--compile-cache-dir /tmp/cc-8"
    kill $(jobs -p) 2>/dev/null
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
if [ "${1:-}" = profile ]; then
    # a second pod's load, function by function (bench/load_profile.py), after a first server compiled at
    # max-batch 8: with the kernel caches beside the artifacts, then with caches of its own
    stage profile-first /tmp/site-new 5 --robot-max-batch 8 --robots 1 --robot-n 5 --robot-warmup 1 \
        --frontend inline --no-in-process --serve-args "--compile-cache-dir /tmp/cc"
    PROFILE=(--checkpoint /tmp/base --device cuda --dtype bfloat16 --compile reduce-overhead --max-batch 8 --steps 10
        --compile-cache-dir /tmp/cc --top 45)
    PYTHONPATH=/tmp/site-new python3 "$REPO/bench/load_profile.py" "${PROFILE[@]}" >"$OUT/profile-shared.txt" 2>&1
    head -3 "$OUT/profile-shared.txt"
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind-own TRITON_CACHE_DIR=/tmp/tri-own PYTHONPATH=/tmp/site-new \
        python3 "$REPO/bench/load_profile.py" "${PROFILE[@]}" >"$OUT/profile-own.txt" 2>&1
    head -3 "$OUT/profile-own.txt"
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
if [ "${1:-}" = final ]; then
    # issue 24's targets in one run at this build: max-batch 1, 8 and 32 with 1, 8, 16 and 32 robots (the
    # inline front-end, the default), the in-process batches beside them; start times from the servers' logs
    stage final /tmp/site-new 5 --robot-max-batch 1,8,32 --robots 1,8,16,32 --frontend inline \
        --server-log "$OUT/logs-final" --serve-args "--compile-cache-dir /tmp/cc"
    grep -h "warmed up" "$OUT"/logs-final/*.log | sed 's/.*INFO //'
    grep "^| .*max-batch" "$OUT/final.md"
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
if [ "${1:-}" = rtc ]; then
    # real-time chunking in-process on the step compiled over a symbolic batch (plain, inpaint, guided: the
    # guided backward compiled too), against bench/results/rtc-h200.md's graph per bucket
    PYTHONPATH=/tmp/site-new timeout $(( $(left) - 5 )) python3 "$REPO/bench/rtc.py" --device cuda --size base \
        --dtype bfloat16 --compile reduce-overhead --sizes 1,8 --reps 20 --checkpoint /tmp/base --out "$OUT/rtc.md" \
        >"$OUT/rtc.log" 2>&1
    echo "rtc rc=$? after $(( $(date +%s) - start )) s"
    grep "^| \|warm-up" "$OUT/rtc.md" || tail -5 "$OUT/rtc.log"
    exit 0
fi
if [ "${1:-}" = frontends ]; then
    # max-batch 32 with 1 and 32 robots: the inline front-end against 1, 2 and 4 front-end processes sharing the
    # port (--frontend-processes), the in-process batches beside them; then max-batch 8 with 8 and 32 robots
    stage frontends /tmp/site-new 100 --robot-max-batch 32 --robots 1,32 --frontend inline,process,process:2,process:4 \
        --server-log "$OUT/logs-frontends" --serve-args "--compile-cache-dir /tmp/cc"
    grep "^| .*max-batch\|^| 32, \|^| 1, " "$OUT/frontends.md"
    stage frontends-mb8 /tmp/site-new 5 --robot-max-batch 8 --robots 8,32 --frontend inline,process:4 --no-in-process \
        --serve-args "--compile-cache-dir /tmp/cc"
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
if [ "${1:-}" = fe-profile ]; then
    # max-batch 32, 32 robots on 4 front-end processes under py-spy (PYSPY: its binary, carried), then inline
    # against 4 and 8 front-end processes at a 2 ms window, and 4 at 4 ms
    profile() {  # profile NAME: rank 0 of the server that runs --frontend-processes, and its children, for 10 s
        local pid="" port
        for _ in $(seq 600); do pid=$(pgrep -f -- "cli serve .*--frontend-processes" | head -1); [ -n "$pid" ] && break; sleep 0.5; done
        port=$(tr '\0' ' ' </proc/$pid/cmdline | sed 's/.*--port \([0-9]*\).*/\1/')
        for _ in $(seq 600); do curl -sf "127.0.0.1:$port/readyz" >/dev/null && break; sleep 0.5; done
        sleep 10
        "$PYSPY" record -p "$pid" --subprocesses --nonblocking --format raw -r 250 -d 10 -o "$OUT/prof-$1.txt" \
            >"$OUT/prof-$1.log" 2>&1
    }
    [ -n "${PYSPY:-}" ] && { profile process4 & }
    stage fe-profile /tmp/site-new 300 --robot-max-batch 32 --robots 32 --robot-n 400 --frontend process:4 \
        --no-in-process --serve-args "--compile-cache-dir /tmp/cc"
    wait
    stage fe-variants /tmp/site-new 60 --robot-max-batch 32 --robots 1,32 --frontend inline,process:4,process:8 \
        --serve-args "--compile-cache-dir /tmp/cc"
    grep "^| .*max-batch" "$OUT/fe-variants.md"
    stage fe-w4 /tmp/site-new 5 --robot-max-batch 32 --robots 1,32 --frontend process:4 --batch-window-ms 4 \
        --no-in-process --serve-args "--compile-cache-dir /tmp/cc"
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
if [ "${1:-}" = rtc-static ]; then
    # guided RTC side by side in one call: the step over a symbolic batch (the reference policy's compile) and a
    # graph per batch size (what the worker does under --rtc guided), one process each
    for variant in dynamic static; do
        PYTHONPATH=/tmp/site-new timeout $(( $(left) - 5 )) python3 "$REPO/bench/rtc.py" --device cuda --size base \
            --dtype bfloat16 --compile reduce-overhead --sizes 1,8 --reps 20 --checkpoint /tmp/base \
            --out "$OUT/rtc-$variant.md" $( [ $variant = static ] && echo --static-batch ) >"$OUT/rtc-$variant.log" 2>&1
        echo "rtc-$variant rc=$? after $(( $(date +%s) - start )) s"
        grep "^| \|warm-up" "$OUT/rtc-$variant.md" || tail -5 "$OUT/rtc-$variant.log"
    done
    exit 0
fi
if [ "${1:-}" = lone ]; then
    # one robot, inline, max-batch 1 / 8 / 32 (issue 24: p50 <= the in-process batch-1 time + 1 ms), the build in
    # .old against this one, interleaved, twice; then rank 0 under native py-spy (PYSPY: its binary, carried) for
    # 10 s of one robot at max-batch 32, thread by thread: where the 1.3-1.5 ms around infer go on this host
    for n in 1 2; do
        for b in old new; do
            [ -d "/tmp/site-$b" ] || continue
            stage "lone-$b-$n" /tmp/site-$b 150 --robot-max-batch 1,8,32 --robots 1 --robot-n 60 --frontend inline \
                $( [ "$b-$n" = new-1 ] && echo --in-process || echo --no-in-process ) \
                --serve-args "--compile-cache-dir /tmp/cc-$b"
        done
    done
    if [ -n "${PYSPY:-}" ]; then
        (
            for _ in $(seq 600); do pid=$(pgrep -f -- "cli serve .*--max-batch 32" | head -1); [ -n "$pid" ] && break; sleep 0.5; done
            port=$(tr '\0' ' ' </proc/$pid/cmdline | sed 's/.*--port \([0-9]*\).*/\1/')
            for _ in $(seq 600); do curl -sf "127.0.0.1:$port/readyz" >/dev/null && break; sleep 0.5; done
            sleep 5
            "$PYSPY" record -p "$pid" --native --threads --nonblocking --format raw -r 500 -d 10 \
                -o "$OUT/prof-lone.txt" >"$OUT/prof-lone.log" 2>&1
        ) &
        stage lone-profile /tmp/site-new 5 --robot-max-batch 32 --robots 1 --robot-n 1500 --frontend inline \
            --no-in-process --serve-args "--compile-cache-dir /tmp/cc-new"
        wait
    fi
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
if [ "${1:-}" = targets ]; then
    # issue 24's targets at this build in one call: max-batch 32 with 1 and 32 robots, inline against 4 front-end
    # processes, with the in-process batches of 1 and 32; then max-batch 1 and 8 with 1-32 robots (inline; their
    # one-robot rows compare with the first stage's in-process batch-1 time)
    # `targets short` (a call with less than ~500 s): the first stage alone
    stage targets-mb32 /tmp/site-new "$( [ "${2:-}" = short ] && echo 5 || echo 240 )" --robot-max-batch 32 \
        --robots 1,32 --frontend inline,process:4 --server-log "$OUT/logs-mb32" --serve-args "--compile-cache-dir /tmp/cc"
    [ "${2:-}" = short ] && { grep -h "^| .*max-batch\|^| 1 robot" "$OUT"/targets-*.md; exit 0; }
    stage targets-mb1-8 /tmp/site-new 70 --robot-max-batch 1,8 --robots 1,8,16,32 --frontend inline \
        --no-in-process --server-log "$OUT/logs-mb1-8" --serve-args "--compile-cache-dir /tmp/cc"
    grep -h "^| .*max-batch\|^| 1 robot" "$OUT"/targets-*.md
    # the floor under the one-robot target: floor servers that only wait the batch-1 time, beside the real
    # server at max-batch 8 (its graphs loaded from the artifacts above), and the build in .old when carried,
    # rounds interleaved
    [ "$(left)" -gt 60 ] && PYTHONPATH=/tmp/site-new timeout $(( $(left) - 5 )) python3 "$REPO/bench/lone_floor.py" \
        --compute-ms 14.8 --checkpoint /tmp/base --n 150 --rounds 3 --out "$OUT/lone-floor.md" --serve-args \
        "--device cuda --dtype bfloat16 --steps 10 --compile reduce-overhead --max-batch 8 --compile-cache-dir /tmp/cc" \
        --serve-variant "" \
        $( [ -d /tmp/site-old ] && echo --serve-variant PYTHONPATH=/tmp/site-old ) >"$OUT/lone-floor.log" 2>&1
    grep "^| " "$OUT/lone-floor.md" || tail -5 "$OUT/lone-floor.log"
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
if [ "${1:-}" = window ]; then
    # max-batch 32 with 32 robots: does a longer batch window fill the process front-end's batches (24.4 of 32
    # at 2 ms), and what does it cost inline; the in-process batch-32 time once, beside them
    for w in 2 5 10; do
        stage "window-$w" /tmp/site-new 30 --robot-max-batch 32 --robots 32 --frontend process,inline \
            --batch-window-ms "$w" --serve-args "--compile-cache-dir /tmp/cc" \
            $( [ "$w" = 10 ] && echo --in-process || echo --no-in-process )
    done
    echo "done after $(( $(date +%s) - start )) s"
    exit 0
fi
stage head /tmp/site-new 300 --robot-max-batch 8 --robots 1,8,16,32 --frontend inline,process --serve-args "--compile-cache-dir /tmp/cc"
[ -d "$REPO/.old" ] && stage old-process /tmp/site-old 200 --robot-max-batch 8 --robots 8,16 --frontend process --no-in-process \
    --serve-args "--compile-cache-dir /tmp/cc-old"
OMP_NUM_THREADS=1 stage head-omp1 /tmp/site-new 80 --robot-max-batch 8 --robots 8,16 --frontend inline,process --no-in-process \
    --serve-args "--compile-cache-dir /tmp/cc"
stage head-gil05 /tmp/site-new 5 --robot-max-batch 8 --robots 8,16 --frontend inline --no-in-process \
    --serve-args "--compile-cache-dir /tmp/cc --gil-switch-ms 0.5"
echo "done after $(( $(date +%s) - start )) s"
