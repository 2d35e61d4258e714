"""``hf://`` sources through the real huggingface_hub client against a local hub stub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policy_operator.constants import COMPLETE_MARKER
from policy_operator.exit_codes import FetchExit
from policy_operator.runtime.checkpoint.fetch import check_complete, read_marker
from policy_operator.runtime.checkpoint.format import sha256_file, write_manifest
from policy_operator.source_uri import request_key
from tests.support.hub_stub import HubStub

MiB = 1 << 20
FETCH_CMD = [sys.executable, "-m", "policy_operator.runtime.checkpoint.fetch"]  # see tests/test_fetch.py
REPO = "lab/pi0-tiny"
TOKEN = "hf_stubTOKEN0123456789secret"


def make_repo(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"policy": "pi0", "action_horizon": 10}))
    (directory / "model.safetensors").write_bytes(os.urandom(3 * MiB))  # LFS on the hub
    (directory / "assets").mkdir()
    (directory / "assets" / "norm_stats.json").write_text('{"state": {"mean": [0.1]}}')  # a regular git file
    write_manifest(directory)
    return directory


def hub_env(cli_env: dict[str, str], hub: HubStub, home: Path, token: str | None = None) -> dict[str, str]:
    env = {**cli_env, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_HUB_CACHE", None)
    if token:
        env["HF_TOKEN"] = token
    return env


def run_fetch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FETCH_CMD, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture()
def repo_dir(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "repo")


def test_hf_fetch_through_huggingface_hub(repo_dir, tmp_path, cli_env):
    with HubStub(page_size=2) as hub:  # page_size=2: the tree listing is paginated by Link headers
        commit = hub.add_repo(REPO, repo_dir)
        env = hub_env(cli_env, hub, tmp_path / "hf-home")
        dest = tmp_path / "models"
        res = run_fetch(env, f"hf://{REPO}", str(dest))
        assert res.returncode == 0, res.stderr
        final = dest / request_key(f"hf://{REPO}")
        assert res.stdout.strip().splitlines()[-1] == str(final)
        for name in ("config.json", "model.safetensors", "assets/norm_stats.json", "manifest.json"):
            assert sha256_file(final / name) == sha256_file(repo_dir / name), name
        marker = check_complete(final, verify=True)
        assert marker["source"] == f"hf://{REPO}" and marker["revision"] is None
        assert marker["resolved_revision"] == commit
        assert sorted(p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file()) == sorted(
            ["config.json", "model.safetensors", "assets/norm_stats.json", "manifest.json", COMPLETE_MARKER]
        )
        # the real client walked the real routes: tree pages, resolve HEADs, the LFS redirect to the "CDN"
        paths = [r.path for r in hub.requests]
        assert sum(p.startswith(f"/api/models/{REPO}/tree/{commit}") for p in paths) >= 3
        assert f"/{REPO}/resolve/{commit}/model.safetensors" in paths
        assert any(p.startswith("/lfs-cdn/") for p in paths)
        # nothing was left in HF_HOME: the bytes live on the volume only
        assert not any(p.is_file() and p.stat().st_size > 64 << 10 for p in (tmp_path / "hf-home").rglob("*"))

        hub.reset_log()
        again = run_fetch(env, f"hf://{REPO}", str(dest))
        assert again.returncode == 0 and "already complete" in again.stderr
        assert hub.requests == []

        # a pinned revision: "@main" in the source and --revision main name the same directory
        pinned = run_fetch(env, f"hf://{REPO}@main", str(dest))
        assert pinned.returncode == 0, pinned.stderr
        hub.reset_log()
        flag = run_fetch(env, f"hf://{REPO}", str(dest), "--revision", "main")
        assert flag.returncode == 0 and "already complete" in flag.stderr and hub.requests == []
        assert flag.stdout.strip() == str(dest / request_key(f"hf://{REPO}@main"))
        pinned_marker = read_marker(Path(flag.stdout.strip()))
        assert pinned_marker is not None and pinned_marker["revision"] == "main"


def test_hf_token_is_sent_to_the_hub_only_and_never_printed(repo_dir, tmp_path, cli_env):
    with HubStub(token=TOKEN) as hub:
        hub.add_repo(REPO, repo_dir)
        dest = tmp_path / "models"
        denied = run_fetch(hub_env(cli_env, hub, tmp_path / "home1"), f"hf://{REPO}", str(dest))
        # the hub hides a private repository from a client without the token: as missing as one that is not there
        assert denied.returncode == FetchExit.NOT_FOUND and "RepositoryNotFoundError" in denied.stderr

        hub.reset_log()
        ok = run_fetch(hub_env(cli_env, hub, tmp_path / "home2", token=TOKEN), f"hf://{REPO}", str(dest))
        assert ok.returncode == 0, ok.stderr
        hub_routes = [r for r in hub.requests if r.path.startswith(("/api/models", f"/{REPO}/"))]
        assert hub_routes and all(r.headers.get("Authorization") == "<redacted>" for r in hub_routes)
        cdn = [r for r in hub.requests if r.path.startswith("/lfs-cdn/")]
        assert cdn and all("Authorization" not in r.headers for r in cdn), "token must not follow the CDN redirect"

        token_file = tmp_path / "token"
        token_file.write_text(TOKEN)
        by_file = run_fetch(
            hub_env(cli_env, hub, tmp_path / "home3"), f"hf://{REPO}@main", str(dest), "--token-file", str(token_file)
        )
        assert by_file.returncode == 0, by_file.stderr
        for res in (denied, ok, by_file):
            assert TOKEN not in res.stdout + res.stderr
        for marker in dest.glob(f"*/{COMPLETE_MARKER}"):
            assert TOKEN not in marker.read_text()


def test_hf_corrupt_bytes_fail_verification(repo_dir, tmp_path, cli_env):
    with HubStub() as hub:
        hub.add_repo(REPO, repo_dir)  # metadata (hashes) taken now; bytes read when served
        weights = repo_dir / "model.safetensors"
        promised = sha256_file(weights)
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
        env = hub_env(cli_env, hub, tmp_path / "home")
        dest = tmp_path / "models"
        res = run_fetch(env, f"hf://{REPO}", str(dest))
        assert res.returncode == FetchExit.VERIFY, res.stderr
        assert "model.safetensors" in res.stderr and promised in res.stderr and sha256_file(weights) in res.stderr
        key = request_key(f"hf://{REPO}")
        assert not (dest / key).exists()
        assert not (dest / ".fetch" / key / "model.safetensors").exists()

        # a regular (non-LFS) file is vouched for by its git blob id
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
        (repo_dir / "config.json").write_text(json.dumps({"policy": "pi0", "action_horizon": 99}))
        res = run_fetch(env, f"hf://{REPO}", str(tmp_path / "other"))
        assert res.returncode == FetchExit.VERIFY and "config.json: git blob sha1" in res.stderr, res.stderr
        assert read_marker(tmp_path / "other" / key) is None


def test_hf_missing_repo_revision_and_bad_ids(repo_dir, tmp_path, cli_env):
    with HubStub() as hub:
        hub.add_repo(REPO, repo_dir)
        env = hub_env(cli_env, hub, tmp_path / "home")
        dest = str(tmp_path / "models")
        missing = run_fetch(env, "hf://lab/does-not-exist", dest)
        assert missing.returncode == FetchExit.NOT_FOUND and "RepositoryNotFoundError" in missing.stderr
        bad_rev = run_fetch(env, f"hf://{REPO}@no-such-branch", dest)
        assert bad_rev.returncode == FetchExit.NOT_FOUND and "RevisionNotFoundError" in bad_rev.stderr
        bad_id = run_fetch(env, "hf://lab/bad id!", dest)
        assert bad_id.returncode == FetchExit.USAGE, bad_id.stderr
