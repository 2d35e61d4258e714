"""``--batch-buckets``: the batch sizes a compiled server captures, chosen by the user (fewer: a shorter warm-up).

A CUDA graph per bucket costs 60-100 s of compile on an H100 for pi0.5 or
SmolVLA (bench/results/lerobot-h100-round2.md), so the default 1, 2, 4, 8 is
a four-bucket warm-up; ``--batch-buckets 1,8`` halves it, padding 2-7 robots
to 8.  The flag is refused before anything loads unless the sizes can hold
every batch up to ``--max-batch``.
"""

from __future__ import annotations

import pytest

from policy_operator import cli, serve_flags


def options(*argv: str) -> serve_flags.ServeOptions:
    args = cli.build_parser().parse_args(["serve", "--checkpoint", "/ck", *argv])
    return serve_flags.ServeOptions.from_args(args)


def test_the_sizes_given_are_the_buckets_and_travel_to_the_worker() -> None:
    opts = options("--max-batch", "8", "--batch-buckets", "1,8")
    serve_flags.check_values(opts)
    assert serve_flags.bucket_sizes(opts.batch_buckets, opts.max_batch) == (1, 8)
    argv = serve_flags.to_argv(opts)
    assert argv[argv.index("--batch-buckets") + 1] == "1,8"
    assert serve_flags.bucket_sizes(options("--max-batch", "8").batch_buckets, 8) is None  # the default ladder


@pytest.mark.parametrize(
    ("sizes", "says"),
    [
        ("1,4", "must end at --max-batch (8)"),
        ("8,1", "ascending"),
        ("0,8", "ascending sizes of at least 1"),
        ("1,1,8", "ascending"),
        ("one,8", "comma-separated batch sizes"),
    ],
)
def test_sizes_that_cannot_hold_every_batch_are_refused_naming_the_flag(sizes: str, says: str) -> None:
    with pytest.raises(ValueError, match="--batch-buckets") as refused:
        serve_flags.check_values(options("--max-batch", "8", "--batch-buckets", sizes))
    assert says in str(refused.value)
