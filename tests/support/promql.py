"""What a PromQL query needs from /metrics: its metric names and the labels it matches, groups and joins on.

Queries are parsed by ``promql-parser`` (a binding of the Rust PromQL parser
used by GreptimeDB), never by regular expressions, so a query that does not
parse fails its test, and a label in ``by (...)`` is found as surely as one in
a selector.  Grafana's ``$variables`` and prometheus-adapter's ``<<.Templates>>``
are substituted first with values of the right syntax.

Labels a query may use without the server exporting them are the ones the
scrape adds: the chart's ServiceMonitor goes through the PolicyServer's
Service, and the Prometheus Operator then labels every sample with
``namespace``, ``service``, ``pod``, ``container`` and ``endpoint``, plus
``job`` (the ServiceMonitor's ``jobLabel``) and ``instance``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import promql_parser

SCRAPE_LABELS = frozenset({"namespace", "service", "pod", "container", "endpoint", "job", "instance"})

# Grafana's built-in interval variables -> a valid duration; template variables -> a valid label value
_INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
_VARIABLE = re.compile(r"\$\{?(\w+)(?::\w+)?\}?")


def substitute_grafana(expr: str) -> str:
    for name, value in _INTERVALS.items():
        expr = expr.replace(name, value)
    return _VARIABLE.sub(lambda m: f"value_of_{m.group(1)}", expr)


@dataclass
class Usage:
    """Per metric name: the labels its selectors match on; and labels used to group or join, per subexpression."""

    selectors: dict[str, set[str]] = field(default_factory=dict)
    groupings: list[tuple[frozenset[str], frozenset[str]]] = field(default_factory=list)  # (labels, metrics below)

    def metrics(self) -> set[str]:
        return set(self.selectors)


def _children(node: object) -> Iterator[object]:
    for attr in ("lhs", "rhs", "expr", "param"):
        child = getattr(node, attr, None)
        if child is not None and not isinstance(child, (str, int, float)):
            yield child
    if isinstance(node, promql_parser.Call):
        yield from node.args
    if isinstance(node, promql_parser.MatrixSelector):
        yield node.vector_selector


def _metrics_below(node: object) -> set[str]:
    if isinstance(node, promql_parser.VectorSelector):
        return {node.name} if node.name else set()
    found: set[str] = set()
    for child in _children(node):
        found |= _metrics_below(child)
    return found


def _walk(node: object, usage: Usage) -> None:
    if isinstance(node, promql_parser.VectorSelector):
        if not node.name:
            raise AssertionError(f"selector without a metric name: {node}")
        matched = {m.name for m in node.matchers.matchers} - {"__name__"}
        usage.selectors.setdefault(node.name, set()).update(matched)
        return
    labels: set[str] = set()
    if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
        labels |= set(node.modifier.labels)
    if isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
        modifier = node.modifier
        if modifier.matching is not None:
            labels |= set(modifier.matching.labels)
        labels |= set(modifier.group_labels or [])
    if isinstance(node, promql_parser.Call) and node.func.name in ("label_replace", "label_join"):
        # label_replace(v, dst, replacement, src, regex) reads src; label_join(v, dst, sep, src...) reads every src
        sources = node.args[3:4] if node.func.name == "label_replace" else node.args[3:]
        labels |= {arg.val for arg in sources}
    if labels:
        usage.groupings.append((frozenset(str(label) for label in labels), frozenset(_metrics_below(node))))
    for child in _children(node):
        _walk(child, usage)


def usage(expr: str, into: Usage | None = None) -> Usage:
    """Parse ``expr`` (raises ValueError when it is not PromQL) and collect what it uses."""
    found = into if into is not None else Usage()
    _walk(promql_parser.parse(expr), found)
    return found


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.+),\s*)?(\w+)\s*\)\s*$")


def variable_usage(query: str, into: Usage) -> None:
    """A Grafana Prometheus variable: ``label_values(SELECTOR, label)`` or a plain query."""
    match = _LABEL_VALUES.match(query)
    if match is None:
        usage(query, into)
        return
    selector, label = match.groups()
    if selector is None:
        raise AssertionError(f"label_values({label}) without a metric reads every series: {query}")
    usage(selector, into)
    into.groupings.append((frozenset({label}), frozenset(_metrics_below(promql_parser.parse(selector)))))


def exported_labels(metrics_text: str) -> dict[str, set[str]]:
    """Sample name (``x_bucket``, ``x_total``, ...) -> the label names its samples carry, from /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def problems(found: Usage, exported: Mapping[str, set[str]]) -> list[str]:
    """Everything ``found`` uses that a scrape of a server exporting ``exported`` would not have."""
    out = []
    for metric, labels in sorted(found.selectors.items()):
        if metric not in exported:
            out.append(f"metric {metric} is not exported")
            continue
        extra = labels - exported[metric] - SCRAPE_LABELS
        if extra:
            out.append(f"{metric} has no label(s) {sorted(extra)}")
    for grouped, metrics in found.groupings:
        available = set(SCRAPE_LABELS).union(*(exported.get(m, set()) for m in metrics))
        extra = set(grouped) - available
        if extra:
            out.append(f"grouping by {sorted(extra)} over {sorted(metrics)}: no such label")
    return out
