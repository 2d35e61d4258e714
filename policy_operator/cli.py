"""policyserver: serve flow-matching robot action policies on multi-GPU pods, and run their operator.

Each subcommand lives in the module that owns its concept and exposes
``add_arguments(parser)`` and ``main(args) -> int``.  Those modules keep heavy
imports (torch, kopf) inside ``main`` so ``--help`` and the operator image stay
fast and light.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from policy_operator import __version__

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("policy_operator.runtime.serve_cli", "serve a policy over the openpi WebSocket protocol"),
    "client": ("policy_operator.runtime.client", "send RoboLab-shaped observations and print latency"),
    "probe": ("policy_operator.runtime.probe", "check a server like a robot: metadata, one request, finite actions"),
    "checkpoint": ("policy_operator.runtime.checkpoint_cmd", "create or verify checkpoint directories"),
    "fetch": ("policy_operator.runtime.checkpoint.fetch", "download a checkpoint once into a shared volume"),
    "demo": ("policy_operator.runtime.demo", "serve a tiny checkpoint on 1 and 2 ranks and compare"),
    "operator": ("policy_operator.operator.main", "run the kopf operator that reconciles PolicyServers"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="policyserver", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"policyserver {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip().splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
