"""Under torchrun (cfgp x dp > 1) ``serve`` exits with the documented code of the rank that failed first, as one
rank does, not torchrun's 1: each rank notes its code in the directory ``serve`` names
(``exit_codes.ENV_RANK_EXIT_DIR``).  kill -9 of the front-end process at cfgp=2 ended ``serve`` with 1 and a gloo
traceback from the peer; now 6 (``FRONTEND``), and the peer says in one line that rank 0 left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from policy_operator.exit_codes import ENV_RANK_EXIT_DIR, ServeExit, first_rank_exit, note_rank_exit
from tests.support.servers import PolicyServerProcess, descendants

COMMON = ["--threads", "1", "--steps", "2", "--heartbeat-s", "0.5"]


def test_the_first_noted_failure_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert first_rank_exit(tmp_path) is None
    monkeypatch.setenv(ENV_RANK_EXIT_DIR, str(tmp_path))
    for rank, code in ((1, 0), (0, 6), (1, 4)):  # rank 1's 0 is not noted; rank 0's 6 came before rank 1's 4
        monkeypatch.setenv("RANK", str(rank))
        note_rank_exit(code)
    (tmp_path / "rank7").write_text("garbage")  # a half-written note is skipped
    assert first_rank_exit(tmp_path) == (0, ServeExit.FRONTEND)


def frontend_pid(server: PolicyServerProcess) -> int:
    for pid in descendants(server.pid):
        with contextlib.suppress(OSError):
            if b"policy_operator.runtime.serving.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise AssertionError(f"no front-end process\n{server.log_tail()}")


def rank_tracebacks(log: str) -> list[str]:
    """A rank's traceback (torchrun prefixes its lines with [rankN]); torchrun's own report is not one."""
    return [line for line in log.splitlines() if line.startswith("[rank") and "Traceback" in line]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--cfgp", "2"], ["--dp", "2"]], ids=["cfgp2", "dp2"])
def test_killing_the_frontend_process_exits_6_at_every_layout(tiny_checkpoint: Path, layout: list[str]) -> None:
    server = PolicyServerProcess(tiny_checkpoint, *layout, *COMMON, "--frontend", "process")
    with server.start():
        os.kill(frontend_pid(server), signal.SIGKILL)
        killed = time.monotonic()
        code = server.wait_exit(timeout=60)
        log = server.log_text()
    assert code == ServeExit.FRONTEND, log[-4000:]
    assert time.monotonic() - killed < 30
    assert not rank_tracebacks(log), log[-4000:]
    assert "rank 0 failed first, exiting 6" in log and "rank 0 left" in log, log[-4000:]


@pytest.mark.slow
def test_a_checkpoint_that_does_not_load_exits_3_at_cfgp2(tmp_path: Path, tiny_checkpoint: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_checkpoint / "config.json").read_text())  # no weights
    server = PolicyServerProcess(broken, "--cfgp", "2", *COMMON)
    server.start(wait="started")
    try:
        code = server.wait_exit(timeout=90)
    finally:
        server.stop()
    assert code == ServeExit.LOAD, server.log_text()[-4000:]
    assert not rank_tracebacks(server.log_text()), server.log_text()[-4000:]
