"""One rank of a bare cfgp=2 pair (gloo on 127.0.0.1), for sampler tests that need two real ranks but no server.

``python cfg_pair.py RANK PORT CHECKPOINT STEPS OUT POLICY...``: for each
``POLICY`` (``module:Class``) loaded from ``CHECKPOINT``, samples the example
observation (seed 7, guidance 3.0) in ``parallel`` mode as cfg index ``RANK``;
rank 0 saves the final ``x`` of each, in order, to ``OUT`` (torch.save).
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from policy_operator.runtime.policy.interface import load_policy_class
from policy_operator.runtime.policy.sampler import CfgGroup, sample_actions


def main(rank: int, port: int, checkpoint: str, steps: int, out: str, policies: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        world = dist.group.WORLD
        assert world is not None  # init_process_group above made it
        finals = []
        for path in policies:
            policy = load_policy_class(path).load(checkpoint, device=torch.device("cpu"), dtype=torch.float32)
            sample = policy.prepare(policy.example_observation(0))
            finals.append(
                sample_actions(
                    policy,
                    sample,
                    [7],
                    steps=steps,
                    guidance=3.0,
                    mode="parallel",
                    cfg_group=CfgGroup(world, rank),
                )
            )
        if rank == 0:
            torch.save(finals, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6:])
