"""``spec.policy.type: lerobot`` on a GPU is served with the fast flags (serve_flags.LEROBOT_GPU_DEFAULTS) unless
extraArgs say otherwise; nothing changes for another policy or on the CPU."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from policy_operator import serve_flags
from policy_operator.operator import manifests as M
from policy_operator.operator.spec import SpecError, parse_spec


def served_args(runtime: dict[str, Any], policy: str = "lerobot") -> tuple[argparse.Namespace, list[str]]:
    spec = parse_spec(
        {"image": "registry.example/policy:1", "checkpoint": {"source": "hf://org/policy"}, "policy": {"type": policy}}
        | {"runtime": runtime},
        name="ps",
        namespace="robots",
    )
    worker_args = M.worker_command(spec, M.ServingCheckpoint("key", "/models/ckpt"))[2:]
    parser = argparse.ArgumentParser()
    serve_flags.add_arguments(parser)
    return parser.parse_args(worker_args), worker_args


def test_a_lerobot_policy_on_a_gpu_is_served_in_bfloat16_with_cuda_graphs() -> None:
    args, _ = served_args({})
    assert (args.policy, args.device, args.dtype, args.compile) == ("lerobot", "cuda", "bfloat16", "reduce-overhead")
    assert args.max_batch == serve_flags.DEFAULT_MAX_BATCH  # the buckets: 1, 2, 4, 8


@pytest.mark.parametrize(
    "extra", [["--dtype=float32", "--compile=default"], ["--dtype", "float32", "--compile", "default"]]
)
def test_extra_args_replace_the_defaults_never_doubled(extra: list[str]) -> None:
    args, argv = served_args({"extraArgs": extra})
    assert (args.dtype, args.compile) == ("float32", "default")
    assert sum(a.startswith("--dtype") for a in argv) == 1 and sum(a.startswith("--compile") for a in argv) == 1


@pytest.mark.parametrize(("runtime", "policy"), [({"device": "cpu", "guidance": 1.0}, "lerobot"), ({}, "reference")])
def test_other_policies_and_the_cpu_keep_the_serve_defaults(runtime: dict[str, Any], policy: str) -> None:
    args, _ = served_args(runtime, policy)
    assert (args.dtype, args.compile) == ("float32", None)


@pytest.mark.parametrize("extra", [["--compile=none"], ["--compile", "none"]])
def test_compile_none_serves_eager_without_the_compile_default(extra: list[str]) -> None:
    """The one way to serve a LeRobot policy on a GPU eager: the operator adds no --compile, serve reads None."""
    args, argv = served_args({"extraArgs": extra})
    assert (args.dtype, args.compile) == ("bfloat16", None)  # the dtype default stays
    assert "reduce-overhead" not in argv and sum(a.startswith("--compile") for a in argv) == 1
    assert serve_flags.ServeOptions.from_args(args).compile is None
    assert not any(a.startswith("--compile") for a in serve_flags.to_argv(serve_flags.ServeOptions.from_args(args)))


@pytest.mark.parametrize(
    ("extra", "path"), [(["--compile=foo"], r"extraArgs\[0\]"), (["--compile", "foo"], "extraArgs")]
)
def test_an_unknown_compile_mode_is_refused_before_any_pod(extra: list[str], path: str) -> None:
    with pytest.raises(SpecError, match=rf"spec\.runtime\.{path}: .*--compile .*reduce-overhead.*none \(eager\)"):
        served_args({"extraArgs": extra})
