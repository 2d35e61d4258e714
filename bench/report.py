"""Where every benchmark's table goes: written under bench/results/ (or ``--out``) and printed, the same way."""

from __future__ import annotations

from pathlib import Path


def publish(lines: list[str], out: str | Path) -> None:
    """Write the markdown ``lines`` to ``out`` (folders created) and print them."""
    text = "\n".join(lines)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
