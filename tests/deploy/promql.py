"""Just enough PromQL handling for the live test: Grafana variables, operands, metric names."""

from __future__ import annotations

import re

# Grafana's built-in interval variables, replaced with a window that holds many 1 s scrapes and
# the test's requests.
GRAFANA_INTERVALS = {
    "__rate_interval": "2m",
    "__interval": "2m",
    "__range": "2m",
    "__range_s": "120",
}

_SET_OP = re.compile(
    r"(?<![\w])(?:or|and|unless)(?![\w])\s*"
    r"(?:(?:on|ignoring)\s*\([^)]*\)\s*)?(?:group_(?:left|right)\s*(?:\([^)]*\))?\s*)?"
)
_CMP_OP = re.compile(
    r"(?:==|!=|>=|<=|>|<)\s*(?:bool\s+)?"
    r"(?:(?:on|ignoring)\s*\([^)]*\)\s*)?(?:group_(?:left|right)\s*(?:\([^)]*\))?\s*)?"
)
_LITERAL = re.compile(r"[\d.eE+\-*/%^()\s]+")


def substitute_grafana(expr: str) -> str:
    """Replace $__rate_interval & co. with 2m and dashboard variables ($namespace, ${pod}) with .*.

    The dashboard uses its variables only inside =~ matchers, where .* selects everything.
    """
    return re.sub(
        r"\$\{?(\w+)(?::\w+)?\}?", lambda m: GRAFANA_INTERVALS.get(m.group(1), ".*"), expr
    )


def _split_top_level(expr: str, op: re.Pattern) -> list[str]:
    """Split at `op` where it occurs outside (), [], {} and string literals."""
    parts, depth, start, i, quote = [], 0, 0, 0, None
    while i < len(expr):
        ch = expr[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = None
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and (m := op.match(expr, i)):
            parts.append(expr[start:i])
            i = start = m.end()
            continue
        i += 1
    parts.append(expr[start:])
    return [p.strip() for p in parts]


def _strip_parens(expr: str) -> str:
    while expr.startswith("(") and expr.endswith(")"):
        depth = 0
        for i, ch in enumerate(expr):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0 and i < len(expr) - 1:
                return expr  # the first "(" closes before the end: not one wrapping pair
        expr = expr[1:-1].strip()
    return expr


def operands(expr: str) -> list[str]:
    """The non-literal sides of an alert's set operators (or/and/unless) and comparisons.

    `a > 0.9` -> [a]; `deriv(q[10m]) > 0 and q > 64` -> [deriv(q[10m]), q]. These are what an
    alert compares, so they have data whenever the metrics exist, firing or not.
    """
    out = []
    for part in _split_top_level(_strip_parens(expr.strip()), _SET_OP):
        for side in _split_top_level(_strip_parens(part), _CMP_OP):
            side = _strip_parens(side)
            if side and not _LITERAL.fullmatch(side):
                out.append(side)
    return out


def metric_names(expr: str) -> set[str]:
    """Our metrics (prefill_*) and `up` referenced by an expression."""
    return set(re.findall(r"\b(prefill_\w+|up)\b(?!\s*\()", expr))


def foreign_metrics(expr: str) -> set[str]:
    """Metrics from other exporters (kube-state-metrics' kube_*) that a test of the service alone
    cannot have."""
    return set(re.findall(r"\b(kube_\w+)\b", expr))


def selectors(expr: str) -> list[tuple[str, list[str]]]:
    """(metric name, label names matched) for each `name{...}` selector."""
    return [
        (name, re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body))
        for name, body in re.findall(r"\b([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", expr)
    ]
