"""The policies ``--policy NAME`` serves without an import path, and what a launch must know of each before torch.

``serve`` refuses a launch the policy cannot run (cfgp=2 or a guidance other
than 1.0 for a policy trained without an unconditional branch) before any rank
starts, and the operator refuses the same PolicyServer before any pod exists:
neither may import torch, so each built-in's traits are written here, torch-free.
A plug-in (``--policy pkg.module:Class``) declares the same traits as class
attributes of its ``Policy``; they are checked when it loads.  The built-in
classes read theirs from this table, so each fact is written once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Final

from policy_operator.constants import CONFIG_FILE
from policy_operator.layout import LayoutError


@dataclass(frozen=True)
class BuiltinPolicy:
    target: str  # pkg.module:Class
    has_unconditional: bool  # trained with a null condition: classifier-free guidance can run
    summary: str


REFERENCE: Final = "reference"
LEROBOT: Final = "lerobot"

BUILTIN_POLICIES: Final[Mapping[str, BuiltinPolicy]] = MappingProxyType(
    {
        REFERENCE: BuiltinPolicy(
            "policy_operator.runtime.policy.reference:ReferencePolicy",
            True,
            "the reference flow-matching transformer (policyserver checkpoint init)",
        ),
        LEROBOT: BuiltinPolicy(
            "policy_operator.runtime.policy.lerobot:LeRobotPolicy",
            False,
            "a LeRobot pretrained directory of a type in LEROBOT_FAMILIES (below)",
        ),
    }
)


@dataclass(frozen=True)
class LeRobotFamily:
    """A LeRobot policy type ``--policy lerobot`` serves, as a launch knows it before torch."""

    has_unconditional: bool  # trained with a null condition: cfgp=2 and a guidance other than 1.0 can run
    summary: str
    #: config.json keys naming other hub repositories the policy loads (the fetch Job downloads each,
    #: runtime/checkpoint/references.py; loading resolves each offline, runtime/policy/lerobot/loading.py)
    references: tuple[str, ...] = ()


#: The LeRobot family registry: a type served here has a row, and its split is runtime/policy/lerobot/families.py's
#: own class or, for a family added as one module, runtime/policy/lerobot/family_<type>.py (its split and its
#: offline tiny config); docs/runtime.md, "Adding a LeRobot family".
LEROBOT_FAMILIES: Final[Mapping[str, LeRobotFamily]] = MappingProxyType(
    {
        "smolvla": LeRobotFamily(False, "SmolVLA"),
        "pi0": LeRobotFamily(False, "pi0"),
        "pi05": LeRobotFamily(False, "pi0.5"),
        "diffusion": LeRobotFamily(False, "Diffusion Policy"),
        "lingbot_va": LeRobotFamily(
            True,
            "LingBot-VA (video guided by its empty prompt)",
            ("wan_pretrained_path",),  # VAE, UMT5, tokenizer
        ),
        "xvla": LeRobotFamily(False, "X-VLA"),
        "groot": LeRobotFamily(False, "GR00T N1.7 (served without remote code)"),
    }
)


#: The LeRobot types trained with a null condition: the only ones ``spec.policy.family`` admits cfgp=2 for.
LEROBOT_CFG_FAMILIES: Final = tuple(kind for kind, row in LEROBOT_FAMILIES.items() if row.has_unconditional)


def builtin(policy: str) -> BuiltinPolicy | None:
    """The built-in ``policy`` names, or None for an import path (a plug-in)."""
    return BUILTIN_POLICIES.get(policy)


def policy_target(policy: str) -> str:
    """``pkg.module:Class`` of ``--policy``: a built-in name's class, an import path as given."""
    found = builtin(policy)
    return found.target if found is not None else policy


def launch_has_unconditional(policy: str, checkpoint: str, family: str | None = None) -> bool | None:
    """Whether ``--policy`` has an unconditional branch, as a launch knows it before torch: a built-in's own trait;
    for ``lerobot``, its family's (the registry row of the type a local checkpoint's config.json names, else of
    ``family``, the type declared with ``--lerobot-family``).  None when only loading can tell: a plug-in, or a
    LeRobot checkpoint not fetched yet of no declared type or of a type not served (the loaded policy's own trait
    is checked then, and a type not served is refused).  A local checkpoint of another type than the declared one
    is refused (LayoutError, naming both)."""
    found = builtin(policy)
    if found is None:
        return None
    if policy != LEROBOT:
        return found.has_unconditional
    kind = checkpoint_type(checkpoint)
    check_family(family, kind)
    row = LEROBOT_FAMILIES.get(kind if kind is not None else family or "")
    return None if row is None else row.has_unconditional


def checkpoint_type(checkpoint: str) -> str | None:
    """The ``type`` a local LeRobot checkpoint's config.json names; None for a source not fetched yet."""
    try:
        kind = json.loads((Path(checkpoint) / CONFIG_FILE).read_text()).get("type")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def check_family(declared: str | None, found: str | None) -> None:
    """Refuse a LeRobot checkpoint of another type than the PolicyServer declared (``spec.policy.family``): the
    operator admitted its layout and guidance for the declared family, one line naming both."""
    if declared is not None and found is not None and found != declared:
        raise LayoutError(
            f"--lerobot-family {declared} (spec.policy.family) declares a {declared} checkpoint, but its "
            f"{CONFIG_FILE} names type {found}: set policy.family to {found} or point the checkpoint at a "
            f"{declared} one"
        )


def check_unconditional(policy: str, has_unconditional: bool, *, cfgp: int, guidance: float) -> None:
    """Refuse guidance for a policy with no unconditional branch: it would guide towards noise, one line."""
    if has_unconditional:
        return
    if cfgp == 2:
        raise LayoutError(
            f"--policy {policy} has no unconditional branch (it was not trained for classifier-free "
            "guidance), so cfgp=2 has nothing to run on its second rank; use cfgp=1"
        )
    if float(guidance) != 1.0:
        raise LayoutError(
            f"--policy {policy} has no unconditional branch (it was not trained for classifier-free "
            f"guidance): guidance must be 1.0, got {guidance:g}; leave --guidance unset"
        )
