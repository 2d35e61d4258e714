"""Interpreters the server starts put no working directory on ``sys.path``: a ``struct.py`` in the directory
``serve`` was started from must not replace the standard library's module in the front-end process
(``--frontend process``, started with ``python -P``) nor in torchrun's ranks (``PYTHONSAFEPATH``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from policy_operator.runtime.policy.reference import PolicyConfig, example_observation
from tests.support.openpi import OpenpiSession
from tests.support.servers import NO_DRAIN, PolicyServerProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"),
]

SHADOW = "SHADOWING struct.py was imported"


@pytest.fixture
def hostile_cwd(tmp_path: Path) -> Path:
    """A directory whose ``struct.py`` (which pickle, msgpack and torch import) says so and exits."""
    (tmp_path / "struct.py").write_text(f"import sys\nsys.stderr.write({SHADOW!r} + '\\n')\nraise SystemExit(1)\n")
    return tmp_path


@pytest.mark.parametrize("layout", [["--frontend", "process"], ["--cfgp", "2"]], ids=["frontend-process", "cfgp2"])
def test_the_working_directory_shadows_no_module(tiny_checkpoint: Path, hostile_cwd: Path, layout: list[str]) -> None:
    server = PolicyServerProcess(tiny_checkpoint, "--steps", "2", *layout, *NO_DRAIN, cwd=hostile_cwd)
    with server.start():
        with OpenpiSession(server.url) as client:
            actions = client.infer(example_observation(PolicyConfig()))["actions"]
        assert actions.shape == (PolicyConfig().horizon, PolicyConfig().action_dim)
    assert SHADOW not in server.log_text(), server.log_tail()
