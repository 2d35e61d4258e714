"""``--compile [MODE]``: one of torch.compile's modes, or ``none`` (eager), checked before anything loads.

An unknown mode used to reach ``torch.compile(mode=...)`` only at warm-up,
after every rank loaded the model: a crash loop for a pod.  ``none`` is the
way to serve eager where the operator would add ``--compile reduce-overhead``
(a LeRobot policy on a GPU): the worker sees no compile at all.
"""

from __future__ import annotations

import pytest

from policy_operator import cli, serve_flags


def options(*argv: str) -> serve_flags.ServeOptions:
    args = cli.build_parser().parse_args(["serve", "--checkpoint", "/ck", *argv])
    return serve_flags.ServeOptions.from_args(args)


@pytest.mark.parametrize("mode", serve_flags.COMPILE_MODES)
def test_every_torch_compile_mode_is_accepted_and_travels_to_the_worker(mode: str) -> None:
    for argv in (["--compile", mode], [f"--compile={mode}"]):
        opts = options(*argv)
        serve_flags.check_values(opts)
        worker = serve_flags.to_argv(opts)
        assert opts.compile == mode and worker[worker.index("--compile") + 1] == mode


def test_bare_compile_is_default_and_none_is_eager() -> None:
    assert options("--compile").compile == "default"
    assert options().compile is None
    for argv in (["--compile", "none"], ["--compile=none"], ["--compile", "reduce-overhead", "--compile=none"]):
        opts = options(*argv)
        serve_flags.check_values(opts)
        assert opts.compile is None, argv  # every `if opts.compile` path reads it as no flag
        assert "--compile" not in serve_flags.to_argv(opts)  # the torchrun worker compiles nothing either


@pytest.mark.parametrize("mode", ["foo", "", "None", "reduce_overhead", "max-autotune-no-cudagraph"])
def test_an_unknown_mode_is_refused_in_one_line_naming_the_flag_and_the_modes(mode: str) -> None:
    with pytest.raises(ValueError, match="^--compile must be one of ") as refused:
        serve_flags.check_values(options(f"--compile={mode}"))
    message = str(refused.value)
    assert "\n" not in message and message.endswith(f"got {mode!r}")
    assert all(m in message for m in (*serve_flags.COMPILE_MODES, "none (eager)"))


def test_the_operator_reads_extra_args_as_serve_does() -> None:
    """check_compile_args: the two-word form the CRD's one-word rule cannot see; other flags pass untouched."""
    serve_flags.check_compile_args(["--compile-cache-dir", "/c", "--compile", "--dtype", "bfloat16"])
    serve_flags.check_compile_args(["--compile", "none", "--threads", "2"])
    serve_flags.check_compile_args(["--dtype", "foo"])
    for args in (["--compile", "foo"], ["--threads", "2", "--compile=foo"], ["--compile=none", "--compile", "x"]):
        with pytest.raises(ValueError, match="--compile must be one of"):
            serve_flags.check_compile_args(args)


def test_help_names_the_modes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(mode in help_text for mode in serve_flags.COMPILE_MODES) and "none (eager" in help_text
