"""Shared pytest configuration: every multi-process test binds 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.support.control_plane import ControlPlane
    from tests.support.servers import PolicyServerProcess

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny reference checkpoint (seed 0), shared by every test of the session."""
    from tests.support.servers import session_checkpoint

    return session_checkpoint(tmp_path_factory)


@pytest.fixture(scope="session")
def shared_server(tiny_checkpoint: Path) -> Iterator[PolicyServerProcess]:
    """The reference policy with ``SHARED_SERVER_ARGS`` (2 steps, frames up to 1 MB), started once for every module
    whose tests only send requests and read what it exports (test_server, test_cli, test_dashboard,
    test_autoscaling).  Tests leave it as they found it: they count metrics before and after their own requests,
    and none kills, drains or reconfigures it."""
    from tests.support.servers import NO_DRAIN, SHARED_SERVER_ARGS, serve_policy

    with serve_policy(tiny_checkpoint, *SHARED_SERVER_ARGS, *NO_DRAIN) as server:
        yield server


@pytest.fixture(scope="session")
def auth_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PolicyServerProcess]:
    """``shared_server``'s configuration behind a bearer token (``AUTH_TOKEN``, in the file ``.token_file``), for
    test_server's auth tests and test_probe's real server; left as found, like ``shared_server``."""
    from tests.support.servers import AUTH_TOKEN, NO_DRAIN, SHARED_SERVER_ARGS, serve_policy

    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(AUTH_TOKEN + "\n")
    with serve_policy(tiny_checkpoint, *SHARED_SERVER_ARGS, "--auth-token-file", str(token_file), *NO_DRAIN) as server:
        server.token_file = token_file  # type: ignore[attr-defined]
        yield server


@pytest.fixture(scope="session")
def cli_env() -> dict[str, str]:
    """Environment for subprocesses: the venv's scripts (policyserver, torchrun) first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("HF_TOKEN", None)
    return env


HUB_OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # huggingface_hub honours either


@pytest.fixture(autouse=True)
def _hub_access_stays_with_its_test() -> Iterator[None]:
    """A LeRobot checkpoint loaded in this process turns its hub access off (``go_offline``: the environment and
    huggingface_hub's flag), as a server must; a later test that runs an online fetch, or snapshots the
    environment for a subprocess (``cli_env``), must not inherit that."""
    saved = {name: os.environ.get(name) for name in HUB_OFFLINE_ENV}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        offline = any((os.environ.get(name) or "").upper() in {"1", "ON", "YES", "TRUE"} for name in HUB_OFFLINE_ENV)
        setattr(constants, "HF_HUB_OFFLINE", offline)  # noqa: B010 - a module found at run time, untyped


@pytest.fixture(scope="session", autouse=True)
def _kubernetes_schemas_read_once() -> Iterator[None]:
    """kubernetes-validate reads and parses a kind's schema and the 1.3 MB ``_definitions.json`` at every
    ``validate`` call (~10 ms); the files do not change during a session, so each is read once.  Nothing
    mutates them: jsonschema and referencing only read a schema."""
    import functools

    from kubernetes_validate import utils

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(utils, "schema_contents", functools.lru_cache(maxsize=None)(utils.schema_contents))
        yield


PolicyserverMain = Callable[..., subprocess.CompletedProcess[str]]


class _LastResort(logging.Handler):
    """Log records of WARNING and above on stderr, as Python's last-resort handler prints them in a process that
    configured no logging (a command's own process): pytest's handlers on the root logger would hide them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(self.format(record) + "\n")


@pytest.fixture
def policyserver_main(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> PolicyserverMain:
    """``policyserver ARGS...`` run in this process by ``policy_operator.cli.main``: its exit code and what it
    printed, as a ``CompletedProcess``.

    For tests of argument checks, exit codes and messages: a subprocess would spend more time starting an
    interpreter and repeating imports than in the command.  Each command keeps tests that run the real
    ``policyserver`` executable.  ``serve`` may not get past its checks here: starting the runtime (which ends
    its process with ``os._exit``) or torchrun fails the test instead.
    """
    from policy_operator.cli import main
    from policy_operator.runtime import serve_cli, worker

    def must_not_serve(*args: object, **kwargs: object) -> int:
        raise AssertionError("serve got past its checks in the test process")

    monkeypatch.setattr(worker, "run", must_not_serve)
    monkeypatch.setattr(serve_cli, "run_torchrun", must_not_serve)
    monkeypatch.delenv("HF_TOKEN", raising=False)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        stderr_log = _LastResort()
        logging.getLogger().addHandler(stderr_log)
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse: --help, --version, usage errors
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        finally:
            logging.getLogger().removeHandler(stderr_log)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["policyserver", *argv], code, out, err)

    return run


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the control plane's binary before the first test when a ``cluster`` test is selected.

    A cold Go build takes minutes; inside the fixture it would count against
    one test's timeout.  ``make test`` has built it already (then this is a
    hash check).
    """
    if session.config.option.collectonly or not any(i.get_closest_marker("cluster") for i in session.items):
        return
    from tests.support.control_plane import ensure_binary

    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        ensure_binary()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """One real control plane (etcd, kube-apiserver, controller-manager, scheduler) for the whole session.

    Tests share it, so each uses namespaces of its own (``create_namespace``)
    and cluster-scoped names that no other test uses.  Logs:
    ``<pytest tmp>/control-plane0/logs/``.
    """
    from tests.support.control_plane import ControlPlane

    with ControlPlane(tmp_path_factory.mktemp("control-plane")) as cp:
        yield cp
