"""``policyserver fetch`` against real loopback HTTP servers, real processes and real files."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from policy_operator.constants import COMPLETE_MARKER, MANIFEST_FILE
from policy_operator.exit_codes import FetchExit
from policy_operator.runtime.checkpoint.fetch import (
    SourceError,
    UsageError,
    VerificationError,
    check_complete,
    fetch,
    read_marker,
)
from policy_operator.runtime.checkpoint.format import CheckpointError, sha256_file, write_manifest
from policy_operator.source_uri import request_key
from tests.support.http_checkpoint_server import CheckpointServer
from tests.support.net import free_port, wait_for

MiB = 1 << 20
CLI_TIMEOUT_S = 120
# The fetch module's own entry point: same add_arguments/main as `policyserver fetch`, without the
# start-up cost of importing every other subcommand. The registration itself is tested below.  Tests of one
# fetch's outcome (exit code, messages, files) call the same main in this process (``policyserver_main``).
FETCH_CMD = [sys.executable, "-m", "policy_operator.runtime.checkpoint.fetch"]


def make_checkpoint(directory: Path, weights_size: int = 2 * MiB) -> Path:
    """A checkpoint-shaped directory of arbitrary bytes (no torch needed) with its manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"policy": "test", "action_dim": 7}))
    (directory / "model.safetensors").write_bytes(os.urandom(weights_size))
    (directory / "norm").mkdir(exist_ok=True)
    (directory / "norm" / "stats.json").write_text('{"mean": [0.0]}')
    write_manifest(directory)
    return directory


def same_tree(a: Path, b: Path) -> None:
    for name in ("config.json", "model.safetensors", "norm/stats.json", MANIFEST_FILE):
        assert sha256_file(a / name) == sha256_file(b / name), name


def run_fetch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FETCH_CMD, *args], env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


def popen_fetch(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*FETCH_CMD, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture()
def src_root(tmp_path: Path) -> Path:
    make_checkpoint(tmp_path / "srv" / "ckpt")
    return tmp_path / "srv"


@pytest.fixture()
def server(src_root: Path):
    with CheckpointServer(src_root) as srv:
        yield srv


def test_http_fetch_verifies_then_second_fetch_sends_nothing(server, src_root, tmp_path, policyserver_main):
    url = server.url_for("ckpt/")
    dest = tmp_path / "models"
    first = policyserver_main("fetch", url, str(dest))
    assert first.returncode == 0, first.stderr
    final = dest / request_key(url)
    assert first.stdout.strip().splitlines()[-1] == str(final)
    same_tree(src_root / "ckpt", final)
    marker = check_complete(final, verify=True)
    assert marker["source"] == url and marker["revision"] is None
    assert set(marker["files"]) == {"config.json", "model.safetensors", "norm/stats.json", MANIFEST_FILE}
    assert marker["files"]["model.safetensors"]["sha256"] == sha256_file(src_root / "ckpt" / "model.safetensors")
    assert sorted(r.path for r in server.requests) == sorted(
        f"/ckpt/{n}" for n in ("manifest.json", "config.json", "model.safetensors", "norm/stats.json")
    )
    assert not (dest / ".fetch" / final.name).exists(), "staging dir left behind"
    assert "done, 4 files" in first.stderr

    before = len(server.requests)
    for extra in ([], ["--verify"]):
        again = policyserver_main("fetch", url, str(dest), *extra)
        assert again.returncode == 0, again.stderr
        assert again.stdout.strip().splitlines()[-1] == str(final)
        assert "already complete" in again.stderr
    assert len(server.requests) == before, "a complete checkpoint must not touch the network"


def test_registered_as_policyserver_fetch(server, tmp_path, cli_env):
    url = server.url_for("ckpt/")
    res = subprocess.run(
        ["policyserver", "fetch", url, str(tmp_path / "models"), "--quiet"],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(tmp_path / "models" / request_key(url)) and res.stderr == ""
    usage = subprocess.run(
        ["policyserver", "fetch"], env=cli_env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S
    )
    assert usage.returncode == FetchExit.USAGE and "SOURCE" in usage.stderr


def test_four_concurrent_processes_download_once(server, src_root, tmp_path, cli_env):
    server.throttle_bps = 4 * MiB  # ~0.5 s per download, so the four overlap
    url = server.url_for("ckpt/")
    dest = tmp_path / "models"
    procs = [popen_fetch(cli_env, url, str(dest)) for _ in range(4)]
    outs = [p.communicate(timeout=CLI_TIMEOUT_S) for p in procs]
    final = dest / request_key(url)
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.strip().splitlines()[-1] == str(final)
    assert server.count("/ckpt/model.safetensors") == 1
    assert server.count("/ckpt/manifest.json") == 1
    assert sum("completed by another fetcher" in err or "already complete" in err for _, err in outs) == 3
    same_tree(src_root / "ckpt", final)
    check_complete(final, verify=True)


@pytest.mark.slow  # fault injection: a fetch killed mid-download, then a second one
def test_killed_fetch_resumes_with_a_range_request(tmp_path, cli_env):
    root = tmp_path / "srv"
    make_checkpoint(root / "ckpt", weights_size=8 * MiB)
    with CheckpointServer(root, throttle_bps=1 * MiB) as server:
        url = server.url_for("ckpt/")
        dest = tmp_path / "models"
        key = request_key(url)
        part = dest / ".fetch" / key / "model.safetensors.part"
        proc = popen_fetch(cli_env, url, str(dest))
        try:
            wait_for(lambda: part.exists() and part.stat().st_size >= 4 * MiB, timeout=60, what="4 MiB on disk")
        finally:
            proc.kill()
            _, err = proc.communicate(timeout=30)
        # at <= 1 MiB/s four seconds have passed: the periodic progress line (every 2 s) must be there
        assert re.search(r"fetch: [\d.]+ MiB / [\d.]+ MiB \(\d+\.\d%\) [\d.]+ MB/s", err), err
        assert not (dest / key).exists() and read_marker(dest / key) is None
        resumed_from = part.stat().st_size
        assert 0 < resumed_from < 8 * MiB

        server.throttle_bps = None
        server.reset_log()
        done = run_fetch(cli_env, url, str(dest))
        assert done.returncode == 0, done.stderr
        ranges = [r.range for r in server.requests if r.path == "/ckpt/model.safetensors"]
        assert ranges == [f"bytes={resumed_from}-"]
        assert server.count("/ckpt/config.json") == 0, "finished files are reused, not fetched again"
        same_tree(root / "ckpt", dest / key)
        check_complete(dest / key, verify=True)


def test_resume_restarts_a_file_that_changed_on_the_server(tmp_path):
    """If-Range: a partial file of an older version must not be spliced with the new one."""
    root = tmp_path / "srv"
    ckpt = make_checkpoint(root / "ckpt", weights_size=1 * MiB)
    with CheckpointServer(root) as server:
        url = server.url_for("ckpt/")
        dest = tmp_path / "models"
        staging = dest / ".fetch" / request_key(url)
        staging.mkdir(parents=True)
        (staging / "model.safetensors.part").write_bytes(b"x" * 1000)
        (staging / "model.safetensors.part.json").write_text(json.dumps({"validator": '"stale-etag"'}))
        final = fetch(url, dest, progress=False)
        assert [r.range for r in server.requests if r.path == "/ckpt/model.safetensors"] == ["bytes=1000-"]
        same_tree(ckpt, final)


def test_corrupt_source_fails_with_both_hashes_and_leaves_no_marker(server, src_root, tmp_path, policyserver_main):
    weights = src_root / "ckpt" / "model.safetensors"
    good = weights.read_bytes()
    promised = sha256_file(weights)
    weights.write_bytes(bytes([good[0] ^ 0xFF]) + good[1:])  # same size, one byte flipped after the manifest
    served = sha256_file(weights)
    url = server.url_for("ckpt/")
    dest = tmp_path / "models"
    key = request_key(url)
    bad = policyserver_main("fetch", url, str(dest))
    assert bad.returncode == FetchExit.VERIFY, bad.stderr
    assert "model.safetensors" in bad.stderr and promised in bad.stderr and served in bad.stderr
    assert not (dest / key).exists()
    assert not (dest / ".fetch" / key / "model.safetensors").exists(), "the bad file must be deleted"
    assert (dest / ".fetch" / key / "config.json").exists(), "good files stay for the next run"

    weights.write_bytes(good)
    server.reset_log()
    ok = policyserver_main("fetch", url, str(dest))
    assert ok.returncode == 0, ok.stderr
    assert [r.path for r in server.requests if r.method == "GET"] == ["/ckpt/manifest.json", "/ckpt/model.safetensors"]
    check_complete(dest / key, verify=True)


def test_wrong_sha256_flag_and_bad_flags(server, tmp_path, policyserver_main):
    url = server.url_for("ckpt/")
    dest = tmp_path / "models"
    wrong = "0" * 64
    res = policyserver_main("fetch", url, str(dest), "--sha256", f"model.safetensors={wrong}")
    assert res.returncode == FetchExit.VERIFY, res.stderr
    assert "--sha256" in res.stderr and wrong in res.stderr and "model.safetensors" in res.stderr
    assert read_marker(dest / request_key(url)) is None

    assert policyserver_main("fetch", url, str(dest), "--sha256", f"nosuchfile={wrong}").returncode == FetchExit.USAGE
    bad_hash = policyserver_main("fetch", url, str(dest), "--sha256", "model.safetensors=abc")
    assert bad_hash.returncode == FetchExit.USAGE and "64-digit" in bad_hash.stderr
    assert policyserver_main("fetch", url, str(dest), "--sha256", "no-equals-sign").returncode == FetchExit.USAGE


def test_token_reaches_the_server_and_appears_nowhere(src_root, tmp_path, policyserver_main, monkeypatch):
    token = "tok-HTTP-5ecret-value-81"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    with CheckpointServer(src_root, token=token) as server:
        url = server.url_for("ckpt/")
        dest = tmp_path / "models"
        denied = policyserver_main("fetch", url, str(dest))
        assert denied.returncode == FetchExit.SOURCE and "401" in denied.stderr
        # HF_TOKEN is for the hub only: it must not be offered to an arbitrary web server
        with monkeypatch.context() as env:
            env.setenv("HF_TOKEN", token)
            leaked = policyserver_main("fetch", url, str(dest))
        assert leaked.returncode == FetchExit.SOURCE
        assert all(r.headers.get("Authorization") is None for r in server.requests)

        wrong_file = tmp_path / "wrong"
        wrong_file.write_text("tok-wrong-one-42")
        wrong = policyserver_main("fetch", url, str(dest), "--token-file", str(wrong_file))
        assert wrong.returncode == FetchExit.SOURCE and "tok-wrong-one-42" not in wrong.stdout + wrong.stderr

        server.reset_log()
        ok = policyserver_main("fetch", url, str(dest), "--token-file", str(token_file))
        assert ok.returncode == 0, ok.stderr
        assert server.requests and all(r.headers.get("Authorization") == "<redacted>" for r in server.requests)
        for res in (denied, leaked, wrong, ok):
            assert token not in res.stdout + res.stderr
        assert token not in (dest / request_key(url) / COMPLETE_MARKER).read_text()
    assert (
        policyserver_main("fetch", url, str(dest), "--token-file", str(tmp_path / "missing")).returncode
        == FetchExit.USAGE
    )


def test_single_file_url(server, src_root, tmp_path, policyserver_main):
    url = server.url_for("ckpt/model.safetensors")
    digest = sha256_file(src_root / "ckpt" / "model.safetensors")
    res = policyserver_main("fetch", url, str(tmp_path / "models"), "--sha256", f"model.safetensors={digest}")
    assert res.returncode == 0, res.stderr
    final = Path(res.stdout.strip().splitlines()[-1])
    assert sorted(p.name for p in final.iterdir()) == [COMPLETE_MARKER, "model.safetensors"]
    assert check_complete(final, verify=True)["files"]["model.safetensors"]["sha256"] == digest


def test_file_url_and_plain_path(src_root, tmp_path, policyserver_main):
    ckpt = src_root / "ckpt"
    dest = tmp_path / "models"
    for source in (f"file://{ckpt}", str(ckpt)):
        res = policyserver_main("fetch", source, str(dest))
        assert res.returncode == 0, res.stderr
        final = Path(res.stdout.strip().splitlines()[-1])
        assert final == dest / request_key(source)
        same_tree(ckpt, final)
        check_complete(final, verify=True)
    assert len([p for p in dest.iterdir() if not p.name.startswith(".")]) == 2

    # no manifest: every file is taken as found; a single file works too
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "a.bin").write_bytes(b"abc")
    final = fetch(str(loose), dest, progress=False)
    assert (final / "a.bin").read_bytes() == b"abc"
    final = fetch(f"file://{loose / 'a.bin'}", dest, progress=False)
    assert sorted(p.name for p in final.iterdir()) == [COMPLETE_MARKER, "a.bin"]

    # a local checkpoint whose manifest does not match its files is refused
    (ckpt / "config.json").write_text('{"edited": true}')
    with pytest.raises(VerificationError, match="config.json"):
        fetch(str(ckpt), tmp_path / "other", progress=False)
    assert policyserver_main("fetch", str(tmp_path / "does-not-exist"), str(dest)).returncode == FetchExit.SOURCE


def test_unknown_scheme_and_bad_sources_are_usage_errors(tmp_path, policyserver_main):
    res = policyserver_main("fetch", "gs://bucket/ckpt/", str(tmp_path / "models"))
    assert res.returncode == FetchExit.USAGE and "unsupported source scheme gs://" in res.stderr
    assert not (tmp_path / "models").exists(), "a usage error must not touch the volume"
    for source in ("hf://only-one-part", "hf://org/repo@", "file://otherhost/x"):
        res = policyserver_main("fetch", source, str(tmp_path / "models"))
        assert res.returncode == FetchExit.USAGE, (source, res.stderr)
    with pytest.raises(UsageError, match="conflicts"):
        fetch("hf://org/repo@v1", tmp_path, revision="v2", progress=False)


def test_s3_without_boto3_is_a_clear_error(tmp_path, policyserver_main):
    try:
        import boto3  # noqa: F401
    except ImportError:
        res = policyserver_main("fetch", "s3://bucket/ckpt/", str(tmp_path))
        assert res.returncode == FetchExit.USAGE and "boto3" in res.stderr
    else:
        pytest.skip("boto3 is installed: the missing-client path cannot be exercised")


def test_unreachable_source(tmp_path, policyserver_main):
    res = policyserver_main("fetch", f"http://127.0.0.1:{free_port()}/ckpt/", str(tmp_path))
    assert res.returncode == FetchExit.SOURCE and "cannot reach" in res.stderr


@pytest.mark.parametrize(
    "name", ["../escape.bin", "a/../../escape.bin", "/tmp/escape.bin", "sub\\..\\escape.bin", "a//b.bin", "./a.bin", ""]
)
def test_a_manifest_naming_files_outside_the_checkpoint_is_refused(tmp_path, name):
    """Over HTTP and from a local directory: nothing is written anywhere, the error names the file."""
    src = tmp_path / "srv" / "ckpt"
    make_checkpoint(src)
    manifest = json.loads((src / MANIFEST_FILE).read_text())
    manifest["files"][name] = {"size": 3, "sha256": "0" * 64}
    (src / MANIFEST_FILE).write_text(json.dumps(manifest))
    with CheckpointServer(tmp_path / "srv") as srv:
        for source in (srv.url_for("ckpt/"), str(src)):
            dest = tmp_path / "models"
            with pytest.raises(SourceError, match="outside the checkpoint") as info:
                fetch(source, dest, progress=False)
            assert info.value.exit_code == FetchExit.SOURCE and repr(name) in str(info.value)
            assert not (dest / request_key(source)).exists()
            assert not list(tmp_path.rglob("escape.bin")) and not Path("/tmp/escape.bin").exists()
            assert not any(p.is_file() for p in (dest / ".fetch").rglob("*") if p.suffix != ".lock")
        assert srv.count() == 1  # the manifest only: no file download was attempted


def test_damaged_checkpoint_is_detected_and_repaired(server, src_root, tmp_path):
    url = server.url_for("ckpt/")
    dest = tmp_path / "models"
    final = fetch(url, dest, progress=False)
    weights = final / "model.safetensors"

    # same size, different bytes: only --verify can tell, and then only that file is fetched again
    data = bytearray(weights.read_bytes())
    data[100] ^= 0x01
    weights.write_bytes(bytes(data))
    server.reset_log()
    assert fetch(url, dest, progress=False) == final and server.requests == []
    with pytest.raises(CheckpointError, match="model.safetensors: sha256 differs"):
        check_complete(final, verify=True)
    fetch(url, dest, verify=True, progress=False)
    assert [r.path for r in server.requests] == ["/ckpt/manifest.json", "/ckpt/model.safetensors"]
    check_complete(final, verify=True)

    # a truncated file is caught by the size check alone
    with open(weights, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=r"model.safetensors: size 10 != \d+"):
        check_complete(final)
    server.reset_log()
    fetch(url, dest, progress=False)
    assert server.count("/ckpt/model.safetensors") == 1
    same_tree(src_root / "ckpt", final)

    # no marker at all (e.g. a directory copied in by hand) is not trusted either
    (final / COMPLETE_MARKER).unlink()
    with pytest.raises(CheckpointError, match="no valid .complete.json"):
        check_complete(final)
    server.reset_log()
    fetch(url, dest, progress=False)
    assert [r.path for r in server.requests] == ["/ckpt/manifest.json"], "verified files are reused"
    assert read_marker(final) is not None
    with pytest.raises(CheckpointError, match="no such directory"):
        check_complete(tmp_path / "nothing-here")


def test_disk_full_exits_5(server, tmp_path, cli_env):
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare to mount a small tmpfs in a private mount namespace")
    dest = tmp_path / "small"
    dest.mkdir()
    url = server.url_for("ckpt/")
    script = f'mount -t tmpfs -o size=1m tmpfs "{dest}" && exec "$@"'
    cmd = ["unshare", "-m", "sh", "-c", script, "sh", *FETCH_CMD, url, str(dest)]
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs "{dest}"'], capture_output=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {probe.stderr.decode().strip()}")
    res = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert res.returncode == FetchExit.DISK_FULL, res.stderr
    assert "MiB more needed" in res.stderr
    assert server.count("/ckpt/model.safetensors") == 0, "refused before downloading"


def test_git_blob_sha1_matches_git():
    from policy_operator.runtime.checkpoint.fetch import git_blob_sha1

    if shutil.which("git") is None:
        pytest.skip("git not installed")
    path = Path(__file__)
    expected = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True, check=True).stdout
    assert git_blob_sha1(path) == expected.strip()
