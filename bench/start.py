"""Fast start (issue 24): time to Ready of a first server and of a second one of the same spec, side by side.

Every start is a fresh ``policyserver serve`` process with an inductor and
Triton cache directory of its own, as a new pod on a new node has; the
``--compile-cache-dir`` is shared, as the checkpoint cache volume is:

* ``first``: the directory is empty; the server compiles and writes the artifacts;
* ``second``: the same spec, the directory as the first left it: the server loads them;
* ``no cache``: the same spec without ``--compile-cache-dir``: what every later pod paid before.

Time to Ready is from process start to ``/readyz`` 200 (what the kubelet's
readiness probe sees, minus its period); load and warm-up are the server's own
``policy_load_seconds`` / ``policy_warmup_seconds``.  All rows come from one run.

    python bench/start.py                                     # CPU: tiny model, --compile default
    python bench/start.py --device cuda --size base --dtype bfloat16 --compile reduce-overhead \\
        --max-batch 8,32 --out bench/results/h200-start.md    # the issue's H200 rows

On the CPU the artifacts hold the generated C++ source but not the built
kernels (a second CPU server still runs the C++ compiler); on a GPU they
carry the Triton kernels.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from harness import serve
from report import publish  # bench/ is sys.path[0] when a benchmark runs as a script

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


def _metric(text: str, name: str) -> float | None:
    found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else None


def start(checkpoint: Path, serve_args: list[str], inductor: Path, timeout_s: float) -> dict[str, Any]:
    """One server from nothing to Ready, then stopped; what it took and what its log says about the cache."""
    env = {
        "TORCHINDUCTOR_CACHE_DIR": str(inductor),
        "TRITON_CACHE_DIR": str(inductor / "triton"),
        "PYTHONUNBUFFERED": "1",
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    log = Path(tempfile.NamedTemporaryFile(prefix="bench-start-", suffix=".log", delete=False).name)
    started = time.monotonic()
    with serve(checkpoint, env=env, log=log, flags=serve_args, ready_timeout_s=timeout_s, poll_s=0.05) as server:
        ready_s = time.monotonic() - started
        metrics = _get(server.port, "/metrics")[1]
    text = log.read_text()
    graphs = re.search(r"compile cache: (\d+) graph\(s\) from the cache, (\d+) compiled", text)
    return {
        "ready_s": ready_s,
        "load_s": _metric(metrics, "policy_load_seconds"),
        "warmup_s": _metric(metrics, "policy_warmup_seconds"),
        "cache": (
            "loaded"
            if "compile cache: loaded" in text
            else "ignored"
            if "compile cache: ignoring" in text
            else "written"
            if "compile cache: saved" in text
            else "-"
        ),
        "graphs": f"{graphs.group(1)} / {graphs.group(2)}" if graphs else "-",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default="tiny", help="reference checkpoint size: tiny | small | base")
    parser.add_argument("--depth", type=int, default=None, help="override the model's number of blocks")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compile", default="default", help="--compile MODE of every server")
    parser.add_argument("--max-batch", default="1", help="comma-separated: one first/second/no-cache trio each")
    parser.add_argument("--serve-args", default="", help="more serve flags, one shell-quoted string")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per start")
    parser.add_argument("--out", default=None, help="default bench/results/start-<device>.md")
    args = parser.parse_args()

    from policy_operator.runtime.policy.reference import init_checkpoint

    work = Path(tempfile.mkdtemp(prefix="bench-start-"))
    checkpoint = init_checkpoint(work / "checkpoint", args.size, **({"depth": args.depth} if args.depth else {}))
    base = [
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--compile",
        args.compile,
        *(["--threads", "1"] if args.device == "cpu" else []),
        *shlex.split(args.serve_args),
    ]
    rows = []
    for max_batch in (int(b) for b in args.max_batch.split(",")):
        spec = [*base, "--max-batch", str(max_batch)]
        cache = work / f"compile-cache-{max_batch}"
        runs = {
            "first (empty cache dir)": [*spec, "--compile-cache-dir", str(cache)],
            "second (same spec)": [*spec, "--compile-cache-dir", str(cache)],
            "no compile cache": spec,
        }
        results = {}
        for label, serve_args in runs.items():
            inductor = Path(tempfile.mkdtemp(prefix="inductor-", dir=work))  # a new pod: nothing compiled here
            results[label] = start(checkpoint, serve_args, inductor, args.timeout_s)
            print(f"max-batch {max_batch}, {label}: {results[label]}", file=sys.stderr, flush=True)
        first = results["first (empty cache dir)"]["ready_s"]
        for label, r in results.items():
            rows.append(
                f"| {max_batch} | {label} | {r['ready_s']:.1f} | {r['ready_s'] / first:.2f}x | "
                f"{_fmt(r['load_s'])} | {_fmt(r['warmup_s'])} | {r['cache']} | {r['graphs']} |"
            )
    import torch

    device = (
        torch.cuda.get_device_name(0)
        if args.device == "cuda" and torch.cuda.is_available()
        else f"{platform.machine()}, {os.cpu_count()} CPUs"
    )
    lines = [
        "# Time to Ready: a first server and a second one of the same spec",
        "",
        f"{device}, torch {torch.__version__}, `{args.size}` reference model"
        f"{f' (depth {args.depth})' if args.depth else ''}, {args.dtype}, "
        f"`--compile {args.compile}`; every start with an empty inductor/Triton cache directory (a new pod); "
        "one run, rows side by side. Reproduce: "
        f"`.venv/bin/python bench/start.py {shlex.join(sys.argv[1:])}`.",
        "",
        "| max-batch | start | ready s | / first | load s | warm-up s | artifacts | graphs cached / compiled |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- | --- |",
        *rows,
        "",
        "- ready s: process start to `/readyz` 200 (torch import, load, warm-up with every bucket compiled)",
        "- artifacts: `written` (the first start saved them), `loaded` (the second found them)",
        *(
            []
            if args.device != "cpu"
            else [
                "- CPU: the artifacts hold inductor's generated C++ source, not the built kernels, so every start here "
                "still runs the C++ compiler, which is most of the warm-up: this table shows the load path working "
                "(graphs from the cache, none compiled), not the GPU's saving; run it on a GPU for the ratio"
            ]
        ),
    ]
    publish(lines, args.out or REPO / "bench" / "results" / f"start-{args.device}.md")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()
