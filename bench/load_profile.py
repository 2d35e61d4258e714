"""Where a rank's start goes, function by function: the runtime's own load path (``Runtime`` and
``Runtime.load``, weights, compile cache, compile set-up and every bucket's warm-up) under cProfile.

The warm-up log line (runtime/worker.py) says which phase is long; this says why.  Run it as the server would
start, with the same flags (one rank, no server, no port):

    python bench/load_profile.py --checkpoint /tmp/base --device cuda --dtype bfloat16 --compile reduce-overhead \
        --max-batch 8 --compile-cache-dir /tmp/cc --steps 10 [--top 40] [--out profile.txt]

It prints the phases (seconds since the process started) and the functions with the most cumulative time, then
those with the most time of their own.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

from policy_operator import serve_flags
from policy_operator.runtime.worker import Runtime, preflight, process_age_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    serve_flags.add_arguments(parser)
    parser.add_argument("--top", type=int, default=40, help="functions to print, by cumulative time")
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args(argv)
    opts = serve_flags.ServeOptions.from_args(args)
    layout = preflight(opts)
    print(f"{process_age_s():.1f}s: interpreter and imports", flush=True)
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    rt = Runtime(opts, layout)
    built = time.perf_counter()
    rt.load()
    profile.disable()
    print(
        f"{process_age_s():.1f}s: Runtime {built - started:.1f}s, load {rt.load_s:.1f}s, warm-up {rt.warmup_s:.1f}s",
        flush=True,
    )
    text = io.StringIO()
    for order in ("cumulative", "tottime"):  # what each phase calls, then where the time itself is spent
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(args.top)
    print(text.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            f.write(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
