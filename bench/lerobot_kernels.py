"""Where a LeRobot flow family's prefix and denoising step spend the GPU, per variant: the next lever, measured.

One process, one published-size random-weight checkpoint (as
bench/lerobot_vs_server.py writes it), ``--policy lerobot``'s own
``LeRobotPolicy`` in bfloat16.  For each variant and batch size: the prefix
(cameras staged, vision tower, VLM prefix: ``condition``) and one denoising
step, median device time over ``--reps`` (CUDA events), eager and -- with
``--compile`` -- as served (``--compile reduce-overhead``, one graph per
bucket, its compile time, and one request's kernel time against the span
from its first kernel to its last, with its trace); then, eager, the profiler's heaviest kernels of
one prefix and one step and the share of matrix products, attention and the
rest.  Variants:

- ``lerobot``: LeRobot's own bfloat16 mode: the vision tower and projector
  float32, matrix products in full float32 (TF32 off);
- ``tf32``: the same weights, float32 products on the tensor cores as TF32;
- ``vision-bf16``: the vision tower and projector in bfloat16 as well
  (``Pi0.float32_vision = False``, the default since this measured it), attention as LeRobot's;
- ``lerobot-step``: that, with LeRobot's own ``denoise_step`` (the prefix cache
  cloned every step; ``Pi0.lerobot_step``) instead of the family's;
- ``grouped-attention``: ``vision-bf16``, and the prefix's and expert's attention as eager's
  products without the copies of the shared key/value head (``Pi0.grouped_attention``, on by default since round 4).

With ``--one-graph``, after the last ``--compile`` variant as served: the whole
request (cameras staged, prefix, every step) captured as one CUDA graph per
batch, against the served graphs in the same process (``one_graph``;
``bench/trace_gaps.py`` reads the traces both leave).

    python bench/lerobot_kernels.py --family pi05 --workdir /tmp/ck --compile vision-bf16   # on the GPU
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from report import publish  # bench/ is sys.path[0] when a benchmark runs as a script

VARIANTS = ("lerobot", "tf32", "vision-bf16", "lerobot-step", "grouped-attention")


def device_ms(fn: Callable[[], Any], reps: int) -> float:
    import torch

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kind_of(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("gemm", "cutlass", "sm90_xmma", "matmul", "ampere_", "sm80_", "nvjet", "_mm_")):
        return "matmul"
    if any(k in low for k in ("fmha", "flash", "attention", "softmax", "sdpa")):
        return "attention/softmax"
    if "conv" in low:
        return "conv"
    return "other"


def kernels(fn: Callable[[], Any], top: int) -> tuple[list[tuple[str, float]], dict[str, float], float]:
    """The heaviest kernels of one call (ms), the time per kind, and the total device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type.name == "CUDA" and event.device_time_total > 0:
            per[event.name] += event.device_time_total / 1e3
    kinds: collections.Counter[str] = collections.Counter()
    for name, ms in per.items():
        kinds[kind_of(name)] += ms
    return per.most_common(top), dict(kinds), sum(per.values())


def timeline(fn: Callable[[], Any], out: str, batch: int) -> tuple[float, float]:
    """One served request's kernels: their summed time and the span from the first one's start to the last one's
    end (ms; the difference is the device idle between them: launches the host did not queue in time), with
    its trace beside ``out`` (chrome://tracing, Perfetto)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(Path(out).with_suffix(f".b{batch}.{time.monotonic_ns()}.trace.json")))
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0]
    if not kernels:
        return 0.0, 0.0
    busy = sum(e.device_time_total for e in kernels) / 1e3
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e3
    return busy, span


def split(kinds: dict[str, float]) -> str:
    main = ("matmul", "attention/softmax")
    rest = sum(v for k, v in kinds.items() if k not in main)
    return " / ".join(f"{kinds.get(k, 0.0):.2f}" for k in main) + f" / {rest:.2f}"


def robots(policy: Any, b: int) -> tuple[Any, Any]:
    """``b`` robots' prepared observations as one batch, and their initial noise (seeds 100, 101, ...)."""
    import torch

    from policy_operator.runtime.policy.interface import collate

    batch = collate([policy.prepare(policy.example_observation(i)) for i in range(b)])
    return batch, torch.cat([policy.init_noise(100 + i) for i in range(b)])


def integrate(denoise: Callable[[Any, Any, Any], Any], integ: Any, context: Any, x: Any, device: Any) -> Any:
    """The unguided step loop as the sampler runs it: ``x`` after every step of ``integ`` with ``denoise``."""
    for i in range(integ.steps):
        x = integ.step(x, denoise(context, x, integ.time(i, x.shape[0], device)), i)
    return x


def measure(policy: Any, b: int, reps: int, top: int) -> tuple[str, list[str]]:
    """One variant at batch ``b``, eager: the table row's cells after the batch, and the heaviest kernels."""
    import torch

    from policy_operator.runtime.policy.interface import Branch

    integ = policy.integrator()
    batch, x = robots(policy, b)
    t = integ.time(0, b, policy.device)
    with torch.inference_mode():
        context = policy.condition(batch, Branch.COND)
        policy.denoise_step(context, x, t)
        prefix_ms = device_ms(lambda: policy.condition(batch, Branch.COND), reps)
        step_ms = device_ms(lambda: policy.denoise_step(context, x, t), reps)
        ptop, pkinds, _ = kernels(lambda: policy.condition(batch, Branch.COND), top)
        stop, skinds, _ = kernels(lambda: policy.denoise_step(context, x, t), top)
    listed = [f"- prefix {ms:.2f} {name[:110]}" for name, ms in ptop]
    listed += [f"- step {ms:.2f} {name[:110]}" for name, ms in stop]
    return f"{prefix_ms:.2f} | {step_ms:.2f} | {split(pkinds)} | {split(skinds)}", listed


def served(
    policy: Any, args: argparse.Namespace, variant: str, batches: list[int], out: str, lines: list[str]
) -> list[str]:
    """``variant`` compiled as served (``--compile reduce-overhead``): per bucket, the compile and capture time,
    the prefix, the 10 steps, and one request's kernel time against its span; ``lines`` so far are saved with
    each row, so a stage cut short by its bound leaves them."""
    import torch
    import torch._dynamo

    from policy_operator.runtime.policy.interface import Branch
    from policy_operator.runtime.policy.lerobot.families import family_class

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    if args.compile_prefix:
        family_class(args.family).compile_prefix = True
    policy.compile("reduce-overhead")
    integ = policy.integrator()
    rows = [
        "",
        f"{variant} as served (`--compile reduce-overhead`):",
        "",
        "| batch | compile + capture s | prefix ms | 10 steps ms | one request: kernels busy / first to last kernel ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    for b in batches:
        batch, x0 = robots(policy, b)

        def steps(context: Any, x: Any = x0) -> Any:
            return integrate(policy.denoise_step, integ, context, x, policy.device)

        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(3):
                steps(policy.condition(batch, Branch.COND))
            torch.cuda.synchronize()
            warm = time.perf_counter() - t0
            context = policy.condition(batch, Branch.COND)
            prefix_ms = device_ms(lambda batch=batch: policy.condition(batch, Branch.COND), args.reps)
            steps_ms = device_ms(lambda c=context: steps(c), args.reps)
            busy, span = timeline(lambda batch=batch: steps(policy.condition(batch, Branch.COND)), out, b)
        rows.append(f"| {b} | {warm:.1f} | {prefix_ms:.2f} | {steps_ms:.2f} | {busy:.2f} / {span:.2f} |")
        print(rows[-1], flush=True)
        Path(out).write_text("\n".join(lines + rows) + "\n")
    return rows


def wall_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median host time of ``fn`` up to its last kernel's end: what a robot waits, launches included."""
    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def one_graph(policy: Any, batches: list[int], reps: int, out: str, lines: list[str]) -> list[str]:
    """The lever round 4 measured the room for: the whole request -- cameras staged, prefix, every step -- as one
    CUDA graph per bucket, against the served path (``policy`` compiled ``reduce-overhead`` by ``served``: a graph
    for the prefix and one per step, replayed by torch's graph trees) in the same process.  Both from the batch's
    CPU tensors and its noise to the final x on the device (the postprocessor is the same host work for both).
    The one graph is torch.compile's default mode (no graphs of its own), captured whole after three warm-up
    runs, replayed after copying the inputs into its buffers."""
    import torch
    import torch._dynamo

    from policy_operator.runtime.policy.interface import Branch
    from policy_operator.runtime.policy.lerobot.relative_actions import STATE_KEY

    integ = policy.integrator()
    device = policy.device
    rows = [
        "",
        "The whole request as one CUDA graph against the served graphs, same process (wall: host clock to the last "
        "kernel's end, median):",
        "",
        "| batch | served wall ms | one graph wall ms | one graph: compile + capture s | kernels busy / first to last "
        "kernel ms | max abs diff of x |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    inputs = {}
    served_ms: dict[int, float] = {}
    served_x: dict[int, Any] = {}
    for b in batches:
        sample, noise = robots(policy, b)
        inputs[b] = (sample, noise)

        def request(sample: Any = sample, noise: Any = noise) -> Any:
            return integrate(policy.denoise_step, integ, policy.condition(sample, Branch.COND), noise, device)

        with torch.inference_mode():
            request()
            served_ms[b] = wall_ms(request, reps)
            served_x[b] = request().float().cpu()
    torch._dynamo.reset()  # the served graphs go; the same functions compile again without graphs of their own
    prefix = torch.compile(policy.family.condition, dynamic=False)
    denoise = torch.compile(policy.family.denoise, dynamic=False)
    staging = policy._staging  # noqa: SLF001 - the served cameras' device step, as ``condition`` runs it
    for b in batches:
        sample, noise = inputs[b]
        static = {k: v.to(device) for k, v in sample.tensors.items() if k != STATE_KEY}
        x_in = noise.clone()

        def whole(static: dict[str, Any] = static, x_in: Any = x_in) -> Any:
            batch = staging.finish(static) if staging is not None else dict(static)
            return integrate(denoise, integ, prefix(batch), x_in, device)

        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.inference_mode():
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        whole()
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(graph):
                    x_out = whole()
        except Exception as exc:  # noqa: BLE001 - what stops the capture is the finding: the row says it
            rows.append(f"| {b} | {served_ms[b]:.2f} | not captured: {type(exc).__name__}: {str(exc)[:200]} | | | |")
            print(rows[-1], flush=True)
            Path(out).write_text("\n".join(lines + rows) + "\n")
            continue
        build_s = time.perf_counter() - t0
        with torch.inference_mode():

            def replay(
                sample: Any = sample,
                noise: Any = noise,
                static: dict[str, Any] = static,
                x_in: Any = x_in,
                graph: Any = graph,
                x_out: Any = x_out,
            ) -> Any:
                for k, v in static.items():
                    v.copy_(sample.tensors[k], non_blocking=True)
                x_in.copy_(noise, non_blocking=True)
                graph.replay()
                return x_out

            replay()
            ms = wall_ms(replay, reps)
            busy, span = timeline(replay, out, b)
            diff = float((replay().float().cpu() - served_x[b]).abs().max())
        rows.append(f"| {b} | {served_ms[b]:.2f} | {ms:.2f} | {build_s:.1f} | {busy:.2f} / {span:.2f} | {diff:.1e} |")
        print(rows[-1], flush=True)
        Path(out).write_text("\n".join(lines + rows) + "\n")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="pi05", choices=["pi05", "pi0", "smolvla"])
    p.add_argument("--workdir", default="/tmp/ck")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--top", type=int, default=8)
    p.add_argument(
        "--compile",
        default="",
        metavar="VARIANTS",
        help="comma-separated: also time these variants as served (reduce-overhead; 90-110 s a bucket for pi0.5)",
    )
    p.add_argument("--compile-prefix", action="store_true", help="compile the prefix too where the family does not")
    p.add_argument(
        "--one-graph",
        action="store_true",
        help="after the last --compile variant as served: the whole request as one CUDA graph, against it",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch
    import torch._dynamo

    from policy_operator.runtime.policy.lerobot import LeRobotPolicy
    from policy_operator.runtime.policy.lerobot.families import Pi0
    from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint

    device = torch.device("cuda")
    out = args.out or f"/tmp/lerobot-kernels-{args.family}.md"
    root = Path(args.workdir) / args.family
    t0 = time.perf_counter()
    if not (root / "config.json").exists():
        from lerobot.policies.factory import get_policy_class

        def build(config: Any) -> Any:
            with torch.device(device):
                return get_policy_class(args.family)(config)

        write_tiny_checkpoint(args.family, root, size="base", seed=0, build=build)
    print(f"checkpoint {time.perf_counter() - t0:.1f} s", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    lines = [
        f"# {args.family}: prefix and one denoising step per variant ({torch.cuda.get_device_name()}, torch "
        f"{torch.__version__}), bfloat16, eager unless said",
        "",
        "| variant | batch | prefix ms | step ms | prefix: matmul / attention / other ms | step: matmul / attention "
        "/ other ms |",
        "|---|---:|---:|---:|---|---|",
    ]
    tops: list[str] = []
    compiled: list[str] = []
    policy: Any = None
    for variant in args.variants.split(","):
        policy = None
        torch._dynamo.reset()  # the last variant's graphs hold its model
        torch.cuda.empty_cache()
        Pi0.float32_vision = variant in ("lerobot", "tf32")
        Pi0.grouped_attention = variant == "grouped-attention"
        Pi0.lerobot_step = variant == "lerobot-step"
        policy = LeRobotPolicy.load(str(root), device=device, dtype=torch.bfloat16)
        torch.backends.cuda.matmul.allow_tf32 = variant != "lerobot"
        for b in batches:
            row, top = measure(policy, b, args.reps, args.top)
            lines.append(f"| {variant} | {b} | {row} |")
            print(lines[-1], flush=True)
            Path(out).write_text("\n".join(lines) + "\n")  # what a stage cut short by its bound leaves
            tops.append(f"\n{variant}, batch {b}, the prefix's and then one step's heaviest kernels (ms):")
            tops += top
        if variant in args.compile.split(","):
            compiled += served(policy, args, variant, batches, out, lines + compiled)
            if args.one_graph and variant == args.compile.split(",")[-1]:
                compiled += one_graph(policy, batches, args.reps, out, lines + compiled)
    lines += compiled + tops
    lines += ["", f"Reproduce: `python bench/lerobot_kernels.py {' '.join(sys.argv[1:])}`"]
    publish(lines, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
