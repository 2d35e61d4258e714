"""Shared pytest configuration: every multi-process test binds 127.0.0.1 only."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def cli_env() -> dict[str, str]:
    """Environment for subprocesses: the venv's scripts (policyserver, torchrun) first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("HF_TOKEN", None)
    return env
