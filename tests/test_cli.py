"""The ``policyserver`` command as a user runs it: exit codes and what it prints.

Each command runs at least once as the real executable (a subprocess); the checks of arguments and messages
call the same ``main`` in this process (the ``policyserver_main`` fixture), which prints and returns alike.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from policy_operator import __version__
from policy_operator.cli import COMMANDS
from policy_operator.constants import COMPLETE_MARKER, CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE
from tests.support.servers import (
    VENV_BIN,
    PolicyServerProcess,
    serve_policy,
    subprocess_env,
)

POLICYSERVER = str(VENV_BIN / "policyserver")
CLI_TIMEOUT_S = 120


def policyserver(*args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [POLICYSERVER, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(),
        stdin=subprocess.DEVNULL,
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """A usage error is exactly one readable line on stderr, no traceback."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("policyserver: error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    return lines[0]


# --- help -------------------------------------------------------------------------------------
def test_top_level_help_and_version() -> None:
    result = policyserver("--help")
    assert result.returncode == 0, result.stderr
    for name in ("serve", "client", "checkpoint"):
        assert name in result.stdout
    version = policyserver("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"policyserver {__version__}"


PRESENT = [name for name, (module, _) in COMMANDS.items() if importlib.util.find_spec(module) is not None]


@pytest.mark.parametrize(
    "argv",
    [[name] for name in PRESENT] + [["checkpoint", "init"], ["checkpoint", "verify"]],
    ids=lambda argv: " ".join(argv),
)
def test_every_subcommand_help_exits_0(policyserver_main, argv: list[str]) -> None:
    result = policyserver_main(*argv, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: policyserver {' '.join(argv)}"), result.stdout[:200]


def test_runtime_subcommand_parsers_import_no_torch() -> None:
    """--help of serve/client/checkpoint stays instant: their parsers must not pull in torch."""
    code = (
        "import argparse, sys\n"
        "from policy_operator.runtime import client, serve_cli\n"
        "from policy_operator.runtime import checkpoint_cmd\n"
        "from policy_operator.runtime.checkpoint import cli as checkpoint_cli\n"
        "for m in (serve_cli, client, checkpoint_cli, checkpoint_cmd):\n"
        "    m.add_arguments(argparse.ArgumentParser())\n"
        "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=subprocess_env()
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_serve_requires_a_checkpoint(policyserver_main) -> None:
    result = policyserver_main("serve")
    assert result.returncode == 2 and "--checkpoint" in result.stderr


# --- serve refuses bad launches before loading anything -------------------------------------------
@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--cfgp", "3"], "cfgp=3 is not supported"),
        (["--cfgp", "2", "--guidance", "1.0"], "cfgp=2 needs classifier-free guidance"),
        (["--cfgp", "2", "--dp", "2", "--guidance", "1"], "cfgp=2 needs classifier-free guidance"),
        (["--dp", "0"], "dp=0 is not supported"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--cfgp", "2", "--steps", "0"], "--steps must be >= 1"),  # caught before torchrun is exec'd
        (["--auth-token-file", "{missing}"], "--auth-token-file {missing}: cannot read it"),
        (["--dp", "2", "--auth-token-file", "{empty}"], "the file is empty"),
        (["--compile=foo"], "--compile must be one of default, reduce-overhead, max-autotune, "),
    ],
    ids=[
        "cfgp3",
        "cfgp2-guidance1",
        "cfgp2-dp2-guidance1",
        "dp0",
        "steps0",
        "cfgp2-steps0",
        "token-missing",
        "token-empty",
        "compile-foo",
    ],
)
def test_serve_refuses_bad_launches_with_one_line(
    policyserver_main, tmp_path: Path, flags: list[str], words: str
) -> None:
    (tmp_path / "empty").write_text("\n")
    flags = [f.format(missing=tmp_path / "missing", empty=tmp_path / "empty") for f in flags]
    # a checkpoint that does not exist: had serve got as far as loading, it would say so and exit 3
    result = policyserver_main(
        "serve", "--checkpoint", str(tmp_path / "no-such-checkpoint"), "--host", "127.0.0.1", "--port", "0", *flags
    )
    assert result.returncode == 2, result.stderr
    assert words.format(missing=tmp_path / "missing") in one_error_line(result)
    assert "listening" not in result.stdout and "no-such-checkpoint" not in result.stderr


def test_serve_missing_checkpoint_fails_with_a_reason(tmp_path: Path) -> None:
    with serve_policy(tmp_path / "nowhere", "--steps", "2", wait="started") as server:
        code = server.wait_exit(60)
    assert code == 3
    assert (
        f"policyserver: error: FileNotFoundError: checkpoint directory {tmp_path / 'nowhere'} does not exist"
        in server.log_text()
    )


# --- checkpoint init / verify ----------------------------------------------------------------------
def test_checkpoint_init_and_verify(policyserver_main, tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    init = policyserver("checkpoint", "init", str(target), "--seed", "3")
    assert init.returncode == 0, init.stderr
    assert init.stdout.strip() == str(target)
    assert {p.name for p in target.iterdir()} == {CONFIG_FILE, WEIGHTS_FILE, MANIFEST_FILE}
    manifest = json.loads((target / MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {CONFIG_FILE, WEIGHTS_FILE}

    sizes = policyserver_main("checkpoint", "verify", str(target))
    assert sizes.returncode == 0 and "2 files verified (sizes)" in sizes.stdout, sizes.stderr
    hashes = policyserver("checkpoint", "verify", str(target), "--hashes")
    assert hashes.returncode == 0 and "2 files verified (sha256)" in hashes.stdout, hashes.stderr

    again = policyserver_main("checkpoint", "init", str(tmp_path / "again"), "--seed", "3")
    assert again.returncode == 0
    assert (tmp_path / "again" / MANIFEST_FILE).read_text() == (target / MANIFEST_FILE).read_text(), "init is seeded"


@pytest.fixture
def checkpoint_copy(tmp_path: Path, tiny_checkpoint: Path) -> Path:
    """A private copy of the session's (already ``init``-ed) checkpoint, for tests that damage it."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))


def test_verify_catches_a_corrupted_byte_with_hashes(policyserver_main, checkpoint_copy: Path) -> None:
    weights = checkpoint_copy / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    # same size: the default (sizes only, what a pod's init container runs) cannot see it, --hashes does
    assert policyserver_main("checkpoint", "verify", str(checkpoint_copy)).returncode == 0
    result = policyserver_main("checkpoint", "verify", str(checkpoint_copy), "--hashes")
    assert result.returncode == 1
    assert f"{WEIGHTS_FILE}: sha256" in one_error_line(result)


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda p: (p / WEIGHTS_FILE).write_bytes((p / WEIGHTS_FILE).read_bytes()[:-10]), "size"),
        (lambda p: (p / WEIGHTS_FILE).unlink(), f"{WEIGHTS_FILE} is missing"),
        (lambda p: (p / MANIFEST_FILE).unlink(), f"has no {MANIFEST_FILE}"),
        (lambda p: (p / MANIFEST_FILE).write_text("{"), f"malformed {MANIFEST_FILE}"),
    ],
    ids=["truncated", "no-weights", "no-manifest", "bad-manifest"],
)
def test_verify_fails_on_a_damaged_checkpoint(
    policyserver_main, checkpoint_copy: Path, damage: Callable[[Path], object], words: str
) -> None:
    damage(checkpoint_copy)
    result = policyserver_main("checkpoint", "verify", str(checkpoint_copy))
    assert result.returncode == 1
    assert words in one_error_line(result)


def test_verify_require_marker_refuses_an_unfetched_directory(
    policyserver_main, checkpoint_copy: Path, tmp_path: Path
) -> None:
    result = policyserver_main("checkpoint", "verify", str(checkpoint_copy), "--require-marker")
    assert result.returncode == 1 and COMPLETE_MARKER in one_error_line(result)
    missing = policyserver_main("checkpoint", "verify", str(tmp_path / "nothing-here"))
    assert missing.returncode == 1 and "is not a checkpoint" in one_error_line(missing)


# --- the bundled client -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(shared_server: PolicyServerProcess) -> PolicyServerProcess:
    """The session's shared server (tests/conftest.py)."""
    return shared_server


def test_client_prints_a_summary(server: PolicyServerProcess) -> None:
    result = policyserver("client", "--url", server.url, "--n", "3", "--seed", "5")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "reference-flow-policy" in out and "3 ok, 0 failed" in out and "16x8" in out
    assert "latency p50 / p90 / p99" in out and "replicas used" in out and "0: 3" in out


def test_client_json_and_concurrency(policyserver_main, server: PolicyServerProcess) -> None:
    result = policyserver_main("client", "--url", server.url, "--n", "2", "--concurrency", "2", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout)
    assert summary["requests"] == 4 and summary["errors"] == []
    assert summary["action_shapes"] == [[16, 8]] and summary["replicas"] == {"0": 4}
    assert summary["metadata"]["layout"] == {"cfgp": 1, "dp": 1, "world_size": 1}
    assert summary["latency_ms"]["p50"] > 0


def test_client_against_nothing_fails_cleanly(policyserver_main) -> None:
    from tests.support.net import free_port

    result = policyserver_main("client", "--url", f"ws://127.0.0.1:{free_port()}", "--n", "1", "--timeout", "5")
    assert result.returncode == 1
    assert "0 ok, 1 failed" in result.stdout and "error:" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
