"""A strict parser for the Prometheus text exposition format (0.0.4), for the exporter's tests:
raises AssertionError on anything the format does not allow."""

from __future__ import annotations

import re

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r"[a-zA-Z_][a-zA-Z0-9_]*"
_SAMPLE_RE = re.compile(rf"({_NAME})(?:\{{(.*)\}})? (\S+)\Z")
_LABEL_RE = re.compile(rf'({_LABEL})="((?:[^"\\\n]|\\\\|\\"|\\n)*)"(,|\Z)')
_TYPES = {"counter", "gauge", "untyped", "summary", "histogram"}

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), v)


def parse_prom(text: str) -> tuple[Series, dict[str, str]]:
    """Samples and types; raises AssertionError on anything the format does not allow (no
    timestamps either: node_exporter's textfile collector rejects them)."""
    assert text.endswith("\n"), "the file must end with a newline"
    types: dict[str, str] = {}
    helps: set[str] = set()
    series: Series = {}
    last_family = None
    for n, line in enumerate(text[:-1].split("\n"), 1):
        assert line == line.strip() and line, f"line {n}: blank or padded"
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            assert re.fullmatch(_NAME, name) and help_text, f"line {n}: bad HELP"
            assert name not in helps, f"line {n}: second HELP for {name}"
            helps.add(name)
            continue
        if line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert kind in _TYPES and name not in types, f"line {n}: bad TYPE"
            assert not any(k[0] == name for k in series), f"line {n}: TYPE after samples"
            types[name] = kind
            continue
        assert not line.startswith("#"), f"line {n}: stray comment"
        m = _SAMPLE_RE.match(line)
        assert m, f"line {n}: not a sample: {line!r}"
        name, labels_s, value_s = m.groups()
        assert name in types, f"line {n}: {name} has no TYPE"
        assert name in helps, f"line {n}: {name} has no HELP"
        if types[name] == "counter":
            assert name.endswith("_total"), f"line {n}: counter {name} without _total"
        if last_family is not None and last_family != name:
            assert not any(k[0] == name for k in series), f"line {n}: {name} not grouped"
        last_family = name
        labels: list[tuple[str, str]] = []
        rest = labels_s or ""
        while rest:
            lm = _LABEL_RE.match(rest)
            assert lm, f"line {n}: bad labels {rest!r}"
            labels.append((lm.group(1), _unescape(lm.group(2))))
            rest = rest[lm.end() :]
        assert len({k for k, _ in labels}) == len(labels), f"line {n}: duplicate label"
        value = float(value_s.replace("+Inf", "inf").replace("-Inf", "-inf"))
        key = (name, frozenset(labels))
        assert key not in series, f"line {n}: duplicate series"
        series[key] = value
    return series, types
