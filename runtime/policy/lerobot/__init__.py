"""LeRobot policies served from their pretrained directories: ``--policy lerobot``.

The served types are the family registry's (``builtin_policies.LEROBOT_FAMILIES``): SmolVLA, pi0, pi0.5 and
Diffusion Policy split in ``families``, and one module per family added since (``family_<type>``: LingBot-VA,
X-VLA, GR00T N1.7).

``loading`` (offline load of config, weights and saved processors), ``wire``
(LeRobot's observation keys), ``families`` (each family's condition / denoise
split and integrator), ``policy`` (the ``Policy``), ``tiny`` (small
random-weight checkpoints written offline, for tests and demos).
"""

from policy_operator.runtime.policy.lerobot.policy import LeRobotPolicy

__all__ = ["LeRobotPolicy"]
