"""``make demo-cluster``: the whole stack on this machine, for a person to watch.

A real control plane of its own (tests/support/control_plane.py: etcd,
kube-apiserver, kube-controller-manager, kube-scheduler), the real operator
and the local node (tests/support/local_node_cluster.py); a checkpoint made
by ``policyserver checkpoint init`` behind a loopback HTTP server that wants
a bearer token; ``kubectl apply`` of examples/policyserver-cfgp2-dp1.yaml
edited to point at it (CPU, 2 steps); the status as it moves to Available;
``kubectl get ps``; where the time went; a few actions through openpi-client
via the Service (the node's proxy); ``kubectl delete``; and every process it
started ends, whatever happens.  docs/e2e.md shows a run.
"""

from __future__ import annotations

import argparse
import base64
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from policy_operator import constants as C

from .control_plane import ControlPlane, ControlPlaneError
from .http_checkpoint_server import CheckpointServer
from .local_node_cluster import REPO, LocalCluster, for_local_node, format_timings, free_port_on, phase_timings
from .net import wait_for
from .servers import VENV_BIN

NS = "demo"
TOKEN = "demo-checkpoint-token"
EXAMPLE = REPO / "examples" / "policyserver-cfgp2-dp1.yaml"


def _say(text: str = "") -> None:
    print(text, flush=True)


def _watch_until_available(cluster: LocalCluster, name: str, t0: float, timeout: float) -> float:
    """Print each phase change; the time Available became True."""
    seen = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = cluster.status(name)
        phase = status.get("phase")
        if phase != seen:
            seen = phase
            _say(f"  {time.time() - t0:6.1f}s  phase {phase}  ranks {status.get('ranksReady', '-')}")
        if any(c["type"] == C.COND_AVAILABLE and c["status"] == "True" for c in status.get("conditions") or []):
            return time.time()
        time.sleep(0.1)
    raise TimeoutError(f"{name} was not Available within {timeout:.0f}s\n{cluster.describe()}")


def _actions(cluster: LocalCluster, name: str, n: int) -> None:
    import numpy as np

    from policy_operator.runtime.client import robolab_observation

    from .openpi import session_at

    host, port = cluster.node.service_address(NS, name, C.PORT_NAME)
    t = time.time()
    # the Service sends traffic to pods the kubelet reports Ready (readinessProbe every 5 s), which can come a
    # little after the operator's own /readyz poll made the PolicyServer Available
    wait_for(lambda: cluster.node.proxy.backends(NS, name), 60, what=f"a ready endpoint behind Service {name}")
    _say(f"Service {NS}/{name}: a ready endpoint {time.time() - t:.1f}s after Available was seen")
    with session_at(host, port) as client:
        meta = client.get_server_metadata()
        _say(
            f"openpi session -> ws://{host}:{port} (Service {NS}/{name} port {C.PORT_NAME}, the node's proxy): "
            f"layout {meta['layout']}, action shape {meta['action_shape']}, {meta['steps']} steps, "
            f"guidance {meta['guidance']}"
        )
        for i in range(n):
            t = time.perf_counter()
            actions = client.infer(robolab_observation(meta, seed=i))["actions"]
            ms = (time.perf_counter() - t) * 1e3
            _say(f"  request {i}: {ms:6.1f} ms  first action {np.array2string(actions[0], precision=3)}")


def run(workdir: Path, n: int, timeout: float, size: str) -> int:
    ckpt_root = workdir / "sources"
    subprocess.run(
        [str(VENV_BIN / "policyserver"), "checkpoint", "init", str(ckpt_root / "ckpt"), "--size", size],
        check=True,
        capture_output=True,
        timeout=300,
    )
    weights = (ckpt_root / "ckpt" / C.WEIGHTS_FILE).stat().st_size
    server = CheckpointServer(ckpt_root, token=TOKEN).start()
    control_plane = ControlPlane(workdir / "control-plane")
    cluster: LocalCluster | None = None
    try:
        _say(f"control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) starting in {workdir} ...")
        t = time.time()
        control_plane.start()
        _say(f"  up in {time.time() - t:.1f}s at {control_plane.url} (logs {control_plane.logs})")
        t = time.time()
        cluster = LocalCluster(control_plane, workdir / "cluster", NS)  # needs the control plane's kubeconfig
        cluster.start()
        _say(
            f"  CRD, namespace {NS}, local node and operator in {time.time() - t:.1f}s; "
            f"operator log {cluster.operator.log}, pods under {cluster.node.root}"
        )
        doc = yaml.safe_load(EXAMPLE.read_text())
        secret = doc["spec"]["checkpoint"]["secretRef"]["name"]
        cluster.api.create(
            "v1",
            "secrets",
            {"metadata": {"name": secret}, "data": {C.SECRET_TOKEN_KEY: base64.b64encode(TOKEN.encode()).decode()}},
            NS,
        )
        port = free_port_on(cluster.node.ips(8))
        doc = for_local_node(doc, source=server.url_for("ckpt/"), port=port)
        name = doc["metadata"]["name"]
        _say(
            f"\n$ kubectl apply -f {EXAMPLE.relative_to(REPO)}   (source {doc['spec']['checkpoint']['source']}, "
            f"device cpu, 2 steps, port {port})"
        )
        t0 = time.time()
        _say("  " + cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc)).stdout.strip())
        available_at = _watch_until_available(cluster, name, t0, timeout)
        _say(f"\n$ kubectl wait --for=condition=Available policyserver/{name}")
        _say(
            "  "
            + cluster.kubectl(
                "wait", "--for=condition=Available", f"policyserver/{name}", "--timeout=30s"
            ).stdout.strip()
        )
        _say("\n$ kubectl get ps")
        _say(cluster.kubectl("get", C.SHORT_NAME).stdout.rstrip())
        _say("\n$ kubectl get pods")
        _say(cluster.kubectl("get", "pods").stdout.rstrip())
        _say(
            f"\nkubectl apply -> Available, by phase ({size} checkpoint, {weights / 2**20:.1f} MiB of weights, "
            f"downloaded {server.count('/ckpt/' + C.WEIGHTS_FILE)} time(s)):"
        )
        _say(format_timings(phase_timings(cluster, name, t0, available_at)))
        _say("")
        _actions(cluster, name, n)
        procs = cluster.node.processes()
        ranks = [p for p in procs if "policy_operator.runtime.worker" in p.argv and "RANK" in p.env]
        _say(f"\n$ kubectl delete ps {name}   (running: torchrun + {len(ranks)} ranks, {len(procs)} processes in all)")
        t = time.time()
        _say("  " + cluster.kubectl("delete", C.SHORT_NAME, name, "--timeout=120s", timeout=150).stdout.strip())
        wait_for(
            lambda: not cluster.node.processes() and not cluster.list("v1", "pods"),
            120,
            what="every pod and process gone",
        )
        _say(
            f"  every pod deleted and every process ended after {time.time() - t:.1f}s "
            f"(preStop sleep 5s, then SIGTERM: torchrun drains and exits)"
        )
        return 0
    finally:
        try:
            if cluster is not None:
                cluster.stop()
        finally:
            control_plane.stop()
            server.stop()
        left = cluster.node.processes() if cluster is not None else []
        if left:
            _say(f"warning: processes left: {[p.pid for p in left]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.demo_cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3, help="actions to request (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for Available")
    parser.add_argument(
        "--size",
        choices=["tiny", "small", "base"],
        default="tiny",
        help="reference checkpoint size (default %(default)s)",
    )
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="demo-cluster-"))
    try:
        return run(workdir, args.requests, args.timeout, args.size)
    except (TimeoutError, subprocess.CalledProcessError, ControlPlaneError) as exc:
        print(f"demo-cluster: error: {exc}", file=sys.stderr)
        if isinstance(exc, subprocess.CalledProcessError):
            print(exc.stderr, file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
