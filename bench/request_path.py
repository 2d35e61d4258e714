"""How far one request travels through the code: files and function hops from the WebSocket frame to the actions.

A real ``policyserver serve --cfgp 2 --dp 2`` (torchrun, 4 ranks, CPU) runs
with a ``sitecustomize`` on its PYTHONPATH that installs a call tracer in
every process and every thread.  The tracer records nothing until a trigger
file appears; then it records each call into the project's own code (file,
function, caller, process, thread) until the file is removed.  One request is
sent inside each window, to replica 1 (rank 0 hands it to the driver of
replica 1, which runs it with its cfg peer) and to replica 0 (rank 0's own
model thread runs it with its peer), and the records are reduced to:

* **hops**: the distinct project functions the request entered, in order,
  across every rank (a model's own internals, comprehensions and lambdas,
  and the heartbeat/watchdog threads are left out; a function entered every
  denoising step counts once);
* **files**: the distinct source files those functions live in;
* **module crossings**: calls whose caller lives in another project file than
  the callee, repeats included (``engine -> replica -> engine`` is two; a
  call made every denoising step counts every step, of which there are 2);
  hand-overs between ranks are listed by the ranks the request visits.

Nothing in the server is instrumented and only the CLI, HTTP and WebSocket
are used, so the same script measures any version of the code::

    python bench/request_path.py            # prints both paths
    python bench/request_path.py --json out.json
    python bench/request_path.py --front-end   # one rank, --frontend inline and process

``--front-end`` measures the path issue 38 set targets for: one rank
(``--cfgp 1 --dp 1``), the request from the WebSocket frame to the actions
through the front-end and the engine, with ``--frontend inline`` and with
``--frontend process`` (the front-end child is traced too).  It counts the
serving side only: the model thread's computation below ``dispatch.py`` and
the server's periodic chores that run inside the window (readiness pushes,
heartbeats, the replica watch, the frame sweep, and what only they call) are
left out.
tests/test_request_path.py holds docs/architecture.md's numbers to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import import_root, serve  # bench/ is sys.path[0] when a benchmark runs as a script

REPO = Path(__file__).resolve().parents[1]  # the tree measured (--root: another one, e.g. a git archive)
PROJECT_DIRS = ("runtime", "policy_operator", "operator")
SKIPPED_THREADS = re.compile(r"^(heartbeat-\d+|watchdog|request-path-watch)$")
SKIPPED_FUNCTIONS = re.compile(r"<(genexpr|listcomp|dictcomp|setcomp|lambda)>$")
MODEL_FILES = ("reference.py",)  # a model's internals are not the serving path

SITECUSTOMIZE = """
import json, os, sys, threading, time

_trigger = os.environ.get("REQUEST_PATH_TRIGGER")
if _trigger:
    _roots = tuple(os.environ["REQUEST_PATH_ROOTS"].split(os.pathsep))
    _out = os.environ["REQUEST_PATH_OUT"]
    _state = {"on": False, "records": []}

    def _trace(frame, event, arg):
        if _state["on"] and event == "call":
            code = frame.f_code
            if code.co_filename.startswith(_roots):
                back = frame.f_back
                _state["records"].append((time.time(), threading.current_thread().name, code.co_filename,
                                          code.co_qualname, back.f_code.co_filename if back else "",
                                          back.f_code.co_qualname if back else ""))
        return None

    def _watch():
        window = 0
        while True:
            on = os.path.exists(_trigger)
            if on and not _state["on"]:
                _state["records"] = []
                _state["on"] = True
            elif not on and _state["on"]:
                _state["on"] = False
                window += 1
                path = os.path.join(_out, f"window{window}-pid{os.getpid()}.json")
                with open(path + ".tmp", "w") as f:
                    json.dump({"pid": os.getpid(), "rank": os.environ.get("RANK", "0"),
                               "records": _state["records"]}, f)
                os.replace(path + ".tmp", path)
            time.sleep(0.01)

    sys.settrace(_trace)
    threading.settrace(_trace)
    threading.Thread(target=_watch, name="request-path-watch", daemon=True).start()
"""


def observation(seed: int) -> dict[str, object]:
    """A DROID-shaped observation as RoboLab sends it (built here, so no project import is needed)."""
    rng = np.random.default_rng(seed)
    return {
        "observation/image": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8),
        "observation/joint_position": rng.standard_normal(7).astype(np.float32),
        "observation/gripper_position": rng.random(1).astype(np.float32),
        "prompt": "pick up the cube",
        "seed": seed,
    }


HERE = REPO


class TracedServer:
    def __init__(self, work: Path, ranks: int, frontend: str = "inline") -> None:
        """``ranks``: 4 (cfgp=2, dp=2) or 1; ``frontend``: inline or process."""
        self.work, self.ranks = work, ranks
        site, self.out, self.trigger = work / "site", work / "trace", work / "trace-on"
        site.mkdir()
        self.out.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        checkpoint = work / "ckpt"
        subprocess.run(
            [sys.executable, "-m", "policy_operator.cli", "checkpoint", "init", str(checkpoint), "--size", "tiny"],
            check=True,
            capture_output=True,
            timeout=300,
        )
        env = {
            **os.environ,
            # another tree (--root): its import root goes first, laid out as the import names (see import_root)
            "PYTHONPATH": os.pathsep.join([str(site), *([str(import_root(REPO, work))] if REPO != HERE else [])]),
            "REQUEST_PATH_TRIGGER": str(self.trigger),
            "REQUEST_PATH_OUT": str(self.out),
            "REQUEST_PATH_ROOTS": os.pathsep.join(
                [str(REPO / d) + os.sep for d in PROJECT_DIRS]
                + ([str(import_root(REPO, work) / "policy_operator") + os.sep] if REPO != HERE else [])
            ),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        self.processes = ranks + 2 if ranks > 1 else 1 + (frontend == "process")
        self._stack = contextlib.ExitStack()
        served = self._stack.enter_context(
            serve(
                checkpoint,
                env=env,
                log=work / "server.log",
                ready_timeout_s=300,
                cfgp=2 if ranks > 1 else 1,
                dp=max(1, ranks // 2),
                frontend=frontend,
                steps=2,
                device="cpu",
                threads=1,
                heartbeat_s=1,
            )
        )
        self.port = served.port

    def traced(self, client, obs: dict[str, object], window: int) -> tuple[dict[str, object], list[dict]]:
        """One request inside a trace window; its reply and every process's records."""
        self.trigger.touch()
        time.sleep(0.3)  # every process's watcher polls every 10 ms
        reply = client.infer(obs)
        time.sleep(0.3)
        self.trigger.unlink()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            files = sorted(self.out.glob(f"window{window}-pid*.json"))
            # policyserver/torchrun launcher + every rank (one rank: the policyserver process itself, and its
            # front-end child with --frontend process)
            if len(files) >= self.processes:
                break
            time.sleep(0.1)
        time.sleep(0.5)
        return reply, [json.loads(f.read_text()) for f in sorted(self.out.glob(f"window{window}-pid*.json"))]

    def stop(self) -> None:
        self._stack.close()  # the harness stops the server's process group


def _project(path: str) -> str | None:
    try:
        rel = Path(path).resolve().relative_to(REPO)
    except ValueError:
        return None
    return rel.as_posix() if rel.parts[0] in PROJECT_DIRS else None


# The front-end path (``--front-end``): what runs for the request on the serving side, not the model's work nor
# the server's periodic chores that happen to run inside the window.
MODEL_THREAD = re.compile(r"^model")  # the replica's computation; only dispatch.py's part of it is serving
BACKGROUND_ROOTS = re.compile(
    r"(_push_snapshots|FrontendLink\.push|report_recent_sessions|Engine\._watch|_sweep|^Heartbeat\.|^Board\.|"
    r"^BoardWatcher\.)"
)


def _background(events: list[tuple]) -> set[tuple[str, str]]:
    """(file, function) of the server's periodic chores: the roots, and whatever only they called."""
    callers: dict[tuple[str, str], set[tuple[str | None, str]]] = {}
    for _ts, _rank, _thread, callee, func, caller, caller_func in events:
        callers.setdefault((callee, func), set()).add((caller, caller_func))
    background = {key for key in callers if BACKGROUND_ROOTS.search(key[1])}
    grew = True
    while grew:
        grew = False
        for key, by in callers.items():
            if key not in background and by and all(c in background for c in by):
                background.add(key)
                grew = True
    return background


def reduce_path(dumps: list[dict], serving_only: bool = False) -> dict[str, object]:
    """The hop list, files and module crossings of one traced request (see the module docstring); ``serving_only``:
    without the model's computation and the server's periodic chores (the front-end path)."""
    events = []
    for dump in dumps:
        for ts, thread, file, func, caller_file, caller_func in dump["records"]:
            if SKIPPED_THREADS.match(thread) or SKIPPED_FUNCTIONS.search(func):
                continue
            callee, caller = _project(file), _project(caller_file)
            if callee is None or (
                caller is not None and Path(caller).name in MODEL_FILES and Path(callee).name in MODEL_FILES
            ):
                continue
            events.append(
                (ts, int(dump["rank"]) if dump["rank"].isdigit() else -1, thread, callee, func, caller, caller_func)
            )
    events.sort()
    if serving_only:
        background = _background(events)
        events = [
            e
            for e in events
            if (e[3], e[4]) not in background
            and not (MODEL_THREAD.match(e[2]) and not e[3].endswith("parallel/dispatch.py"))
        ]
    hops, seen, crossings = [], set(), 0
    entered: set[tuple[int, str, str]] = set()  # functions entered from another file (or from no project code)
    for _ts, rank, thread, callee, func, caller, caller_func in events:
        if caller is not None and caller != callee:
            crossings += 1
        if caller != callee:
            entered.add((rank, callee, func))
        # A loop that was already waiting when the window opened (a driver or peer loop) made no "call"
        # event; it shows up as the caller of what it runs, so it is listed where it first acts.
        for key, hop in (
            (
                (rank, caller, caller_func),
                {"rank": rank, "thread": thread, "file": caller, "function": caller_func, "waiting": True},
            ),
            ((rank, callee, func), {"rank": rank, "thread": thread, "file": callee, "function": func}),
        ):
            if key[1] is None or key in seen or SKIPPED_FUNCTIONS.search(key[2]):
                continue
            if hop.get("waiting") and Path(key[1]).name in MODEL_FILES:
                continue
            if serving_only and hop.get("waiting") and (key[1], key[2]) in background:
                continue
            seen.add(key)
            hops.append(hop)
    return {
        "hops": len(hops),
        # what a reader follows from module to module: the hops entered from another file, a file's own helpers
        # (a decoder's hooks, a parser's checks) folded into the function that called them
        "module_hops": sum(1 for h in hops if (h["rank"], h["file"], h["function"]) in entered),
        "files": sorted({h["file"] for h in hops}),
        "module_crossings": crossings,
        "ranks": sorted({h["rank"] for h in hops}),
        "path": hops,
    }


def print_path(title: str, result: dict[str, object]) -> None:
    print(
        f"\n## {title}: {result['hops']} hops ({result['module_hops']} entered from another file) in "
        f"{len(result['files'])} files, {result['module_crossings']} module crossings, ranks {result['ranks']}"
    )
    for i, hop in enumerate(result["path"], 1):  # type: ignore[arg-type]
        waiting = "  (already waiting when the request came)" if hop.get("waiting") else ""
        print(f"{i:3d}. rank {hop['rank']} {hop['thread']:<12} {hop['file']}:{hop['function']}{waiting}")


def front_end_paths(client_factory) -> dict[str, dict[str, object]]:  # noqa: ANN001 - the openpi client class
    """One rank's request path with ``--frontend inline`` and with ``--frontend process`` (issue 38's targets)."""
    results = {}
    for frontend in ("inline", "process"):
        with tempfile.TemporaryDirectory(prefix="request-path-") as tmp:
            server = TracedServer(Path(tmp), ranks=1, frontend=frontend)
            try:
                client = client_factory("127.0.0.1", server.port)
                client.infer(observation(0))  # untraced: the first request's one-time work
                _, dumps = server.traced(client, observation(1), 1)
                results[frontend] = reduce_path(dumps, serving_only=True)
            finally:
                server.stop()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--root", type=Path, help="measure this tree instead (e.g. an older commit's git archive)")
    parser.add_argument(
        "--front-end", action="store_true", help="one rank, --frontend inline and process (issue 38's targets)"
    )
    args = parser.parse_args()
    if args.root is not None:
        global REPO
        REPO = args.root.resolve()
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    if args.front_end:
        results = front_end_paths(WebsocketClientPolicy)
        for name, result in results.items():
            print_path(f"--frontend {name}, one rank", result)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
        return 0
    results = {}
    with tempfile.TemporaryDirectory(prefix="request-path-") as tmp:
        server = TracedServer(Path(tmp), ranks=4)
        try:
            client = WebsocketClientPolicy("127.0.0.1", server.port)
            client.infer(observation(0))  # untraced: replica 0 (the router's tie-break starts there)
            replies = {}
            for window, name in (
                (1, "replica 1 (rank 0 -> driver rank 2 -> cfg peer rank 3)"),
                (2, "replica 0 (rank 0's model thread -> cfg peer rank 1)"),
            ):
                replies[name], dumps = server.traced(client, observation(window), window)
                results[name] = reduce_path(dumps)
                results[name]["replica"] = replies[name]["server_timing"]["replica"]
        finally:
            server.stop()
    for name, result in results.items():
        print_path(name, result)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
