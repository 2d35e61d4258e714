"""The LeRobot gRPC service's pickle reader and instruction check, without a server (fast).

``safe_pickle`` must build what LeRobot's robot_client really sends (its
``TimedObservation`` of floats, numpy frames and torch tensors; its
``RemotePolicyConfig``) and refuse, before it runs, every pickle that would
call anything else -- at the top, nested in a dict, inside a tensor's storage
(torch's own second pickle), or in a numpy object array.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("grpc")
pytest.importorskip("lerobot")

from lerobot.async_inference.helpers import (  # noqa: E402
    RemotePolicyConfig,
    TimedObservation,
    raw_observation_to_observation,
)
from lerobot.configs.types import FeatureType, PolicyFeature  # noqa: E402
from lerobot.utils.feature_utils import hw_to_dataset_features  # noqa: E402

from policy_operator.runtime.serving.lerobot_grpc import (  # noqa: E402
    AsyncInferenceService,
    InstructionsRefused,
    Served,
    answer_pickle,
    check_instructions,
    frame_of,
)
from policy_operator.runtime.serving.safe_pickle import RefusedPickle, restricted_loads  # noqa: E402

SERVED = Served(
    "smolvla",
    {"observation.state": ("STATE", (6,)), "observation.images.top": ("VISUAL", (3, 48, 64))},
    8,
    True,
    {},
)
HW = {**{f"j{i}.pos": float for i in range(6)}, "top": (480, 640, 3)}


def service() -> AsyncInferenceService:
    return AsyncInferenceService(SERVED, lambda request: None, max_message_bytes=1 << 20)  # type: ignore[arg-type, return-value]


class Runs:
    """A pickle that would run ``fn(*args)`` when read."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


def real_observation() -> TimedObservation:
    raw: dict[str, Any] = {f"j{i}.pos": float(i) for i in range(5)}
    raw["j5.pos"] = np.float32(0.5)  # a bus read may hand numpy scalars
    raw["top"] = np.zeros((480, 640, 3), np.uint8)
    raw["task"] = "pick up the cube"
    raw["extra"] = torch.arange(4, dtype=torch.float32)[1:]  # a view: its storage is pickled whole
    return TimedObservation(timestamp=1.5, timestep=7, observation=raw, must_go=True)


def test_what_robot_client_sends_is_read_back_exactly() -> None:
    svc = service()
    obs = restricted_loads(pickle.dumps(real_observation()), svc.observation_globals, "observation")
    assert isinstance(obs, TimedObservation) and (obs.timestep, obs.must_go) == (7, True)
    assert obs.observation["top"].shape == (480, 640, 3) and obs.observation["j5.pos"] == np.float32(0.5)
    assert torch.equal(obs.observation["extra"], torch.tensor([1.0, 2.0, 3.0]))
    config = RemotePolicyConfig("smolvla", "someone/else", hw_to_dataset_features(HW, "observation"), 5)
    read = restricted_loads(pickle.dumps(config), svc.instruction_globals, "policy instructions")
    assert read == config


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(lambda m: Runs(os.system, f"touch {m}"), id="os.system"),
        pytest.param(lambda m: {"nested": [Runs(os.system, f"touch {m}")]}, id="nested"),
        pytest.param(lambda m: Runs(subprocess.Popen, ["touch", str(m)]), id="subprocess"),
        pytest.param(lambda m: Runs(eval, f"open({str(m)!r}, 'w')"), id="eval"),
        pytest.param(lambda m: Runs(Path(m).touch), id="bound-method"),
        pytest.param(lambda m: np.array([Runs(os.system, f"touch {m}")], dtype=object), id="numpy-object-array"),
    ],
)
def test_a_pickle_that_would_run_code_is_refused_before_it_runs(tmp_path: Path, payload: Any) -> None:
    marker = tmp_path / "ran"
    data = pickle.dumps(TimedObservation(0.0, 1, {"x": payload(marker)}))
    svc = service()
    for allowed, what in ((svc.observation_globals, "observation"), (svc.instruction_globals, "policy instructions")):
        with pytest.raises(RefusedPickle, match=f"{what} refused: its pickle names"):
            restricted_loads(data, allowed, what)
    assert not marker.exists()
    with pytest.raises(RefusedPickle):  # and LeRobot's own classes are no way in for the other message
        restricted_loads(
            pickle.dumps(RemotePolicyConfig("smolvla", "x", {}, 1)), svc.observation_globals, "observation"
        )


def test_a_tensor_storage_carrying_a_pickle_is_read_by_torchs_weights_only_reader(tmp_path: Path) -> None:
    """A tensor's storage is ``torch.storage._load_from_bytes(torch.save blob)``, which torch itself reads with
    ``weights_only=False``: a crafted blob would run its own pickle there."""
    marker = tmp_path / "ran"
    blob = io.BytesIO()
    torch.save(Runs(os.system, f"touch {marker}"), blob)
    data = pickle.dumps(Runs(torch.storage._load_from_bytes, blob.getvalue()))
    with pytest.raises(RefusedPickle, match="weights-only"):
        restricted_loads(data, service().observation_globals, "observation")
    assert not marker.exists()


@pytest.mark.parametrize(
    "data",
    [b"", b"not a pickle", pickle.dumps(TimedObservation(0.0, 1, {}))[:-3]],
    ids=["empty", "garbage", "truncated"],
)
def test_an_unreadable_pickle_is_a_clear_refusal(data: bytes) -> None:
    with pytest.raises(RefusedPickle, match="observation is not a readable pickle"):
        restricted_loads(data, service().observation_globals, "observation")


def instructions(**change: Any) -> RemotePolicyConfig:
    fields: dict[str, Any] = {
        "policy_type": "smolvla",
        "pretrained_name_or_path": "lerobot/smolvla_base",
        "lerobot_features": hw_to_dataset_features(HW, "observation"),
        "actions_per_chunk": 5,
    }
    return RemotePolicyConfig(**{**fields, **change})


def test_matching_instructions_are_taken_and_never_name_what_is_loaded() -> None:
    checked = check_instructions(instructions(), SERVED)
    assert checked.actions_per_chunk == 5 and set(checked.lerobot_features) == set(SERVED.features)
    renamed = {"observation.images.front": hw_to_dataset_features(HW, "observation")["observation.images.top"]}
    renamed["observation.state"] = hw_to_dataset_features(HW, "observation")["observation.state"]
    config = instructions(lerobot_features=renamed, rename_map={"observation.images.front": "observation.images.top"})
    assert set(check_instructions(config, SERVED).lerobot_features) == set(SERVED.features)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"policy_type": "pi0"}, "serves a 'smolvla' policy, the client asked for 'pi0'"),
        ({"actions_per_chunk": 9}, r"actions_per_chunk must be in 1\.\.8"),
        ({"actions_per_chunk": 0}, r"actions_per_chunk must be in 1\.\.8"),
        ({"lerobot_features": hw_to_dataset_features({"j0.pos": float, "top": (4, 4, 3)}, "observation")}, "shape"),
        (
            {"lerobot_features": hw_to_dataset_features({**HW, "wrist": (4, 4, 3)}, "observation")},
            r"unexpected \['observation.images.wrist'\]",
        ),
        (
            {"lerobot_features": hw_to_dataset_features({f"j{i}.pos": float for i in range(6)}, "observation")},
            r"missing \['observation.images.top'\]",
        ),
        ({"lerobot_features": hw_to_dataset_features({**HW, "top": (4, 4, 1)}, "observation")}, "x 3"),
    ],
)
def test_instructions_that_do_not_describe_the_served_policy_are_refused(change: dict[str, Any], words: str) -> None:
    with pytest.raises(InstructionsRefused, match=words):
        check_instructions(instructions(**change), SERVED)


@pytest.mark.parametrize(
    "camera",
    [
        np.arange(48 * 64 * 3, dtype=np.uint8).reshape(48, 64, 3),  # the policy's size: taken as it is
        np.arange(60 * 80 * 3, dtype=np.uint8).reshape(60, 80, 3),  # resized by LeRobot's own resize
        np.linspace(0, 1, 48 * 64 * 3, dtype=np.float32).reshape(48, 64, 3),  # float: LeRobot's path throughout
    ],
    ids=["uint8-policy-size", "uint8-other-size", "float32"],
)
def test_a_frame_is_what_lerobots_own_conversion_gives_the_policy(camera: np.ndarray) -> None:
    """What the policy reads from a frame (a uint8 camera scaled to [0, 1], channels first) is exactly LeRobot's
    ``raw_observation_to_observation`` of the same raw observation, whatever the camera's size and type."""
    served = Served(
        SERVED.policy_type,
        SERVED.features,
        SERVED.chunk,
        True,
        {"observation.images.top": PolicyFeature(FeatureType.VISUAL, (3, 48, 64))},
    )
    hw = {**{f"j{i}.pos": float for i in range(6)}, "top": camera.shape}
    checked = check_instructions(instructions(lerobot_features=hw_to_dataset_features(hw, "observation")), served)
    raw: dict[str, Any] = {f"j{i}.pos": 0.25 * i for i in range(6)}
    raw.update(top=camera, task="pick up the cube", seed=3)
    frame, seed = frame_of(raw, checked, served)
    lerobots = raw_observation_to_observation(raw, checked.lerobot_features, served.image_features)
    assert seed == 3 and frame["task"] == "pick up the cube"
    assert torch.equal(torch.from_numpy(frame["observation.state"]), lerobots["observation.state"][0])
    image = torch.from_numpy(frame["observation.images.top"])
    if image.dtype == torch.uint8:  # HWC bytes, as a WebSocket robot sends them
        image = image.permute(2, 0, 1).float() / 255
    assert image.shape == (3, 48, 64) and torch.equal(image, lerobots["observation.images.top"][0])


def test_an_answer_is_lerobots_list_of_timed_actions() -> None:
    """GetActions' pickle reads back, with ``pickle.loads`` as robot_client reads it, as LeRobot's TimedActions:
    one float32 tensor per row, from the observation's timestep and timestamp, one 1/fps apart."""
    actions = np.arange(24, dtype=np.float32).reshape(4, 6)
    answer = pickle.loads(answer_pickle(actions[:3], 2.0, 7))
    assert [(a.timestep, round(a.timestamp, 6)) for a in answer] == [
        (7, 2.0),
        (8, round(2 + 1 / 30, 6)),
        (9, round(2 + 2 / 30, 6)),
    ]
    for row, action in zip(actions, answer, strict=False):
        assert type(action).__name__ == "TimedAction" and type(action.action) is torch.Tensor
        assert action.action.dtype == torch.float32 and torch.equal(action.action, torch.from_numpy(row))
