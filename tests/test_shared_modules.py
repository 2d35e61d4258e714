"""The boundary facts both sides import: source schemes, the cache key, safe file names, exit codes, serve flags."""

from __future__ import annotations

import pytest

from policy_operator import serve_flags
from policy_operator.exit_codes import FETCH_FATAL, FetchExit, describe
from policy_operator.source_uri import (
    InvalidSource,
    check_relpath,
    check_source,
    checkpoint_key,
    request_key,
    scheme_of,
    split_revision,
)
from tests.support.serve_options import parse_serve


@pytest.mark.parametrize("name", ["model.safetensors", "norm/stats.json", "a/b/c.bin", ".gitattributes", "a..b"])
def test_relative_names_inside_the_checkpoint_pass_unchanged(name: str) -> None:
    assert check_relpath(name) == name


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "empty file name"),
        ("/etc/passwd", "absolute"),
        ("../x", "'..'"),
        ("a/../../x", "'..'"),
        ("..", "'..'"),
        ("a\\b", "backslash"),
        ("..\\x", "backslash"),
        ("a//b", "empty or '.'"),
        ("a/", "empty or '.'"),
        ("./a", "empty or '.'"),
        ("a/./b", "empty or '.'"),
    ],
)
def test_names_that_leave_or_alias_the_checkpoint_are_refused(name: str, why: str) -> None:
    with pytest.raises(InvalidSource, match=why) as info:
        check_relpath(name)
    assert repr(name) in str(info.value) and "\n" not in str(info.value)


def test_sources_the_operator_accepts() -> None:
    for source in (
        "hf://org/repo",
        "hf://org/repo@v1",
        "https://h/ckpt/",
        "http://h/f.bin",
        "s3://b/p/",
        "file:///data/ckpt",
        "/data/ckpt",
    ):
        check_source(source)
    for source in ("gs://b/p", "hf://", "relative/path", "", "HF://org/repo"):
        with pytest.raises(InvalidSource, match="no supported scheme"):
            check_source(source)
    assert [scheme_of(s) for s in ("HF://o/r", "https://h/", "/data", "rel")] == ["hf", "https", "", ""]


def test_inline_and_separate_revisions_are_one_checkpoint() -> None:
    assert split_revision("hf://org/repo@v2", None) == ("hf://org/repo", "v2")
    assert split_revision("hf://org/repo@v2", "v2") == ("hf://org/repo", "v2")
    assert split_revision("https://user@host/ckpt/", None) == ("https://user@host/ckpt/", None)  # only hf:// has @rev
    assert (
        request_key("hf://org/repo@v2") == request_key("hf://org/repo", "v2") == checkpoint_key("hf://org/repo", "v2")
    )
    assert (
        len({checkpoint_key("hf://org/repo"), checkpoint_key("hf://org/repo", "v2"), checkpoint_key("hf://org/x")}) == 3
    )
    assert all(len(k) == 16 and int(k, 16) >= 0 for k in (request_key("/data"), request_key("hf://a/b@c")))
    with pytest.raises(InvalidSource, match="empty revision"):
        request_key("hf://org/repo@")
    with pytest.raises(InvalidSource, match="conflicts"):
        request_key("hf://org/repo@v1", "v2")


def test_fetch_exit_codes_and_what_the_operator_does_with_them() -> None:
    # no retry fixes usage, a hash mismatch, a full volume or a repository the hub does not have
    assert [int(c) for c in FETCH_FATAL] == [2, 4, 5, 6]
    assert FetchExit.SOURCE not in FETCH_FATAL and FetchExit.ERROR not in FETCH_FATAL
    assert describe(FetchExit).startswith("0 ok, 1 other, 2 usage, 3 source unreachable or auth, 4 verification")
    assert len({int(c) for c in FetchExit}) == len(FetchExit)


def test_to_argv_reproduces_the_options() -> None:
    opts = parse_serve(["--checkpoint", "/c", "--cfgp", "2", "--dp", "2", "--share-gpu", "--compile", "--threads", "3"])
    assert parse_serve(serve_flags.to_argv(opts)) == opts
    assert "--share-gpu" in serve_flags.to_argv(opts) and "--revision" not in serve_flags.to_argv(opts)


def test_managed_flags_are_serve_flags_the_operator_writes() -> None:
    fields = set(serve_flags.ServeOptions.__dataclass_fields__)
    assert set(serve_flags.MANAGED) <= fields
    argv = serve_flags.managed_argv(
        checkpoint="/models/k",
        policy="lerobot",
        lerobot_family="lingbot_va",
        port=8000,
        cfgp=2,
        dp=1,
        guidance=2.5,
        steps=8,
        max_batch=4,
        batch_window_ms=0.5,
        device="cuda",
        auth_token_file=None,
        drain_grace_s=20,
        latency_budget_ms=40.0,
        max_connections=64,
        session_idle_timeout_s=45.0,
        frontend="process",
        frontend_processes=4,
        rtc="guided",
        rtc_max_delay=4,
        trust_remote_code=True,
        lerobot_grpc_port=8080,
    )
    opts = parse_serve(argv)
    assert (opts.rtc, opts.rtc_max_delay) == ("guided", 4)
    assert opts.trust_remote_code is True
    assert opts.lerobot_grpc_port == 8080
    assert (opts.frontend, opts.frontend_processes) == ("process", 4)
    assert opts.session_idle_timeout_s == 45.0
    assert (opts.policy, opts.lerobot_family) == ("lerobot", "lingbot_va")
    assert (
        opts.checkpoint,
        opts.port,
        opts.cfgp,
        opts.dp,
        opts.guidance,
        opts.steps,
        opts.max_batch,
        opts.batch_window_ms,
        opts.device,
        opts.auth_token_file,
        opts.drain_grace_s,
        opts.latency_budget_ms,
        opts.max_connections,
    ) == ("/models/k", 8000, 2, 1, 2.5, 8, 4, 0.5, "cuda", None, 20.0, 40.0, 64)
    assert [a for a in argv if a.startswith("--")] == [f for f in serve_flags.MANAGED_FLAGS if f != "--auth-token-file"]


@pytest.mark.parametrize(
    ("threads", "device", "environ", "expected"),
    [
        (None, "cuda", {}, 1),  # a GPU rank: one host thread per thread that touches torch
        (None, "cpu", {}, None),  # the CPU does the math: torch's own count
        (None, "cuda", {"OMP_NUM_THREADS": "4"}, None),  # the user's environment decides (torch reads it)
        (3, "cuda", {"OMP_NUM_THREADS": "4"}, 3),  # and --threads over both
        (2, "cpu", {}, 2),
    ],
)
def test_intra_op_threads_default_to_one_on_a_gpu(
    threads: int | None, device: str, environ: dict[str, str], expected: int | None
) -> None:
    assert serve_flags.intra_op_threads(threads, device, environ) == expected
