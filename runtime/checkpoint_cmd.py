"""Create or verify checkpoint directories: init writes one with seeded random weights (a policy); verify, prune.

``init`` writes a policy (the reference policy, or a tiny LeRobot one), so it
lives here, beside the programs, and not in ``checkpoint/``: that package is
torch-free (the fetch Job and the init container import it) and is imported
by the policies, never the other way.  ``verify`` and ``prune`` are
``checkpoint/cli.py``'s.
"""

from __future__ import annotations

import argparse
import sys

from policy_operator.builtin_policies import LEROBOT_FAMILIES
from policy_operator.runtime.checkpoint import cli as checkpoint_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    p = sub.add_parser(
        "init",
        help="write a reference-policy (or LeRobot) checkpoint with seeded random weights",
        description="Write a reference-policy checkpoint with seeded random weights; with --lerobot, "
        "a LeRobot pretrained directory of that family, written without any hub.",
    )
    p.add_argument("directory")
    p.add_argument(
        "--size",
        choices=["tiny", "small", "base"],
        default="tiny",
        help="tiny | small | base; a LeRobot family has tiny and base (its published size)",
    )
    p.add_argument(
        "--lerobot",
        metavar="FAMILY",
        choices=list(LEROBOT_FAMILIES),
        default=None,
        help=f"{' | '.join(LEROBOT_FAMILIES)} (serve it with --policy lerobot)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(_action=_init)
    checkpoint_cli.add_subcommands(sub)


def _init(args: argparse.Namespace) -> int:
    if args.lerobot:
        from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint

        try:
            path = write_tiny_checkpoint(args.lerobot, args.directory, size=args.size, seed=args.seed)
        except ValueError as exc:
            print(f"policyserver: error: {exc}", file=sys.stderr)
            return 2
        print(path)
        return 0
    from policy_operator.runtime.policy.reference import init_checkpoint

    path = init_checkpoint(args.directory, args.size, args.seed)
    print(path)
    return 0


def main(args: argparse.Namespace) -> int:
    return args._action(args)
