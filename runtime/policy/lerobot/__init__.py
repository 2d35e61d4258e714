"""LeRobot policies (SmolVLA, pi0, pi0.5, Diffusion Policy) served from their pretrained directories: ``--policy lerobot``.

``loading`` (offline load of config, weights and saved processors), ``wire``
(LeRobot's observation keys), ``families`` (each family's condition / denoise
split and integrator), ``policy`` (the ``Policy``), ``tiny`` (small
random-weight checkpoints written offline, for tests and demos).
"""

from policy_operator.runtime.policy.lerobot.policy import LeRobotPolicy

__all__ = ["LeRobotPolicy"]
