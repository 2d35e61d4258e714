"""Issue 39 item 2: a LeRobot checkpoint never runs code that nobody chose to run.

Each attack is a real tiny checkpoint (``write_tiny_checkpoint``, Diffusion
Policy: no tokenizer, the fastest to build) with its saved pipeline or files
changed as the review's checkpoints were, and its manifest rewritten to match
(an attacker publishes a consistent one).  Each must be refused -- by the
loader (``load_pretrained``, what ``serve`` runs) and by ``policyserver
checkpoint verify`` (the pod's init container) -- with a message naming the
step or file, and the marker file its payload would write must never appear.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lerobot")

from policy_operator.cli import main as policyserver  # noqa: E402
from policy_operator.exit_codes import CheckpointExit  # noqa: E402
from policy_operator.runtime.checkpoint.format import CheckpointError, write_manifest  # noqa: E402
from policy_operator.runtime.checkpoint.trusted_steps import (  # noqa: E402
    PREPROCESSOR_JSON,
    SERVED_TYPES,
    TRUSTED_STEPS,
    check_lerobot_checkpoint,
)
from policy_operator.runtime.policy.lerobot.families import FAMILIES  # noqa: E402
from policy_operator.runtime.policy.lerobot.loading import load_pretrained  # noqa: E402
from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint  # noqa: E402

CPU = torch.device("cpu")
REMOTE_DIR = "fast"  # a bundled action tokenizer that ships its own Python file


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("diffusion", tmp_path_factory.mktemp("diffusion") / "ckpt", seed=3)


@pytest.fixture
def checkpoint(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "ckpt"))


def _add_step(root: Path, step: dict[str, Any], file: str = PREPROCESSOR_JSON) -> None:
    path = root / file
    saved = json.loads(path.read_text())
    saved["steps"].insert(1, step)
    path.write_text(json.dumps(saved))


class _Planted:
    """A pickle that writes its marker when unpickled (what a pickled weights file can do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, str]]:
        return (open, (self.marker, "w"))


def _subprocess_run(root: Path, marker: Path) -> None:
    _add_step(root, {"class": "subprocess.run", "config": {"args": ["touch", str(marker)]}})


def _os_system(root: Path, marker: Path) -> None:
    _add_step(root, {"class": "os.system", "config": {"command": f"touch {marker}"}})


def _class_in_the_checkpoint(root: Path, marker: Path) -> None:
    (root / "planted_step.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n\nclass Planted:\n    pass\n"
    )
    _add_step(root, {"class": "planted_step.Planted", "config": {}})


def _remote_code_tokenizer(root: Path, marker: Path) -> None:
    """LeRobot's own registered action tokenizer step (trust_remote_code defaults to True there), pointed at a
    processor directory of the checkpoint whose auto_map names a Python file of its own."""
    _add_step(root, _action_tokenizer_step(_remote_code_processor(root / REMOTE_DIR, marker)))


def _action_tokenizer_step(directory: Path) -> dict[str, Any]:
    return {
        "registry_name": "action_tokenizer_processor",
        "config": {"action_tokenizer_name": str(directory), "trust_remote_code": True},
    }


def _remote_code_processor(bundled: Path, marker: Path) -> Path:
    """A transformers processor directory whose auto_map names its own Python file (which writes ``marker``)."""
    bundled.mkdir()
    (bundled / "processing_planted.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n\n"
        "from transformers import ProcessorMixin\n\nclass PlantedProcessor(ProcessorMixin):\n    attributes = []\n"
    )
    (bundled / "processor_config.json").write_text(
        json.dumps(
            {
                "processor_class": "PlantedProcessor",
                "auto_map": {"AutoProcessor": "processing_planted.PlantedProcessor"},
            }
        )
    )
    return bundled


def _pickled_weights(root: Path, marker: Path) -> None:
    (root / "pytorch_model.bin").write_bytes(pickle.dumps(_Planted(marker)))


def _unregistered_step(root: Path, marker: Path) -> None:
    _add_step(root, {"registry_name": "libero_processor", "config": {}})  # LeRobot's, but no served policy's


ATTACKS: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "subprocess.run": (_subprocess_run, r"policy_preprocessor.json step 1 names an import path \('subprocess.run'\)"),
    "os.system": (_os_system, r"policy_preprocessor.json step 1 names an import path \('os.system'\)"),
    "a class in the checkpoint": (_class_in_the_checkpoint, r"step 1 names an import path \('planted_step.Planted'\)"),
    "remote-code tokenizer": (
        _remote_code_tokenizer,
        r"policy_preprocessor.json step 1 \(action_tokenizer_processor\), fast/processor_config.json: asks to run "
        r"the checkpoint's own Python code \(auto_map\); refused unless .*trustRemoteCode",
    ),
    "pickled weights": (_pickled_weights, r"pytorch_model.bin: a pickled weights file"),
    "unregistered step": (_unregistered_step, r"step 1 \('libero_processor'\) is not a processor step this server"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_checkpoint_that_would_run_code_is_refused_before_it_runs(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], attack: str
) -> None:
    plant, message = ATTACKS[attack]
    marker = tmp_path / "marker"
    plant(checkpoint, marker)
    write_manifest(checkpoint)
    monkeypatch.syspath_prepend(str(checkpoint))  # so that a file of the checkpoint is importable, as in a pod's cwd
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(checkpoint, CPU)
    assert not marker.exists()
    capsys.readouterr()
    assert policyserver(["checkpoint", "verify", str(checkpoint), "--hashes"]) == CheckpointExit.INVALID
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert not marker.exists()


def test_remote_code_outside_the_checkpoint_is_refused_naming_the_step(checkpoint: Path, tmp_path: Path) -> None:
    """The action tokenizer in a directory the static checks do not see (the hub cache's view, a path elsewhere):
    the loader gives the step the user's trust_remote_code (off), so transformers refuses it; the load fails
    naming the step and the planted module never runs."""
    marker = tmp_path / "marker"
    _add_step(checkpoint, _action_tokenizer_step(_remote_code_processor(tmp_path / "elsewhere", marker)))
    write_manifest(checkpoint)
    assert check_lerobot_checkpoint(checkpoint).type == "diffusion"  # nothing of the checkpoint asks for it
    with pytest.raises(CheckpointError, match=r"a saved processor step did not load: .*action_tokenizer_processor"):
        load_pretrained(checkpoint, CPU)
    assert not marker.exists()


def test_the_remote_code_step_needs_the_users_opt_in_and_import_paths_stay_refused(checkpoint: Path) -> None:
    _remote_code_tokenizer(checkpoint, checkpoint / "unused-marker")
    assert check_lerobot_checkpoint(checkpoint, trust_remote_code=True).type == "diffusion"
    _os_system(checkpoint, checkpoint / "unused-marker")
    with pytest.raises(CheckpointError, match="names an import path"):
        check_lerobot_checkpoint(checkpoint, trust_remote_code=True)


def test_a_policy_type_that_is_not_served_is_refused_from_its_config_alone(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "type": "pi0_fast"}))
    with pytest.raises(CheckpointError, match=r"LeRobot policy type 'pi0_fast' is not served; served types: smolvla"):
        load_pretrained(checkpoint, CPU)


def test_an_untouched_checkpoint_loads_and_verifies(pristine: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loaded = load_pretrained(pristine, CPU)
    assert loaded.type == "diffusion" and len(loaded.preprocessor.steps) == 4
    assert policyserver(["checkpoint", "verify", str(pristine), "--hashes"]) == CheckpointExit.OK


def test_the_allowed_steps_are_lerobots_own() -> None:
    """Every allowed step name is registered by LeRobot itself once the served families are imported."""
    assert set(FAMILIES) <= set(SERVED_TYPES)  # the trust checks know every family with a split here
    from lerobot.policies.factory import get_policy_class
    from lerobot.processor import ProcessorStepRegistry

    for kind in SERVED_TYPES:
        get_policy_class(kind)  # registers the family's own steps
    for name in TRUSTED_STEPS:
        assert ProcessorStepRegistry.get(name).__module__.startswith("lerobot."), name


def test_the_spec_field_is_the_pods_opt_in_and_only_it_is() -> None:
    """spec.policy.trustRemoteCode reaches the init container's verify and the server's serve as the same flag;
    extraArgs may not set it (the admission-checked field is the one opt-in)."""
    import argparse

    from policy_operator.operator import manifests as M
    from policy_operator.operator.spec import SpecError
    from policy_operator.runtime.checkpoint import cli as checkpoint_cli
    from tests.support.serve_options import parse_serve
    from tests.test_manifests import base, spec_of

    parser = argparse.ArgumentParser()
    checkpoint_cli.add_arguments(parser)
    for trust in (False, True):
        spec = spec_of(base(policy={"type": "lerobot", "trustRemoteCode": trust}))
        pod = M.build_statefulset(spec)["spec"]["template"]["spec"]
        assert parser.parse_args(pod["initContainers"][-1]["command"][2:]).trust_remote_code is trust
        assert parse_serve(pod["containers"][0]["command"][2:]).trust_remote_code is trust
    with pytest.raises(SpecError, match=r"extraArgs must not set .*--trust-remote-code"):
        spec_of(base(policy={"type": "lerobot"}, runtime={"extraArgs": ["--trust-remote-code"]}))


def test_the_reference_policy_refuses_the_opt_in_before_anything_starts() -> None:
    from policy_operator import serve_flags
    from tests.support.serve_options import parse_serve

    serve_flags.check_values(parse_serve(["--checkpoint", "x", "--policy", "lerobot", "--trust-remote-code"]))
    with pytest.raises(
        ValueError, match="--trust-remote-code lets a LeRobot checkpoint .* --policy reference loads none"
    ):
        serve_flags.check_values(parse_serve(["--checkpoint", "x", "--trust-remote-code"]))


def test_the_spec_refuses_the_opt_in_for_the_reference_policy() -> None:
    from policy_operator.operator.spec import SpecError
    from tests.test_manifests import base, spec_of

    assert spec_of(base(policy={"type": "lerobot", "trustRemoteCode": True})).policy.trust_remote_code
    with pytest.raises(SpecError, match=r"policy.trustRemoteCode lets a LeRobot checkpoint .* reference loads none"):
        spec_of(base(policy={"trustRemoteCode": True}))
