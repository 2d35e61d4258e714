"""Run the kopf operator that reconciles PolicyServers.

``policyserver operator --namespace NS`` (a Role suffices) or
``--all-namespaces`` (needs a ClusterRole).  With two replicas, kopf peering
picks the leader: each replica takes a random priority, the highest one
works and the others pause until its peering heartbeat expires (needs the
KopfPeering CRD and an object named by ``--peering``).  ``--standalone``
skips peering for a single replica.  Liveness is kopf's probe endpoint with
this operator's own ``reconciler`` probe; logs are JSON lines by default.
"""

from __future__ import annotations

import argparse
import logging
import random

from policy_operator.constants import PEERING_NAME

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
LOG_FORMATS = ("json", "plain", "full")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        metavar="NS",
        help="reconcile PolicyServers in this namespace (repeatable; kopf globs such as 'team-*' allowed)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="reconcile PolicyServers in every namespace")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--standalone", action="store_true", help="no peering: only ever run one replica")
    peering.add_argument(
        "--peering",
        metavar="NAME",
        default=None,
        help="KopfPeering object for leader election between replicas; it must exist "
        f"(default: use {PEERING_NAME!r} if it exists, else run standalone)",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority (default: random, so that exactly one replica is active)",
    )
    parser.add_argument(
        "--liveness",
        default=DEFAULT_LIVENESS,
        metavar="URL",
        help=f"liveness endpoint served by kopf (default {DEFAULT_LIVENESS}; '' disables)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=None,
        metavar="S",
        help="full reconcile of every PolicyServer this often, incl. /readyz polling (default 10)",
    )
    parser.add_argument(
        "--probe-timeout",
        type=float,
        default=None,
        metavar="S",
        help="HTTP timeout of one pod's /readyz poll (default 2)",
    )
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="json", help="log line format (default json)")
    parser.add_argument("--verbose", action="store_true", help="log more")
    parser.add_argument("--debug", action="store_true", help="log everything, including API traffic")


def main(args: argparse.Namespace) -> int:
    import kopf  # heavy: only when the operator actually runs

    from policy_operator.operator.handlers import DEFAULT_RESYNC_S, OperatorConfig, register
    from policy_operator.operator.rank_probe import PROBE_TIMEOUT_S

    resync = DEFAULT_RESYNC_S if args.resync_seconds is None else args.resync_seconds
    probe_timeout = PROBE_TIMEOUT_S if args.probe_timeout is None else args.probe_timeout
    if resync <= 0 or probe_timeout <= 0:
        raise SystemExit("policyserver operator: --resync-seconds and --probe-timeout must be > 0")
    log_format = {"json": kopf.LogFormat.JSON, "plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL}
    kopf.configure(debug=args.debug, verbose=args.verbose, log_format=log_format[args.log_format])
    if not args.debug:  # one access line per kubelet liveness probe is noise
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)

    # exact namespace names need no namespace listing, so a Role suffices; globs need kopf's scanning
    exact = not args.all_namespaces and all(not set("*?[!") & set(ns) for ns in args.namespace)
    config = OperatorConfig(resync_seconds=resync, probe_timeout=probe_timeout, namespaced=exact)
    registry = kopf.OperatorRegistry()
    register(registry, config)

    settings = kopf.OperatorSettings()
    standalone: bool | None
    if args.standalone:
        standalone, peering_name = True, None
    else:
        standalone = False if args.peering else None  # None: kopf uses the peering object if it exists
        peering_name = args.peering or PEERING_NAME
        settings.peering.mandatory = bool(args.peering)
    priority = args.priority if args.priority is not None else random.SystemRandom().randint(1, 2**31 - 1)
    kopf.run(
        registry=registry,
        settings=settings,
        standalone=standalone,
        peering_name=peering_name,
        priority=priority,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness or None,
    )
    return 0
