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

from policy_operator.runtime import options

WORKER_MODULE = "policy_operator.runtime.worker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_arguments(parser)


def torchrun_argv(nproc: int, worker_args: list[str]) -> list[str]:
    """The launch command; the operator writes the same one into pod specs."""
    return ["torchrun", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", "-m", WORKER_MODULE,
            *worker_args]


def main(args: argparse.Namespace) -> int:
    from policy_operator.runtime.worker import preflight  # torch-free

    opts = options.ServeOptions.from_args(args)
    try:
        layout = preflight(opts)  # here too, or every torchrun rank would print it and torchrun a traceback
    except ValueError as exc:  # LayoutError is one
        print(f"policyserver: error: {exc}", file=sys.stderr)
        return 2
    if layout.world_size == 1 and "WORLD_SIZE" not in os.environ:
        from policy_operator.runtime.worker import run

        return run(opts)
    cmd = torchrun_argv(layout.world_size, options.to_argv(opts))
    exe = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    sys.stdout.flush()
    os.execv(exe, [exe, *cmd[1:]])
    return 1  # not reached
