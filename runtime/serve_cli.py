"""Serve a policy over the openpi WebSocket protocol, on 1 rank or under torchrun.

``--cfgp C --dp D`` with C*D > 1 replaces this process with ``torchrun
--standalone --nproc-per-node=C*D -m policy_operator.runtime.worker`` and the
same flags, so signals reach torchrun directly; a single-rank layout runs in
this process.  The layout is checked before anything starts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from policy_operator import serve_flags
from policy_operator.exit_codes import ServeExit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve_flags.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from policy_operator.runtime.worker import preflight  # torch-free

    opts = serve_flags.ServeOptions.from_args(args)
    try:
        layout = preflight(opts)  # here too, or every torchrun rank would print it and torchrun a traceback
    except ValueError as exc:  # LayoutError is one
        print(f"policyserver: error: {exc}", file=sys.stderr)
        return ServeExit.LAYOUT
    if layout.world_size == 1 and "WORLD_SIZE" not in os.environ:
        from policy_operator.runtime.worker import run

        return run(opts)
    cmd = serve_flags.torchrun_argv(layout.world_size, serve_flags.to_argv(opts))
    exe = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    sys.stdout.flush()
    os.execv(exe, [exe, *cmd[1:]])
    return 1  # not reached
