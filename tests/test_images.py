"""The two Dockerfiles, checked as far as a machine without a Docker engine can.

They are parsed with BuildKit's own parser (the ``dockerfile`` package wraps
it); then every claim they make is held against the real thing: the COPY
sources exist, pass ``.dockerignore`` and build the project's wheel; the
operator image's dependency list is pyproject's minus torch and its import
path really runs with torch unimportable; the runtime image provides every
executable and subcommand the operator writes into pod specs; the runtime
HEALTHCHECK command is run against a real ``policyserver serve``; the users
are the non-root uids the chart and the operator's manifests run as.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import dockerfile
import helm_python
import pytest
import yaml
from packaging.requirements import Requirement

from policy_operator import cli, serve_flags
from policy_operator import constants as C
from policy_operator.operator import main as operator_main
from policy_operator.operator import manifests
from policy_operator.operator.spec import parse_spec
from tests.support.servers import serve_policy

REPO = Path(__file__).resolve().parents[1]
OPERATOR_DOCKERFILE = REPO / "operator" / "Dockerfile"
RUNTIME_DOCKERFILE = REPO / "runtime" / "Dockerfile"
DOCKERFILES = {"operator": OPERATOR_DOCKERFILE, "runtime": RUNTIME_DOCKERFILE}
VENV_BIN = Path(sys.executable).parent
EXAMPLES = {p.name: yaml.safe_load(p.read_text()) for p in sorted((REPO / "examples").glob("policyserver-*.yaml"))}


# --- reading a Dockerfile ---------------------------------------------------------------------


def commands(path: Path) -> tuple[dockerfile.Command, ...]:
    return dockerfile.parse_file(str(path))


def stages(path: Path) -> list[list[dockerfile.Command]]:
    """Instructions per build stage; the global ARGs before the first FROM are stage 0's prelude."""
    out: list[list[dockerfile.Command]] = [[]]
    for cmd in commands(path):
        if cmd.cmd == "FROM" and out[-1] and any(c.cmd == "FROM" for c in out[-1]):
            out.append([])
        out[-1].append(cmd)
    return out


def final_stage(path: Path) -> list[dockerfile.Command]:
    return stages(path)[-1]


def arg_defaults(path: Path) -> dict[str, str]:
    args = {}
    for cmd in commands(path):
        if cmd.cmd == "ARG":
            name, _, default = cmd.value[0].partition("=")
            args[name] = default.strip('"')
    return args


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], text)


def env_of(stage: list[dockerfile.Command]) -> dict[str, str]:
    env: dict[str, str] = {}
    for cmd in stage:
        if cmd.cmd == "ENV":
            env.update(zip(cmd.value[::2], cmd.value[1::2], strict=True))
    return env


def run_lines(stage: list[dockerfile.Command]) -> list[str]:
    """Each RUN's shell command split at ``&&`` into single commands."""
    return [part.strip() for cmd in stage if cmd.cmd == "RUN" for part in cmd.value[0].split(" && ")]


def dockerfile_user(path: Path) -> tuple[str, str]:
    (user,) = [c.value[0] for c in final_stage(path) if c.cmd == "USER"]
    uid, _, gid = user.partition(":")
    return uid, gid


def one_cmd(stage: list[dockerfile.Command], name: str) -> dockerfile.Command:
    (cmd,) = [c for c in stage if c.cmd == name]
    return cmd


# --- both images ------------------------------------------------------------------------------


@pytest.mark.parametrize("image", DOCKERFILES)
def test_dockerfile_parses_with_buildkits_parser(image: str) -> None:
    path = DOCKERFILES[image]
    assert path.read_text().splitlines()[0] == "# syntax=docker/dockerfile:1"
    cmds = commands(path)
    assert {c.cmd.lower() for c in cmds} <= set(dockerfile.all_cmds())
    args = arg_defaults(path)
    for cmd in cmds:
        if cmd.cmd == "FROM":
            base = expand(cmd.value[0], args)
            assert re.fullmatch(r"[a-z0-9./-]+:[A-Za-z0-9_.-]+", base), base  # always a pinned tag
            assert not base.endswith(":latest")
    with pytest.raises(dockerfile.GoParseError):  # the parser does reject what BuildKit rejects
        dockerfile.parse_string("FROM python:3.11-slim\nRUN <<EOF\nnever closed\n")


@pytest.mark.parametrize("image", DOCKERFILES)
def test_every_copy_source_exists_and_is_in_the_build_context(image: str) -> None:
    ignore = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert ignore[0] == "*"  # an allowlist: nothing enters the context unless named
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    stage_names = set()
    for stage in stages(DOCKERFILES[image]):
        for cmd in stage:
            if cmd.cmd == "FROM" and "AS" in cmd.value:
                stage_names.add(cmd.value[-1])
            if cmd.cmd not in ("COPY", "ADD"):
                continue
            assert cmd.cmd == "COPY", "ADD fetches and unpacks implicitly; use COPY"
            from_stage = [f.split("=", 1)[1] for f in cmd.flags if f.startswith("--from=")]
            if from_stage:
                assert from_stage[0] in stage_names
                continue
            for source in cmd.value[:-1]:
                assert (REPO / source).exists(), source
                assert source.rstrip("/") in allowed, f"{source} is excluded by .dockerignore"


def test_the_copied_sources_build_the_whole_project(tmp_path: Path) -> None:
    """Only what the images COPY goes into the wheel build, so a package folder the images forget fails here."""
    for image, path in DOCKERFILES.items():
        copied = {
            s for c in final_stage(path) + stages(path)[0] if c.cmd == "COPY" and not c.flags for s in c.value[:-1]
        }
        assert copied == {"pyproject.toml", "README.md", "policy_operator/", "runtime/", "operator/"}, image
    context = tmp_path / "context"
    context.mkdir()
    for source in ("pyproject.toml", "README.md"):
        (context / source).write_bytes((REPO / source).read_bytes())
    for folder in ("policy_operator", "runtime", "operator"):
        subprocess.run(["cp", "-r", str(REPO / folder), str(context / folder)], check=True)
    out = tmp_path / "wheels"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--wheel-dir",
            str(out),
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    for module in (
        "policy_operator/cli.py",
        "policy_operator/runtime/worker.py",
        "policy_operator/runtime/serve_cli.py",
        "policy_operator/runtime/serving/server.py",
        "policy_operator/runtime/parallel/dispatch.py",
        "policy_operator/runtime/policy/interface.py",
        "policy_operator/runtime/checkpoint/fetch.py",
        "policy_operator/operator/main.py",
        "policy_operator/operator/handlers.py",
    ):
        assert module in names
    assert "policyserver = policy_operator.cli:main" in entry_points


@pytest.mark.parametrize("image", DOCKERFILES)
def test_final_stage_runs_as_a_non_root_uid(image: str) -> None:
    stage = final_stage(DOCKERFILES[image])
    uid, gid = dockerfile_user(DOCKERFILES[image])
    assert uid.isdigit() and gid.isdigit() and int(uid) != 0  # numeric, so runAsNonRoot can verify it
    # USER comes after the last RUN: nothing is left to run as root, and nothing the image runs is root
    assert stage.index(one_cmd(stage, "USER")) > max(i for i, c in enumerate(stage) if c.cmd == "RUN")
    useradd = next(line for line in run_lines(stage) if "useradd" in line)
    assert f"--uid {uid}" in useradd and f"--gid {gid}" in useradd


def test_users_are_the_uids_the_pods_run_as() -> None:
    assert dockerfile_user(RUNTIME_DOCKERFILE) == (str(manifests.RUN_AS_USER),) * 2
    chart = helm_python.Chart.load(REPO / "charts" / "policy-operator")
    assert dockerfile_user(OPERATOR_DOCKERFILE) == (str(chart.values["securityContext"]["runAsUser"]),) * 2


@pytest.mark.parametrize("image", DOCKERFILES)
def test_build_args_pin_versions(image: str) -> None:
    args = arg_defaults(DOCKERFILES[image])
    expected = {
        "operator": {"PYTHON_VERSION"},
        "runtime": {"PYTORCH_VERSION", "CUDA_VERSION", "CUDNN_VERSION", "EXTRA_PACKAGES"},
    }[image]
    assert expected <= set(args)
    for name in expected - {"EXTRA_PACKAGES"}:
        assert re.fullmatch(r"\d+(\.\d+)*", args[name]), (name, args[name])


def test_makefile_builds_both_images_from_the_repository_root() -> None:
    recipe = re.search(r"^images:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert recipe
    builds = [shlex.split(line) for line in recipe.group(1).splitlines() if "docker build" in line]
    files = sorted(argv[argv.index("-f") + 1] for argv in builds)
    assert files == ["operator/Dockerfile", "runtime/Dockerfile"]
    assert all(argv[-1] == "." for argv in builds)


# --- the operator image -------------------------------------------------------------------------


def test_operator_image_installs_the_project_dependencies_minus_torch(tmp_path: Path) -> None:
    """Runs the Dockerfile's own requirements step on the real pyproject.toml."""
    (step,) = [c.value[0] for c in stages(OPERATOR_DOCKERFILE)[0] if c.cmd == "RUN" and "tomllib" in c.value[0]]
    (tmp_path / "pyproject.toml").write_bytes((REPO / "pyproject.toml").read_bytes())
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(["sh", "-c", step], cwd=tmp_path, env=env, check=True, timeout=60)
    got = (tmp_path / "requirements-operator.txt").read_text().split("\n")
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [line for line in got if line] == [d for d in deps if Requirement(d).name != "torch"]
    assert {"kopf", "kubernetes"} <= {Requirement(d).name for d in got if d}
    final = " ".join(run_lines(final_stage(OPERATOR_DOCKERFILE)))
    assert "pip install -r /wheels/requirements-operator.txt" in final and "pip install --no-deps" in final


BLOCK_TORCH = "import sys; sys.modules['torch'] = None; "


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO / "tests")


def test_operator_import_path_runs_without_torch() -> None:
    """The image has no torch: the Dockerfile's own smoke check, and every operator module, must not need it.

    One interpreter runs both, the smoke check first, as the image's build runs it."""
    (smoke,) = [line for line in run_lines(final_stage(OPERATOR_DOCKERFILE)) if "sys.modules['torch'] = None" in line]
    argv = shlex.split(smoke)
    assert argv[:2] == ["python", "-c"] and argv[2].startswith(BLOCK_TORCH)
    every_module = (
        "import pkgutil, importlib, policy_operator.operator as op; "
        "[importlib.import_module(f'policy_operator.operator.{m.name}') for m in pkgutil.iter_modules(op.__path__)]; "
        "from policy_operator.cli import main; main(['operator', '--help'])"
    )
    proc = _python(f"{argv[2]}\nprint('smoke check passed', flush=True)\n{every_module}")
    assert proc.returncode == 0 and "--all-namespaces" in proc.stdout, proc.stderr
    assert proc.stdout.startswith("smoke check passed\n"), proc.stdout[:200]
    # the block is real: the runtime's model code, which does need torch, fails under it
    proc = _python(BLOCK_TORCH + "import policy_operator.runtime.policy.interface")
    assert proc.returncode != 0 and "torch" in proc.stderr


def test_what_the_operator_and_the_fetch_job_share_needs_no_torch() -> None:
    """policy_operator's own modules (serve flags, /readyz, exit codes, sources) and runtime/checkpoint/."""
    code = (
        "import pkgutil, importlib, policy_operator, policy_operator.runtime.checkpoint as ck; "
        "names = [f'policy_operator.{m.name}' for m in pkgutil.iter_modules(policy_operator.__path__) "
        "if not m.ispkg] + [f'{ck.__name__}.{m.name}' for m in pkgutil.iter_modules(ck.__path__)]; "
        "[importlib.import_module(n) for n in names]; print(len(names), sorted(names))"
    )
    proc = _python(BLOCK_TORCH + code)
    assert proc.returncode == 0, proc.stderr
    for module in (
        "policy_operator.readyz",
        "policy_operator.source_uri",
        "policy_operator.serve_flags",
        "policy_operator.exit_codes",
        "policy_operator.runtime.checkpoint.fetch",
        "policy_operator.runtime.checkpoint.format",
    ):
        assert f"'{module}'" in proc.stdout, proc.stdout


def test_operator_image_default_command_is_the_operator() -> None:
    stage = final_stage(OPERATOR_DOCKERFILE)
    entrypoint, cmd = list(one_cmd(stage, "ENTRYPOINT").value), list(one_cmd(stage, "CMD").value)
    assert one_cmd(stage, "ENTRYPOINT").json and one_cmd(stage, "CMD").json  # exec form: signals reach kopf
    assert entrypoint == ["policyserver"]
    args = cli.build_parser().parse_args(cmd)
    assert cli.COMMANDS[args.command][0] == operator_main.__name__ and args.all_namespaces and args.standalone
    # the chart overrides the command with the same executable
    chart = helm_python.Chart.load(REPO / "charts" / "policy-operator")
    deployment = yaml.safe_load(
        chart.render({}, name="po", namespace="ns")["policy-operator/templates/deployment.yaml"]
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"][0] == entrypoint[0]
    assert one_cmd(stage, "EXPOSE").value == (str(urlport(operator_main.DEFAULT_LIVENESS)),)


def urlport(url: str) -> int:
    from urllib.parse import urlsplit

    port = urlsplit(url).port
    assert port is not None
    return port


# --- the runtime image ---------------------------------------------------------------------------


def test_runtime_base_is_a_cuda_pytorch_runtime_image_and_keeps_its_torch() -> None:
    cmds = commands(RUNTIME_DOCKERFILE)
    base = expand(one_cmd(list(cmds), "FROM").value[0], arg_defaults(RUNTIME_DOCKERFILE))
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda12\.\d+-cudnn9-runtime", base), base
    lines = run_lines(final_stage(RUNTIME_DOCKERFILE))
    (pin,) = [line for line in lines if "torch-constraint.txt" in line and "m.version(p)" in line]
    argv = shlex.split(pin.split(">")[0])
    proc = _python(argv[2])
    # pins that only the base image's own torch and torchvision builds satisfy
    assert proc.stdout.splitlines() == [
        f"torch=={importlib.metadata.version('torch')}",
        f"torchvision=={importlib.metadata.version('torchvision')}",
    ], proc.stderr
    (install,) = [line for line in lines if line.startswith("pip install")]
    assert "--constraint /tmp/torch-constraint.txt" in install
    (target,) = [w for w in shlex.split(install) if w.startswith(".")]
    assert target == ".[lerobot]"  # the project with its lerobot extra (--policy lerobot)


def test_runtime_base_carries_a_torch_pair_the_lerobot_extra_accepts() -> None:
    """The base image's torch/torchvision (its tag names torch) satisfy what the lerobot extra's lerobot requires,
    as the versions installed here do."""
    from packaging.specifiers import SpecifierSet

    base_torch = arg_defaults(RUNTIME_DOCKERFILE)["PYTORCH_VERSION"]
    assert base_torch == importlib.metadata.version("torch").split("+")[0]
    wanted = {
        Requirement(r).name: Requirement(r).specifier
        for r in importlib.metadata.requires("lerobot") or []
        if Requirement(r).marker is None
    }
    assert base_torch in SpecifierSet(str(wanted["torch"]))
    assert importlib.metadata.version("torchvision").split("+")[0] in SpecifierSet(str(wanted["torchvision"]))
    extra = [r for r in importlib.metadata.requires("policy-operator") or [] if 'extra == "lerobot"' in r]
    assert [Requirement(r).name for r in extra] == ["lerobot"]


def _operator_commands() -> list[list[str]]:
    """Every container command the operator writes, over the examples."""
    out = []
    for example in EXAMPLES.values():
        spec = parse_spec(example["spec"], name=example["metadata"]["name"], namespace="robots")
        job = manifests.build_fetch_job(spec)["spec"]["template"]["spec"]
        pod = manifests.build_pod_template(spec, manifests.ServingCheckpoint.of(spec))["spec"]
        out += [c["command"] for c in job["containers"] + pod["initContainers"] + pod["containers"]]
    return out


def test_runtime_image_provides_every_command_the_operator_writes() -> None:
    lines = run_lines(final_stage(RUNTIME_DOCKERFILE))
    on_path = {line.split()[-1] for line in lines if line.startswith("command -v ")}
    smoke = " ".join(lines)
    for command in _operator_commands():
        assert command[0] in on_path, f"{command[0]} is not checked on PATH in the runtime image"
        if command[0] == "policyserver":
            sub = [w for w in command[1:3] if not w.startswith("-") and "/" not in w and ":" not in w]
            sub = sub[:2] if sub[:1] == ["checkpoint"] else sub[:1]
            assert f"policyserver {' '.join(sub)} --help" in smoke, sub
        else:
            module = command[command.index("-m") + 1]
            assert module == serve_flags.WORKER_MODULE
            assert re.search(rf'python -c "import [\w., ]*\b{re.escape(module)}\b', smoke), module
    env = env_of(final_stage(RUNTIME_DOCKERFILE))
    assert env[C.ENV_HOME] == manifests.TMP_PATH and env[C.ENV_XDG_CACHE_HOME] == f"{manifests.TMP_PATH}/.cache"


def test_runtime_image_has_the_compilers_torch_compile_calls() -> None:
    """--compile needs a C compiler (Triton's launchers) and a C++ one (inductor's CPU kernels) in the pod; an image
    without them builds, and fails at every pod's first compiled warm-up.  The build checks them after the last
    install, so the image cannot be built without them."""
    lines = run_lines(final_stage(RUNTIME_DOCKERFILE))
    install = max(i for i, line in enumerate(lines) if line.startswith("pip install"))
    checked = {line.split()[-1] for line in lines[install:] if line.startswith("command -v ")}
    assert {"gcc", "g++"} <= checked, checked
    installing = [line for line in lines[:install] if "apt-get install" in line]
    assert installing and all(pkg in installing[0].split() for pkg in ("gcc", "g++", "libc6-dev")), installing


def test_runtime_image_holds_the_bytecode_of_every_installed_module() -> None:
    """Pods cannot write bytecode (PYTHONDONTWRITEBYTECODE, read-only root filesystem): whatever the image lacks
    is compiled from source at every pod start, seconds of a second pod's start on a GPU host."""
    stage = final_stage(RUNTIME_DOCKERFILE)
    assert env_of(stage)["PYTHONDONTWRITEBYTECODE"] == "1"
    lines = run_lines(stage)
    install = next(i for i, line in enumerate(lines) if line.startswith("pip install"))
    compiled = [i for i, line in enumerate(lines) if "compileall.compile_dir(sysconfig.get_paths()['purelib']" in line]
    assert compiled and compiled[0] > install, "compileall runs over site-packages after the last install"
    assert not any(line.startswith("pip install") for line in lines[compiled[0] :])


def test_runtime_default_command_serves_like_the_operator_pods() -> None:
    """``policyserver serve`` (the image's CMD) is the entrypoint the operator writes, with flags serve parses."""
    cmd = one_cmd(final_stage(RUNTIME_DOCKERFILE), "CMD")
    assert cmd.json and cmd.value[:2] == serve_flags.SERVE_COMMAND
    args = cli.build_parser().parse_args([*cmd.value[1:], "--cfgp", "2", "--dp", "2", "--guidance", "2.5"])
    launched = serve_flags.to_argv(serve_flags.ServeOptions.from_args(args))
    example = EXAMPLES["policyserver-cfgp2-dp2.yaml"]
    spec = parse_spec(example["spec"], name=example["metadata"]["name"], namespace="robots")
    written = manifests.worker_command(spec, manifests.ServingCheckpoint.of(spec))
    assert tuple(written[:2]) == serve_flags.SERVE_COMMAND
    cli.build_parser().parse_args(written[1:])  # every flag the operator writes is one serve accepts
    for flag in ("--cfgp", "--dp", "--guidance"):
        assert launched[launched.index(flag) + 1] == written[written.index(flag) + 1]
    assert one_cmd(final_stage(RUNTIME_DOCKERFILE), "EXPOSE").value == (str(C.DEFAULT_PORT),)


def _healthcheck() -> tuple[dockerfile.Command, list[str]]:
    hc = one_cmd(final_stage(RUNTIME_DOCKERFILE), "HEALTHCHECK")
    assert hc.json and hc.value[0] == "CMD"
    return hc, list(hc.value[1:])


def test_healthcheck_names_the_runtime_health_endpoint_and_port() -> None:
    hc, argv = _healthcheck()
    assert argv[:2] == ["python", "-c"]
    assert C.HEALTHZ_PATH in argv[2] and C.ENV_PORT in argv[2] and f"'{C.DEFAULT_PORT}'" in argv[2]
    assert env_of(final_stage(RUNTIME_DOCKERFILE))[C.ENV_PORT] == str(C.DEFAULT_PORT)
    flags = dict(f.lstrip("-").split("=", 1) for f in hc.flags)
    match = re.search(r"timeout=(\d+)", argv[2])
    assert match is not None, argv[2]
    timeout = float(match.group(1))
    assert timeout < float(flags["timeout"].rstrip("s"))  # urllib gives up before Docker kills the check


@pytest.mark.slow  # a server of its own, stopped to see the check fail
def test_healthcheck_passes_on_a_live_server_and_fails_once_it_is_gone(tiny_checkpoint: Path) -> None:
    _, argv = _healthcheck()
    probe = [sys.executable, *argv[1:]]
    with serve_policy(tiny_checkpoint, "--steps", "2") as server:
        env = {**os.environ, C.ENV_PORT: str(server.port)}
        ok = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=30)
        assert ok.returncode == 0, ok.stderr
        server.stop()
    gone = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=30)
    assert gone.returncode != 0
