"""Download progress from the fetch container's ``/progress`` endpoint to ``status.checkpoint.progress`` and
``kubectl get ps``.

One line format (``policy_operator/fetch_progress.py``) on both sides: the
fetch's real progress reporter writes it, its container serves the newest one
over HTTP (``runtime/checkpoint/progress_server.py``) and the operator reads
it there, never from the pod's log (it holds no ``pods/log``).  Here: the
format round trip, the reporter's own output parsed back, the real ``policyserver
fetch`` serving its progress while it downloads, the operator's read of it,
its pure steps (which pod, what state, what status, what merge patch), the
status schema the apiserver prunes by, the printer column, and on the real
control plane the status while a download runs, with no container log to read.
"""

from __future__ import annotations

import io
import os
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import yaml
from kubernetes.client import V1Job, V1Pod

from policy_operator import constants as C
from policy_operator import fetch_progress as fetch_progress_format
from policy_operator.fetch_progress import FetchProgress
from policy_operator.operator import crd, download_state, manifests, observe, rbac, workload_state
from policy_operator.operator import status as status_step
from policy_operator.operator.download_state import CheckpointPhase
from policy_operator.operator.resource import PolicyServerStatus
from policy_operator.operator.spec import parse_spec
from tests.support.api_objects import api_object, api_objects
from tests.support.net import free_port, wait_for

NOW = "2025-01-01T00:00:00Z"


def spec() -> Any:
    return parse_spec({"image": "img:1", "checkpoint": {"source": "hf://org/p"}}, name="ps", namespace="ns")


# --- the line -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "progress",
    [
        FetchProgress(1288490188, 3650722201, 12_300_000.0),
        FetchProgress(0, 10, 0.0),
        FetchProgress(5 * 1024**4, None, 1.0),  # a source that gives no size
    ],
)
def test_line_round_trip(progress: FetchProgress) -> None:
    line = progress.line()
    assert line.startswith(f"fetch: {progress.text} [progress ")
    assert fetch_progress_format.parse_line(line) == progress
    assert fetch_progress_format.parse_line(progress.line(label="fetch hf://org/p")) == progress


def test_text_is_what_people_read() -> None:
    p = FetchProgress(1288490188, 3650722201, 12_300_000.0)
    assert p.text == "1.2 GiB / 3.4 GiB (35.3%) 12.3 MB/s"
    assert FetchProgress(512, None, 2e6).text == "512 B 2.0 MB/s"
    assert p.as_status() == {
        "bytesDone": 1288490188,
        "bytesTotal": 3650722201,
        "bytesPerSecond": 12300000,
        "text": p.text,
    }
    assert "bytesTotal" not in FetchProgress(1, None, 0.0).as_status()


def test_last_progress_is_the_newest_line_and_ignores_everything_else() -> None:
    log = "\n".join(
        [
            "fetch: resolving hf://org/p",
            FetchProgress(10, 100, 1.0).line(),
            "a line that mentions [progress but is not one",
            FetchProgress(60, 100, 5.0).line(),
            "WARNING: retrying model.safetensors after a reset",
            "",
        ]
    )
    assert fetch_progress_format.last_progress(log) == FetchProgress(60, 100, 5.0)
    assert fetch_progress_format.last_progress("fetch: resolving\n[progress x/y z]\n") is None
    assert fetch_progress_format.last_progress("") is None
    # a log cut by limitBytes in the middle of the newest line: the one before it counts
    cut = log + FetchProgress(90, 100, 7.0).line()[:30]
    assert fetch_progress_format.last_progress(cut) == FetchProgress(60, 100, 5.0)


def test_the_fetch_reporter_writes_lines_the_operator_reads() -> None:
    """The runtime's real reporter, off a TTY as in a Job's log, parsed back by the operator's reader."""
    from policy_operator.runtime.checkpoint.progress_meter import Progress

    out = io.StringIO()
    with Progress(total=4096, stream=out, interval=0.02, initial=1024) as progress:
        progress.advance(1024)
        deadline = time.monotonic() + 10
        while fetch_progress_format.last_progress(out.getvalue()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        progress.advance(2048)
        deadline = time.monotonic() + 10
        while (
            fetch_progress_format.last_progress(out.getvalue()) or FetchProgress(0, 0, 0)
        ).done != 4096 and time.monotonic() < deadline:
            time.sleep(0.02)
    read = fetch_progress_format.last_progress(out.getvalue())
    assert read is not None and (read.done, read.total) == (4096, 4096) and read.rate > 0
    assert read.text in out.getvalue()


# --- the operator's steps --------------------------------------------------------------------------


def fetch_pod(name: str, state: str, created: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "creationTimestamp": created},
        "status": {"containerStatuses": [{"name": manifests.FETCH_CONTAINER, "state": {state: {}}}]},
    }


def test_the_running_attempt_is_the_pod_whose_progress_is_read() -> None:
    pods = [
        fetch_pod("old", "terminated", "2025-01-01T00:00:00Z"),
        fetch_pod("new", "running", "2025-01-01T00:01:00Z"),
        fetch_pod("next", "waiting", "2025-01-01T00:02:00Z"),
    ]
    running = observe.running_fetch_pod(api_objects(V1Pod, pods))
    assert running is not None and running.metadata is not None and running.metadata.name == "new"
    assert observe.running_fetch_pod(api_objects(V1Pod, pods[:1])) is None


def test_the_fetch_job_serves_its_progress_on_the_port_the_operator_reads() -> None:
    job = manifests.build_fetch_job(spec())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][-2:] == ["--progress-port", str(C.FETCH_PROGRESS_PORT)]
    assert container["ports"] == [
        {"name": C.FETCH_PROGRESS_PORT_NAME, "containerPort": C.FETCH_PROGRESS_PORT, "protocol": "TCP"}
    ]
    assert observe.progress_port(api_object(V1Pod, job["spec"]["template"])) == C.FETCH_PROGRESS_PORT
    assert observe.progress_port(V1Pod()) == C.FETCH_PROGRESS_PORT


def running_pod_at(port: int) -> V1Pod:
    pod = fetch_pod("p", "running", "2025-01-01T00:00:00Z")
    pod["status"]["podIP"] = "127.0.0.1"
    pod["spec"] = {
        "containers": [
            {"name": manifests.FETCH_CONTAINER, "ports": [{"name": C.FETCH_PROGRESS_PORT_NAME, "containerPort": port}]}
        ]
    }
    return api_object(V1Pod, pod)


def test_the_operator_reads_the_newest_line_from_the_progress_endpoint() -> None:
    from policy_operator.runtime.checkpoint.progress_server import ProgressServer

    with ProgressServer(0, host="127.0.0.1") as server:
        assert server.bound_port is not None
        pod = running_pod_at(server.bound_port)
        assert observe.fetch_progress(active_job(), [pod]) is None  # 204: nothing downloaded yet
        server.update(FetchProgress(10, 100, 1.0))
        server.update(FetchProgress(50, 100, 2e6))
        line = observe.fetch_progress(active_job(), [pod])
        assert line is not None and fetch_progress_format.last_progress(line) == FetchProgress(50, 100, 2e6)
        assert (
            observe.fetch_progress(api_object(V1Job, {"status": {"succeeded": 1}}), [pod]) is None
        )  # a Job that is done: not asked
        with pytest.raises(urllib.error.HTTPError) as other:
            urllib.request.urlopen(f"http://127.0.0.1:{server.bound_port}/other", timeout=5)  # noqa: S310
        assert other.value.code == 404
    # the pod gone or not listening: no progress, and the pass goes on
    assert observe.fetch_progress(active_job(), [running_pod_at(free_port())]) is None


@pytest.mark.slow  # a throttled download (8 s) read while it runs
@pytest.mark.timeout(120)
def test_policyserver_fetch_serves_its_progress_while_it_downloads(tmp_path) -> None:
    """The real CLI, throttled: /progress answers with growing byte counts before the download is done."""
    import subprocess

    from tests.support.http_checkpoint_server import CheckpointServer
    from tests.support.servers import VENV_BIN

    subprocess.run(
        [str(VENV_BIN / "policyserver"), "checkpoint", "init", str(tmp_path / "src" / "ckpt")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    size = sum(p.stat().st_size for p in (tmp_path / "src" / "ckpt").rglob("*") if p.is_file())
    port = free_port()
    with CheckpointServer(tmp_path / "src", throttle_bps=max(size // 8, 1)) as source:
        proc = subprocess.Popen(
            [str(VENV_BIN / "policyserver"), "fetch", source.url_for("ckpt/"), str(tmp_path / "dest")]
            + ["--progress-port", str(port)],
            env={**os.environ, C.ENV_HOST: "127.0.0.1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            pod = running_pod_at(port)
            seen: list[FetchProgress] = []

            def two_readings() -> bool:
                line = observe.fetch_progress(active_job(), [pod])
                progress = fetch_progress_format.last_progress(line or "")
                if progress is not None and (not seen or progress.done != seen[-1].done):
                    seen.append(progress)
                return len(seen) >= 2

            wait_for(two_readings, 60, interval=0.2, what="two progress readings from /progress")
            assert proc.poll() is None, "the download ended before its progress was read twice"
            assert all(p.total == size and 0 <= p.done <= size for p in seen), seen
            assert seen[0].done < seen[-1].done
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def active_job() -> V1Job:
    return api_object(V1Job, {"metadata": {"name": "j"}, "status": {"active": 1, "failed": 1}})


def test_a_downloading_state_carries_the_progress_and_says_it() -> None:
    log = FetchProgress(10, 100, 1.0).line() + "\n" + FetchProgress(50, 100, 2e6).line() + "\n"
    state = download_state.checkpoint_state(spec(), active_job(), [], None, log)
    assert state.phase == CheckpointPhase.DOWNLOADING and state.progress == FetchProgress(50, 100, 2e6)
    assert state.message == "downloading hf://org/p: 50 B / 100 B (50.0%) 2.0 MB/s (attempt 2/4)"
    # no answer from /progress (starting, unreachable) or no progress line yet: the state as before, without it
    for no_progress in (None, "fetch: resolving hf://org/p\n"):
        state = download_state.checkpoint_state(spec(), active_job(), [], None, no_progress)
        assert state.progress is None and state.message == "downloading hf://org/p (attempt 2/4)"
    # a Job that is done has no progress, whatever its pod's log still says
    done = download_state.checkpoint_state(
        spec(), api_object(V1Job, {"metadata": {"name": "j"}, "status": {"succeeded": 1}}), [], None, log
    )
    assert done.phase == CheckpointPhase.READY and done.progress is None


def build(checkpoint: download_state.CheckpointState, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    workload = workload_state.WorkloadState(exists=False, desired=1, rolling=True)
    return status_step.build_status(
        spec(),
        checkpoint=checkpoint,
        workload=workload,
        pods=[],
        service_exists=False,
        previous=previous,
        generation=1,
        now=NOW,
    ).document


def test_status_has_the_progress_while_downloading_and_the_schema_keeps_it() -> None:
    log = FetchProgress(50, 100, 2e6).line()
    status = build(download_state.checkpoint_state(spec(), active_job(), [], None, log))
    assert status["checkpoint"]["progress"] == FetchProgress(50, 100, 2e6).as_status()
    # closed model = the CRD's schema: a field it lacks would be pruned by the apiserver, and fails here
    parsed = PolicyServerStatus.model_validate(status)
    assert parsed.checkpoint is not None and parsed.checkpoint.progress is not None
    assert (
        parsed.model_dump(by_alias=True, exclude_none=True)["checkpoint"]["progress"]
        == status["checkpoint"]["progress"]
    )


def test_progress_leaves_the_status_once_the_download_is_done() -> None:
    downloading = build(download_state.checkpoint_state(spec(), active_job(), [], None, FetchProgress(5, 9, 1).line()))
    ready = build(
        download_state.checkpoint_state(
            spec(), api_object(V1Job, {"metadata": {"name": "j"}, "status": {"succeeded": 1}}), [], None
        ),
        previous=downloading,
    )
    assert "progress" not in ready["checkpoint"]
    patch = status_step.status_patch(downloading, ready, full=True)
    assert patch is not None and patch["checkpoint"]["progress"] is None  # a merge patch must null it explicitly
    assert patch["checkpoint"]["phase"] == "Ready"
    # nothing changed: no patch at all
    assert status_step.status_patch(ready, ready, full=True) is None


def test_printer_column_reads_the_progress_text() -> None:
    columns = {c["name"]: c for c in crd.PRINTER_COLUMNS}
    assert columns["Progress"]["jsonPath"] == ".status.checkpoint.progress.text"
    names = [c["name"] for c in crd.PRINTER_COLUMNS]
    assert names.index("Progress") == names.index("Checkpoint") + 1
    on_disk = yaml.safe_load(crd.CRD_PATH.read_text())
    (version,) = on_disk["spec"]["versions"]
    assert columns["Progress"] in version["additionalPrinterColumns"]
    assert crd.schema_at(version["schema"]["openAPIV3Schema"], columns["Progress"]["jsonPath"])["type"] == "string"


def test_rbac_grants_no_pod_logs() -> None:
    """Reading logs and creating Jobs together read any Secret of the namespace: progress comes over HTTP."""
    assert not [r for r in rbac.RULES if r.resource.startswith("pods/")]
    assert not rbac.allows(rbac.policy_rules(all_namespaces=True), "", "pods/log", "get")


# --- on a real control plane ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_kubectl_get_ps_shows_a_running_downloads_progress(control_plane, tmp_path) -> None:
    """A throttled download by the real fetch Job: its /progress -> the operator -> the status.  The local node
    serves no container log here (no kubelet log endpoint), so nothing but /progress can carry the numbers."""
    import subprocess

    from tests.support.http_checkpoint_server import CheckpointServer
    from tests.support.local_node_cluster import LocalCluster, for_local_node
    from tests.support.net import wait_for
    from tests.support.servers import VENV_BIN

    subprocess.run(
        [str(VENV_BIN / "policyserver"), "checkpoint", "init", str(tmp_path / "src" / "ckpt")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    size = sum(p.stat().st_size for p in (tmp_path / "src" / "ckpt").rglob("*") if p.is_file())
    namespace, name = "fetch-progress", "slow"
    # about 12 s of download: several progress lines (one every 2 s) while the operator resyncs every 0.5 s
    with (
        CheckpointServer(tmp_path / "src", throttle_bps=max(size // 12, 1)) as source,
        LocalCluster(control_plane, tmp_path / "cluster", namespace, backoff_s=1.0, resync_s=0.5, gpus=1) as lc,
    ):
        doc = for_local_node(
            yaml.safe_load((crd.REPO / "examples" / "policyserver-minimal.yaml").read_text()),
            source=source.url_for("ckpt/"),
            port=8000,
        )
        doc["metadata"].update(name=name, namespace=namespace)
        doc["spec"]["replicas"] = 0  # the fetch runs all the same; no server pod needed here
        lc.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

        seen: list[dict[str, Any]] = []

        def progressing() -> bool:
            progress = (lc.status(name).get("checkpoint") or {}).get("progress")
            if progress and (not seen or progress != seen[-1]):
                seen.append(progress)
            return len({p["bytesDone"] for p in seen}) >= 2

        wait_for(progressing, 120, interval=0.3, what="two different progress readings in the status")
        header, row = lc.kubectl("get", C.SHORT_NAME, name).stdout.splitlines()[:2]
        columns = header.split()
        assert columns[:7] == ["NAME", "READY", "RANKS", "LAYOUT", "CHECKPOINT", "PROGRESS", "PHASE"]
        cell = row[header.index("PROGRESS") : header.index("PHASE")].strip()
        assert "Downloading" in row and " / " in cell and "%)" in cell and cell.endswith("MB/s"), (header, row)
        for progress in seen:
            assert progress["bytesTotal"] == size and 0 <= progress["bytesDone"] <= size
            assert progress["text"].startswith(FetchProgress(progress["bytesDone"], size, 0).text.split(" (")[0])
        assert [p["bytesDone"] for p in seen] == sorted(p["bytesDone"] for p in seen)
        message = lc.status(name)["checkpoint"]["message"]
        assert message.startswith(f"downloading {source.url_for('ckpt/')}")

        wait_for(
            lambda: (lc.status(name).get("checkpoint") or {}).get("phase") == "Ready",
            120,
            interval=0.3,
            what="download done",
        )
        wait_for(lambda: "progress" not in lc.status(name)["checkpoint"], 30, interval=0.3, what="progress cleared")
        header, row = lc.kubectl("get", C.SHORT_NAME, name).stdout.splitlines()[:2]
        assert row[header.index("CHECKPOINT") : header.index("PROGRESS")].strip() == "Ready", row
        assert row[header.index("PROGRESS") : header.index("PHASE")].strip() == "", row  # an empty cell
        lc.kubectl("delete", C.SHORT_NAME, name, "--timeout=120s", timeout=150)
