"""GR00T N1.7 through ``--policy lerobot``: LeRobot's own actions on a tiny checkpoint written offline, no remote code.

runtime/policy/lerobot/family_groot.py bundles GR00T's base model directory and
a small Qwen3-VL backbone (config, a locally trained tokenizer with a chat
template, Qwen3-VL's own image and video processors); the reference is
LeRobot's ``predict_action_chunk`` with its global generator seeded with the
request's seed (what ``get_action_with_features`` draws its noise from) and its
postprocessor.  Measured: bitwise equal on this CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("lerobot")

from openpi_client.websocket_client_policy import WebsocketClientPolicy  # noqa: E402

from policy_operator.layout import LayoutError  # noqa: E402
from policy_operator.runtime.policy.lerobot import LeRobotPolicy  # noqa: E402
from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint  # noqa: E402
from policy_operator.runtime.policy.sampler import SamplerSettings  # noqa: E402
from tests.support.lerobot_equality import (  # noqa: E402
    ATOL,
    assert_answers_as_lerobot,
    assert_batched_rows_equal_each_alone,
    assert_checkpoint_init_writes,
    ours,
)
from tests.support.servers import serve_policy  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def groot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("groot", tmp_path_factory.mktemp("groot") / "ckpt", seed=6)


@pytest.fixture(scope="module")
def groot(groot_dir: Path) -> LeRobotPolicy:
    return LeRobotPolicy.load(str(groot_dir), device=CPU)


def test_groot_answers_as_lerobot(groot: LeRobotPolicy) -> None:
    obs = groot.example_observation(2)
    got = assert_answers_as_lerobot(groot, obs, 17)
    assert groot.action_shape == (4, 6)
    other = {**obs, "task": "open the top drawer"}
    assert not np.array_equal(got, ours(groot, [other], [17])[0])  # the prompt reaches the backbone


def test_batched_requests_equal_each_alone(groot: LeRobotPolicy) -> None:
    """Rows of one prompt length batch (Qwen3-VL's patches and grids collate with them); each row is its own."""
    observations = [groot.example_observation(k) for k in (1, 2, 3)]
    assert_batched_rows_equal_each_alone(groot, observations)


def test_no_guidance_and_no_rtc(groot: LeRobotPolicy) -> None:
    assert not groot.has_unconditional
    assert SamplerSettings(None, None, "sequential").for_policy(groot).guidance == 1.0
    with pytest.raises(LayoutError, match="cfgp=2"):
        SamplerSettings(None, None, "sequential").for_policy(groot, cfgp=2)
    meta = groot.metadata()
    assert meta["lerobot_type"] == "groot" and meta["chunk_shape"] == [4, 6]
    assert set(meta["observation_keys"]) == {"observation.images.top", "observation.state", "task"}
    assert groot.rtc_unsupported_reason is not None and "t=0" in groot.rtc_unsupported_reason


def test_loads_without_remote_code(groot_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LeRobot asks transformers for trust_remote_code=True when it builds GR00T's backbone and processor; every
    transformers load of this checkpoint gets False."""
    import transformers

    asked: list[tuple[str, Any]] = []
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.Qwen2VLImageProcessor):

        def spy(*args: Any, _load: Any = cls.from_pretrained, _name: str = cls.__name__, **kwargs: Any) -> Any:
            asked.append((_name, kwargs.get("trust_remote_code")))
            return _load(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    LeRobotPolicy.load(str(groot_dir), device=CPU)
    names = {name for name, _ in asked}
    assert {"AutoConfig", "AutoTokenizer", "Qwen2VLImageProcessor"} <= names, asked
    assert all(trust is False for _, trust in asked), asked


def test_checkpoint_init_writes_the_family_and_it_verifies(groot_dir: Path, tmp_path: Path) -> None:
    """The CLI writes the fixture's bytes for the same seed (the bundled base model is seeded too), and the pods'
    ``checkpoint verify`` accepts it."""
    assert_checkpoint_init_writes(
        "groot", 6, groot_dir, tmp_path / "ckpt", ("model.safetensors", "base/model.safetensors")
    )


@pytest.mark.slow
def test_served_from_a_front_end_process_as_in_process(groot_dir: Path, groot: LeRobotPolicy) -> None:
    """Over the WebSocket with ``--frontend process`` (the front-end prepares: Qwen3-VL's patches cross to the
    model process with their batch dimension): the metadata names the keys, chunk, guidance and RTC, and the
    answer is the in-process one."""
    obs = groot.example_observation(4)
    with serve_policy(groot_dir, "--policy", "lerobot", "--threads", "1", "--frontend", "process") as server:
        client = WebsocketClientPolicy(server.url)
        meta = client.get_server_metadata()
        assert (meta["lerobot_type"], meta["chunk_shape"], meta["guidance"]) == ("groot", [4, 6], 1.0)
        assert meta["rtc"]["mode"] == "off"
        assert set(meta["observation_keys"]) == {"observation.images.top", "observation.state", "task"}
        actions = np.asarray(client.infer({**obs, "seed": 8})["actions"])
    np.testing.assert_allclose(actions, ours(groot, [obs], [8])[0], rtol=0, atol=ATOL)
