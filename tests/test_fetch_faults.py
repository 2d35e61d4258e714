"""``policyserver fetch`` against servers and volumes that misbehave: every run ends, keeps what it got, writes only under DEST.

Real loopback HTTP servers that drop, reset or stall connections
(``tests/support/faulty_http.py``), real files; ``policyserver fetch``'s main
in this process (``policyserver_main``), or as a process where the test waits
out back-offs and stalls.  Every fetch is bounded: a process by its timeout,
one in this process by the test's (pytest-timeout): a fetch that loops forever
fails its test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from policy_operator.constants import COMPLETE_MARKER, MANIFEST_FILE
from policy_operator.exit_codes import FetchExit
from policy_operator.runtime.checkpoint.format import sha256_file, write_manifest
from policy_operator.source_uri import request_key
from tests.support.faulty_http import FaultyCheckpointServer
from tests.support.http_checkpoint_server import CheckpointServer
from tests.support.servers import VENV_BIN

MiB = 1 << 20
WEIGHTS = "model.safetensors"
WEIGHTS_PATH = f"/ckpt/{WEIGHTS}"


def make_checkpoint(directory: Path, weights_size: int = 2 * MiB) -> Path:
    """A checkpoint-shaped directory of random bytes with its manifest (no torch needed)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"policy": "test"}))
    (directory / WEIGHTS).write_bytes(os.urandom(weights_size))
    write_manifest(directory)
    return directory


def fetch(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``policyserver fetch ARGS``; a run that does not end within ``timeout`` fails the test."""
    try:
        return subprocess.run(
            [str(VENV_BIN / "policyserver"), "fetch", *args], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"policyserver fetch {' '.join(args)} still running after {timeout}s\n{(exc.stderr or b'')[-3000:]!r}"
        )


def published_tree_is_clean(final: Path, source: Path) -> None:
    """Every file of the source, byte-identical, as a regular file; no link anywhere under ``final``."""
    assert final.is_dir() and not final.is_symlink()
    for root, dirs, files in os.walk(final):
        for name in dirs + files:
            assert not Path(root, name).is_symlink(), f"{Path(root, name)} is a symlink"
    for path in source.rglob("*"):
        if path.is_file():
            got = final / path.relative_to(source)
            assert got.is_file() and sha256_file(got) == sha256_file(path), got
            assert got.stat().st_nlink == 1, f"{got} has another name: a published inode must be the checkpoint's own"


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    make_checkpoint(tmp_path / "srv" / "ckpt")
    return tmp_path / "srv"


# --- connections that drop, reset or stall --------------------------------------------------------
@pytest.mark.slow  # five attempts without progress: 1 + 2 + 4 + 8 s of back-off by design
def test_server_ignoring_range_and_dropping_at_30_percent_ends_with_exit_3(root, tmp_path, cli_env):
    """Every attempt starts at byte 0 and ends at the same 30%: that is no progress, however often it is tried."""
    with FaultyCheckpointServer(root, fault="close", cut=0.3, ignore_range=True) as server:
        res = fetch(cli_env, server.url_for("ckpt/"), str(tmp_path / "models"), timeout=60)
        gets = server.count(WEIGHTS_PATH)
    assert res.returncode == FetchExit.SOURCE, res.stderr
    assert 2 <= gets <= 10, f"{gets} GETs of the weights"
    assert WEIGHTS in res.stderr.splitlines()[-1]


def test_reset_connections_resume_from_the_bytes_already_received(root, tmp_path, policyserver_main):
    """A RST after each 30% of the file: each retry asks for the rest, so the file arrives once in total."""
    size = (root / "ckpt" / WEIGHTS).stat().st_size
    dest = tmp_path / "models"
    with FaultyCheckpointServer(root, fault="reset", cut=0.3) as server:
        url = server.url_for("ckpt/")
        res = policyserver_main("fetch", url, str(dest))
        ranges = [r.range for r in server.requests if r.path == WEIGHTS_PATH]
        sent = server.bytes_sent[WEIGHTS_PATH]
    assert res.returncode == 0, res.stderr
    starts = [0 if r is None else int(r.removeprefix("bytes=").rstrip("-")) for r in ranges]
    assert starts == sorted(set(starts)) and starts[0] == 0 and len(starts) >= 3, ranges
    assert sent <= size * 1.05, f"{sent} bytes sent for a {size}-byte file"
    published_tree_is_clean(dest / request_key(url), root / "ckpt")


@pytest.mark.slow  # waits out stall timeouts by design
def test_stalled_body_is_dropped_after_the_stall_timeout_and_resumed(root, tmp_path, cli_env):
    """A server that sends 30% and then nothing: after --stall-timeout-s the fetch asks for the rest."""
    size = (root / "ckpt" / WEIGHTS).stat().st_size
    dest = tmp_path / "models"
    with FaultyCheckpointServer(root, fault="stall", cut=0.3, stall_s=60) as server:
        url = server.url_for("ckpt/")
        res = fetch(cli_env, url, str(dest), "--stall-timeout-s", "1", timeout=45)
        ranges = [r.range for r in server.requests if r.path == WEIGHTS_PATH]
        sent = server.bytes_sent[WEIGHTS_PATH]
    assert res.returncode == 0, res.stderr
    assert len(ranges) >= 3 and ranges[0] is None and all(r and r.startswith("bytes=") for r in ranges[1:]), ranges
    assert sent <= size * 1.05, f"{sent} bytes sent for a {size}-byte file"
    published_tree_is_clean(dest / request_key(url), root / "ckpt")


def test_stall_timeout_must_be_positive(root, tmp_path, policyserver_main):
    res = policyserver_main("fetch", "file://" + str(root / "ckpt"), str(tmp_path / "models"), "--stall-timeout-s", "0")
    assert res.returncode == FetchExit.USAGE, res.stderr
    assert "--stall-timeout-s" in res.stderr and "must be > 0" in res.stderr, res.stderr


# --- what the volume holds ------------------------------------------------------------------------
def test_planted_symlink_in_staging_writes_nothing_outside_dest(tmp_path, policyserver_main):
    """``DEST/.fetch/<key>/sub -> /elsewhere`` and a manifest listing ``sub/evil.bin``: the file lands under DEST."""
    root = tmp_path / "srv"
    ckpt = make_checkpoint(root / "ckpt")
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "evil.bin").write_bytes(b"payload" * 1000)
    write_manifest(ckpt)
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "models"
    with CheckpointServer(root) as server:
        url = server.url_for("ckpt/")
        staging = dest / ".fetch" / request_key(url)
        staging.mkdir(parents=True)
        (staging / "sub").symlink_to(outside, target_is_directory=True)
        (staging / "config.json").symlink_to(outside / "config-elsewhere.json")
        res = policyserver_main("fetch", url, str(dest))
    assert res.returncode == 0, res.stderr
    assert list(outside.iterdir()) == [], "the fetch wrote outside DEST through a planted link"
    published_tree_is_clean(dest / request_key(url), ckpt)


def _plant_hard_link(outside: Path, name: Path, content: bytes) -> int:
    outside.parent.mkdir(parents=True, exist_ok=True)
    outside.write_bytes(content)
    name.parent.mkdir(parents=True, exist_ok=True)
    os.link(outside, name)
    return outside.stat().st_ino


def test_planted_hard_link_as_a_partial_download_is_never_written_through(root, tmp_path, policyserver_main):
    """``.fetch/<key>/model.safetensors.part`` hard-linked to a file outside DEST, with a validator that does not
    match (the download restarts): the outside file keeps its bytes and the published weights are a new inode."""
    dest = tmp_path / "models"
    outside = tmp_path / "outside" / "precious.bin"
    precious = b"not yours to overwrite " * 4096
    with CheckpointServer(root) as server:
        url = server.url_for("ckpt/")
        staging = dest / ".fetch" / request_key(url)
        inode = _plant_hard_link(outside, staging / f"{WEIGHTS}.part", precious)
        (staging / f"{WEIGHTS}.part.json").write_text(json.dumps({"url": url, "validator": '"not-the-etag"'}))
        res = policyserver_main("fetch", url, str(dest))
    assert res.returncode == 0, res.stderr
    assert outside.read_bytes() == precious, "the fetch wrote the weights through a planted hard link"
    final = dest / request_key(url)
    assert (final / WEIGHTS).stat().st_ino != inode
    published_tree_is_clean(final, root / "ckpt")


@pytest.mark.parametrize("planted", [WEIGHTS, MANIFEST_FILE])
def test_planted_hard_link_with_the_right_bytes_is_not_published(root, tmp_path, policyserver_main, planted):
    """A staged file with the right content but a second name outside DEST: reusing it would publish an inode
    someone else can still change, so it is fetched again instead."""
    dest = tmp_path / "models"
    with CheckpointServer(root) as server:
        url = server.url_for("ckpt/")
        outside = tmp_path / "outside" / planted
        inode = _plant_hard_link(
            outside, dest / ".fetch" / request_key(url) / planted, (root / "ckpt" / planted).read_bytes()
        )
        res = policyserver_main("fetch", url, str(dest))
    assert res.returncode == 0, res.stderr
    final = dest / request_key(url)
    assert (final / planted).stat().st_ino != inode and outside.stat().st_nlink == 1
    published_tree_is_clean(final, root / "ckpt")


def test_a_local_source_is_copied_never_hard_linked(root, tmp_path, policyserver_main):
    """A published file sharing the source's inode would change whenever the source is edited in place."""
    dest = tmp_path / "models"
    source = "file://" + str(root / "ckpt")
    res = policyserver_main("fetch", source, str(dest))
    assert res.returncode == 0, res.stderr
    published_tree_is_clean(dest / request_key(source), root / "ckpt")
    assert (root / "ckpt" / WEIGHTS).stat().st_nlink == 1


def test_symlink_in_place_of_the_checkpoint_dir_is_not_taken_as_complete(tmp_path, policyserver_main):
    """``DEST/<key> -> a complete checkpoint elsewhere``: a link is never what the fetch publishes."""
    root = tmp_path / "srv"
    ckpt = make_checkpoint(root / "ckpt")
    dest = tmp_path / "models"
    with CheckpointServer(root) as server:
        url = server.url_for("ckpt/")
        assert policyserver_main("fetch", url, str(tmp_path / "elsewhere")).returncode == 0
        dest.mkdir()
        (dest / request_key(url)).symlink_to(tmp_path / "elsewhere" / request_key(url), target_is_directory=True)
        res = policyserver_main("fetch", url, str(dest))
    assert res.returncode == 0, res.stderr
    published_tree_is_clean(dest / request_key(url), ckpt)
    assert (dest / request_key(url) / COMPLETE_MARKER).is_file()


@pytest.mark.parametrize("where", ["final", "staging"])
def test_a_regular_file_where_a_directory_should_be_is_repaired(root, tmp_path, policyserver_main, where):
    dest = tmp_path / "models"
    with CheckpointServer(root) as server:
        url = server.url_for("ckpt/")
        key = request_key(url)
        blocker = dest / key if where == "final" else dest / ".fetch" / key
        blocker.parent.mkdir(parents=True)
        blocker.write_bytes(b"not a directory")
        first = policyserver_main("fetch", url, str(dest))
        again = policyserver_main("fetch", url, str(dest))
    assert first.returncode == 0, first.stderr
    assert again.returncode == 0 and "already complete" in again.stderr, again.stderr
    published_tree_is_clean(dest / key, root / "ckpt")


def test_manifest_size_disagreeing_with_the_server_is_a_verification_failure(root, tmp_path, policyserver_main):
    """The listing promises one size, the server delivers another: the bytes are wrong (4), not unreachable (3)."""
    manifest = json.loads((root / "ckpt" / MANIFEST_FILE).read_text())
    manifest["files"][WEIGHTS]["size"] += 4096
    (root / "ckpt" / MANIFEST_FILE).write_text(json.dumps(manifest))
    dest = tmp_path / "models"
    with CheckpointServer(root) as server:
        url = server.url_for("ckpt/")
        res = policyserver_main("fetch", url, str(dest))
    assert res.returncode == FetchExit.VERIFY, res.stderr
    assert WEIGHTS in res.stderr and str(manifest["files"][WEIGHTS]["size"]) in res.stderr
    assert not (dest / request_key(url)).exists()
