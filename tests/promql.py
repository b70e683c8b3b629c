"""What a PromQL expression reads: its series selectors (metric name and the labels matched)
and the labels it groups by, for tests/test_dashboard.py to check against a daemon's metrics.

A small scanner, not a PromQL parser: strings are skipped whole (so ``{`` or ``(`` inside a
label value mean nothing), ``[...]`` ranges too (``5m``, ``$__rate_interval``); an
identifier followed by ``(`` is a function or an aggregation, unless it opens a label list
(``by``, ``without``, ``on``, ``ignoring``, ``group_left``, ``group_right``), and one
followed by ``by`` or ``without`` is an aggregation (``sum by (le) (...)``); other
keywords and numbers are skipped; any other identifier is a metric name, and a ``{...}``
right after it holds its matchers. A matcher block with no metric name before it, or
brackets that do not close, is refused (``ValueError``) rather than guessed at.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = LABEL_LISTS | {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
NUMBER = re.compile(r"[0-9.][0-9a-zA-Z_.+-]*")  # 0.99, 1e3, 5m, 0x1f
MATCHER = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*")


@dataclass(frozen=True)
class Selector:
    metric: str
    labels: frozenset[str]  # the labels its matchers name


@dataclass(frozen=True)
class Reads:
    selectors: tuple[Selector, ...]
    grouping: frozenset[str]  # labels named by by/without/on/ignoring/group_left/group_right


def _string_end(expr: str, start: int) -> int:
    """The index after the string literal opening at ``start``."""
    quote, i = expr[start], start + 1
    while i < len(expr):
        if expr[i] == "\\" and quote != "`":
            i += 2
            continue
        if expr[i] == quote:
            return i + 1
        i += 1
    raise ValueError(f"unterminated string at {start} in {expr!r}")


def _matchers(expr: str, start: int) -> tuple[frozenset[str], int]:
    """The labels of the ``{...}`` block opening at ``start``, and the index after it."""
    labels, i = set(), start + 1
    while True:
        while i < len(expr) and expr[i] in " \t\n,":
            i += 1
        if i < len(expr) and expr[i] == "}":
            return frozenset(labels), i + 1
        m = MATCHER.match(expr, i)
        if m is None or m.end() >= len(expr) or expr[m.end()] not in "\"'`":
            raise ValueError(f"cannot read the matchers at {i} in {expr!r}")
        labels.add(m.group(1))
        i = _string_end(expr, m.end())


def _label_list(expr: str, start: int) -> tuple[set[str], int]:
    """The labels of the ``(...)`` list opening at ``start``, and the index after it."""
    end = expr.find(")", start)
    if end < 0:
        raise ValueError(f"unclosed label list at {start} in {expr!r}")
    names = [n.strip() for n in expr[start + 1 : end].split(",") if n.strip()]
    if not all(IDENTIFIER.fullmatch(n) for n in names):
        raise ValueError(f"not a label list: {expr[start : end + 1]!r}")
    return set(names), end + 1


def reads(expr: str) -> Reads:
    selectors: list[Selector] = []
    grouping: set[str] = set()
    i = 0
    while i < len(expr):
        c = expr[i]
        if c in "\"'`":
            i = _string_end(expr, i)
        elif c == "[":
            end = expr.find("]", i)
            if end < 0:
                raise ValueError(f"unclosed range at {i} in {expr!r}")
            i = end + 1
        elif c == "{":
            raise ValueError(f"matchers without a metric name at {i} in {expr!r}")
        elif c.isdigit() or (c == "." and expr[i + 1 : i + 2].isdigit()):
            i = NUMBER.match(expr, i).end()
        elif IDENTIFIER.match(expr, i):
            name = IDENTIFIER.match(expr, i).group()
            i += len(name)
            after = i
            while after < len(expr) and expr[after].isspace():
                after += 1
            opens = after < len(expr) and expr[after] == "("
            following = IDENTIFIER.match(expr, after)
            aggregates = following is not None and following.group() in ("by", "without")  # sum by (...) (...)
            if name in LABEL_LISTS and opens:
                labels, i = _label_list(expr, after)
                grouping |= labels
            elif name in KEYWORDS or opens or aggregates:
                continue  # a keyword, or a function or aggregation: its arguments are scanned on
            elif after < len(expr) and expr[after] == "{":
                labels, i = _matchers(expr, after)
                selectors.append(Selector(name, labels))
            else:
                selectors.append(Selector(name, frozenset()))
        else:
            i += 1  # operators, parentheses, commas, whitespace
    return Reads(tuple(selectors), frozenset(grouping))
