"""pytest fixtures for the Kubernetes API emulator (tests/support/kube_emulator.py).

Use them from a test module with either line (tests/conftest.py stays untouched)::

    pytest_plugins = ["tests.support.kube_fixtures"]
    from tests.support.kube_fixtures import kube, kube_module  # noqa: F401

``kube`` is a fresh emulator per test (it starts in milliseconds); ``kube_module``
is shared by a module's tests, which then should use their own namespaces.
Both fail the test if the emulator itself crashed while serving it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .kube_emulator import KubeEmulator


def _run(workdir: Path) -> Iterator[KubeEmulator]:
    emulator = KubeEmulator(workdir)
    with emulator:
        yield emulator
    emulator.raise_internal_errors()


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubeEmulator]:
    """A Kubernetes API emulator for one test: ``kube.url``, ``kube.kubectl(...)``, ``kube.get(...)``, ..."""
    yield from _run(tmp_path / "kube")


@pytest.fixture(scope="module")
def kube_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeEmulator]:
    """One emulator shared by all tests of a module."""
    yield from _run(tmp_path_factory.mktemp("kube"))
