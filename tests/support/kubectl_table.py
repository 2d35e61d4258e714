"""``kubectl get`` output read as a table: cells cut at the header's column offsets, since a cell may be empty
(a printer column with no value) and whitespace splitting would shift every cell after it."""

from __future__ import annotations


def table(text: str) -> list[dict[str, str]]:
    """``kubectl get`` output as rows of header -> cell."""
    header, *rows = text.splitlines()
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return [{header[a:b].strip(): row[a:b].strip() for a, b in bounds} for row in rows]
