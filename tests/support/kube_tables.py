"""Server-side printing: the ``Table`` responses ``kubectl get`` asks for.

kubectl sends ``Accept: application/json;as=Table;g=meta.k8s.io;v=v1`` and
prints whatever columns the server returns; a CRD's
``additionalPrinterColumns`` only show up if the server evaluates them.  This
follows apiextensions-apiserver's table convertor: a Name column, then the
CRD's columns (or ``Age`` when it declares none), cells typed per column and
dates rendered as a human age ("5m3s").  The JSONPath subset covers what CRDs
use: ``.a.b``, ``[0]``, ``[*]``, ``['dotted.key']`` and ``[?(@.type=="Ready")]``.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterable
from typing import Any

_TOKEN = re.compile(
    r"""\.(?P<field>[A-Za-z0-9_\-]+)
      | \[(?P<index>-?\d+|\*)\]
      | \[\?\(@\.(?P<fpath>[A-Za-z0-9_.\-]+)\s*(?P<fop>==|!=)\s*(?P<fval>"[^"]*"|'[^']*'|[^)\s]+)\s*\)\]
      | \[['"](?P<quoted>[^'"]+)['"]\]
      | (?P<star>\.\*)""",
    re.VERBOSE,
)

NAME_COLUMN = {
    "name": "Name",
    "type": "string",
    "format": "name",
    "priority": 0,
    "description": "Name must be unique within a namespace.",
}
AGE_COLUMN = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp", "description": "", "priority": 0}


def check_jsonpath(expr: str) -> None:
    """Raise ValueError for an expression outside the supported subset (so a CRD is rejected, not mis-printed)."""
    _tokens(expr)


def _tokens(expr: str) -> list[re.Match[str]]:
    text = expr.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1].strip()
    text = text.removeprefix("$")
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ValueError(f"unsupported JSONPath {expr!r} at {text[pos:]!r}")
        tokens.append(m)
        pos = m.end()
    return tokens


def jsonpath_values(obj: Any, expr: str) -> list[Any]:
    """All values the expression selects, in document order."""
    current = [obj]
    for tok in _tokens(expr):
        found: list[Any] = []
        for value in current:
            if tok["field"] or tok["quoted"]:
                key = tok["field"] or tok["quoted"]
                if isinstance(value, dict) and key in value:
                    found.append(value[key])
            elif tok["index"] == "*" or tok["star"]:
                found.extend(value if isinstance(value, list) else value.values() if isinstance(value, dict) else [])
            elif tok["index"] is not None:
                index = int(tok["index"])
                if isinstance(value, list) and -len(value) <= index < len(value):
                    found.append(value[index])
            elif isinstance(value, list):
                wanted = tok["fval"].strip("'\"")
                for item in value:
                    got = jsonpath_values(item, "." + tok["fpath"])
                    equal = bool(got) and _scalar(got[0]) == wanted
                    if equal == (tok["fop"] == "=="):
                        found.append(item)
        current = found
    return current


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value)


def human_duration(seconds: float) -> str:
    """k8s.io/apimachinery's duration.HumanDuration, which kubectl shows in AGE columns."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes, hours, days = s // 60, s // 3600, s // 86400
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{days}d" if hours % 24 == 0 else f"{days}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{days}d"
    years = days // 365
    if hours < 24 * 365 * 8:
        return f"{years}y" if days % 365 == 0 else f"{years}y{days % 365}d"
    return f"{years}y"


def _cell(column: dict[str, Any], obj: dict[str, Any]) -> Any:
    values = jsonpath_values(obj, column["jsonPath"])
    if not values or values[0] is None:
        return None
    value, kind = values[0], column.get("type", "string")
    if kind == "date":
        try:
            stamp = datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            return "<invalid>"
        return human_duration((datetime.datetime.now(datetime.timezone.utc) - stamp).total_seconds())
    if kind == "integer":
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if kind == "number":
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if kind == "boolean":
        return value if isinstance(value, bool) else None
    return value if isinstance(value, str) else _scalar(value)


def table(
    objs: Iterable[dict[str, Any]], columns: list[dict[str, Any]], resource_version: str, include_object: str = "Metadata"
) -> dict[str, Any]:
    """A meta.k8s.io/v1 Table; ``include_object`` is the request's includeObject (None|Metadata|Object)."""
    columns = columns or [AGE_COLUMN]
    rows = []
    for obj in objs:
        row: dict[str, Any] = {"cells": [obj.get("metadata", {}).get("name")] + [_cell(c, obj) for c in columns]}
        if include_object == "Object":
            row["object"] = obj
        elif include_object != "None":
            row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata", {})}
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": [NAME_COLUMN]
        + [
            {
                "name": c["name"],
                "type": c.get("type", "string"),
                "format": c.get("format", ""),
                "description": c.get("description", ""),
                "priority": c.get("priority", 0),
            }
            for c in columns
        ],
        "rows": rows,
    }
