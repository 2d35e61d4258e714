"""Throughput of ``policyserver fetch`` over loopback, next to curl and cp of the same bytes.

Not a test: it prints and writes ``bench/results/fetch.md``.  One file of
``--size`` random bytes is served by the test suite's ``CheckpointServer``
(sendfile, no throttle) as a checkpoint directory with a manifest, then:

* ``fetch``: ``policyserver fetch`` (Python API): download, in-stream sha256,
  fsync, marker, rename - everything a real fetch does;
* ``fetch, fsync patched out``: the same with ``os.fsync``/``os.fdatasync``
  replaced by no-ops *in this benchmark process only*, to compare the download
  path itself with plain curl (neither then waits for the disk);
* ``curl``: ``curl -o`` of the same URL (no hash, no fsync: the bytes may still
  be only in the page cache when it exits);
* ``curl + fsync``: the same durability as fetch, without verification;
* ``curl + sha256sum + fsync``: what a shell script would need to match fetch's guarantees;
* ``cp``: a local copy (page cache to page cache).

Like is compared with like: fetch against ``curl + fsync`` and the patched
fetch against plain ``curl``; the target for both ratios is >= 0.9x.

Each is run ``--repeat`` times; the table shows the best run (least noise from
other processes).  Disk use peaks at about 2 x ``--size`` (each result is
deleted before the next run).

    .venv/bin/python bench/fetch.py --size 1GiB --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import publish  # bench/ is sys.path[0] when a benchmark runs as a script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from policy_operator.runtime.checkpoint.fetch import fetch  # noqa: E402
from policy_operator.runtime.checkpoint.format import write_manifest  # noqa: E402
from policy_operator.runtime.checkpoint.marker import fsync_path  # noqa: E402
from tests.support.http_checkpoint_server import CheckpointServer  # noqa: E402

_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :]
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 512MiB or 1GiB")
    return int(float(num) * _UNITS[unit])


def make_source(root: Path, size: int) -> Path:
    ckpt = root / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text('{"bench": true}\n')
    block = os.urandom(8 << 20)
    with open(ckpt / "model.safetensors", "wb") as f:
        left = size
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
    write_manifest(ckpt)
    return ckpt


FETCH = "fetch (sha256 + fsync + marker)"
FETCH_NOSYNC = "fetch, fsync patched out"
CURL_SYNC = "curl + fsync"


@contextlib.contextmanager
def no_fsync():  # type: ignore[no-untyped-def]
    real = os.fsync, os.fdatasync
    os.fsync = os.fdatasync = lambda fd: None  # type: ignore[assignment]
    try:
        yield
    finally:
        os.fsync, os.fdatasync = real


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="bytes to move (default 1GiB)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where the bytes go (default: a temp dir under /tmp)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "fetch.md"))
    args = parser.parse_args()

    curl = shutil.which("curl")
    root = Path(tempfile.mkdtemp(prefix="bench-fetch-", dir=args.workdir))
    try:
        src_dir = make_source(root / "src", args.size)
        weights = src_dir / "model.safetensors"
        results: dict[str, list[float]] = {}
        with CheckpointServer(root / "src") as server:
            url = server.url_for("ckpt/")
            file_url = server.url_for("ckpt/model.safetensors")
            for _ in range(args.repeat):
                dest = root / "dest"

                def run_fetch(dest: Path = dest) -> None:
                    fetch(url, dest, progress=False)

                results.setdefault(FETCH, []).append(timed(run_fetch))
                shutil.rmtree(dest)
                with no_fsync():
                    results.setdefault(FETCH_NOSYNC, []).append(timed(run_fetch))
                shutil.rmtree(dest)
                if curl:
                    out = root / "curl.out"

                    def run_curl(out: Path = out) -> None:
                        subprocess.run([curl, "-sSf", "-o", str(out), file_url], check=True)

                    results.setdefault("curl", []).append(timed(run_curl))
                    out.unlink()

                    def run_curl_synced(out: Path = out) -> None:
                        run_curl(out)
                        fsync_path(out)

                    results.setdefault(CURL_SYNC, []).append(timed(run_curl_synced))
                    out.unlink()

                    def run_curl_checked(out: Path = out) -> None:
                        subprocess.run([curl, "-sSf", "-o", str(out), file_url], check=True)
                        hashlib.sha256(out.read_bytes()) if args.size < (256 << 20) else subprocess.run(
                            ["sha256sum", str(out)], check=True, capture_output=True
                        )
                        fsync_path(out)

                    results.setdefault("curl + sha256sum + fsync", []).append(timed(run_curl_checked))
                    out.unlink()
                copy = root / "copy.out"
                results.setdefault("cp", []).append(
                    timed(lambda copy=copy: subprocess.run(["cp", str(weights), str(copy)], check=True))
                )
                copy.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    best = {name: min(times) for name, times in results.items()}
    mbps = {name: args.size / t / 1e6 for name, t in best.items()}
    lines = [
        "# `policyserver fetch` loopback throughput",
        "",
        f"{args.size / (1 << 20):.0f} MiB in one file (+ config.json, manifest.json), best of {args.repeat}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}. "
        "Reproduce: `.venv/bin/python bench/fetch.py --size "
        f"{args.size >> 20}MiB --repeat {args.repeat}`.",
        "",
        "| method | seconds | MB/s | fetch / method |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, t in best.items():
        lines.append(f"| {name} | {t:.2f} | {mbps[name]:.0f} | {mbps[FETCH] / mbps[name]:.2f}x |")
    lines.append("")
    if "curl" in mbps:
        lines += [
            f"- like for like, durable: fetch / (curl + fsync) = **{mbps[FETCH] / mbps[CURL_SYNC]:.2f}x** (target >= 0.9x)",
            f"- like for like, page cache only: patched fetch / curl = **{mbps[FETCH_NOSYNC] / mbps['curl']:.2f}x** "
            "(target >= 0.9x)",
            f"- fetch / plain curl = **{mbps[FETCH] / mbps['curl']:.2f}x** (the brief's target >= 0.9x), "
            "although only fetch waits for the disk",
            f"- fetch / (curl + sha256sum + fsync) = {mbps[FETCH] / mbps['curl + sha256sum + fsync']:.2f}x: "
            "hashing in-stream instead of re-reading",
        ]
    else:
        lines.append("curl is not installed here: no curl rows.")
    publish([*lines, ""], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
