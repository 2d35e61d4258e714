"""How far one reconcile travels through the operator's code: files and function hops to the StatefulSet.

A real kube-apiserver (``tests/support/control_plane.py``, no controllers
needed) holds a PolicyServer whose checkpoint status already says Ready, so
one pass goes all the way: read the object, parse the spec, read the
children, plan, and write the StatefulSet.  A profiler hook records every
call into the project's own files during that pass, in order, until the
StatefulSet write is entered; the records are reduced as
``bench/request_path.py`` reduces a request's:

* **hops**: the distinct project functions entered (comprehensions and
  lambdas left out; a function entered several times counts once);
* **files**: the distinct source files they live in;
* **module crossings**: calls from one project file into another, repeats
  included.

``--rev REV`` measures the operator as it was at a git revision (its tree is
exported and laid out as the package, in a child process), so before and
after come from the same script against the same apiserver::

    python bench/reconcile_path.py --rev 5f72225     # before the observe/plan/apply/status split
    python bench/reconcile_path.py                   # the working tree
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHILD = r"""
import json, os, sys, uuid
import yaml
import kubernetes.client, kubernetes.config
from policy_operator.operator import reconcile as rec
from policy_operator.operator.spec import parse_spec
import policy_operator
assert policy_operator.__file__.startswith(os.environ["TREE"]), policy_operator.__file__

kubernetes.config.load_kube_config(os.environ["KUBECONFIG"])
api = kubernetes.client.ApiClient()
kube_mod = __import__("policy_operator.operator.kube", fromlist=["x"])
kube = (getattr(kube_mod, "Kube", None) or getattr(kube_mod, "KubeClient"))(api)
ns, name = os.environ["NS"], "path"
body = {"image": "img:1", "checkpoint": {"source": "hf://org/policy"}}
key = parse_spec(body, name=name, namespace=ns).checkpoint.key
custom = kubernetes.client.CustomObjectsApi(api)
custom.create_namespaced_custom_object("policyoperator.io", "v1alpha1", ns, "policyservers",
    {"apiVersion": "policyoperator.io/v1alpha1", "kind": "PolicyServer", "metadata": {"name": name}, "spec": body})
custom.patch_namespaced_custom_object_status("policyoperator.io", "v1alpha1", ns, "policyservers", name,
    {"status": {"checkpoint": {"key": key, "phase": "Ready"}}})

roots = tuple(os.path.join(os.environ["TREE"], d) + os.sep for d in ("policy_operator",))
records, state = [], {"cut": None}

def tracer(frame, event, arg):
    if event != "call" or state["cut"] is not None:
        return
    path = os.path.abspath(frame.f_code.co_filename)
    if not path.startswith(roots) or frame.f_code.co_name.startswith("<"):
        return
    rel = os.path.relpath(path, os.environ["TREE"] + "/policy_operator")
    rel = rel if rel.split(os.sep)[0] in ("operator", "runtime") else "policy_operator/" + rel
    caller = frame.f_back
    caller_path = os.path.abspath(caller.f_code.co_filename) if caller else ""
    records.append({"file": rel, "fn": frame.f_code.co_qualname, "from_project": caller_path.startswith(roots),
                    "caller": caller_path})
    if rel.endswith("kube.py") and frame.f_code.co_name in ("create", "apply"):
        obj = frame.f_locals.get("obj") or {}
        if isinstance(obj, dict) and obj.get("kind") == "StatefulSet":
            state["cut"] = len(records)

sys.setprofile(tracer)
try:
    rec.reconcile(kube, ns, name, post_event=lambda owner, event: None, probe_timeout=1.0)
finally:
    sys.setprofile(None)
assert state["cut"], "the pass never wrote the StatefulSet"
print(json.dumps(records[: state["cut"]]))
"""


def export_tree(rev: str, into: Path) -> Path:
    """``git archive REV`` laid out as the import names: policy_operator/{,runtime,operator}."""
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "policy_operator", "runtime", "operator", "crds"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(src, filter="data")
    return link_tree(src, into / "pkg")


def link_tree(src: Path, pkg: Path) -> Path:
    (pkg / "policy_operator").mkdir(parents=True)
    for item in (src / "policy_operator").iterdir():
        (pkg / "policy_operator" / item.name).symlink_to(item)
    (pkg / "policy_operator" / "runtime").symlink_to(src / "runtime")
    (pkg / "policy_operator" / "operator").symlink_to(src / "operator")
    return pkg


def measure(cp, pkg: Path, crd: Path, namespace: str) -> list[dict]:
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    cp.kubectl("wait", "--for=condition=Established", "crd/policyservers.policyoperator.io", "--timeout=60s")
    cp.create_namespace(namespace)
    env = {**cp.env, "PYTHONPATH": str(pkg), "TREE": str(pkg), "NS": namespace}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=pkg, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(records: list[dict]) -> dict:
    hops, seen = [], set()
    for r in records:
        key = (r["file"], r["fn"])
        if key not in seen:
            seen.add(key)
            hops.append(f"{r['file']}:{r['fn']}")
    files = sorted({r["file"] for r in records})
    crossings = sum(
        1 for r in records if r["from_project"] and os.path.basename(r["caller"]) != os.path.basename(r["file"])
    )
    return {"hops": hops, "files": files, "crossings": crossings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rev", action="append", default=[], help="git revision(s) to measure besides the working tree (repeatable)"
    )
    parser.add_argument("--json", type=Path, help="write every measurement here")
    args = parser.parse_args()
    from tests.support.control_plane import ControlPlane

    results = {}
    with tempfile.TemporaryDirectory() as tmp, ControlPlane(Path(tmp) / "cp", controllers=False, scheduler=False) as cp:
        for i, rev in enumerate([*args.rev, "working tree"]):
            where = Path(tmp) / f"tree{i}"
            if rev == "working tree":
                pkg = link_tree(REPO, where / "pkg")
                crd = REPO / "crds" / "policyservers.yaml"
            else:
                pkg = export_tree(rev, where)
                crd = where / "src" / "crds" / "policyservers.yaml"
            results[rev] = summarize(measure(cp, pkg, crd, f"path-{i}"))
    for rev, s in results.items():
        print(f"## {rev}: {len(s['hops'])} hops in {len(s['files'])} files, {s['crossings']} module crossings")
        for n, hop in enumerate(s["hops"], 1):
            print(f"  {n:2}. {hop}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
