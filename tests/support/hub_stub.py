"""A small stand-in for the Hugging Face Hub's read routes, for the real huggingface_hub client.

It answers exactly what ``snapshot_download`` / ``hf_hub_download`` (huggingface_hub
2.x) ask, with the headers they read:

* ``GET /api/models/{repo}[/revision/{rev}]`` -> model info JSON (``sha`` = commit)
* ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand=`` -> file list,
  paginated with a ``Link: <...>; rel="next"`` header like the Hub (``page_size``)
* ``HEAD|GET /{repo}/resolve/{rev}/{path}``: for a regular file 200 with
  ``ETag`` = git blob sha1 and ``X-Repo-Commit``; for an LFS file 302 to a
  "CDN" URL on another origin (``localhost`` instead of ``127.0.0.1``) with
  ``X-Linked-Etag`` = sha256 and ``X-Linked-Size`` - so the client drops the
  Authorization header on the way, as it does against the real Hub
* ``GET /api/agent-harnesses`` -> an empty registry (the client's user-agent
  telemetry asks for it, unauthenticated)
* errors carry ``X-Error-Code`` (RepoNotFound / RevisionNotFound / EntryNotFound),
  which is what huggingface_hub turns into its typed exceptions.

No Xet headers are sent, so the client takes its plain HTTP download path.
File metadata is taken when a repo is added; bytes are read when served, so a
test that changes a file afterwards simulates corruption in transit.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

from tests.support.http_checkpoint_server import LoopbackHTTPServer

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".npz", ".msgpack", ".h5", ".onnx")
LFS_POINTER_SIZE = 134


@dataclass(frozen=True)
class HubFile:
    path: str
    file: Path
    size: int
    git_sha1: str
    sha256: str
    lfs: bool

    def tree_entry(self) -> dict:
        entry: dict = {"type": "file", "path": self.path, "size": self.size}
        if self.lfs:
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n"
            entry["oid"] = hashlib.sha1(f"blob {len(pointer)}\0{pointer}".encode()).hexdigest()
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": LFS_POINTER_SIZE}
        else:
            entry["oid"] = self.git_sha1
        return entry


def _hash_file(path: Path) -> tuple[str, str]:
    size = path.stat().st_size
    sha1 = hashlib.sha1(f"blob {size}\0".encode())
    sha256 = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            sha1.update(chunk)
            sha256.update(chunk)
    return sha1.hexdigest(), sha256.hexdigest()


class HubStub(LoopbackHTTPServer):
    """``HF_ENDPOINT=stub.endpoint``; ``add_repo`` returns the new commit sha."""

    cdn_host = "localhost"

    def __init__(self, *, token: str | None = None, page_size: int = 1000, **kwargs: object) -> None:
        super().__init__(token=token, **kwargs)  # type: ignore[arg-type]
        self.page_size = page_size
        self.refs: dict[str, dict[str, str]] = {}  # repo -> {branch/tag: commit}
        self.commits: dict[str, dict[str, dict[str, HubFile]]] = {}  # repo -> commit -> path -> file
        self._blobs: dict[str, HubFile] = {}  # sha256 -> file, for the CDN route

    @property
    def endpoint(self) -> str:
        return self.url.rstrip("/")

    def add_repo(
        self,
        repo_id: str,
        directory: str | os.PathLike[str],
        *,
        revision: str = "main",
        lfs_suffixes: tuple[str, ...] = LFS_SUFFIXES,
    ) -> str:
        root = Path(directory)
        files: dict[str, HubFile] = {}
        for p in sorted(x for x in root.rglob("*") if x.is_file()):
            rel = p.relative_to(root).as_posix()
            git_sha1, sha256 = _hash_file(p)
            hub_file = HubFile(rel, p, p.stat().st_size, git_sha1, sha256, p.suffix in lfs_suffixes)
            files[rel] = hub_file
            if hub_file.lfs:
                self._blobs[sha256] = hub_file
        commit = hashlib.sha1(json.dumps([(f.path, f.git_sha1) for f in files.values()]).encode()).hexdigest()
        self.commits.setdefault(repo_id, {})[commit] = files
        self.refs.setdefault(repo_id, {})[revision] = commit
        return commit

    # --- routing ------------------------------------------------------------------
    def handle(self, handler: BaseHTTPRequestHandler, path: str, head: bool) -> None:
        raw = urlsplit(handler.path)
        segments = [unquote(s) for s in raw.path.split("/")[1:]]
        if segments[:1] == ["lfs-cdn"] and len(segments) == 2:
            self._cdn(handler, segments[1], head)  # signed-URL stand-in: no token check, like a CDN
            return
        if segments == ["api", "agent-harnesses"]:  # huggingface_hub's user-agent registry, public on the Hub
            self._json(handler, {"standardEnvVars": [], "harnesses": {}}, head)
            return
        if not self.authorized(handler):
            self._error(
                handler, HTTPStatus.UNAUTHORIZED, "RepoNotFound", "Invalid credentials in Authorization header", head
            )
            return
        if segments[:2] == ["api", "models"] and len(segments) >= 4:
            repo_id = "/".join(segments[2:4])
            rest = segments[4:]
            if not rest:
                self._info(handler, repo_id, "main", head)
            elif rest[0] == "revision" and len(rest) == 2:
                self._info(handler, repo_id, rest[1], head)
            elif rest[0] == "tree" and len(rest) >= 2:
                self._tree(handler, repo_id, rest[1], "/".join(rest[2:]), parse_qs(raw.query), head)
            else:
                self._error(handler, HTTPStatus.NOT_FOUND, None, "no such route", head)
            return
        if len(segments) >= 5 and segments[2] == "resolve":
            self._resolve(handler, "/".join(segments[:2]), segments[3], "/".join(segments[4:]), head)
            return
        self._error(handler, HTTPStatus.NOT_FOUND, None, "no such route", head)

    def _error(
        self,
        handler: BaseHTTPRequestHandler,
        status: int,
        code: str | None,
        message: str,
        head: bool,
        commit: str | None = None,
    ) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        if commit:
            headers["X-Repo-Commit"] = commit
        body = json.dumps({"error": message}).encode()
        self.send_status(handler, status, body, head=head, headers=headers)

    def _commit(self, handler: BaseHTTPRequestHandler, repo_id: str, revision: str, head: bool) -> str | None:
        if repo_id not in self.commits:
            self._error(handler, HTTPStatus.NOT_FOUND, "RepoNotFound", "Repository not found", head)
            return None
        commit = self.refs[repo_id].get(revision, revision)
        if commit not in self.commits[repo_id]:
            self._error(handler, HTTPStatus.NOT_FOUND, "RevisionNotFound", f"Invalid rev id: {revision}", head)
            return None
        return commit

    def _json(
        self, handler: BaseHTTPRequestHandler, doc: object, head: bool, headers: dict[str, str] | None = None
    ) -> None:
        body = json.dumps(doc).encode()
        handler.send_response(HTTPStatus.OK)
        handler.send_header("Content-Type", "application/json; charset=utf-8")
        handler.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        if not head:
            handler.wfile.write(body)

    def _info(self, handler: BaseHTTPRequestHandler, repo_id: str, revision: str, head: bool) -> None:
        commit = self._commit(handler, repo_id, revision, head)
        if commit is None:
            return
        files = self.commits[repo_id][commit]
        self._json(
            handler,
            {
                "_id": commit[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0],
                "sha": commit,
                "private": self.token is not None,
                "gated": False,
                "disabled": False,
                "tags": [],
                "downloads": 0,
                "likes": 0,
                "lastModified": "2026-01-01T00:00:00.000Z",
                "createdAt": "2026-01-01T00:00:00.000Z",
                "siblings": [{"rfilename": p} for p in files],
            },
            head,
        )

    def _tree(
        self,
        handler: BaseHTTPRequestHandler,
        repo_id: str,
        revision: str,
        subpath: str,
        query: dict[str, list[str]],
        head: bool,
    ) -> None:
        commit = self._commit(handler, repo_id, revision, head)
        if commit is None:
            return
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = f"{subpath}/" if subpath else ""
        entries: dict[str, dict] = {}
        for path, f in self.commits[repo_id][commit].items():
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :].split("/")
            for depth in range(1, len(rest)):  # the folders on the way
                if recursive or depth == 1:
                    folder = prefix + "/".join(rest[:depth])
                    entries.setdefault(
                        folder,
                        {
                            "type": "directory",
                            "path": folder,
                            "size": 0,
                            "oid": hashlib.sha1(folder.encode()).hexdigest(),
                        },
                    )
            if recursive or len(rest) == 1:
                entries[path] = f.tree_entry()
        if subpath and not entries:
            self._error(handler, HTTPStatus.NOT_FOUND, "EntryNotFound", f"{subpath} does not exist", head)
            return
        listing = sorted(entries.values(), key=lambda e: e["path"])
        cursor = int(query.get("cursor", ["0"])[0])
        page = listing[cursor : cursor + self.page_size]
        headers = {}
        if cursor + self.page_size < len(listing):
            nxt = f"{self.endpoint}{raw_path(handler)}?recursive={str(recursive).lower()}&cursor={cursor + self.page_size}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._json(handler, page, head, headers)

    def _resolve(self, handler: BaseHTTPRequestHandler, repo_id: str, revision: str, path: str, head: bool) -> None:
        commit = self._commit(handler, repo_id, revision, head)
        if commit is None:
            return
        f = self.commits[repo_id][commit].get(path)
        if f is None:
            self._error(handler, HTTPStatus.NOT_FOUND, "EntryNotFound", f"{path} does not exist", head, commit)
            return
        if f.lfs:
            location = f"http://{self.cdn_host}:{self.port}/lfs-cdn/{f.sha256}"
            handler.send_response(HTTPStatus.FOUND)
            handler.send_header("Location", location)
            handler.send_header("X-Repo-Commit", commit)
            handler.send_header("X-Linked-Etag", f'"{f.sha256}"')
            handler.send_header("X-Linked-Size", str(f.size))
            handler.send_header("ETag", f'"{f.tree_entry()["oid"]}"')
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        self.send_file(
            handler,
            f.file,
            head=head,
            log_path=f"/{repo_id}/resolve/{revision}/{path}",
            headers={"X-Repo-Commit": commit, "ETag": f'"{f.git_sha1}"'},
        )

    def _cdn(self, handler: BaseHTTPRequestHandler, sha256: str, head: bool) -> None:
        f = self._blobs.get(sha256)
        if f is None:
            self.send_status(handler, HTTPStatus.NOT_FOUND, b"no such blob\n", head=head)
            return
        self.send_file(
            handler,
            f.file,
            head=head,
            log_path=f"/lfs-cdn/{sha256}",
            headers={"Content-Disposition": f'inline; filename="{quote(Path(f.path).name)}"'},
        )


def raw_path(handler: BaseHTTPRequestHandler) -> str:
    return urlsplit(handler.path).path
