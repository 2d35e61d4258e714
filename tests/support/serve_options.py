"""A ``policyserver serve`` command line read back as its options, the way serve itself parses it."""

from __future__ import annotations

import argparse

from policy_operator import serve_flags


def parse_serve(argv: list[str]) -> serve_flags.ServeOptions:
    """``argv`` (the flags after ``serve``) as ``ServeOptions``; argparse's own errors exit as serve's do."""
    parser = argparse.ArgumentParser()
    serve_flags.add_arguments(parser)
    return serve_flags.ServeOptions.from_args(parser.parse_args(argv))
