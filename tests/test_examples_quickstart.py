"""The README's quick start, run as written: one server, both robot sides (slow: real processes).

The block after ``<!-- quick start -->`` in README.md is the only copy of these commands: this test runs each
line -- ``checkpoint init`` of a tiny SmolVLA, ``serve`` with LeRobot's gRPC port in the background, the openpi
client, and LeRobot's AsyncInference calls (examples/lerobot_grpc_client.py) -- with the paths moved under this
test's directory and the ports the server picked (it is started on port 0: no other test's port is taken).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc")
pytest.importorskip("lerobot")

from tests.support.servers import VENV_BIN, serve_policy, subprocess_env  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- quick start -->\n```\n(.*?)```", re.S)
GRPC_LINE = r"LeRobot AsyncInference gRPC on [0-9.]+:(\d+)"


def quick_start() -> list[list[str]]:
    (block,) = BLOCK.findall((REPO / "README.md").read_text())
    return [shlex.split(line.split("#", 1)[0]) for line in block.splitlines() if line.strip()]


def run(argv: list[str]) -> str:
    exe = str(VENV_BIN / argv[0]) if argv[0] == "policyserver" else sys.executable if argv[0] == "python" else argv[0]
    done = subprocess.run(
        [exe, *argv[1:]], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, (
        f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )
    return done.stdout


def test_the_readme_quick_start_serves_both_robot_sides(tmp_path: Path) -> None:
    init, serve, openpi, lerobot = quick_start()
    assert init[:3] == ["policyserver", "checkpoint", "init"] and serve[:2] == ["policyserver", "serve"]
    assert serve[-1] == "&" and openpi[:2] == ["policyserver", "client"] and lerobot[0] == "python"
    checkpoint = init[3]
    moved = str(tmp_path / "smolvla")

    def here(argv: list[str]) -> list[str]:
        return [moved if a == checkpoint else a for a in argv]

    run(here(init))
    flags = here(serve[2:-1])
    flags[flags.index("--port") + 1] = "0"  # the server picks its ports, the clients get them from its log
    flags[flags.index("--lerobot-grpc-port") + 1] = "0"
    assert flags[flags.index("--checkpoint") + 1] == moved
    del flags[flags.index("--checkpoint") : flags.index("--checkpoint") + 2]
    with serve_policy(moved, *flags, "--drain-grace-s", "0") as server:
        grpc_port = server.wait_for_log(GRPC_LINE).group(1)
        openpi_argv = [a.replace(":8000", f":{server.port}") for a in here(openpi)]
        assert "3 ok, 0 failed" in run(openpi_argv)
        lerobot_argv = [a.replace(":8080", f":{grpc_port}") for a in here(lerobot)]
        out = run(lerobot_argv)
        assert re.findall(r"^timesteps (\d+)\.\.(\d+): 8 actions of 6", out, re.M) == [
            ("0", "7"),
            ("8", "15"),
            ("16", "23"),
        ], out
