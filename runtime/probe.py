"""Check a policy server the way a robot would: connect, read the metadata, send one observation, check the actions.

``policyserver probe ws://HOST:PORT`` speaks the openpi wire protocol through
the runtime's own ``wire`` module, so what it checks is what openpi-client and
RoboLab see.  It checks the metadata frame (an ``action_shape`` of two positive
ints, and when present ``max_cameras`` and ``image_size`` in range), builds one
canned observation from it (the advertised image size, state sizes and a fixed
seed), and checks that the reply holds a float array of exactly that shape with
every value finite.  A NaN in an action chunk would move a real arm, so a
server that answers with one fails here, not on the robot.

It prints one line and exits 0 (``ok ...``) or 1 (``FAIL ...``); 2 is a usage
error.  Whatever the server does (closes before the handshake, answers
garbage instead of HTTP, sends a text frame or something that is not
msgpack, never answers), the line says what was wrong: no traceback, no
second line, no log record of the WebSocket library.  ``--retry-seconds`` keeps retrying while the server refuses the
connection or answers 503 (still loading), which is what ``helm test`` right
after an install needs.  torch-free: the chart's ``helm test`` hook runs it in
the operator image.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from policy_operator.constants import DEFAULT_PORT
from policy_operator.exit_codes import ProbeExit, describe

# Keys of an openpi / RoboLab DROID observation (runtime/policy/observation.py validates them on the server).
IMAGE_KEY = "observation/image"
JOINT_KEY = "observation/joint_position"
GRIPPER_KEY = "observation/gripper_position"
PROMPT = "probe: hold still"
SEED = 0
DEFAULT_IMAGE_SIZE = 224  # openpi's image size, for a policy whose metadata does not say
DEFAULT_JOINT_DIM, DEFAULT_GRIPPER_DIM = 7, 1  # DROID
MAX_IMAGE_SIDE = 4096
MAX_DIM = 4096  # cameras, joints, gripper values: far beyond any robot, and an observation that fits in memory
RETRY_INTERVAL_S = 1.0
MAX_REASON_CHARS = 400
# the WebSocket library's own records (a failed handshake, a broken frame) would add lines to the probe's one
_QUIET_LOG = logging.getLogger("policyserver.probe.websockets")
_QUIET_LOG.addHandler(logging.NullHandler())
_QUIET_LOG.propagate = False


class ProbeFailed(Exception):
    """The server answered, but not like a policy server should (or not at all)."""


@dataclass(frozen=True)
class Expectation:
    """What the metadata frame promises: the observation to send and the actions to expect."""

    action_shape: tuple[int, int]
    image_size: int
    cameras: int
    joint_dim: int
    gripper_dim: int


@dataclass
class ProbeResult:
    url: str
    ok: bool
    reason: str = ""
    policy: str = "?"
    layout: str = "?"
    action_shape: tuple[int, ...] | None = None
    latency_ms: float | None = None

    def line(self) -> str:
        """One line whatever the server sent: its policy name and layout are flattened like a reason is."""
        if not self.ok:
            return one_line(f"FAIL {self.url}: {self.reason}")
        shape = "x".join(map(str, self.action_shape or ()))
        policy, layout = one_line(self.policy), one_line(self.layout)
        return one_line(f"ok {self.url}: policy {policy} ({layout}), actions {shape} finite, {self.latency_ms:.1f} ms")

    def as_json(self) -> str:
        return json.dumps(
            {
                "url": self.url,
                "ok": self.ok,
                "reason": one_line(self.reason),
                "policy": one_line(self.policy),
                "layout": one_line(self.layout),
                "action_shape": list(self.action_shape or ()) or None,
                "latency_ms": self.latency_ms,
            }
        )


def one_line(text: str) -> str:
    """``text`` on one line, shortened: a server's error text, body or policy name may hold newlines, other
    control characters (a terminal's escapes) and any amount of bytes."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in str(text)).split())
    return flat if len(flat) <= MAX_REASON_CHARS else flat[: MAX_REASON_CHARS - 3] + "..."


def _positive_int(meta: dict[str, Any], key: str, default: int | None, upper: int | None = None) -> int:
    if key not in meta:
        if default is None:
            raise ProbeFailed(f"metadata has no {key!r}")
        return default
    value = meta[key]
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or value < 1
        or (upper is not None and value > upper)
    ):
        bound = f"1..{upper}" if upper else ">= 1"
        raise ProbeFailed(f"metadata {key!r} must be an integer in {bound}, got {value!r}")
    return int(value)


def check_metadata(meta: Any) -> Expectation:
    """The metadata frame as a robot relies on it; anything missing or malformed raises ProbeFailed."""
    if not isinstance(meta, dict):
        raise ProbeFailed(f"the first frame must be a metadata map, got {type(meta).__name__}")
    shape = meta.get("action_shape")
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) != 2
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)
    ):
        raise ProbeFailed(f"metadata 'action_shape' must be [horizon, action_dim] of positive ints, got {shape!r}")
    for key, dim in (("action_horizon", shape[0]), ("action_dim", shape[1])):
        if key in meta and meta[key] != dim:
            raise ProbeFailed(f"metadata {key!r} is {meta[key]!r} but 'action_shape' says {dim}")
    return Expectation(
        action_shape=(int(shape[0]), int(shape[1])),
        image_size=_positive_int(meta, "image_size", DEFAULT_IMAGE_SIZE, MAX_IMAGE_SIDE),
        cameras=_positive_int(meta, "max_cameras", 1, MAX_DIM),
        joint_dim=_positive_int(meta, "joint_dim", DEFAULT_JOINT_DIM, MAX_DIM),
        gripper_dim=_positive_int(meta, "gripper_dim", DEFAULT_GRIPPER_DIM, MAX_DIM),
    )


def canned_observation(expect: Expectation) -> dict[str, Any]:
    """One valid observation of the advertised sizes, the same bytes on every run (fixed pattern and seed)."""
    s = expect.image_size
    ramp = np.linspace(0, 255, s, dtype=np.float32)
    image = np.stack(
        [np.add.outer(ramp, ramp) / 2, np.tile(ramp, (s, 1)), np.tile(ramp[:, None], (1, s))], axis=-1
    ).astype(np.uint8)
    return {
        IMAGE_KEY: image,
        JOINT_KEY: np.linspace(-0.5, 0.5, expect.joint_dim, dtype=np.float32),
        GRIPPER_KEY: np.zeros(expect.gripper_dim, dtype=np.float32),
        "prompt": PROMPT,
        "seed": SEED,
    }


def check_reply(reply: Any, expect: Expectation) -> np.ndarray:
    """The actions of a reply frame: a float array of the advertised shape, every value finite."""
    if isinstance(reply, str):
        raise ProbeFailed(f"the server answered with an error: {reply}")
    if not isinstance(reply, dict):
        raise ProbeFailed(f"the reply must be a map, got {type(reply).__name__}")
    if reply.get("type") == "error":
        error = reply.get("error")
        if isinstance(error, dict):
            raise ProbeFailed(f"the server answered with an error: {error.get('kind')}: {error.get('message')}")
        raise ProbeFailed(f"the server answered with an error: {error!r}")
    if "actions" not in reply:
        raise ProbeFailed(f"the reply has no 'actions' (keys: {sorted(map(str, reply))})")
    actions = reply["actions"]
    if not isinstance(actions, np.ndarray) or actions.dtype.kind != "f":
        what = actions.dtype.str if isinstance(actions, np.ndarray) else type(actions).__name__
        raise ProbeFailed(f"'actions' must be a float array, got {what}")
    if actions.shape != expect.action_shape:
        raise ProbeFailed(f"'actions' has shape {actions.shape}, the metadata promised {expect.action_shape}")
    finite = np.isfinite(actions)
    if not finite.all():
        bad = np.argwhere(~finite)
        raise ProbeFailed(
            f"'actions' has {len(bad)} non-finite value(s), first at {tuple(int(i) for i in bad[0])}: "
            f"{actions[tuple(bad[0])]}"
        )
    return actions


class Deadline:
    """The probe's one bound: ``--timeout`` seconds for connecting, the metadata, the reply and the close
    together (after ``--retry-seconds`` of retries), so a server that stalls at any step costs at most that."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; TimeoutError once none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left


def _connect(url: str, headers: dict[str, str] | None, timeout: float, retry_seconds: float):
    """Open the WebSocket, retrying refused connections and 503s (a server still loading) until the retry
    deadline; the connection and what follows it get ``timeout`` from then (``Deadline``)."""
    from websockets.exceptions import InvalidStatus, InvalidURI
    from websockets.sync.client import connect

    deadline = time.monotonic() + retry_seconds
    while True:
        bound = Deadline(timeout)
        try:
            ws = connect(
                url,
                additional_headers=headers,
                open_timeout=timeout,
                close_timeout=timeout,
                max_size=None,
                compression=None,
                logger=_QUIET_LOG,
            )
            return ws, bound
        except InvalidURI as exc:
            raise ProbeFailed(f"not a WebSocket URL: {exc}") from None
        except InvalidStatus as exc:
            status = exc.response.status_code
            body = exc.response.body.decode("utf-8", "replace").strip() if exc.response.body else ""
            if status != 503 or time.monotonic() >= deadline:
                raise ProbeFailed(f"the server refused the WebSocket upgrade: HTTP {status} {body}".rstrip()) from None
        except (OSError, TimeoutError) as exc:  # refused, unresolvable, unreachable
            if time.monotonic() >= deadline:
                raise ProbeFailed(f"cannot connect: {exc or type(exc).__name__}") from None
        time.sleep(RETRY_INTERVAL_S)


def probe(url: str, *, token: str | None = None, timeout: float = 60.0, retry_seconds: float = 0.0) -> ProbeResult:
    """One robot's first request, checked; never raises for what the server does (the result says)."""
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, WebSocketException

    from policy_operator.runtime.serving import wire

    result = ProbeResult(url=url, ok=False)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        ws, bound = _connect(url, headers, timeout, retry_seconds)
        with ws:  # its exit closes, waiting for the server's close frame only as long as the deadline leaves
            _check_session(ws, bound, result)
    except ProbeFailed as exc:
        result.reason = str(exc)
    except wire.WireError as exc:
        result.reason = f"undecodable frame from the server: {exc}"
    except TimeoutError:
        result.reason = f"no reply within {timeout:g}s"
    except ConnectionClosed as exc:
        result.reason = f"the server closed the connection: {exc}"
    except InvalidHandshake as exc:  # closed before the handshake, garbage instead of HTTP, a bad upgrade answer
        result.reason = f"the WebSocket handshake failed: {type(exc).__name__}: {exc}"
    except WebSocketException as exc:
        result.reason = f"WebSocket error: {type(exc).__name__}: {exc}"
    except OSError as exc:
        result.reason = f"connection failed: {exc}"
    except Exception as exc:  # noqa: BLE001 - whatever the server does, the probe answers with one line
        result.reason = f"unexpected {type(exc).__name__} talking to the server: {exc}"
    return result


def _check_session(ws: Any, bound: Deadline, result: ProbeResult) -> None:
    """The metadata, one request and its reply, each step within what is left of ``bound``."""
    from policy_operator.runtime.serving import wire

    try:
        first = ws.recv(timeout=bound.left())
        if isinstance(first, str):
            raise ProbeFailed(f"the first frame must be a binary msgpack metadata map, got a text frame: {first!r}")
        try:
            meta = wire.unpackb(first)
        except wire.WireError as exc:
            raise ProbeFailed(f"the metadata frame is not msgpack: {exc}") from None
        expect = check_metadata(meta)
        result.policy = str(meta.get("policy_name", "?"))
        layout = meta.get("layout")
        if isinstance(layout, dict):
            result.layout = ",".join(f"{k}={layout[k]}" for k in ("cfgp", "dp") if k in layout) or "?"
        frame = wire.packb(canned_observation(expect))
        started = time.perf_counter()
        bound.left()
        ws.send(frame)
        raw = ws.recv(timeout=bound.left())
        result.latency_ms = (time.perf_counter() - started) * 1e3
        reply = raw if isinstance(raw, str) else wire.unpackb(raw)
        actions = check_reply(reply, expect)
        result.action_shape = tuple(actions.shape)
        result.ok = True
    finally:
        ws.close_timeout = max(0.1, bound.at - time.monotonic())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help=f"server URL, e.g. ws://policy-sample.robots.svc:{DEFAULT_PORT}")
    parser.add_argument("--token-file", default=None, help="bearer token for a server started with auth")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds the whole check may take: connect, metadata, reply and close together, after any "
        "--retry-seconds (default %(default)s)",
    )
    parser.add_argument(
        "--retry-seconds",
        type=float,
        default=0.0,
        help="keep retrying this long while the server refuses connections or is not ready (default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.epilog = f"Prints one line (ok ... / FAIL ...). Exit codes: {describe(ProbeExit)}."


def main(args: argparse.Namespace) -> int:
    from policy_operator.tokens import read_token_file

    try:
        if not (math.isfinite(args.timeout) and args.timeout > 0) or not args.retry_seconds >= 0:
            raise ValueError("--timeout must be > 0 and --retry-seconds >= 0")
        token = read_token_file(args.token_file, "--token-file") if args.token_file else None
    except ValueError as exc:
        print(f"policyserver probe: error: {exc}", file=sys.stderr)
        return ProbeExit.USAGE
    result = probe(args.url, token=token, timeout=args.timeout, retry_seconds=args.retry_seconds)
    print(result.as_json() if args.json else result.line(), flush=True)
    return ProbeExit.OK if result.ok else ProbeExit.FAILED
