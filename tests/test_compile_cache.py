"""Fast start: torch compile artifacts kept in ``--compile-cache-dir``, loaded by a later server of the same spec.

The file format's checks run in-process; the rest on real ``policyserver
serve --compile`` processes (inductor on the CPU, a one-block tiny
checkpoint, one bucket).  Each later server gets an inductor cache directory
without the graph caches (``fxgraph``, ``aotautograd``), as a fresh pod has:
a graph it does not compile can only have come from the artifacts file the
first server left in ``--compile-cache-dir``.  On the CPU those artifacts
hold the generated C++ source, not the built kernels; the C++ build
products (the rest of the directory) are copied along so that the later
servers skip gcc, which the test is not about and which costs minutes on two
cores (on a GPU the artifacts carry the Triton kernels themselves).
"""

from __future__ import annotations

import logging
import multiprocessing
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from openpi_client import msgpack_numpy
from websockets.sync.client import connect

from policy_operator.runtime.checkpoint.compile_file import LEGACY_MAGICS, MAGIC, ArtifactError, decode, encode
from policy_operator.runtime.compile_cache import CompileCache, open_cache
from tests.support.servers import serve_policy, session_checkpoint

KEY = {"checkpoint": "abc", "device": "cpu:x86_64:AVX2", "torch": "2.11.0"}
SECRET = b"this PolicyServer's own key, 32B"
OTHER = b"another PolicyServer's key, 32 B"
COMPILE = ["--compile", "default", "--max-batch", "1", "--steps", "2", "--threads", "1"]
COMPILE_START_S = 600.0  # import torch + inductor's C++ build of every kernel, on two busy cores
GRAPH_CACHES = ("fxgraph", "aotautograd")  # what the artifacts file refills; a new pod starts without them
LOADED = "compile cache: loaded"
IGNORED = "compile cache: ignoring"


def test_a_file_round_trips_and_every_kind_of_damage_is_refused() -> None:
    payload = bytes(range(256)) * 40
    data = encode(KEY, payload)
    assert decode(data, KEY) == payload
    damaged = {
        "not a compile-artifacts file": b"garbage" + data,
        "truncated": data[:-10],
        "checksum mismatch": data[:-1] + bytes([data[-1] ^ 1]),
        "no header": data[: data.index(b"\n") + 5],
    }
    for reason, blob in damaged.items():
        with pytest.raises(ArtifactError, match=reason):
            decode(blob, KEY)
    with pytest.raises(ArtifactError, match=r"another spec \(device, torch differ\)"):
        decode(data, {**KEY, "device": "cuda:NVIDIA H200:sm90:cuda12.8", "torch": "2.12.0"})


def test_a_tagged_file_loads_only_under_its_own_key() -> None:
    payload = b"artifacts" * 100
    tagged = encode(KEY, payload, SECRET)
    assert decode(tagged, KEY, SECRET) == payload
    refused = {
        "does not verify": encode(KEY, payload, OTHER),  # another PolicyServer's pod wrote it
        "no HMAC tag": encode(KEY, payload),  # written without a key, consistent sha256 and all
        "older format": LEGACY_MAGICS[0] + encode(KEY, payload)[len(MAGIC) :],
        # the payload replaced and the header's sha256 and size rewritten to match, the tag kept
        "does not verify ": _reheadered(tagged, b"planted"),
    }
    for reason, blob in refused.items():
        with pytest.raises(ArtifactError, match=reason.strip()):
            decode(blob, KEY, SECRET)


def _reheadered(data: bytes, payload: bytes) -> bytes:
    """``data`` with ``payload`` in place of its own, its header's size and sha256 rewritten to match."""
    import hashlib
    import json

    end = data.index(b"\n", len(MAGIC))
    header = json.loads(data[len(MAGIC) : end])
    header.update(bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


def _planted_payload(target: Path) -> bytes:
    """torch's own artifacts format holding one entry that, once torch loads it, writes ``target/entry`` (where
    a real attacker would put a pickle that a later compile unpickles, or a file anywhere the pod may write)."""
    from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    CacheArtifactManager._ensure_cache_artifacts_registered()
    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    serializer.append(("precompile", [CacheArtifactFactory.create("precompile", str(target), b"planted")]))
    return serializer.to_bytes()


def test_the_planted_payload_runs_when_torch_loads_it(tmp_path: Path) -> None:
    """The marker the next test watches for is real: torch writes it as soon as it loads such a payload."""
    assert torch.compiler.load_cache_artifacts(_planted_payload(tmp_path / "marker")) is not None
    assert (tmp_path / "marker" / "entry").is_file()


@pytest.mark.parametrize("plant", ["another key", "untagged", "payload swapped", "group-writable, no key"])
def test_a_planted_artifact_is_never_loaded(tmp_path: Path, caplog: pytest.LogCaptureFixture, plant: str) -> None:
    """Issue 39: a PolicyServer that can write another's compile directory must not run code in its pods."""
    marker = tmp_path / "marker"
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    secret = None if plant.endswith("no key") else SECRET
    cache = CompileCache(directory, KEY, secret)
    evil = _planted_payload(marker)
    cache.path.write_bytes(
        {
            "another key": lambda: encode(KEY, evil, OTHER),
            "untagged": lambda: encode(KEY, evil),
            "payload swapped": lambda: _reheadered(encode(KEY, b"genuine", SECRET), evil),
            "group-writable, no key": lambda: encode(KEY, evil),
        }[plant]()
    )
    if plant.startswith("group-writable"):
        cache.path.chmod(0o664)
    with caplog.at_level(logging.INFO, logger="policy_operator.runtime.compile_cache"):
        assert cache.load() is False
    assert not marker.exists()
    assert [r.levelno for r in caplog.records] == [logging.WARNING], caplog.text
    assert IGNORED in caplog.text and not cache.loaded


def test_without_a_key_only_a_private_directory_is_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # what any pod (or any user) may write
    key: dict[str, Any] = {"policy": "reference", "dtype": "float32", "mode": "default", "buckets": [1]}
    key.update(layout="dp1", checkpoint=str(tmp_path), cfg_mode="sequential", device=torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="policy_operator.runtime.compile_cache"):
        assert open_cache(str(shared), **key) is None
    assert "not private to this user and no --compile-key-file" in caplog.text
    assert open_cache(str(tmp_path / "new"), **key) is not None  # created private
    assert (tmp_path / "new").stat().st_mode & 0o077 == 0
    (tmp_path / "key").write_bytes(b"k" * 16 + b"\n")
    assert open_cache(str(shared), key_file=str(tmp_path / "key"), **key) is not None  # tagged artifacts
    (tmp_path / "short").write_bytes(b"k" * 8)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="policy_operator.runtime.compile_cache"):
        assert open_cache(str(shared), key_file=str(tmp_path / "short"), **key) is None
    assert "shorter than 16 bytes" in caplog.text and "k" * 8 not in caplog.text


def test_a_bad_file_is_ignored_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Garbage, and a well-formed file whose payload torch cannot read: no exception, one line each."""
    cache = CompileCache(tmp_path, KEY)
    for blob in (b"\x00" * 100, encode(KEY, b"not torch's artifacts")):
        cache.path.write_bytes(blob)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="policy_operator.runtime.compile_cache"):
            assert cache.load() is False
        assert [r.levelno for r in caplog.records] == [logging.WARNING], caplog.text
        assert IGNORED in caplog.text and "\n" not in caplog.records[0].getMessage()
        assert not cache.loaded


def _save_without_compiling(directory: str) -> bool:
    return CompileCache(Path(directory), KEY).save()


def test_nothing_compiled_writes_nothing(tmp_path: Path) -> None:
    """In a process that compiled nothing: a fresh one, since torch's artifacts are per process and a test that
    ran before in this one may have compiled."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_save_without_compiling, (str(tmp_path / "cache"),)) is False
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def _writer(directory: str, fill: int, rounds: int) -> None:
    cache = CompileCache(Path(directory), KEY, SECRET)
    for size in range(rounds):
        assert cache.write(bytes([fill]) * ((1 << 20) + 4096 * size * fill))


def test_two_writers_at_once_never_leave_a_partial_file(tmp_path: Path) -> None:
    """Two pods of a rollout saving at the same moment: a reader sees one writer's whole file, or none yet."""
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_writer, args=(str(tmp_path), fill, 25)) for fill in (1, 2)]
    for writer in writers:
        writer.start()
    path, reads, deadline = CompileCache(tmp_path, KEY).path, 0, time.monotonic() + 120
    while any(w.is_alive() for w in writers) and time.monotonic() < deadline:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        assert (
            len(set(decode(data, KEY, SECRET))) == 1
        )  # intact (decode checks size and sha256), and one writer's bytes
        reads += 1
    for writer in writers:
        writer.join(30)
        assert writer.exitcode == 0
    assert reads > 0
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind
    assert path.stat().st_mode & 0o044 == 0o044  # tagged: readable by the pods of other users


# --- real servers ---------------------------------------------------------------------
OBS_SEEDS = (1, 2, 3)


def _actions(server, seeds=OBS_SEEDS) -> list[np.ndarray]:
    """Actions for fixed observations and seeds: equal bits across servers iff they run the same kernels."""
    out = []
    with connect(server.url, compression=None, max_size=None, open_timeout=30) as ws:
        ws.recv(timeout=60)
        for seed in seeds:
            rng = np.random.default_rng(seed)
            obs = {
                "observation/image": rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8),
                "observation/joint_position": rng.standard_normal(7).astype(np.float32),
                "observation/gripper_position": rng.random(1).astype(np.float32),
                "prompt": "pick up the cup",
                "seed": seed,
            }
            ws.send(msgpack_numpy.packb(obs))
            out.append(np.asarray(msgpack_numpy.unpackb(ws.recv(timeout=60))["actions"]))
    return out


def _serve(checkpoint: Path, cache: Path, inductor: Path, *extra: str):
    """A server with the inductor cache directory ``inductor`` of its own."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "TRITON_CACHE_DIR": str(inductor / "triton")}
    return serve_policy(
        checkpoint, *COMPILE, "--compile-cache-dir", str(cache), *extra, env=env, timeout=COMPILE_START_S
    )


def _fresh_pod_inductor(first: Path, target: Path) -> Path:
    """``first``'s inductor directory without its graph caches (module docstring)."""
    shutil.copytree(
        first,
        target,
        ignore=lambda folder, names: [n for n in names if n in GRAPH_CACHES] if Path(folder) == first else [],
    )
    return target


@pytest.fixture(scope="module")
def first_server(tmp_path_factory) -> tuple[Path, Path, Path, list[np.ndarray]]:
    """One server that compiled from nothing: its checkpoint, the cache and inductor directories it wrote, and
    its answers."""
    checkpoint = session_checkpoint(tmp_path_factory, depth=1)
    cache, inductor = tmp_path_factory.mktemp("compile-cache"), tmp_path_factory.mktemp("inductor")
    with _serve(checkpoint, cache, inductor) as server:
        actions = _actions(server)
        log = server.log_text()
    lines = _cache_lines(log)
    assert any("compile cache: nothing for this spec" in line for line in lines), lines
    assert any("compile cache: saved" in line for line in lines) and not any(LOADED in line for line in lines), lines
    return checkpoint, cache, inductor, actions


@pytest.mark.slow
@pytest.mark.timeout(COMPILE_START_S + 300)
def test_a_second_server_of_the_same_spec_loads_the_artifacts(first_server, tmp_path) -> None:
    checkpoint, cache_written, inductor, first_actions = first_server
    cache = tmp_path / "cache"
    shutil.copytree(cache_written, cache)
    files = sorted(cache.glob("*.artifacts"))
    assert len(files) == 1
    with _serve(checkpoint, cache, _fresh_pod_inductor(inductor, tmp_path / "inductor")) as server:
        actions = _actions(server)
        log = server.log_text()
    lines = _cache_lines(log)
    assert any(LOADED in line for line in lines) and not any(IGNORED in line for line in lines), lines
    assert any(re.search(r"compile cache: [1-9]\d* graph\(s\) from the cache, 0 compiled", line) for line in lines), (
        lines
    )
    assert "compile cache: saved" not in log  # the file already held these artifacts
    for a, b in zip(actions, first_actions, strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()  # bitwise: the same kernels
    assert sorted(cache.glob("*")) == files  # no temporary file left behind


@pytest.mark.slow
@pytest.mark.timeout(COMPILE_START_S + 300)
def test_a_corrupt_artifact_file_is_ignored_and_replaced(first_server, tmp_path) -> None:
    checkpoint, cache_written, inductor, first_actions = first_server
    cache = tmp_path / "cache"
    shutil.copytree(cache_written, cache)
    (path,) = cache.glob("*.artifacts")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the payload
    path.write_bytes(bytes(data))
    with _serve(checkpoint, cache, _fresh_pod_inductor(inductor, tmp_path / "inductor")) as server:
        actions = _actions(server)
        log = server.log_text()
    lines = _cache_lines(log)
    ignored = [line for line in lines if IGNORED in line]
    assert len(ignored) == 1 and "checksum mismatch" in ignored[0], lines
    assert not any(LOADED in line for line in lines), lines
    assert any("compile cache: saved" in line for line in lines), lines  # compiled, then wrote a good file
    assert decode(path.read_bytes(), _header_key(path))  # intact again
    for a, b in zip(actions, first_actions, strict=True):
        assert a.tobytes() == b.tobytes()


@pytest.mark.slow
@pytest.mark.timeout(COMPILE_START_S + 300)
def test_a_planted_artifact_never_runs_and_the_server_still_comes_up(first_server, tmp_path) -> None:
    """Issue 39: another PolicyServer rewrote this one's artifacts file under its own key.  The server (with its
    --compile-key-file) refuses it with one warning, compiles, answers as the first server did, and leaves a file
    tagged under its own key; the file the planted payload would have written never appears."""
    checkpoint, cache_written, inductor, first_actions = first_server
    cache = tmp_path / "cache"
    shutil.copytree(cache_written, cache)
    (path,) = cache.glob("*.artifacts")
    key, marker = _header_key(path), tmp_path / "marker"
    path.write_bytes(encode(key, _planted_payload(marker), OTHER))
    (tmp_path / "key").write_bytes(SECRET)
    inductor_dir = _fresh_pod_inductor(inductor, tmp_path / "inductor")
    with _serve(checkpoint, cache, inductor_dir, "--compile-key-file", str(tmp_path / "key")) as server:
        actions = _actions(server)
        log = server.log_text()
    assert not marker.exists()
    lines = _cache_lines(log)
    ignored = [line for line in lines if IGNORED in line]
    assert len(ignored) == 1 and "does not verify" in ignored[0], lines
    assert not any(LOADED in line for line in lines) and any("compile cache: saved" in line for line in lines), lines
    assert decode(path.read_bytes(), key, SECRET)  # replaced by this server's own, tagged
    for a, b in zip(actions, first_actions, strict=True):
        assert a.tobytes() == b.tobytes()


def _cache_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "compile cache" in line]


def _header_key(path: Path) -> dict[str, str]:
    import json

    from policy_operator.runtime.checkpoint.compile_file import MAGIC

    data = path.read_bytes()
    return json.loads(data[len(MAGIC) : data.index(b"\n", len(MAGIC))])["key"]
