"""CPU per request of ``--frontend process``'s per-message work, without sockets or a model.

The server-level runs of the process front-end on a shared 2-core machine
vary by more than any one cost in the request path, so this times the path's
pieces in one thread, request by request, 1 ms apart (robots' frames come
apart, and what a copy leaves running in between counts): the front-end's
decode, ``prepare``, ring write and ``Request`` pickle plus its unpickling of
the ``Answer`` and ``Freed``; the model process's unpickling, copy out of the
ring and reply pickles; and the whole process's CPU over the run, which also
counts torch's intra-op threads spinning after a parallel op.  To compare two
trees side by side, run it once per tree with ``PYTHONPATH`` pointing at a
copy of the other tree laid out as the ``policy_operator`` package.

    python bench/frontend_ipc.py CHECKPOINT_DIR [N]
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch

from policy_operator.runtime import ipc
from policy_operator.runtime.client import robolab_observation
from policy_operator.runtime.engine_api import PreparedRequest
from policy_operator.runtime.policy.reference import PolicyConfig, ReferencePreprocessor
from policy_operator.runtime.result import Result
from policy_operator.runtime.serving import wire

try:
    from policy_operator.runtime.policy.observation import parse_request_keys
except ImportError:  # a tree from before it (bench runs against older trees too)
    from policy_operator.runtime.policy.observation import parse_seed, parse_session

    def parse_request_keys(obs):  # type: ignore[no-redef]
        return parse_seed(obs), parse_session(obs)


WARMUP = 50
GAP_S = 0.001


def main(checkpoint: Path, n: int) -> dict[str, float]:
    cfg = PolicyConfig(**json.loads((checkpoint / "config.json").read_text()))
    pre = ReferencePreprocessor(cfg)
    frames = [
        wire.packb(robolab_observation({"joint_dim": cfg.joint_dim, "gripper_dim": cfg.gripper_dim}, i))
        for i in range(32)
    ]
    slots, slot_bytes = ipc.ring_geometry(1 << 20, 8 << 20)
    ring = ipc.SlotRing(ipc.create_ring_fd(slots, slot_bytes), slots, slot_bytes)
    actions = np.zeros((cfg.horizon, cfg.action_dim), np.float32)
    frontend = engine = engine_all = 0.0
    started = 0.0
    for i in range(n + WARMUP):
        if i == WARMUP:
            started = time.process_time()
        slot = i % slots
        t0 = time.thread_time()
        obs = wire.decode_observation(frames[i % len(frames)])
        prepared = PreparedRequest(pre.prepare(obs), None, *parse_request_keys(obs))
        request = (
            ring.write_request(i, slot, prepared, 8)
            if hasattr(ring, "write_request")
            else ipc.request_of(i, slot, ring, prepared, 8)  # a tree from before write_request
        )
        sent = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        t1, p1 = time.thread_time(), time.process_time()
        got = pickle.loads(sent)
        ring.read_request(got) if hasattr(ring, "read_request") else ipc.prepared_of(got, ring)
        answer = pickle.dumps(ipc.Answer(got.id, Result(actions, infer_ms=1.0)), protocol=pickle.HIGHEST_PROTOCOL)
        freed = pickle.dumps(ipc.Freed((got.slot,)), protocol=pickle.HIGHEST_PROTOCOL)
        t2, p2 = time.thread_time(), time.process_time()
        pickle.loads(answer)
        pickle.loads(freed)
        t3 = time.thread_time()
        time.sleep(GAP_S)
        if i >= WARMUP:
            frontend += (t1 - t0) + (t3 - t2)
            engine += t2 - t1
            engine_all += p2 - p1
    return {
        "frontend_us": round(frontend / n * 1e6, 1),
        "engine_loop_us": round(engine / n * 1e6, 1),
        "engine_all_threads_us": round(engine_all / n * 1e6, 1),
        "process_cpu_per_request_us": round((time.process_time() - started) / n * 1e6, 1),
        "torch_threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2000)))
