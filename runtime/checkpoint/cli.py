"""Create or verify checkpoint directories (config.json + model.safetensors + manifest.json).

``verify`` is what the serving pod's init container runs against the shared
volume (``init``, which writes policies, is ``runtime/checkpoint_cmd.py``): it
trusts the files, not a status flag, and refuses a LeRobot checkpoint that
would run code as ``serve`` refuses it (``trusted_steps.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from policy_operator.constants import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE
from policy_operator.exit_codes import CheckpointExit
from policy_operator.runtime.checkpoint.format import CheckpointError, verify_checkpoint
from policy_operator.runtime.checkpoint.trusted_steps import check_lerobot_checkpoint, is_lerobot_checkpoint
from policy_operator.serve_flags import add_trust_remote_code


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``verify`` and ``prune`` (what the pods run); ``policyserver checkpoint`` adds ``init``
    (``runtime/checkpoint_cmd.py``: it writes policies, which this torch-free package never imports)."""
    add_subcommands(parser.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True))


def add_subcommands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "verify",
        help="check a checkpoint against its manifest (and completion marker)",
        description="Check a checkpoint directory against its manifest.",
    )
    p.add_argument("directory")
    p.add_argument(
        "--require-marker",
        action="store_true",
        help="also require the completion marker written by 'policyserver fetch' (it lists every file "
        "the fetch verified, so a checkpoint without manifest.json, such as a LeRobot one, passes)",
    )
    p.add_argument(
        "--references",
        action="store_true",
        help="also require every hub repository the checkpoint names to be fetched next to it and "
        "resolvable offline (policyserver fetch --references)",
    )
    p.add_argument("--hashes", action="store_true", help="re-hash every file (default: sizes only)")
    add_trust_remote_code(p)  # a LeRobot checkpoint is checked as serve loads it (checkpoint/trusted_steps.py)
    p.set_defaults(_action=_verify)
    p = sub.add_parser(
        "prune",
        help="remove old checkpoint directories from a cache volume",
        description="Remove checkpoints older than the kept ones (what the operator runs after a "
        "switch); see policy_operator/runtime/checkpoint/prune.py.",
    )
    from policy_operator.runtime.checkpoint import prune

    prune.add_arguments(p)
    p.set_defaults(_action=prune.main)


def _verify(args: argparse.Namespace) -> int:
    from policy_operator.runtime.checkpoint.errors import FetchError

    root = Path(args.directory)
    try:
        if args.require_marker:
            from policy_operator.runtime.checkpoint.fetch import check_complete

            marker = check_complete(root, verify=args.hashes)
        if args.require_marker and not (root / MANIFEST_FILE).is_file():
            missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if name not in marker["files"]]
            if missing:
                raise CheckpointError(f"{root} is not a checkpoint: {', '.join(missing)} is missing")
            count = len(marker["files"])  # the marker is the list the fetch verified
        else:
            count = len(verify_checkpoint(root, hashes=args.hashes))
        if args.references:
            from policy_operator.runtime.checkpoint.references import check_references

            check_references(root, root.parent)
        if is_lerobot_checkpoint(root):
            check_lerobot_checkpoint(root, trust_remote_code=args.trust_remote_code)
    except (CheckpointError, FetchError) as exc:
        print(f"policyserver: error: {exc}", file=sys.stderr)
        return CheckpointExit.INVALID
    print(f"{args.directory}: {count} files verified ({'sha256' if args.hashes else 'sizes'})")
    return CheckpointExit.OK


def main(args: argparse.Namespace) -> int:
    return args._action(args)
