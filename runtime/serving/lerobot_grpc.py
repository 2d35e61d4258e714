"""LeRobot's ``AsyncInference`` gRPC service on its own port: LeRobot's ``robot_client``, unchanged, against a pod.

``lerobot.async_inference.robot_client`` talks to a ``policy_server`` over
gRPC with the stubs LeRobot ships (``lerobot.transport``): ``Ready``, then
``SendPolicyInstructions`` (a pickled ``RemotePolicyConfig``), then a stream of
``SendObservations`` (pickled ``TimedObservation``) and ``GetActions`` calls
answered with a pickled list of ``TimedAction``.  LeRobot's own server serves
one client at a time (every ``Ready`` resets it), loads whatever checkpoint the
client names, and unpickles whatever it is sent.  This service keeps the wire
and changes those three:

- every client (a gRPC peer: one channel, one robot) is its own session --
  its latest observation, the timesteps it was answered for, its history for
  Diffusion Policy -- and ``Ready`` resets that session only;
- ``SendPolicyInstructions`` is checked against the policy this pod serves
  (its type, its observation features, ``actions_per_chunk`` at most the
  chunk); nothing a client names is ever loaded;
- every pickle is read by ``safe_pickle``: LeRobot's message classes and plain
  data only, refused before anything in it runs.

Observations become the frame the WebSocket front hands the engine, through
LeRobot's own ``raw_observation_to_observation`` (the robot's motors into
``observation.state``, each camera resized to the policy's image shape), and go
through the same admission type and engine as a WebSocket robot's
(``engine_api.PreparedRequest``, ``EngineClient.submit``): gRPC and WebSocket
robots share the batches of the same replicas.  The answer is LeRobot's own:
``actions_per_chunk`` ``TimedAction``s from the observation's timestep, one
``1/fps`` apart.  A client may put an integer ``seed`` in its observation dict
(LeRobot ignores keys that are no feature) to get the actions LeRobot's server
gives after ``torch.manual_seed(seed)``.

The service is a grpc.aio server on the engine's own event loop: a request
goes to ``submit`` as a WebSocket frame does, with no thread between; an
observation above ``INLINE_MAX_BYTES`` is unpickled and converted on a thread.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import torch
from lerobot.async_inference import helpers
from lerobot.async_inference.constants import DEFAULT_FPS, DEFAULT_OBS_QUEUE_TIMEOUT
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.transport import services_pb2, services_pb2_grpc
from lerobot.utils.constants import OBS_STATE

from policy_operator.runtime.engine_api import INLINE_MAX_BYTES, EngineClient, PreparedRequest, scoped_session
from policy_operator.runtime.errors import ErrorKind, InvalidObservation, RequestError
from policy_operator.runtime.policy.lerobot.policy import LeRobotPolicy
from policy_operator.runtime.policy.lerobot.wire import OBSERVATION_PREFIX, TASK_KEY
from policy_operator.runtime.result import Result
from policy_operator.runtime.serving.safe_pickle import RefusedPickle, plain_data_globals, restricted_loads

log = logging.getLogger(__name__)

SERVICE = "AsyncInference"  # LeRobot's service name (lerobot/transport/services.proto)
METADATA_KEY = "lerobot_grpc_port"  # in the WebSocket metadata: where LeRobot's robot_client connects
OBS_WAIT_S = float(DEFAULT_OBS_QUEUE_TIMEOUT)  # GetActions waits this long for an observation, as LeRobot's server
ENVIRONMENT_DT_S = 1.0 / DEFAULT_FPS  # the TimedActions' spacing, LeRobot's server default
MAX_SESSIONS = 1024  # clients remembered at once; the least recently active goes first
RECENT_SESSION_S = 1.0  # a client active this recently may send again soon (the batch window waits for it)
GRPC_CHUNK_BYTES = 4 << 20  # LeRobot streams 2 MiB chunks (lerobot.transport.utils.CHUNK_SIZE) and caps them at 4
SEED_KEY = "seed"
MAX_SEED = 2**63 - 1

_STATUS: Mapping[ErrorKind, grpc.StatusCode] = {
    ErrorKind.BAD_FRAME: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.INVALID_OBSERVATION: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.REPLICA_FAILED: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.REPLICA_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DRAIN_TIMEOUT: grpc.StatusCode.UNAVAILABLE,
}


class InstructionsRefused(RequestError, ValueError):
    """A client's ``RemotePolicyConfig`` does not describe the policy this pod serves."""

    kind = ErrorKind.INVALID_OBSERVATION


def status_of(exc: RequestError) -> grpc.StatusCode:
    if isinstance(exc, InstructionsRefused):
        return grpc.StatusCode.FAILED_PRECONDITION
    return _STATUS.get(exc.kind, grpc.StatusCode.INTERNAL)


# --- what a client's instructions are checked against -------------------------------------------
@dataclass(frozen=True)
class Served:
    """The served policy as LeRobot's client describes one: its type, its observation features, its chunk."""

    policy_type: str
    features: Mapping[str, tuple[str, tuple[int, ...]]]  # key -> (VISUAL/STATE/ENV, shape; a camera's is C, H, W)
    chunk: int
    needs_task: bool
    image_features: Mapping[str, Any]  # LeRobot's PolicyFeatures of the cameras (raw_observation_to_observation)

    @classmethod
    def of(cls, policy: LeRobotPolicy) -> Served:
        return cls(
            policy.loaded.type,
            {f.key: (f.kind, f.shape) for f in policy.spec.features},
            policy.action_shape[0],
            policy.spec.needs_task,
            dict(policy.loaded.config.image_features),
        )


@dataclass(frozen=True)
class Instructions:
    """A client's checked ``RemotePolicyConfig``: what its observations are read with."""

    actions_per_chunk: int
    lerobot_features: dict[str, dict[str, Any]]  # the robot's features, renamed to the policy's keys
    pretrained_name_or_path: str  # logged, never loaded


def _shape_of(feature: Any) -> tuple[int, ...]:
    shape = feature.get("shape") if isinstance(feature, Mapping) else getattr(feature, "shape", None)
    if not isinstance(shape, (tuple, list)) or not all(isinstance(d, int) and d > 0 for d in shape):
        raise InstructionsRefused(f"a feature's shape must be a list of positive integers, got {shape!r}")
    return tuple(shape)


def check_instructions(config: Any, served: Served) -> Instructions:
    """``config`` (an unpickled ``RemotePolicyConfig``) against the served policy; ``InstructionsRefused`` naming
    the first mismatch.  The checkpoint the client names and its device are not this server's to choose."""
    if not isinstance(config, helpers.RemotePolicyConfig):
        raise InstructionsRefused(
            f"policy instructions must be LeRobot's RemotePolicyConfig, got {type(config).__name__}"
        )
    if config.policy_type != served.policy_type:
        raise InstructionsRefused(
            f"this server serves a {served.policy_type!r} policy, the client asked for {config.policy_type!r} "
            "(--policy_type); the server never loads the checkpoint a client names"
        )
    apc = config.actions_per_chunk
    if not isinstance(apc, int) or isinstance(apc, bool) or not 1 <= apc <= served.chunk:
        raise InstructionsRefused(
            f"actions_per_chunk must be in 1..{served.chunk} (the served policy's chunk), got {apc!r}"
        )
    features = _renamed_features(config)
    _check_features(features, served)
    return Instructions(apc, features, str(config.pretrained_name_or_path))


def _renamed_features(config: Any) -> dict[str, dict[str, Any]]:
    """The robot's observation features, under the policy's keys (``rename_map``)."""
    rename = config.rename_map if isinstance(config.rename_map, Mapping) else {}
    if not isinstance(config.lerobot_features, Mapping):
        raise InstructionsRefused("lerobot_features must be a dict of the robot's features")
    features: dict[str, dict[str, Any]] = {}
    for key, feature in config.lerobot_features.items():
        if not isinstance(key, str) or not key.startswith(OBSERVATION_PREFIX):
            continue
        target = rename.get(key, key)
        if not isinstance(target, str) or not isinstance(feature, Mapping):
            raise InstructionsRefused(f"feature {key!r} must be LeRobot's feature dict (dtype, shape, names)")
        features[target] = dict(feature)
    return features


def _check_features(features: Mapping[str, Any], served: Served) -> None:
    """The robot's features are the policy's: its state of the same shape, its cameras (any size, same channels)."""
    expected = {k for k, (kind, _) in served.features.items() if kind in ("VISUAL", "STATE")}
    others = sorted(k for k, (kind, _) in served.features.items() if kind not in ("VISUAL", "STATE"))
    if others:
        raise InstructionsRefused(f"the served policy also reads {others}, which LeRobot's robot_client never sends")
    if set(features) != expected:
        missing, unexpected = sorted(expected - set(features)), sorted(set(features) - expected)
        raise InstructionsRefused(
            f"the robot's features do not match the served policy's: missing {missing}, unexpected {unexpected} "
            f"(the policy reads {sorted(expected)}; rename_map maps robot keys to them)"
        )
    for key, feature in features.items():
        kind, shape = served.features[key]
        given = _shape_of(feature)
        if kind == "STATE" and given != shape:
            raise InstructionsRefused(f"{key!r} has shape {list(given)}, the served policy's has {list(shape)}")
        if kind == "VISUAL" and (len(given) != 3 or given[2] != shape[0]):
            raise InstructionsRefused(
                f"camera {key!r} must be height x width x {shape[0]} (any size: it is resized to {list(shape[1:])}), "
                f"got {list(given)}"
            )


def frame_of(raw: Any, instructions: Instructions, served: Served) -> tuple[dict[str, Any], int | None]:
    """A robot's raw observation as the frame the engine prepares (LeRobot's own conversion: motors into the
    state vector, cameras resized to the policy's images in [0, 1]), and its seed; ``InvalidObservation``."""
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise InvalidObservation(
            f"a TimedObservation's observation must be a dict with str keys, got {type(raw).__name__}"
        )
    raw = dict(raw)
    seed = raw.pop(SEED_KEY, None)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
        raise InvalidObservation(f"{SEED_KEY!r} must be an integer in 0..2**63-1, got {seed!r}")
    try:
        frame = _converted(raw, instructions, served)
    except Exception as exc:  # noqa: BLE001 - whatever LeRobot's conversion trips on is this observation's fault
        raise InvalidObservation(
            f"the observation does not match the robot's features sent in its policy instructions: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if served.needs_task:
        task = raw.get(TASK_KEY)
        if task is not None:
            frame[TASK_KEY] = task
    return frame, seed


def _converted(raw: dict[str, Any], instructions: Instructions, served: Served) -> dict[str, Any]:
    """LeRobot's ``prepare_raw_observation`` (``raw_observation_to_observation`` less its last step, which the
    policy does), its state and cameras as arrays: a camera's bytes as a WebSocket robot sends them (HWC uint8;
    the policy scales them to [0, 1] as LeRobot's ``prepare_image`` does, and the two protocols' requests share
    one batch shape).  A uint8 camera already of the policy's size is taken as it is: LeRobot's bilinear resize
    to its own size is the identity, and skipping it (a copy, the resize and a copy back, per camera) is most of
    this conversion's time."""
    lerobot_obs = helpers.make_lerobot_observation(raw, instructions.lerobot_features)
    state = helpers.extract_state_from_raw_observation(lerobot_obs)
    frame: dict[str, Any] = {OBS_STATE: state[0].numpy() if state.ndim > 1 else state.numpy()}
    for key in filter(helpers.is_image_key, lerobot_obs):
        image, shape = lerobot_obs[key], served.image_features[key].shape  # the policy's C, H, W
        if isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.shape == (*shape[1:], shape[0]):
            frame[key] = np.ascontiguousarray(image)
            continue
        resized = helpers.resize_robot_observation_image(torch.tensor(image), shape)
        frame[key] = resized.permute(1, 2, 0).contiguous().numpy() if resized.dtype == torch.uint8 else resized.numpy()
    return frame


class _ActionRow:
    """One action of an answer, pickled as ``torch.from_numpy`` of its row: robot_client unpickles the same
    tensor as from LeRobot's server, where a tensor's own pickle is a ``torch.save`` archive per tensor (0.38 ms to
    write a 5-action answer and 0.58 ms to read it, on both ends, per request).  A stand-in rather than a tensor
    turned into an array by a ``Pickler.reducer_override``, which pickle calls for every object of the answer."""

    __slots__ = ("row",)

    def __init__(self, row: np.ndarray) -> None:
        self.row = row

    def __reduce__(self) -> tuple[Any, tuple[np.ndarray]]:
        return (torch.from_numpy, (self.row,))


def answer_pickle(actions: np.ndarray, timestamp: float, timestep: int) -> bytes:
    """GetActions' answer: LeRobot's list of ``TimedAction`` as robot_client unpickles it (``pickle.loads``), one
    per row of ``actions``, ``ENVIRONMENT_DT_S`` apart from the observation's ``timestamp`` and ``timestep``."""
    rows = np.ascontiguousarray(actions)
    timed = [
        helpers.TimedAction(timestamp=timestamp + i * ENVIRONMENT_DT_S, timestep=timestep + i, action=_ActionRow(row))
        for i, row in enumerate(rows)
    ]
    return pickle.dumps(timed, protocol=pickle.HIGHEST_PROTOCOL)


# --- one client ---------------------------------------------------------------------------
@dataclass
class ClientSession:
    """One robot_client (a gRPC peer) since its last ``Ready``: LeRobot's server state, per client."""

    peer: str
    generation: int
    instructions: Instructions | None = None
    # (TimedObservation, frame, seed, its pickle's bytes): a queue of one
    latest: tuple[Any, dict[str, Any], int | None, int] | None = None
    predicted: set[int] = field(default_factory=set)  # timesteps answered (LeRobot skips them)
    last_processed: Any = None  # the TimedObservation last answered
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    last_active: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> str | None:
        """The engine's session: its history and replica stickiness, new with every ``Ready``."""
        return scoped_session(f"lerobot-grpc {self.peer} #{self.generation}", "robot")

    def worth_predicting(self, obs: Any) -> bool:
        """LeRobot's ``_enqueue_observation`` filter: a must-go observation, the first one, or one whose timestep
        was not answered and whose state moved since the last answered."""
        if obs.must_go or self.last_processed is None:
            return True
        if obs.get_timestep() in self.predicted:
            return False
        assert self.instructions is not None
        try:
            return not helpers.observations_similar(obs, self.last_processed, self.instructions.lerobot_features)
        except Exception:  # noqa: BLE001 - an unreadable state is checked (and refused) by frame_of
            return True


Submit = Callable[[PreparedRequest], Awaitable[Result]]


class AsyncInferenceService(services_pb2_grpc.AsyncInferenceServicer):
    """The four RPCs, on the engine's event loop; ``submit``: the engine's.  A large observation is read and
    converted on a thread of its own, never on the loop that answers every robot and probe."""

    def __init__(self, served: Served, submit: Submit, *, max_message_bytes: int) -> None:
        self.served = served
        self.submit = submit
        self.max_message_bytes = max_message_bytes
        self.sessions: OrderedDict[str, ClientSession] = OrderedDict()
        self._lock = threading.Lock()  # recent() may be read from another thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lerobot-grpc-read")
        self._generations = 0
        plain = plain_data_globals()
        self.observation_globals = {
            **plain,
            ("lerobot.async_inference.helpers", "TimedObservation"): helpers.TimedObservation,
        }
        self.instruction_globals = {
            **plain,
            ("lerobot.async_inference.helpers", "RemotePolicyConfig"): helpers.RemotePolicyConfig,
            ("lerobot.configs.types", "PolicyFeature"): PolicyFeature,
            ("lerobot.configs.types", "FeatureType"): FeatureType,
        }

    # --- sessions -------------------------------------------------------------------------
    def _session(self, context: Any, *, fresh: bool = False) -> ClientSession:
        peer = str(context.peer())
        with self._lock:
            session = self.sessions.pop(peer, None)
            if session is None or fresh:
                self._generations += 1
                session = ClientSession(peer, self._generations)
            session.last_active = time.monotonic()
            self.sessions[peer] = session
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        return session

    def recent(self) -> int:
        """Clients active within ``RECENT_SESSION_S``: robots that will send again soon (thread-safe)."""
        since = time.monotonic() - RECENT_SESSION_S
        with self._lock:
            return sum(1 for s in self.sessions.values() if s.last_active >= since)

    async def _instructed(self, context: Any) -> ClientSession:
        session = self._session(context)
        if session.instructions is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "no policy instructions from this client since its Ready: call Ready, then SendPolicyInstructions",
            )
        return session

    # --- the RPCs ----------------------------------------------------------------------------
    async def Ready(self, request: Any, context: Any) -> Any:  # noqa: N802 - LeRobot's RPC names
        """This client starts afresh (its queue, answered timesteps and history); no other client is touched."""
        session = self._session(context, fresh=True)
        log.info("LeRobot client %s ready (session %d)", session.peer, session.generation)
        return services_pb2.Empty()

    async def SendPolicyInstructions(self, request: Any, context: Any) -> Any:  # noqa: N802
        session = self._session(context)
        try:
            config = restricted_loads(bytes(request.data), self.instruction_globals, "policy instructions")
            session.instructions = check_instructions(config, self.served)
        except RequestError as exc:
            log.info("LeRobot client %s: %s", session.peer, exc)
            await context.abort(status_of(exc), str(exc))
        assert session.instructions is not None
        log.info(
            "LeRobot client %s: %s policy, %d actions per chunk (it named %r; this server serves its own)",
            session.peer,
            self.served.policy_type,
            session.instructions.actions_per_chunk,
            session.instructions.pretrained_name_or_path,
        )
        return services_pb2.Empty()

    async def _receive(self, request_iterator: Any, context: Any) -> bytes:
        """LeRobot's chunked transfer (``send_bytes_in_chunks``), bounded by ``--max-message-bytes``."""
        parts: list[bytes] = []
        size = 0
        async for item in request_iterator:
            if item.transfer_state == services_pb2.TransferState.TRANSFER_BEGIN:
                parts, size = [], 0
            size += len(item.data)
            if size > self.max_message_bytes:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"observation larger than {self.max_message_bytes} bytes (--max-message-bytes)",
                )
            parts.append(item.data)
            if item.transfer_state == services_pb2.TransferState.TRANSFER_END:
                return b"".join(parts)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the observation stream ended before TRANSFER_END")
        raise AssertionError("abort raises")

    async def SendObservations(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        session = await self._instructed(context)
        data = await self._receive(request_iterator, context)
        instructions = session.instructions
        assert instructions is not None
        try:
            if len(data) <= INLINE_MAX_BYTES:
                read = self._read(data, session, instructions)
            else:  # a large frame is unpickled and resized off the loop, as the engine prepares one
                read = await asyncio.get_running_loop().run_in_executor(
                    self._pool, self._read, data, session, instructions
                )
        except RequestError as exc:
            log.info("LeRobot client %s: %s", session.peer, exc)
            await context.abort(status_of(exc), f"{exc.kind.value}: {exc}")
            raise AssertionError("abort raises") from None
        if read is not None:
            session.latest = (*read, len(data))
            session.arrived.set()
        return services_pb2.Empty()

    def _read(
        self, data: bytes, session: ClientSession, instructions: Instructions
    ) -> tuple[Any, dict[str, Any], int | None] | None:
        """The observation, its frame and seed; None when LeRobot's filter drops it (already answered, or too
        similar to the last one answered)."""
        obs = restricted_loads(data, self.observation_globals, "observation")
        if not isinstance(obs, helpers.TimedObservation):
            raise RefusedPickle(f"an observation must be LeRobot's TimedObservation, got {type(obs).__name__}")
        if not isinstance(obs.timestep, int) or not isinstance(obs.timestamp, (int, float)):
            raise InvalidObservation("a TimedObservation's timestep must be an int and its timestamp a number")
        if not session.worth_predicting(obs):
            return None
        frame, seed = frame_of(obs.observation, instructions, self.served)
        return obs, frame, seed

    async def GetActions(self, request: Any, context: Any) -> Any:  # noqa: N802
        """The chunk for this client's latest observation, waiting up to ``OBS_WAIT_S`` for one (then an empty
        answer, which robot_client skips, as LeRobot's server sends)."""
        session = await self._instructed(context)
        assert session.instructions is not None
        deadline = time.monotonic() + OBS_WAIT_S
        while session.latest is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return services_pb2.Actions(data=b"")
            try:
                await asyncio.wait_for(session.arrived.wait(), remaining)
            except TimeoutError:
                return services_pb2.Actions(data=b"")
            session.arrived.clear()
        obs, frame, seed, size = session.latest
        session.latest = None
        session.arrived.clear()
        session.predicted.add(obs.get_timestep())
        session.last_processed = obs
        request_ = PreparedRequest(sample=None, observation=frame, seed=seed, session=session.key, frame_bytes=size)
        try:
            result = await self.submit(request_)
            actions = result.unwrap()
        except RequestError as exc:
            await context.abort(status_of(exc), f"{exc.kind.value}: {exc}")
            raise AssertionError("abort raises") from None
        session.last_active = time.monotonic()
        answer = answer_pickle(actions[: session.instructions.actions_per_chunk], obs.timestamp, obs.timestep)
        return services_pb2.Actions(data=answer)


class LeRobotGrpcFront:
    """The service's grpc.aio server on the engine's own event loop: started once the policy is loaded, stopped at
    the drain.  Each request is submitted to the engine where it is answered, with no thread hop (a hop to another
    loop cost a GIL hand-over each way: 8 clients ran at 2.1x one client's rate, against 4.3x over the WebSocket)."""

    def __init__(self, host: str, port: int, max_message_bytes: int) -> None:
        self.host = host
        self.port = port
        self.max_message_bytes = max_message_bytes
        self.service: AsyncInferenceService | None = None
        self._server: grpc.aio.Server | None = None

    def recent(self) -> int:
        return self.service.recent() if self.service is not None else 0

    async def start(self, engine: EngineClient, policy: Any) -> int:
        """Serve ``policy`` (a ``LeRobotPolicy``) through ``engine`` on the running loop; the bound port.
        ``ValueError`` for a policy LeRobot's client cannot describe, ``OSError`` for a port that cannot bind."""
        if not isinstance(policy, LeRobotPolicy):
            raise ValueError(
                f"LeRobot's AsyncInference service serves LeRobot policies (--policy lerobot), not {policy.name}"
            )
        self.service = AsyncInferenceService(Served.of(policy), engine.submit, max_message_bytes=self.max_message_bytes)
        options = [
            ("grpc.max_receive_message_length", GRPC_CHUNK_BYTES),
            ("grpc.max_send_message_length", GRPC_CHUNK_BYTES),
            ("grpc.so_reuseport", 0),  # grpc's default would let a second server share the port silently
        ]
        server = grpc.aio.server(options=options)
        services_pb2_grpc.add_AsyncInferenceServicer_to_server(self.service, server)
        port = server.add_insecure_port(f"{self.host}:{self.port}")
        if port == 0:
            raise OSError(f"{self.host}:{self.port}: LeRobot's gRPC service cannot bind it")
        await server.start()
        self._server = server
        self.port = port
        return port

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving: RPCs in flight get ``grace_s`` to finish."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
