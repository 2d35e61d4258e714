"""Where a LeRobot policy's load goes, each in a fresh process as a pod's would (issue 37: pi0.5 weights in <= 10 s).

For each family, writes the published-size checkpoint (random weights, built
on the device) once under ``--workdir``, then per variant and round starts a
fresh Python that imports what serving imports, initialises CUDA and runs
``LeRobotPolicy.load`` under cProfile, and reports the phases: imports (torch,
then LeRobot's policy modules and the family's own), CUDA's first use, the load itself and, inside
it, LeRobot's module construction (its random init included), the random
init alone (torch.nn.init and transformers' initialisation), reading
``model.safetensors`` (safetensors), the copy into the modules
(``load_state_dict``), the saved pipelines, and the cast to the serving dtype.
Variants: ``as-served`` (this tree), ``no-init`` (the same under
transformers' ``no_init_weights``, to measure what skipping the random init
would buy).  The profile's top entries land in the log.

    python bench/lerobot_load.py --families pi05,smolvla --workdir /tmp/ck --out /tmp/out/lerobot-load.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import publish  # noqa: E402

#: (file suffix, function) -> phase, summed from the profile's cumulative times
PHASES = {
    "random init": [
        ("torch/nn/init.py", "kaiming_uniform_"),
        ("torch/nn/init.py", "normal_"),
        ("torch/nn/init.py", "trunc_normal_"),
        ("torch/nn/init.py", "uniform_"),
        ("transformers/modeling_utils.py", "init_weights"),
    ],
    "read safetensors": [("safetensors/torch.py", "load_file"), ("safetensors/torch.py", "load_model")],
    "load_state_dict": [("torch/nn/modules/module.py", "load_state_dict")],
    "pipelines": [("lerobot/policies/factory.py", "make_pre_post_processors")],
}


def child(family: str, root: str, variant: str, dtype: str) -> None:
    """One fresh process: the phases as JSON on the last line, the profile's top entries before it."""
    import contextlib
    import cProfile
    import pstats

    t0 = time.perf_counter()
    import torch

    t_torch = time.perf_counter()
    from policy_operator.runtime.policy.lerobot.families import family_class  # noqa: F401 - what serve imports
    from policy_operator.runtime.policy.lerobot.policy import LeRobotPolicy

    root_config = json.loads((Path(root) / "config.json").read_text())
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors  # noqa: F401 - serve's imports

    get_policy_class(root_config["type"])

    t_lerobot = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.ones(1, device=device).sum().item()
    t_cuda = time.perf_counter()
    skip: Any = contextlib.nullcontext()
    if variant == "no-init":
        from transformers.initialization import no_init_weights

        skip = no_init_weights()
    prof = cProfile.Profile()
    with skip:
        prof.enable()
        policy = LeRobotPolicy.load(root, device=device, dtype=getattr(torch, dtype))
        if device.type == "cuda":
            torch.cuda.synchronize()
        prof.disable()
    t_load = time.perf_counter()
    stats = pstats.Stats(prof)
    cumulative: dict[tuple[str, str], float] = {}
    for (path, _line, name), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        key = (path.replace(os.sep, "/"), name)
        cumulative[key] = max(cumulative.get(key, 0.0), ct)

    def phase(entries: list[tuple[str, str]]) -> float:
        return sum(ct for (path, name), ct in cumulative.items() for s, n in entries if path.endswith(s) and name == n)

    policy_cls = type(policy.loaded.policy)
    construct = sum(
        ct
        for (path, name), ct in cumulative.items()
        if name == "__init__" and path == policy_cls.__init__.__code__.co_filename.replace(os.sep, "/")
    )
    cast = sum(ct for (path, name), ct in cumulative.items() if name == "cast" and "runtime/policy/lerobot" in path)
    phases = {name: phase(entries) for name, entries in PHASES.items()}
    stats.sort_stats("cumulative").print_stats(30)
    print(
        json.dumps(
            {
                "import torch": t_torch - t0,
                "import LeRobot": t_lerobot - t_torch,
                "CUDA first use": t_cuda - t_lerobot,
                "load": t_load - t_cuda,
                "construct (init incl.)": construct,
                **phases,
                "cast": cast,
                "params (M)": sum(p.numel() for p in policy.loaded.policy.parameters()) / 1e6,
            }
        ),
        flush=True,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="pi05,smolvla")
    p.add_argument("--variants", default="as-served,no-init")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workdir", default="/tmp/ck")
    p.add_argument("--size", default="base", choices=["tiny", "base"])
    p.add_argument("--out", default="/tmp/lerobot-load.md")
    p.add_argument("--child", nargs=3, metavar=("FAMILY", "ROOT", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child, args.dtype)
        return 0
    import torch

    from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows: list[dict[str, Any]] = []
    for family in args.families.split(","):
        root = Path(args.workdir) / family
        if not (root / "config.json").exists():
            from lerobot.policies.factory import get_policy_class

            def build(config: Any, family: str = family) -> Any:
                with torch.device(device):
                    return get_policy_class(family)(config)

            started = time.perf_counter()
            write_tiny_checkpoint(family, root, size=args.size, seed=0, build=build)
            print(f"{family}: checkpoint written in {time.perf_counter() - started:.1f} s", flush=True)
        size_gb = sum(f.stat().st_size for f in root.rglob("*.safetensors")) / 1e9
        for round_ in range(args.rounds):
            for variant in args.variants.split(","):
                cmd = [sys.executable, __file__, "--dtype", args.dtype, "--child", family, str(root), variant]
                started = time.perf_counter()
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
                wall = time.perf_counter() - started
                print(done.stdout[-6000:], done.stderr[-2000:], sep="\n", flush=True)
                if done.returncode != 0:
                    rows.append({"family": family, "variant": variant, "round": round_, "failed": done.returncode})
                    continue
                measured = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(
                    {
                        "family": family,
                        "variant": variant,
                        "round": round_,
                        "process s": wall,
                        "safetensors GB": size_gb,
                        **measured,
                    }
                )
                publish(table(rows, args, device), args.out)
    return 0


def table(rows: list[dict[str, Any]], args: argparse.Namespace, device: Any) -> list[str]:
    import torch

    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "no GPU"
    columns = [
        "import torch",
        "import LeRobot",
        "CUDA first use",
        "load",
        "construct (init incl.)",
        "random init",
        "read safetensors",
        "load_state_dict",
        "pipelines",
        "cast",
        "process s",
    ]
    lines = [
        f"# Where a LeRobot policy's load goes ({gpu}, {os.cpu_count()} cores, {args.dtype}, {args.size} size, random "
        "weights)",
        "",
        "Each row a fresh process (imports counted); seconds. `load` is `LeRobotPolicy.load` (serve's `weights` in "
        "its start line); construct .. cast are inside it (cProfile, cumulative), `random init` inside construct.",
        "",
        "| family | variant | round | params M | safetensors GB | " + " | ".join(columns) + " |",
        "|---|---|---:|---:|---:|" + "---:|" * len(columns),
    ]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['family']} | {r['variant']} | {r['round']} | failed (rc {r['failed']}) |")
            continue
        cells = " | ".join(f"{r[c]:.2f}" for c in columns)
        lines.append(
            f"| {r['family']} | {r['variant']} | {r['round']} | {r['params (M)']:.0f} | "
            f"{r['safetensors GB']:.2f} | {cells} |"
        )
    lines += [
        "",
        f"Reproduce: `python bench/lerobot_load.py --families {args.families} --variants {args.variants} "
        f"--rounds {args.rounds} --dtype {args.dtype} --size {args.size}`",
        "",
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
