"""What a LeRobot checkpoint may make its loader run: LeRobot's own registered steps, by name, and no code of its own.

A checkpoint is data only if its loader treats it so, and LeRobot's does not:
a saved processor pipeline (``policy_preprocessor.json``,
``policy_postprocessor.json``) names each step either by ``registry_name`` (a
class LeRobot registered) or by ``class``, an import path that LeRobot imports
and calls with the step's ``config`` as keyword arguments -- ``subprocess.run``,
``os.system`` or a class in a file shipped next to the weights all run.
transformers imports a Python file a tokenizer or config directory ships when
its JSON has an ``auto_map`` and the caller passes ``trust_remote_code=True``,
which LeRobot's ``action_tokenizer_processor`` does by default; and a pickled
weights file is code when unpickled.

So the checkpoint's JSON is read and checked here, before LeRobot reads
anything of it: the policy type is one this server serves (``SERVED_TYPES``, the
LeRobot family registry), every step is named by a registry name on
``TRUSTED_STEPS`` (never an import path), its state file is a safetensors file
of the checkpoint, no weights file is a pickle, and -- unless the user opted
in by name (``spec.policy.trustRemoteCode`` / ``--trust-remote-code``,
transformers' convention) -- no JSON of the checkpoint asks for remote code.
The loader then forces ``trust_remote_code`` off in the steps that take it.

Torch-free and LeRobot-free: ``policyserver checkpoint verify`` (the server
pod's init container, in the fetch image) runs the same checks, so a refused
checkpoint fails before the server container starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from policy_operator.builtin_policies import LEROBOT_FAMILIES
from policy_operator.constants import CONFIG_FILE
from policy_operator.runtime.checkpoint.format import CheckpointError

PREPROCESSOR_JSON: Final = "policy_preprocessor.json"
POSTPROCESSOR_JSON: Final = "policy_postprocessor.json"
PROCESSOR_FILES: Final = (PREPROCESSOR_JSON, POSTPROCESSOR_JSON)

# The LeRobot policy types this server serves, checked from config.json before anything loads.  pi0_fast, which
# loads its tokenizer with trust_remote_code=True whatever the checkpoint says, is not among them; a family that
# does so must not be added without passing the user's choice through (groot is served with its backbone and
# processor built by family_groot.py with trust_remote_code=False).
SERVED_TYPES: Final = tuple(LEROBOT_FAMILIES)  # the family registry (policy_operator/builtin_policies.py)

# Registry names of the steps LeRobot 0.6's processor factories of the served types write, and nothing else.
TRUSTED_STEPS: Final = frozenset(
    {
        "rename_observations_processor",
        "to_batch_processor",
        "smolvla_new_line_processor",
        "pi0_new_line_processor",
        "pi05_prepare_state_tokenizer_processor_step",
        "tokenizer_processor",
        "device_processor",
        "normalizer_processor",
        "unnormalizer_processor",
        "relative_actions_processor",
        "absolute_actions_processor",
        "action_tokenizer_processor",
        "xvla_image_to_float",
        "xvla_imagenet_normalize",
        "xvla_add_domain_id",
        "groot_n1_7_pack_inputs_v1",
        "groot_n1_7_vlm_encode_v1",
        "groot_n1_7_action_decode_v1",
        "groot_action_unpack_unnormalize_v2",
    }
)
# Trusted steps that load a transformers processor with a ``trust_remote_code`` argument of their own (LeRobot's
# default for it is True): the loader passes the user's choice instead of the checkpoint's.
REMOTE_CODE_STEPS: Final = frozenset({"action_tokenizer_processor"})
TRUST_REMOTE_CODE_KEY: Final = "trust_remote_code"

STEP_KEYS: Final = frozenset({"registry_name", "config", "state_file"})
STATE_SUFFIX: Final = ".safetensors"
# Weights formats that torch.load / pickle would unpickle (a pickle runs code while it loads).
PICKLE_SUFFIXES: Final = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")
REMOTE_CODE_KEY: Final = "auto_map"  # what transformers reads to import a repository's own Python file
MAX_JSON_BYTES: Final = 64 << 20


@dataclass(frozen=True)
class Step:
    """One step of a saved pipeline, as checked: its file, position and registry name."""

    file: str
    index: int
    name: str
    config: Mapping[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.file} step {self.index} ({self.name})"


@dataclass(frozen=True)
class TrustedCheckpoint:
    """What the checks found: the policy type and each saved pipeline's steps (file name -> steps)."""

    root: Path
    type: str
    pipelines: Mapping[str, tuple[Step, ...]]

    def steps(self, file: str) -> tuple[Step, ...]:
        return self.pipelines.get(file, ())


def is_lerobot_checkpoint(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` holds a saved LeRobot pipeline (what ``checkpoint verify`` checks as one)."""
    return any(Path(root, name).is_file() for name in PROCESSOR_FILES)


def _read_json(path: Path, what: str) -> Any:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: {what} is larger than {MAX_JSON_BYTES >> 20} MiB")
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent} is not a LeRobot checkpoint: {path.name} is missing") from None
    except ValueError as exc:
        raise CheckpointError(f"{path}: {what} is not JSON ({exc})") from None


def check_type(root: Path) -> str:
    """The policy type of ``config.json``, refused unless it is one this server serves (before anything loads)."""
    data = _read_json(root / CONFIG_FILE, "the policy config")
    kind = data.get("type") if isinstance(data, dict) else None
    if not isinstance(kind, str):
        raise CheckpointError(f"{root / CONFIG_FILE} has no LeRobot policy 'type' (one of {', '.join(SERVED_TYPES)})")
    if kind not in SERVED_TYPES:
        raise CheckpointError(
            f"{root / CONFIG_FILE}: LeRobot policy type {kind!r} is not served; served types: {', '.join(SERVED_TYPES)}"
        )
    return kind


def _check_step(file: str, index: int, entry: Any, root: Path) -> Step:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{file} step {index} is not an object")
    if "class" in entry:
        raise CheckpointError(
            f"{file} step {index} names an import path ({entry['class']!r}): LeRobot would import and call it; "
            f"only LeRobot's registered steps are loaded, by registry_name ({', '.join(sorted(TRUSTED_STEPS))})"
        )
    name = entry.get("registry_name")
    if not isinstance(name, str):
        raise CheckpointError(f"{file} step {index} has no registry_name")
    if name not in TRUSTED_STEPS:
        raise CheckpointError(
            f"{file} step {index} ({name!r}) is not a processor step this server loads; "
            f"allowed: {', '.join(sorted(TRUSTED_STEPS))}"
        )
    unknown = sorted(set(entry) - STEP_KEYS)
    if unknown:
        raise CheckpointError(f"{file} step {index} ({name}) has unknown keys: {', '.join(map(repr, unknown))}")
    config = entry.get("config", {})
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} step {index} ({name}): 'config' is not an object")
    state = entry.get("state_file")
    if state is not None:
        if (
            not isinstance(state, str)
            or "/" in state
            or "\\" in state
            or state.startswith(".")
            or not state.endswith(STATE_SUFFIX)
            or not (root / state).is_file()
        ):
            raise CheckpointError(
                f"{file} step {index} ({name}): state_file {state!r} is not a {STATE_SUFFIX} file of the checkpoint"
            )
    return Step(file, index, name, config)


def check_pipeline(root: Path, file: str) -> tuple[Step, ...]:
    """The steps of one saved pipeline, each checked; CheckpointError naming the first refused one."""
    data = _read_json(root / file, "a saved processor pipeline")
    steps = data.get("steps") if isinstance(data, dict) else None
    if not isinstance(steps, list):
        raise CheckpointError(f"{root / file} is not a saved processor pipeline: it has no 'steps' list")
    return tuple(_check_step(file, i, entry, root) for i, entry in enumerate(steps))


def _files(root: Path) -> Iterator[Path]:
    """Every regular file under ``root``, links to directories not followed."""
    for dirpath, _dirs, names in os.walk(root, followlinks=False):
        for name in names:
            yield Path(dirpath, name)


def check_no_pickles(root: Path) -> None:
    """Refuse a weights file in a format that unpickles (only safetensors are loaded)."""
    for path in sorted(_files(root)):
        if path.suffix.lower() in PICKLE_SUFFIXES:
            raise CheckpointError(
                f"{path.relative_to(root)}: a pickled weights file ({path.suffix}); unpickling runs code, so "
                f"only safetensors weights are loaded: convert it (safetensors.torch.save_file) or remove it"
            )


def remote_code_files(root: Path) -> list[str]:
    """The JSON files of the checkpoint (bundled tokenizers and configs included) that ask transformers to import
    a Python file of their own (``auto_map``)."""
    found = []
    for path in sorted(_files(root)):
        if path.suffix != ".json" or path.is_symlink():
            continue
        try:
            if path.stat().st_size > MAX_JSON_BYTES:
                continue
            data = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue  # transformers cannot read it either
        if isinstance(data, dict) and REMOTE_CODE_KEY in data:
            found.append(path.relative_to(root).as_posix())
    return found


def _bundled(value: Any, root: Path) -> str | None:
    """A step's config value as a directory of the checkpoint, relative to it (None: not one)."""
    if not isinstance(value, str) or not value:
        return None
    path = Path(value)
    if path.is_absolute():
        try:
            path = path.relative_to(root.absolute())
        except ValueError:
            return None
    return path.as_posix().rstrip("/")


def _steps_loading(pipelines: Mapping[str, tuple[Step, ...]], files: list[str], root: Path) -> list[Step]:
    """The steps whose config names a bundled directory holding one of ``files`` (a tokenizer step's)."""
    return [
        step
        for steps in pipelines.values()
        for step in steps
        if any(
            (d := _bundled(value, root)) is not None and any(f.startswith(d + "/") for f in files)
            for value in step.config.values()
        )
    ]


def check_lerobot_checkpoint(root: str | os.PathLike[str], *, trust_remote_code: bool = False) -> TrustedCheckpoint:
    """Everything above, in the order a refusal is most useful; CheckpointError (one line) naming the file or step.

    ``trust_remote_code``: the user opted in to running the checkpoint's own Python files (transformers'
    ``auto_map``); import paths and unregistered steps are refused all the same.
    """
    path = Path(root)
    kind = check_type(path)
    pipelines = {file: check_pipeline(path, file) for file in PROCESSOR_FILES}
    check_no_pickles(path)
    if not trust_remote_code:
        remote = remote_code_files(path)
        if remote:
            steps = [str(s) for s in _steps_loading(pipelines, remote, path)]
            raise CheckpointError(
                f"{', '.join(steps + remote)}: asks to run the checkpoint's own Python code ({REMOTE_CODE_KEY}); "
                "refused unless the PolicyServer sets spec.policy.trustRemoteCode: true (--trust-remote-code)"
            )
    return TrustedCheckpoint(path, kind, pipelines)


def step_overrides(steps: tuple[Step, ...], *, trust_remote_code: bool) -> dict[str, dict[str, Any]]:
    """Constructor overrides that put the user's ``trust_remote_code`` in place of the checkpoint's, for the
    remote-code steps this pipeline has (LeRobot refuses an override naming a step it does not have)."""
    return {s.name: {TRUST_REMOTE_CODE_KEY: trust_remote_code} for s in steps if s.name in REMOTE_CODE_STEPS}
