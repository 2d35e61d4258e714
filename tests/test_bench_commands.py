"""Every benchmark command the docs give to reproduce a result parses with that benchmark's own options.

A results table is only as good as its reproduce line, and a benchmark's flags change with it: a renamed flag
that argparse still takes as an abbreviation of another (``--lerobot-compile`` for ``--lerobot-compile-only``)
runs something else than the table says.  Each ``python bench/NAME.py ...`` of docs/ and the README runs as the
script itself, up to its argument parser (the parser's answer ends the run there), and every ``--option``
written must be one of the parser's own, spelled out.  The device scripts (bench/*.sh), whose broken line costs
a device call, are held to the same spelling: every ``--option`` written after a benchmark's name is one of its
own (their shell variables and arrays are not expanded here).
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"`python3? (bench/[a-z_0-9]+\.py)((?: [^`]*)?)`")


def _commands() -> list[tuple[str, str, str]]:
    """(doc, script, arguments) of every benchmark command written out in full (an elided one, ``...``, is not)."""
    found: set[tuple[str, str, str]] = set()
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for match in COMMAND.finditer(doc.read_text()):
            if "..." not in match.group(2):
                found.add((doc.relative_to(REPO).as_posix(), match.group(1), match.group(2).strip()))
    return sorted(found)


COMMANDS = _commands()
SHELL_COMMAND = re.compile(r'python3? "\$\w+/(bench/[a-z_0-9]+\.py)"(.*)')


def _shell_commands() -> list[tuple[str, str, list[str]]]:
    """(script, benchmark, its --options as written) of every benchmark a device script runs."""
    found: list[tuple[str, str, list[str]]] = []
    for script in sorted((REPO / "bench").glob("*.sh")):
        text = script.read_text().replace("\\\n", " ")  # one logical line per command
        for match in SHELL_COMMAND.finditer(text):
            rest = re.split(r"\s(?:\||&&|\|\||;|>|2>)\s?", match.group(2))[0]
            try:
                tokens = shlex.split(rest, comments=True)
            except ValueError:  # an unbalanced quote of a $(...) the split cut: check what comes before it
                tokens = shlex.split(rest.split("$(")[0], comments=True)
            options = [t.split("=", 1)[0] for t in tokens if t.startswith("--") and " " not in t and "$" not in t]
            found.append((script.relative_to(REPO).as_posix(), match.group(1), options))
    return found


SHELL_COMMANDS = _shell_commands()


class _Parsed(Exception):  # noqa: N818 - not an error: the script got as far as its parser's answer
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _options(parser: argparse.ArgumentParser) -> set[str]:
    options: set[str] = set()
    for action in parser._actions:  # noqa: SLF001 - argparse keeps no public list of a parser's options
        options.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in action.choices.values():
                options |= _options(sub)
    return options


def _parser(script: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """``script``'s argument parser: the script runs as ``__main__`` until it asks that parser for its arguments."""

    def parse_args(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> object:
        raise _Parsed(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        patch.setattr(sys, "argv", [str(REPO / script)])
        patch.syspath_prepend(str(REPO / "bench"))
        with pytest.raises(_Parsed) as parsed:
            runpy.run_path(str(REPO / script), run_name="__main__")
    return parsed.value.parser


def _parse(script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """``script``'s parser once it parsed ``argv`` (its errors exit 2)."""
    parser = _parser(script, monkeypatch)
    parser.parse_args(argv)
    return parser


def test_the_docs_give_benchmark_commands() -> None:
    assert len(COMMANDS) >= 10 and any(script == "bench/runtime.py" for _, script, _ in COMMANDS), COMMANDS


@pytest.mark.parametrize(("doc", "script", "args"), COMMANDS, ids=[f"{d}:{s} {a}"[:90] for d, s, a in COMMANDS])
def test_a_documented_benchmark_command_parses(
    doc: str, script: str, args: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (REPO / script).is_file(), f"{doc} runs {script}, which does not exist"
    argv = shlex.split(args)
    try:
        parser = _parse(script, argv, monkeypatch)
    except SystemExit as exc:
        pytest.fail(f"{doc}: `python {script} {args}` is refused by its parser (exit {exc.code})")
    options = _options(parser)
    written = {a.split("=", 1)[0] for a in argv if a.startswith("--") and " " not in a}  # not a quoted value
    assert written <= options, f"{doc}: {sorted(written - options)} not an option of {script} (abbreviated?)"


def test_the_device_scripts_run_benchmarks() -> None:
    assert any(b == "bench/lerobot_kernels.py" and "--variants" in o for _, b, o in SHELL_COMMANDS), SHELL_COMMANDS


@pytest.mark.parametrize(
    ("script", "benchmark", "options"), SHELL_COMMANDS, ids=[f"{s}:{b}" for s, b, _ in SHELL_COMMANDS]
)
def test_a_device_script_spells_out_its_benchmarks_options(
    script: str, benchmark: str, options: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (REPO / benchmark).is_file(), f"{script} runs {benchmark}, which does not exist"
    own = _options(_parser(benchmark, monkeypatch))
    assert set(options) <= own, f"{script}: {sorted(set(options) - own)} not an option of {benchmark} (abbreviated?)"


def test_a_wrong_or_abbreviated_option_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        _parse("bench/start.py", ["--no-such-option"], monkeypatch)
    parser = _parse("bench/start.py", ["--dep", "1"], monkeypatch)  # argparse takes the abbreviation...
    assert "--dep" not in _options(parser) and "--depth" in _options(parser)  # ...this test does not
