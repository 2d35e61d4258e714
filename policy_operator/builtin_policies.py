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

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

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
            "a LeRobot pretrained directory: SmolVLA, pi0, pi0.5, Diffusion Policy",
        ),
    }
)


def builtin(policy: str) -> BuiltinPolicy | None:
    """The built-in ``policy`` names, or None for an import path (a plug-in)."""
    return BUILTIN_POLICIES.get(policy)


def policy_target(policy: str) -> str:
    """``pkg.module:Class`` of ``--policy``: a built-in name's class, an import path as given."""
    found = builtin(policy)
    return found.target if found is not None else policy


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
