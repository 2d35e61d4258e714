"""Observation validation: every rejection path names the key, and valid inputs are accepted.

The table runs through ``ReferencePolicy.prepare`` (what the server calls
before anything reaches a rank), so a check that exists in
``observation.py`` but is bypassed by the policy would fail here too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from policy_operator.runtime.errors import ErrorKind, RequestError
from policy_operator.runtime.policy import InvalidObservation
from policy_operator.runtime.policy.observation import (
    GRIPPER_KEY,
    IMAGE_KEY,
    JOINT_KEY,
    MAX_ABS_STATE,
    MAX_IMAGE_SIDE,
    MAX_PROMPT_CHARS,
    parse_observation,
    parse_request_keys,
)
from policy_operator.runtime.policy.reference import ReferencePolicy, camera_key

WRIST = "observation/wrist_image_left"


def good(**changes: Any) -> dict[str, Any]:
    obs: dict[str, Any] = {
        IMAGE_KEY: np.zeros((24, 32, 3), np.uint8),
        JOINT_KEY: np.linspace(-1, 1, 7).astype(np.float32),
        GRIPPER_KEY: np.array([0.5], np.float32),
        "prompt": "pick up the cube",
    }
    for key, value in changes.items():
        key = key.replace("__", "/")
        if value is _DROP:
            obs.pop(key)
        else:
            obs[key] = value
    return obs


_DROP = object()
img = np.zeros((8, 8, 3), np.uint8)


@pytest.fixture(scope="module")
def policy(tiny_checkpoint: Path) -> ReferencePolicy:
    return ReferencePolicy.load(str(tiny_checkpoint), device=torch.device("cpu"))


# (id, observation, key the message must name, further words it must contain)
REJECTED: list[tuple[str, Callable[[], Any], str, str]] = [
    ("not-a-dict", lambda: [1, 2], "observation must be a dict", "list"),
    ("no-image", lambda: good(observation__image=_DROP), IMAGE_KEY, "missing"),
    ("image-list", lambda: good(observation__image=[[[0, 0, 0]]]), IMAGE_KEY, "uint8 array"),
    ("image-float", lambda: good(observation__image=np.zeros((8, 8, 3), np.float32)), IMAGE_KEY, "uint8"),
    ("image-2d", lambda: good(observation__image=np.zeros((8, 8), np.uint8)), IMAGE_KEY, "(H, W, 3)"),
    ("image-rgba", lambda: good(observation__image=np.zeros((8, 8, 4), np.uint8)), IMAGE_KEY, "(H, W, 3)"),
    ("image-empty", lambda: good(observation__image=np.zeros((0, 8, 3), np.uint8)), IMAGE_KEY, "size 0x8"),
    (
        "image-huge",
        lambda: good(observation__image=np.zeros((MAX_IMAGE_SIDE + 1, 1, 3), np.uint8)),
        IMAGE_KEY,
        "each side",
    ),
    ("camera-dict-empty", lambda: good(observation__image={}), IMAGE_KEY, "empty dict"),
    (
        "camera-dict-bad",
        lambda: good(observation__image={"base": img, "wrist": np.zeros((8, 8), np.uint8)}),
        f"{IMAGE_KEY}/wrist",
        "(H, W, 3)",
    ),
    ("extra-camera-bad", lambda: good(**{WRIST: np.zeros((8, 8, 3), np.int16)}), WRIST, "uint8"),
    ("too-many-cameras", lambda: good(observation__image={"a": img, "b": img}, **{WRIST: img}), WRIST, "at most 2"),
    ("no-joints", lambda: good(observation__joint_position=_DROP), JOINT_KEY, "missing"),
    ("joints-str", lambda: good(observation__joint_position="0,0,0"), JOINT_KEY, "float array"),
    ("joints-dict", lambda: good(observation__joint_position={"j0": 0.0}), JOINT_KEY, "float array"),
    ("joints-bool", lambda: good(observation__joint_position=np.zeros(7, bool)), JOINT_KEY, "dtype |b1"),
    ("joints-strings", lambda: good(observation__joint_position=["a"] * 7), JOINT_KEY, "dtype"),
    ("joints-none", lambda: good(observation__joint_position=[None] * 7), JOINT_KEY, "dtype |O"),
    ("joints-ragged", lambda: good(observation__joint_position=[1.0, [2.0, 3.0]]), JOINT_KEY, "flat list"),
    ("joints-short", lambda: good(observation__joint_position=np.zeros(6, np.float32)), JOINT_KEY, "(7,), got (6,)"),
    ("joints-2d", lambda: good(observation__joint_position=np.zeros((7, 1), np.float32)), JOINT_KEY, "got (7, 1)"),
    (
        "joints-nan",
        lambda: good(observation__joint_position=np.array([0, 0, np.nan, 0, 0, 0, 0], np.float32)),
        JOINT_KEY,
        "NaN or inf",
    ),
    ("joints-inf", lambda: good(observation__joint_position=[0.0, 0, 0, 0, 0, 0, -np.inf]), JOINT_KEY, "NaN or inf"),
    ("joints-overflow", lambda: good(observation__joint_position=np.full(7, 1e39)), JOINT_KEY, "NaN or inf"),
    ("no-gripper", lambda: good(observation__gripper_position=_DROP), GRIPPER_KEY, "missing"),
    ("gripper-long", lambda: good(observation__gripper_position=[0.1, 0.2]), GRIPPER_KEY, "(1,), got (2,)"),
    ("gripper-nan", lambda: good(observation__gripper_position=float("nan")), GRIPPER_KEY, "NaN or inf"),
    ("prompt-int", lambda: good(prompt=3), "'prompt'", "string"),
    ("prompt-bytes", lambda: good(prompt=b"pick"), "'prompt'", "string"),
    ("prompt-none", lambda: good(prompt=None), "'prompt'", "string"),
    ("prompt-long", lambda: good(prompt="x" * (MAX_PROMPT_CHARS + 1)), "'prompt'", f"at most {MAX_PROMPT_CHARS}"),
]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # joints-overflow, on purpose
@pytest.mark.parametrize(("make", "key", "words"), [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED])
def test_prepare_rejects_and_names_the_key(
    policy: ReferencePolicy, make: Callable[[], Any], key: str, words: str
) -> None:
    with pytest.raises(InvalidObservation) as info:
        policy.prepare(make())
    message = str(info.value)
    assert key in message and words in message, message
    assert info.value.kind is ErrorKind.INVALID_OBSERVATION and isinstance(info.value, RequestError)


@pytest.mark.parametrize(
    "obs",
    [
        good(),
        good(observation__joint_position=[0.0] * 7, observation__gripper_position=0.5),  # plain Python numbers
        good(observation__joint_position=np.zeros(7, np.float64), observation__gripper_position=np.float32(1.0)),
        good(observation__joint_position=np.arange(7, dtype=np.int32), observation__gripper_position=[1]),
        good(observation__image={"base": img, "wrist": img}),
        good(**{WRIST: img}),
        good(prompt=_DROP),
        good(prompt="x" * MAX_PROMPT_CHARS, unknown_key=object(), **{"observation/state_extra": "ignored"}),
        good(observation__image=np.zeros((MAX_IMAGE_SIDE, 1, 3), np.uint8)),
    ],
    ids=[
        "numpy",
        "python-numbers",
        "float64-and-scalar",
        "ints",
        "camera-dict",
        "extra-camera",
        "no-prompt",
        "limits-and-unknown-keys",
        "max-side",
    ],
)
def test_prepare_accepts_valid_observations(policy: ReferencePolicy, obs: dict[str, Any]) -> None:
    sample = policy.prepare(obs)
    cfg = policy.cfg
    cameras = [k for k in sample.tensors if k.startswith("camera")]
    assert cameras == [camera_key(i) for i in range(sample.meta["cameras"])] and cameras
    assert all(sample.tensors[k].dtype == torch.uint8 and sample.tensors[k].shape[0] == 1 for k in cameras)
    assert sample.tensors["present"].sum().item() == len(cameras)
    assert policy.pixels(sample.tensors, 1).shape == (1, cfg.max_cameras, 3, cfg.image_size, cfg.image_size)
    assert sample.tensors["state"].shape == (1, cfg.joint_dim + cfg.gripper_dim)
    assert sample.tensors["state"].dtype == torch.float32
    assert sample.tensors["tokens"].shape == (1, cfg.prompt_tokens)


def test_read_only_arrays_from_the_wire_are_accepted(policy: ReferencePolicy) -> None:
    """openpi-client and our decoder hand out read-only arrays (np.ndarray over the frame's bytes)."""
    obs = good()
    for key in (IMAGE_KEY, JOINT_KEY, GRIPPER_KEY):
        obs[key] = obs[key].copy()
        obs[key].setflags(write=False)
    assert policy.prepare(obs).tensors["present"].tolist() == [[True, False]]


def test_camera_order_is_sorted_and_stable() -> None:
    a, b, c = (np.full((4, 4, 3), v, np.uint8) for v in (1, 2, 3))
    parsed = parse_observation(
        good(observation__image={"zeta": a, "alpha": b}), joint_dim=7, gripper_dim=1, max_cameras=3
    )
    assert [int(x[0, 0, 0]) for x in parsed.cameras] == [2, 1]
    parsed = parse_observation(
        good(observation__image=a, observation__wrist_image=c, observation__exterior_image=b),
        joint_dim=7,
        gripper_dim=1,
        max_cameras=3,
    )
    assert [int(x[0, 0, 0]) for x in parsed.cameras] == [1, 2, 3]  # the main image first, then the others sorted


def test_state_is_joints_then_gripper() -> None:
    parsed = parse_observation(
        good(observation__joint_position=np.arange(7), observation__gripper_position=[9]),
        joint_dim=7,
        gripper_dim=1,
        max_cameras=2,
    )
    assert parsed.state.dtype == np.float32 and parsed.state.tolist() == [0, 1, 2, 3, 4, 5, 6, 9]
    assert parsed.prompt == "pick up the cube"


@pytest.mark.parametrize("value", [-1e30, 3e38, 1.0e6 * 1.01])
def test_state_of_absurd_magnitude_is_refused_naming_the_bound(value: float) -> None:
    """Finite, but far past any robot's reading: a policy's own bound or ``MAX_ABS_STATE`` (1e6) refuses it."""
    joints = np.zeros(7, np.float32)
    joints[3] = value
    with pytest.raises(InvalidObservation, match=rf"{JOINT_KEY!r} has a value of magnitude .*at most 1e\+06"):
        parse_observation(good(observation__joint_position=joints), joint_dim=7, gripper_dim=1, max_cameras=2)
    joints[3] = MAX_ABS_STATE
    assert parse_observation(good(observation__joint_position=joints), joint_dim=7, gripper_dim=1, max_cameras=2)


# --- seed and session ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("seed", "expected"),
    [
        (None, None),
        (0, 0),
        (7, 7),
        (2**63 - 1, 2**63 - 1),
        (np.int64(5), 5),
        (np.uint64(6), 6),
        (np.array(8), 8),
    ],
)
def test_parse_seed_accepts(seed: Any, expected: int | None) -> None:
    assert parse_request_keys({"seed": seed}) == (expected, None)


def test_parse_seed_absent_is_none() -> None:
    assert parse_request_keys({}) == (None, None)


@pytest.mark.parametrize(
    ("seed", "words"),
    [
        (1.0, "integer, got float"),
        ("3", "integer, got str"),
        (True, "integer, got bool"),
        (np.array([1, 2]), "integer, got ndarray"),
        (-1, "0..2**63-1"),
        (2**63, "0..2**63-1"),
        (np.float32(2), "integer, got float32"),
    ],
)
def test_parse_seed_rejects(seed: Any, words: str) -> None:
    with pytest.raises(InvalidObservation, match="'seed'") as info:
        parse_request_keys({"seed": seed, "session_id": 1.5})  # the seed is checked first
    assert words in str(info.value)


@pytest.mark.parametrize(("session", "expected"), [(None, None), ("robot-1", "robot-1"), (12, "12")])
def test_parse_session_accepts(session: Any, expected: str | None) -> None:
    assert parse_request_keys({"session_id": session}) == (None, expected)


@pytest.mark.parametrize("session", [1.5, True, ["a"], {"a": 1}])
def test_parse_session_rejects(session: Any) -> None:
    with pytest.raises(InvalidObservation, match="'session_id' must be a string"):
        parse_request_keys({"seed": 3, "session_id": session})
