"""Where one batch's time goes on the GPU, in one process: condition, each denoise step, postprocess.

Issue 24 target 3: the same build served one robot in ~16 ms in one process and ~27 ms in the next; this
prints the split per phase (CUDA-synchronised host timers, median of ``--reps``), so a slow process shows
which phase is slow.  Run it in several fresh processes (bench/device_lone_robot.sh ``split``).

    python bench/gpu_split.py --checkpoint /tmp/base --sizes 1,8 [--mark-step]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--sizes", default="1,8")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--mark-step", action="store_true", help="cudagraph_mark_step_begin() before every step")
    p.add_argument("--no-pin", action="store_true", help="no pinned staging of the request's tensors")
    p.add_argument("--profile", action="store_true", help="the top host ops of condition() in a profiled rep")
    args = p.parse_args()
    import torch

    from policy_operator.runtime.policy import collate
    from policy_operator.runtime.policy.interface import Branch, context_map
    from policy_operator.runtime.policy.reference import ReferencePolicy, example_observation

    policy = ReferencePolicy.load(args.checkpoint, device=torch.device("cuda"), dtype=torch.bfloat16)
    policy.compile("reduce-overhead")
    if args.no_pin:
        policy.pin_memory = False
    sizes = [int(s) for s in args.sizes.split(",")]
    samples = [policy.prepare(example_observation(policy.cfg, i)) for i in range(max(sizes))]
    sync = torch.cuda.synchronize

    def one(b: int) -> dict[str, float]:
        t: dict[str, float] = {}
        with torch.inference_mode():
            sample = collate(samples[:b])
            sync()
            t0 = time.perf_counter()
            x = torch.cat([policy.init_noise(1000 + i) for i in range(b)])
            ctx_c = policy.condition(sample, Branch.COND)
            ctx_u = policy.condition(sample, Branch.UNCOND)
            ctx = context_map(lambda c, u: torch.cat([c, u.expand_as(c)]), ctx_c, ctx_u)
            sync()
            t1 = time.perf_counter()
            integ = policy.integrator(args.steps)
            steps = []
            for i in range(integ.steps):
                s0 = time.perf_counter()
                if args.mark_step:
                    torch.compiler.cudagraph_mark_step_begin()
                c, u = policy.denoise_step(ctx, torch.cat([x, x]), integ.time(i, 2 * b, x.device)).chunk(2)
                x = integ.step(x, u + 3.0 * (c - u), i)
                sync()
                steps.append((time.perf_counter() - s0) * 1e3)
            t2 = time.perf_counter()
            policy.postprocess_batch(x)
            sync()
            t3 = time.perf_counter()
        t["condition"] = (t1 - t0) * 1e3
        t["denoise"] = (t2 - t1) * 1e3
        t["step_max"] = max(steps)
        t["step_min"] = min(steps)
        t["post"] = (t3 - t2) * 1e3
        t["total"] = (t3 - t0) * 1e3
        return t

    for b in sizes:
        for _ in range(5):
            one(b)
        runs = [one(b) for _ in range(args.reps)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"B={b:>2} " + "  ".join(f"{k} {v:7.2f}" for k, v in med.items()), flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with torch.inference_mode():
                    policy.condition(collate(samples[:b]), Branch.COND)
                    sync()
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
