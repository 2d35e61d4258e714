"""``policyserver probe``: a robot's first request, checked, against real servers that answer well and badly.

The good server is the reference policy; the bad ones are whole servers too
(``tests/support/plugins/broken_actions_policy.py``, loaded by import path):
they start, warm up and answer, only their actions are wrong.  The probe runs
as the CLI does (a subprocess, its exit status and its one line), once with
torch made unimportable, as in the operator image the chart's ``helm test``
hook uses.  Against the fake servers that misbehave at every step, and for its
usage errors, the same ``main`` runs in this process (``policyserver_main``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from policy_operator.exit_codes import ProbeExit
from policy_operator.runtime import probe
from tests.support.net import free_port
from tests.support.servers import AUTH_TOKEN, VENV_BIN, serve_policy, subprocess_env

TOKEN = AUTH_TOKEN  # the session's auth_server's (tests/conftest.py)
BLOCK_TORCH = "import sys; sys.modules['torch'] = None; "


def run_probe(*args: str, torch_blocked: bool = False, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    if torch_blocked:
        argv = [
            sys.executable,
            "-c",
            BLOCK_TORCH + "from policy_operator.cli import main; sys.exit(main(sys.argv[1:]))",
            "probe",
            *args,
        ]
    else:
        argv = [str(VENV_BIN / "policyserver"), "probe", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=subprocess_env())


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def good_server(auth_server):
    """The session's server behind a token (tests/conftest.py)."""
    return auth_server


@pytest.fixture(scope="module")
def token_file(auth_server) -> Path:
    return auth_server.token_file


# --- against a real server ------------------------------------------------------------------


def advertised_metadata(url: str, token: str | None = None) -> dict:
    """The metadata frame, read here independently of the probe."""
    from websockets.sync.client import connect

    from policy_operator.runtime.serving import wire

    headers = {"Authorization": f"Bearer {token}"} if token else None
    with connect(url, additional_headers=headers) as ws:
        return wire.unpackb(ws.recv(timeout=30))


def test_probe_passes_a_real_server_with_the_advertised_shape(good_server, token_file: Path) -> None:
    before = good_server.metric("policy_requests_total", replica="0") or 0.0
    proc = run_probe(good_server.url, "--token-file", str(token_file), "--json")
    assert proc.returncode == ProbeExit.OK, proc.stdout + proc.stderr
    result = json.loads(one_line(proc))
    meta = advertised_metadata(good_server.url, TOKEN)
    assert result["ok"] is True and result["reason"] == ""
    assert result["policy"] == meta["policy_name"]
    assert result["layout"] == f"cfgp={meta['layout']['cfgp']},dp={meta['layout']['dp']}"
    assert result["action_shape"] == meta["action_shape"] and result["latency_ms"] > 0
    # it really sent one request, answered with actions, like a robot's
    assert good_server.metric("policy_requests_total", replica="0") == before + 1


def test_probe_line_without_json_is_one_human_line(good_server, token_file: Path) -> None:
    proc = run_probe(good_server.url, "--token-file", str(token_file))
    line = one_line(proc)
    name = advertised_metadata(good_server.url, TOKEN)["policy_name"]
    assert proc.returncode == 0 and line.startswith(f"ok {good_server.url}: policy {name} (cfgp=1,dp=1)"), line
    assert " finite, " in line and line.endswith(" ms")


def test_probe_runs_without_torch_as_in_the_operator_image(good_server, token_file: Path) -> None:
    proc = run_probe(good_server.url, "--token-file", str(token_file), torch_blocked=True)
    assert proc.returncode == ProbeExit.OK, proc.stdout + proc.stderr
    assert one_line(proc).startswith("ok ")


def test_probe_without_the_token_fails_naming_the_refusal(good_server) -> None:
    proc = run_probe(good_server.url)
    assert proc.returncode == ProbeExit.FAILED
    line = one_line(proc)
    assert line.startswith(f"FAIL {good_server.url}: ") and "HTTP 401" in line, line
    assert TOKEN not in proc.stdout + proc.stderr


def test_probe_of_a_closed_port_fails_at_once(policyserver_main) -> None:
    url = f"ws://127.0.0.1:{free_port()}"
    proc = policyserver_main("probe", url, "--timeout", "5")
    assert proc.returncode == ProbeExit.FAILED
    assert one_line(proc).startswith(f"FAIL {url}: cannot connect")


def test_probe_usage_errors_exit_2(policyserver_main, tmp_path: Path) -> None:
    proc = policyserver_main("probe", "ws://127.0.0.1:1", "--token-file", str(tmp_path / "missing"))
    assert proc.returncode == ProbeExit.USAGE and "--token-file" in proc.stderr and proc.stdout == ""
    proc = policyserver_main("probe", "ws://127.0.0.1:1", "--timeout", "0")
    assert proc.returncode == ProbeExit.USAGE and "--timeout" in proc.stderr


# --- against servers that answer wrongly ------------------------------------------------------


@pytest.mark.slow  # its own server (a broken policy), probed through its start
def test_probe_fails_a_server_whose_actions_contain_nan_and_waits_for_it_to_load(tiny_checkpoint: Path) -> None:
    # started, not ready: the probe's retries carry it through refused connections and 503s to the real answer
    with serve_policy(
        tiny_checkpoint, "--steps", "2", "--policy", "broken_actions_policy:NanActionsPolicy", wait="started"
    ) as server:
        proc = run_probe(f"ws://127.0.0.1:{server.port}", "--retry-seconds", "150", "--timeout", "60", "--json")
        assert server.readyz().status == 200
    assert proc.returncode == ProbeExit.FAILED
    result = json.loads(one_line(proc))
    assert result["ok"] is False and result["action_shape"] is None
    # the server may refuse to send a NaN itself (an error reply of kind non_finite_actions); either way the
    # probe fails and says why, without a robot ever getting the chunk
    reason = result["reason"]
    assert ("1 non-finite value(s), first at (" in reason and "nan" in reason) or "non_finite_actions" in reason, result


@pytest.mark.slow  # its own server (a broken policy); the fake servers below check the shape fast
def test_probe_fails_a_server_whose_actions_do_not_have_the_advertised_shape(tiny_checkpoint: Path) -> None:
    with serve_policy(
        tiny_checkpoint, "--steps", "2", "--policy", "broken_actions_policy:ShortActionsPolicy"
    ) as server:
        proc = run_probe(server.url)
        horizon, dim = advertised_metadata(server.url)["action_shape"]
    assert proc.returncode == ProbeExit.FAILED
    line = one_line(proc)
    assert f"shape ({horizon - 1}, {dim}), the metadata promised ({horizon}, {dim})" in line, line


# --- against servers that misbehave at every step ----------------------------------------------

GOOD_META = {
    "policy_name": "p",
    "action_shape": [4, 2],
    "image_size": 8,
    "max_cameras": 1,
    "joint_dim": 7,
    "gripper_dim": 1,
}


def _pack(obj) -> bytes:
    from policy_operator.runtime.serving import wire

    return wire.packb(obj)


def _session(*replies, meta=GOOD_META):
    """A WebSocket session: ``meta`` (a frame, or an object to pack) on connect, then one reply per request."""

    def script(ws) -> None:
        ws.send(meta if isinstance(meta, (bytes, str)) else _pack(meta))
        for reply in replies:
            ws.recv()
            if callable(reply):
                reply(ws)
            else:
                ws.send(reply if isinstance(reply, (bytes, str)) else _pack(reply))
        ws.recv()  # hold the connection until the probe leaves

    return script


def _close_1011(ws) -> None:
    ws.close(1011, "internal error\nTraceback (most recent call last):\n  File x")


RAW = {
    "closed before the handshake": b"",
    "reset before the handshake": "reset",
    "garbage instead of HTTP": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "HTTP 200 instead of an upgrade": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
    "HTTP 500 with a multi-line body": b"HTTP/1.1 500 Oops\r\nContent-Length: 36\r\n\r\nTraceback:\n  File x\n    raise Boom\nBoo",
    "half an upgrade answer": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n",
    "an upgrade without the accept key": (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    ),
    "never answers the upgrade": None,
}
SESSIONS = {
    "metadata not msgpack": _session(meta=b"\xc1\xc1 not msgpack"),
    "metadata as a text frame": _session(meta="hello\nworld"),
    "metadata a list": _session(meta=[1, 2]),
    "metadata without action_shape": _session(meta={"policy_name": "p"}),
    "metadata with absurd sizes": _session(meta={**GOOD_META, "joint_dim": 10**12}),
    "closes after the metadata": _session(_close_1011),
    "reply not msgpack": _session(b"\x93\x01"),
    "reply a multi-line text frame": _session("invalid_observation: bad\nTraceback (most recent call last):\n  x"),
    "reply error without a map": _session({"type": "error", "error": "boom"}),
    "reply without actions": _session({"result": 1}),
    "reply with the wrong shape": _session({"actions": np.zeros((2, 4), dtype=np.float32)}),
    "reply actions a map": _session({"actions": {"a": 1}}),
    "never replies": _session(lambda ws: ws.recv()),
}
SILENT = {"never answers the upgrade", "never replies"}


@pytest.mark.parametrize("case", [*RAW, *SESSIONS])
def test_probe_prints_one_line_and_exits_1_whatever_the_server_does(policyserver_main, case: str) -> None:
    from tests.support.bad_ws_servers import BadWsServer, RawServer

    server = RawServer(RAW[case]) if case in RAW else BadWsServer(SESSIONS[case])
    timeout = "1" if case in SILENT else "3"  # a silent server fails the probe only by its timeout: 1 s will do
    with server:
        proc = policyserver_main("probe", server.url, "--timeout", timeout)
    assert proc.returncode == ProbeExit.FAILED, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr
    line = one_line(proc)
    assert line.startswith(f"FAIL {server.url}: ") and len(line) > len(f"FAIL {server.url}: ") + 10, line


class SilentAfterUpgrade:
    """Completes the WebSocket upgrade, then says nothing and reads nothing (not even a close frame) for ``HOLD_S``:
    only the probe's own deadline ends its wait."""

    def __init__(self) -> None:
        import socket
        import threading

        self._sock = socket.create_server(("127.0.0.1", 0))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.url = f"ws://127.0.0.1:{self._sock.getsockname()[1]}"

    def _run(self) -> None:
        import base64
        import hashlib

        conn, _ = self._sock.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            key = next(
                line.split(b":", 1)[1].strip()
                for line in request.split(b"\r\n")
                if line.lower().startswith(b"sec-websocket-key:")
            )
            accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
            conn.sendall(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
            )
            self._stop.wait(30)

    def __enter__(self) -> SilentAfterUpgrade:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sock.close()


def test_probe_timeout_bounds_the_whole_check(policyserver_main) -> None:
    """--timeout 2 against a server that upgrades and then never sends metadata nor answers the close: 2 s in all,
    not a wait per step plus the close handshake's own 10 s."""
    import time

    with SilentAfterUpgrade() as server:
        started = time.monotonic()
        proc = policyserver_main("probe", server.url, "--timeout", "2")
        elapsed = time.monotonic() - started
    assert proc.returncode == ProbeExit.FAILED and "within 2s" in one_line(proc), proc.stdout
    assert elapsed < 3.5, elapsed


def test_probe_prints_one_line_whatever_the_policy_is_called(policyserver_main) -> None:
    from tests.support.bad_ws_servers import BadWsServer

    meta = {**GOOD_META, "policy_name": "evil\nok ws://elsewhere: all good\x1b[2J", "layout": {"cfgp": "1\r\n2"}}
    with BadWsServer(_session({"actions": np.zeros((4, 2), dtype=np.float32)}, meta=meta)) as server:
        proc = policyserver_main("probe", server.url, "--timeout", "10")
        as_json = policyserver_main("probe", server.url, "--timeout", "10", "--json")
    assert proc.returncode == ProbeExit.OK, proc.stdout
    line = one_line(proc)
    assert line.startswith(f"ok {server.url}: policy evil ok ws://elsewhere") and "\x1b" not in line, line
    assert json.loads(one_line(as_json))["policy"] == "evil ok ws://elsewhere: all good [2J"


# --- the checks themselves ----------------------------------------------------------------------

META = {
    "policy_name": "p",
    "action_shape": [16, 8],
    "action_horizon": 16,
    "action_dim": 8,
    "image_size": 32,
    "max_cameras": 2,
    "joint_dim": 7,
    "gripper_dim": 1,
}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"action_shape": None}, "'action_shape' must be"),
        ({"action_shape": [16]}, "'action_shape' must be"),
        ({"action_shape": [16, 0]}, "'action_shape' must be"),
        ({"action_shape": [True, 8]}, "'action_shape' must be"),
        ({"action_horizon": 10}, "'action_horizon' is 10"),
        ({"image_size": 0}, "'image_size' must be an integer in 1..4096"),
        ({"image_size": 5000}, "'image_size' must be an integer in 1..4096"),
        ({"max_cameras": "2"}, "'max_cameras' must be"),
        ({"joint_dim": 1.5}, "'joint_dim' must be"),
    ],
)
def test_metadata_checks_name_the_key(change: dict, words: str) -> None:
    meta = {**META, **change}
    with pytest.raises(probe.ProbeFailed, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        probe.check_metadata(meta)
    with pytest.raises(probe.ProbeFailed, match="metadata map"):
        probe.check_metadata([1, 2])


def test_canned_observation_passes_the_servers_own_validation() -> None:
    from policy_operator.runtime.policy import observation
    from policy_operator.runtime.policy.observation import parse_observation

    # the probe spells the keys itself (the observation module is behind torch's import); they must be the server's
    assert (probe.IMAGE_KEY, probe.JOINT_KEY, probe.GRIPPER_KEY) == (
        observation.IMAGE_KEY,
        observation.JOINT_KEY,
        observation.GRIPPER_KEY,
    )
    assert probe.MAX_IMAGE_SIDE == observation.MAX_IMAGE_SIDE

    expect = probe.check_metadata(META)
    obs = probe.canned_observation(expect)
    parsed = parse_observation(obs, joint_dim=7, gripper_dim=1, max_cameras=2)
    assert parsed.cameras[0].shape == (32, 32, 3) and parsed.state.shape == (8,)
    assert parsed.cameras[0].std() > 0  # a pattern, not a blank frame
    again = probe.canned_observation(expect)
    assert all(np.array_equal(obs[k], again[k]) if isinstance(obs[k], np.ndarray) else obs[k] == again[k] for k in obs)


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        ("invalid_observation: missing key", "answered with an error: invalid_observation"),
        ({"type": "error", "error": {"kind": "unavailable", "message": "draining"}}, "error: unavailable: draining"),
        ({"server_timing": {}}, "no 'actions'"),
        ({"actions": [[0.0] * 8] * 16}, "must be a float array, got list"),
        ({"actions": np.zeros((16, 8), dtype=np.int32)}, "must be a float array, got <i4"),
        ({"actions": np.zeros((8, 16), dtype=np.float32)}, "shape (8, 16)"),
        ({"actions": np.full((16, 8), np.inf, dtype=np.float32)}, "128 non-finite value(s), first at (0, 0): inf"),
    ],
)
def test_reply_checks(reply, words: str) -> None:
    with pytest.raises(probe.ProbeFailed) as exc:
        probe.check_reply(reply, probe.check_metadata(META))
    assert words in str(exc.value)
    good = np.zeros((16, 8), dtype=np.float32)
    assert probe.check_reply({"actions": good}, probe.check_metadata(META)) is good
