"""The single-process policy server, end to end: real ``policyserver serve`` processes on 127.0.0.1.

Clients speak openpi-client's protocol through ``tests/support/openpi.py``:
``WebsocketClientPolicy`` (what RoboLab uses) as it connects and packs, plus
the ``close()`` it lacks, so no test leaves a session on a shared server (the
real class itself is refused without a token below and serves a LeRobot
policy in tests/test_lerobot_policies.py).  Frames it cannot produce (garbage
bytes, text, hand-built array maps) go over a plain ``websockets``
connection, which is the transport openpi-client uses.  One server per module
and configuration; tests that count metrics compare before and after their
own requests, so they do not depend on test order.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import threading
from collections.abc import Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import websockets
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.sync.client import ClientConnection, connect

from policy_operator import __version__
from policy_operator.constants import HEALTHZ_PATH, METRICS_PATH, READYZ_PATH
from policy_operator.runtime.engine_api import INLINE_MAX_BYTES
from policy_operator.runtime.policy.reference import PolicyConfig, ReferencePolicy, example_observation
from policy_operator.runtime.policy.sampler import sample_actions
from tests.support.http_checkpoint_server import CheckpointServer
from tests.support.openpi import OpenpiSession
from tests.support.plugins.held_policy import hold_prompt
from tests.support.servers import (
    AUTH_TOKEN,
    NO_DRAIN,
    SHARED_MAX_MESSAGE_BYTES,
    SHARED_SERVER_ARGS,
    SHARED_STEPS,
    PolicyServerProcess,
    serve_policy,
)

CFG = PolicyConfig()  # the tiny checkpoint's config
ACTION_SHAPE = (CFG.horizon, CFG.action_dim)
STEPS = SHARED_STEPS  # the session's shared servers' (tests/conftest.py), and this module's own
MAX_MESSAGE_BYTES = SHARED_MAX_MESSAGE_BYTES
RECV_TIMEOUT_S = 60.0
TOKEN = AUTH_TOKEN  # auth_server's (tests/conftest.py)

# openpi-client 0.1.2 calls websockets' connect() outside a context manager
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


def observation(variant: int = 0, /, **changes: Any) -> dict[str, Any]:
    """A RoboLab-shaped observation (``variant`` picks its random contents); ``changes`` set keys, e.g. seed=."""
    obs = example_observation(CFG, variant)
    obs.update(changes)
    return obs


def openpi_client(server: PolicyServerProcess, api_key: str | None = None) -> OpenpiSession:
    return OpenpiSession(server.url, api_key=api_key)


@contextlib.contextmanager
def raw_connection(server: PolicyServerProcess, headers: dict[str, str] | None = None) -> Iterator[ClientConnection]:
    """A bare WebSocket connection; the metadata frame is read and checked on the way in."""
    with connect(server.url, compression=None, max_size=None, open_timeout=30, additional_headers=headers) as ws:
        assert "policy_name" in msgpack_numpy.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))
        yield ws


def get_actions(server: PolicyServerProcess, obs: dict[str, Any] | None = None) -> np.ndarray:
    """One good request on a fresh connection: proves the server still serves."""
    with openpi_client(server) as client:
        actions = client.infer(obs if obs is not None else observation())["actions"]
    assert actions.shape == ACTION_SHAPE and actions.dtype == np.float32
    return actions


def counter(server: PolicyServerProcess, name: str, **labels: str) -> float:
    return server.metric(name, **labels) or 0.0


def serve_args(*extra: str) -> list[str]:
    return [*SHARED_SERVER_ARGS, *extra]


@pytest.fixture(scope="module")
def server(shared_server: PolicyServerProcess) -> PolicyServerProcess:
    """Default (openpi) error format: a text frame, then close 1011.  The session's shared server (serve_args())."""
    return shared_server


@pytest.fixture(scope="module")
def dict_server(tiny_checkpoint: Path) -> Iterator[PolicyServerProcess]:
    """--error-format dict; also the second process of the cross-process determinism test (same sampler flags)."""
    with serve_policy(tiny_checkpoint, *serve_args("--error-format", "dict"), *NO_DRAIN) as s:
        yield s


# --- the openpi client ----------------------------------------------------------------------
def test_openpi_client_gets_actions_and_metadata(server: PolicyServerProcess) -> None:
    with openpi_client(server) as client:
        meta = client.get_server_metadata()
        first = client.infer(observation(1))
        second = client.infer(observation(2))
    assert meta["policy_name"] == CFG.name
    assert tuple(meta["action_shape"]) == ACTION_SHAPE
    assert (meta["action_horizon"], meta["action_dim"]) == ACTION_SHAPE
    assert meta["layout"] == {"cfgp": 1, "dp": 1, "world_size": 1}
    assert meta["server_version"] == __version__ and meta["server"] == "policy-operator"
    assert meta["steps"] == STEPS and meta["guidance"] == 3.0
    for reply in (first, second):
        actions = reply["actions"]
        assert isinstance(actions, np.ndarray) and actions.shape == ACTION_SHAPE and actions.dtype == np.float32
        assert np.isfinite(actions).all()
        timing = reply["server_timing"]
        assert timing["infer_ms"] > 0 and timing["replica"] == 0
    assert first["server_timing"]["prev_total_ms"] is None
    assert second["server_timing"]["prev_total_ms"] > 0
    assert not np.array_equal(first["actions"], second["actions"])


def test_server_computes_what_the_policy_computes(server: PolicyServerProcess, tiny_checkpoint: Path) -> None:
    """Wire round trip + serving path == the policy run in this process (same seed, steps, guidance)."""
    obs = observation(3, seed=77)
    served = get_actions(server, obs)
    policy = ReferencePolicy.load(str(tiny_checkpoint), device=__import__("torch").device("cpu"))
    local = policy.postprocess(sample_actions(policy, policy.prepare(obs), [77], steps=STEPS, guidance=3.0))
    np.testing.assert_allclose(served, local, rtol=0, atol=1e-5)  # thread counts may differ: not bitwise


def test_a_frame_too_large_for_the_loop_is_prepared_off_it(server: PolicyServerProcess, tiny_checkpoint: Path) -> None:
    """A camera frame above INLINE_MAX_BYTES is decoded and prepared on the prepare thread: same actions."""
    obs = example_observation(CFG, 5, image_hw=(480, 600))
    obs["seed"] = 78
    assert INLINE_MAX_BYTES < len(msgpack_numpy.packb(obs)) <= MAX_MESSAGE_BYTES
    served = get_actions(server, obs)
    policy = ReferencePolicy.load(str(tiny_checkpoint), device=__import__("torch").device("cpu"))
    local = policy.postprocess(sample_actions(policy, policy.prepare(obs), [78], steps=STEPS, guidance=3.0))
    np.testing.assert_allclose(served, local, rtol=0, atol=1e-5)


# --- determinism --------------------------------------------------------------------------------
def test_seed_determinism_across_requests_and_processes(
    server: PolicyServerProcess, dict_server: PolicyServerProcess
) -> None:
    obs = observation(4, seed=123)
    with openpi_client(server) as client:
        a = client.infer(obs)["actions"]
        b = client.infer(obs)["actions"]  # same connection
    c = get_actions(server, obs)  # another connection
    d = get_actions(dict_server, obs)  # another process
    assert a.tobytes() == b.tobytes() == c.tobytes() == d.tobytes()
    assert server.pid != dict_server.pid

    other = get_actions(server, observation(4, seed=124))
    assert not np.allclose(a, other), "a different seed must give different actions"

    unseeded = [get_actions(server, observation(4)) for _ in range(2)]
    assert not np.array_equal(unseeded[0], unseeded[1]), "without a seed every request draws fresh noise"
    assert np.array_equal(get_actions(server, observation(4, seed=np.int64(123))), a), "numpy ints are seeds too"


# --- bad input ----------------------------------------------------------------------------------
def _array_map(**fields: Any) -> dict[bytes, Any]:
    m: dict[bytes, Any] = {b"__ndarray__": True, b"data": b"\x00" * 28, b"dtype": "<f4", b"shape": [7]}
    m.update({k.encode(): v for k, v in fields.items()})
    return m


def _raw_obs(**changes: Any) -> bytes:
    """A frame openpi's packer would never write: the good observation with hand-built entries."""
    obs = {k: v for k, v in observation().items() if k != "observation/joint_position"}
    packed = msgpack.unpackb(msgpack_numpy.packb(obs), raw=False, strict_map_key=False)
    packed["observation/joint_position"] = _array_map()
    packed.update(changes)
    return msgpack.packb(packed)


def _with_raw_entry(key: str, value: bytes) -> bytes:
    """The good observation plus ``key`` whose value is ``value``, msgpack bytes no packer would write."""
    packed = msgpack_numpy.packb({**observation(), key: None})  # the entry goes last: its nil is the last byte
    return packed[:-1] + value


NESTED_MAPS = b"\x81\xa1a" * 1000 + b"\x80"  # {"a": {"a": ... {}}}: 1,000 maps in 3 kB
NAN_JOINTS = np.array([0, 0, np.nan, 0, 0, 0, 0], np.float32)
# (id, payload: dict -> sent by the openpi client, bytes/str -> sent raw, error kind, words of the message)
BAD_INPUTS: list[tuple[str, Any, str, str]] = [
    ("not-msgpack", b"\xc1 this is not msgpack", "bad_frame", "not valid msgpack"),
    ("text-frame", "observation please", "bad_frame", "text frame"),
    ("not-a-dict", msgpack_numpy.packb([1, 2, 3]), "bad_frame", "must be a map"),
    (
        "object-dtype",
        _raw_obs(**{"observation/joint_position": _array_map(dtype="|O", data=b"\x00" * 56)}),
        "bad_frame",
        "unsupported dtype",
    ),
    (
        "buffer-length",
        _raw_obs(**{"observation/joint_position": _array_map(data=b"\x00" * 27)}),
        "bad_frame",
        "needs 28 bytes, got 27",
    ),
    (
        "scalar-overflow",
        _raw_obs(seed={b"__npgeneric__": True, b"data": 2**64 - 1, b"dtype": "<i8"}),
        "bad_frame",
        "not valid msgpack",
    ),
    ("nested-1000-maps", _with_raw_entry("nested", NESTED_MAPS), "bad_frame", "maps and lists"),
    ("300-keys", _raw_obs(**{f"extra_{i}": i for i in range(300)}), "bad_frame", "exceeds max_map_len"),
    (
        "missing-key",
        {k: v for k, v in observation().items() if k != "observation/joint_position"},
        "invalid_observation",
        "missing key 'observation/joint_position'",
    ),
    (
        "wrong-dtype",
        observation(**{"observation/image": np.zeros((224, 224, 3), np.float32)}),
        "invalid_observation",
        "'observation/image' must be uint8",
    ),
    (
        "wrong-shape",
        observation(**{"observation/joint_position": np.zeros(6, np.float32)}),
        "invalid_observation",
        "'observation/joint_position' must have shape (7,)",
    ),
    (
        "nan-joints",
        observation(**{"observation/joint_position": NAN_JOINTS}),
        "invalid_observation",
        "'observation/joint_position' contains NaN or inf",
    ),
    (
        "inf-joints",
        observation(**{"observation/joint_position": np.full(7, np.inf, np.float32)}),
        "invalid_observation",
        "'observation/joint_position' contains NaN or inf",
    ),
    (
        "ragged-joints",
        observation(**{"observation/joint_position": [0.0, [1.0, 2.0]]}),
        "invalid_observation",
        "'observation/joint_position' must be a flat list",
    ),
    ("seed-type", observation(seed="7"), "invalid_observation", "'seed' must be an integer, got str"),
    ("seed-float", observation(seed=7.0), "invalid_observation", "'seed' must be an integer, got float"),
    ("prompt-type", observation(prompt=42), "invalid_observation", "'prompt' must be a string, got int"),
    (
        "unicode-key",
        observation(**{"observation/wrist_image_" + "é" * 80: np.zeros((2, 2), np.uint8)}),
        "invalid_observation",
        "must have shape (H, W, 3)",
    ),
]
BAD_IDS = [case[0] for case in BAD_INPUTS]


@pytest.mark.parametrize(("payload", "kind", "words"), [c[1:] for c in BAD_INPUTS], ids=BAD_IDS)
def test_bad_input_text_mode(server: PolicyServerProcess, payload: Any, kind: str, words: str) -> None:
    before = counter(server, "policy_request_errors_total", kind=kind)
    if isinstance(payload, dict):
        with openpi_client(server) as client:
            with pytest.raises(RuntimeError) as info:
                client.infer(payload)
            assert f"{kind}: " in str(info.value) and words in str(info.value)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                client.infer(observation())  # openpi's reference server closes after an error, and so do we
    else:
        with raw_connection(server) as ws:
            ws.send(payload)
            reply = ws.recv(timeout=RECV_TIMEOUT_S)
            assert isinstance(reply, str) and reply.startswith(f"{kind}: ") and words in reply, reply
            with pytest.raises(websockets.ConnectionClosed) as closed:
                ws.recv(timeout=RECV_TIMEOUT_S)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
    assert closed.value.rcvd.reason.startswith(f"{kind}: "), closed.value.rcvd.reason
    assert counter(server, "policy_request_errors_total", kind=kind) == before + 1
    get_actions(server)
    assert server.alive


@pytest.mark.parametrize(("payload", "kind", "words"), [c[1:] for c in BAD_INPUTS], ids=BAD_IDS)
def test_bad_input_dict_mode_keeps_the_connection(
    dict_server: PolicyServerProcess, payload: Any, kind: str, words: str
) -> None:
    good = observation(5, seed=9)
    if isinstance(payload, dict):
        with openpi_client(dict_server) as client:
            error = client.infer(payload)
            after = client.infer(good)  # the SAME connection
    else:
        with raw_connection(dict_server) as ws:
            ws.send(payload)
            error = msgpack_numpy.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))
            ws.send(msgpack_numpy.packb(good))
            after = msgpack_numpy.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))
    assert error["type"] == "error" and set(error["error"]) == {"kind", "message"}
    assert error["error"]["kind"] == kind and words in error["error"]["message"], error
    assert "actions" not in error
    assert after["actions"].shape == ACTION_SHAPE
    get_actions(dict_server)
    assert dict_server.alive


def test_a_deeply_nested_frame_is_logged_in_one_line(dict_server: PolicyServerProcess) -> None:
    before = len(dict_server.log_text())
    with raw_connection(dict_server) as ws:
        ws.send(_with_raw_entry("nested", NESTED_MAPS))
        error = msgpack_numpy.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))
        ws.send(msgpack_numpy.packb(observation()))  # answered after the log line is written
        assert "actions" in msgpack_numpy.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))
    assert error["error"]["kind"] == "bad_frame", error
    logged = dict_server.log_text()[before:]
    assert "Traceback" not in logged and "RecursionError" not in logged, logged[:2000]
    assert sum("bad frame: frame" in line for line in logged.splitlines()) == 1, logged[:2000]


@pytest.mark.parametrize("which", ["server", "dict_server"])
def test_oversized_frame_is_closed_with_1009(request: pytest.FixtureRequest, which: str) -> None:
    target: PolicyServerProcess = request.getfixturevalue(which)
    big = observation(**{"observation/image": np.zeros((1000, 700, 3), np.uint8)})  # 2.1 MB > 1 MB
    assert len(msgpack_numpy.packb(big)) > MAX_MESSAGE_BYTES
    with openpi_client(target) as client:
        with pytest.raises(websockets.ConnectionClosed) as closed:
            client.infer(big)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    get_actions(target)
    assert target.alive


def test_the_server_never_exited(server: PolicyServerProcess, dict_server: PolicyServerProcess) -> None:
    """After every bad input above (whatever order they ran in), both processes are the ones we started."""
    for s in (server, dict_server):
        assert s.alive and s.readyz().status == 200
        log = s.log_text()
        assert "connection handler failed" not in log and "Traceback" not in log, s.log_tail()


# --- HTTP on the same port ----------------------------------------------------------------------
def test_metrics_expose_latency_errors_and_in_flight(server: PolicyServerProcess) -> None:
    before = server.metrics()
    get_actions(server)
    get_actions(server)
    with raw_connection(server) as ws:
        ws.send(b"\xc1")
        ws.recv(timeout=RECV_TIMEOUT_S)
    with openpi_client(server) as client, pytest.raises(RuntimeError):
        client.infer(observation(prompt=1))
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("policy_request_latency_seconds_count") == 2
    assert delta("policy_request_latency_seconds_sum") > 0
    assert delta("policy_request_latency_seconds_bucket", le="+Inf") == 2
    buckets = [k for k in after if k[0] == "policy_request_latency_seconds_bucket"]
    assert len(buckets) > 5, "a histogram, not a summary"
    assert delta("policy_request_errors_total", kind="bad_frame") == 1
    assert delta("policy_request_errors_total", kind="invalid_observation") == 1
    assert delta("policy_requests_total", replica="0") == 2
    assert after[("policy_requests_in_flight", ())] == 0
    assert server.get(METRICS_PATH).headers["content-type"].startswith("text/plain")


def test_plain_http_paths(server: PolicyServerProcess) -> None:
    assert server.get(HEALTHZ_PATH).json() == {"status": "ok"}
    ready = server.get(READYZ_PATH)
    assert ready.status == 200
    body = ready.json()
    assert body["ready"] is True and body["ranks_ready"] == body["world_size"] == 1
    assert body["ranks"][0]["state"] in ("warm", "serving") and body["draining"] is False
    missing = server.get("/no-such-path")
    assert missing.status == HTTPStatus.NOT_FOUND and "WebSocket clients connect to /" in missing.json()["error"]


@pytest.fixture(scope="module")
def held_server(tiny_checkpoint: Path) -> Iterator[PolicyServerProcess]:
    """The reference policy behind the plug-in path; a ``hold:<file>`` prompt keeps a request running."""
    with serve_policy(tiny_checkpoint, "--steps", str(STEPS), "--policy", "held_policy:HeldPolicy", *NO_DRAIN) as s:
        yield s


def test_probes_answer_while_an_inference_runs(held_server: PolicyServerProcess, tmp_path: Path) -> None:
    s = held_server
    gate = tmp_path / "release"
    before = s.metrics()
    box: dict[str, Any] = {}

    def request() -> None:
        try:
            box["actions"] = get_actions(s, observation(prompt=hold_prompt(gate)))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            box["error"] = exc

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    try:
        s.wait_until(
            lambda: s.metric("policy_requests_in_flight") == 1 or "error" in box,
            timeout=60,
            what="the request to be in flight",
        )
        assert "error" not in box, box.get("error")
        assert s.get(HEALTHZ_PATH, timeout=5).status == 200
        ready = s.get(READYZ_PATH, timeout=5)
        assert ready.status == 200 and ready.json()["in_flight"] == 1
        # warm -> serving is published with the next heartbeat (1 s), not at once (heartbeat.py)
        s.wait_until(
            lambda: s.get(READYZ_PATH, timeout=5).json()["ranks"][0]["state"] == "serving",
            timeout=10,
            what="the rank to publish serving",
        )
        assert s.metric("policy_requests_in_flight") == 1
        assert (s.metric("policy_connections") or 0) >= 1
        assert thread.is_alive() and "actions" not in box, "the request is held until the gate file exists"
    finally:
        gate.touch()
        thread.join(timeout=120)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    assert box["actions"].shape == ACTION_SHAPE
    after = s.metrics()
    assert after[("policy_requests_in_flight", ())] == 0
    assert (
        after[("policy_request_latency_seconds_count", ())] == before[("policy_request_latency_seconds_count", ())] + 1
    )


def test_one_replica_serves_requests_one_at_a_time(held_server: PolicyServerProcess, tmp_path: Path) -> None:
    """A second connection's request waits behind the held one on the single model thread, then is answered."""
    s = held_server
    gate = tmp_path / "release"
    results: dict[str, Any] = {}

    def request(name: str, obs: dict[str, Any]) -> None:
        try:
            with openpi_client(s) as client:
                results[name] = client.infer(obs)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            results[name] = exc

    held = threading.Thread(target=request, args=("held", observation(prompt=hold_prompt(gate))), daemon=True)
    held.start()
    s.wait_until(lambda: s.metric("policy_requests_in_flight") == 1, timeout=60, what="the held request")
    queued = threading.Thread(target=request, args=("queued", observation(1)), daemon=True)
    queued.start()
    try:
        s.wait_until(lambda: s.metric("policy_requests_in_flight") == 2, timeout=60, what="the queued request")
        assert held.is_alive() and queued.is_alive() and not results, "nothing answered while the replica is busy"
    finally:
        gate.touch()
        held.join(timeout=120)
        queued.join(timeout=120)
    for name in ("held", "queued"):
        assert isinstance(results.get(name), dict), results.get(name)
        assert results[name]["actions"].shape == ACTION_SHAPE
    assert results["queued"]["server_timing"]["queue_ms"] > 0


# --- readiness while the model loads ----------------------------------------------------------------
class GatedCheckpointServer(CheckpointServer):
    """Holds every request until ``open()``: the serving process sits in 'resolving checkpoint' meanwhile."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def handle(self, handler: Any, path: str, head: bool) -> None:
        self.waiting.set()
        self.gate.wait(timeout=120)
        super().handle(handler, path, head)

    def stop(self) -> None:
        self.gate.set()
        super().stop()


def test_readyz_is_503_until_the_model_is_loaded_and_warm(tmp_path: Path, tiny_checkpoint: Path) -> None:
    shutil.copytree(tiny_checkpoint, tmp_path / "site" / "ckpt")
    with GatedCheckpointServer(tmp_path / "site") as site:
        source = site.url_for("ckpt/")
        with serve_policy(source, "--steps", str(STEPS), "--cache-dir", str(tmp_path / "cache"), wait="listening") as s:
            s.wait_until(site.waiting.is_set, timeout=60, what="the checkpoint download to start")
            for _ in range(3):  # the download cannot finish while the gate is shut: no race here
                r = s.readyz()
                assert r.status == 503, r.text
                body = r.json()
                assert body["ready"] is False and body["ranks_ready"] == 0
                assert body["ranks"][0]["state"] == "loading" and "resolving" in body["ranks"][0]["detail"]
            assert s.get(HEALTHZ_PATH).status == 200, "alive while loading"
            with pytest.raises(websockets.InvalidStatus) as refused:
                connect(s.url, open_timeout=10).close()
            assert refused.value.response.status_code == 503
            assert s.metric("policy_ranks_ready") == 0

            site.gate.set()
            ready = s.wait_ready(timeout=90).json()
            assert ready["ready"] is True and ready["ranks"][0]["state"] in ("warm", "serving")
            assert "replica 0 warmed up" in s.log_text(), "ready only after the warm-up request"
            assert re.search(r"load [\d.]+s: imports [\d.]+s, weights [\d.]+s", s.log_text()), "the start's split"
            get_actions(s)
            assert site.count("/ckpt/model.safetensors") == 1


# --- auth: the session's auth_server (tests/conftest.py), a token in .token_file ---------------------------
@pytest.mark.parametrize(
    "headers",
    [
        None,
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": "Api-Key wrong-token"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
        {"Authorization": f"Bearer {TOKEN}x"},
    ],
    ids=["none", "wrong-bearer", "wrong-api-key", "basic-scheme", "no-scheme", "token-prefix"],
)
def test_auth_refuses_with_401_before_the_upgrade(
    auth_server: PolicyServerProcess, headers: dict[str, str] | None
) -> None:
    before = counter(auth_server, "policy_request_errors_total", kind="unauthorized")
    with pytest.raises(websockets.InvalidStatus) as refused:
        connect(auth_server.url, additional_headers=headers, open_timeout=10).close()
    assert refused.value.response.status_code == 401
    # the same request as plain HTTP: 401 with a JSON reason, never the upgrade
    reply = auth_server.get(
        "/",
        headers={
            **(headers or {}),
            "Connection": "Upgrade",
            "Upgrade": "websocket",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        },
    )
    assert reply.status == 401 and "token" in reply.json()["error"]
    assert counter(auth_server, "policy_request_errors_total", kind="unauthorized") == before + 2


def raw_upgrade(server: PolicyServerProcess, header_lines: list[bytes]) -> tuple[int, bytes]:
    """An upgrade request written byte for byte (repeated or non-ASCII headers, which http.client will not send):
    the status code and the body of the answer."""
    import socket

    request = b"\r\n".join(
        [
            b"GET / HTTP/1.1",
            f"Host: {server.host}:{server.port}".encode(),
            b"Connection: Upgrade",
            b"Upgrade: websocket",
            b"Sec-WebSocket-Version: 13",
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
            *header_lines,
            b"",
            b"",
        ]
    )
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize(
    ("header_lines", "status"),
    [
        ([f"Authorization: Bearer {TOKEN}".encode()] * 2, 400),
        ([f"Authorization: Bearer {TOKEN}".encode(), b"Authorization: Bearer wrong"], 400),
        ([b"Authorization: Bearer \xff\xfe" + TOKEN.encode()], 401),
        ([b"Authorization: Bearer"], 401),
    ],
    ids=["two-good", "good-and-bad", "non-ascii", "scheme-only"],
)
def test_auth_malformed_headers_are_refused_in_one_line(
    auth_server: PolicyServerProcess, header_lines: list[bytes], status: int
) -> None:
    before = counter(auth_server, "policy_request_errors_total", kind="unauthorized")
    log_before = len(auth_server.log_text())
    code, body = raw_upgrade(auth_server, header_lines)
    assert code == status, body
    assert "Authorization" in json.loads(body)["error"] or "token" in json.loads(body)["error"]
    assert counter(auth_server, "policy_request_errors_total", kind="unauthorized") == before + 1
    new_log = auth_server.log_text()[log_before:]
    # no 500 answered or logged (a bare "500" would also match a log line's milliseconds, e.g. 06:03:52,500)
    assert "Traceback" not in new_log and "Internal Server Error" not in new_log, new_log
    assert re.search(r"\b500\b(?!\d)(?<!,500)", new_log) is None, new_log


def test_auth_openpi_client_without_key_is_refused(auth_server: PolicyServerProcess) -> None:
    with pytest.raises(websockets.InvalidStatus) as refused:
        WebsocketClientPolicy(auth_server.url)
    assert refused.value.response.status_code == 401


def test_auth_right_token_works(auth_server: PolicyServerProcess) -> None:
    with openpi_client(auth_server, api_key=TOKEN) as client:  # sends "Authorization: Api-Key <token>"
        assert client.get_server_metadata()["policy_name"] == CFG.name
        assert client.infer(observation())["actions"].shape == ACTION_SHAPE
    with raw_connection(auth_server, headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        ws.send(msgpack_numpy.packb(observation()))
        assert msgpack_numpy.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))["actions"].shape == ACTION_SHAPE


def test_auth_leaves_probes_open(auth_server: PolicyServerProcess) -> None:
    assert auth_server.get(HEALTHZ_PATH).status == 200
    assert auth_server.get(READYZ_PATH).status == 200
    assert auth_server.get(METRICS_PATH).status == 200


def test_auth_bundled_client_with_token_file(auth_server: PolicyServerProcess) -> None:
    import json
    import subprocess

    from tests.support.servers import VENV_BIN, subprocess_env

    cmd = [str(VENV_BIN / "policyserver"), "client", "--url", auth_server.url, "--n", "2", "--json"]
    ok = subprocess.run(
        [*cmd, "--token-file", str(auth_server.token_file)],  # type: ignore[attr-defined]
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["requests"] == 2
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert refused.returncode == 1 and "401" in json.loads(refused.stdout)["errors"][0]
