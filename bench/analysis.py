"""Pure helpers of the benchmark: summaries, policy bounds, ``-X importtime`` parsing. No I/O."""

from __future__ import annotations

import itertools
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Median and spread of a sample: n, median, p25/p75 (inclusive quartiles), min, max.

    An empty sample gives n=0 and None everywhere (a measurement that produced nothing is
    reported as such, never as 0).
    """
    vals = sorted(float(v) for v in values)
    if not vals:
        return {"n": 0, "median": None, "p25": None, "p75": None, "min": None, "max": None}
    if len(vals) == 1:
        q1 = q3 = vals[0]
    else:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    return {
        "n": len(vals),
        "median": statistics.median(vals),
        "p25": q1,
        "p75": q3,
        "min": vals[0],
        "max": vals[-1],
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def policy_bounds(interval: float, threshold: int, timeout: float) -> tuple[float, float]:
    """The window a "N consecutive failed ticks" policy can fire in, after the fault starts.

    At best the fault lands just before a tick: that tick is the first failure, and the N-th
    failure comes (N-1) intervals later. At worst it lands just after a tick started (which then
    still passes): the first failing tick is one interval later and the N-th one ends a probe
    timeout after its start: N intervals + one timeout.
    """
    return (threshold - 1) * interval, threshold * interval + timeout


def per_window_rates(samples: Sequence[tuple[float, float]]) -> list[float]:
    """Rates between consecutive (count, total) samples: d(total) / d(count), skipping empty
    windows. E.g. (ticks, cpu_ms) samples give the CPU ms per tick of each window."""
    out = []
    for (c0, t0), (c1, t1) in itertools.pairwise(samples):
        if c1 > c0:
            out.append((t1 - t0) / (c1 - c0))
    return out


# -- python -X importtime ------------------------------------------------------------------------

_IMPORT_RE = re.compile(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s*)(\S+)\s*$")


@dataclass(frozen=True)
class ImportRow:
    module: str
    self_us: int
    cumulative_us: int
    depth: int  # 0: imported directly by the top level (or the -m target's own imports)


def parse_importtime(stderr: str) -> list[ImportRow]:
    """The rows of ``python -X importtime`` output (other stderr lines are ignored)."""
    rows = []
    for line in stderr.splitlines():
        m = _IMPORT_RE.match(line)
        if not m:
            continue
        indent = len(m.group(3)) - 1  # one space after the bar, then two per nesting level
        rows.append(ImportRow(m.group(4), int(m.group(1)), int(m.group(2)), max(indent, 0) // 2))
    return rows


def import_breakdown(rows: Sequence[ImportRow], top: int = 12) -> dict[str, Any]:
    """Total import time, the most expensive top-level imports, and self time per package.

    ``packages`` sums *self* time by the first dotted component (``dns.resolver`` -> ``dns``),
    which answers "what does importing X cost" without double counting nested imports.
    """
    total_us = sum(r.self_us for r in rows)
    by_pkg: dict[str, int] = {}
    for r in rows:
        root = r.module.split(".")[0]
        by_pkg[root] = by_pkg.get(root, 0) + r.self_us
    tops = sorted((r for r in rows if r.depth == 0), key=lambda r: -r.cumulative_us)[:top]
    return {
        "total_ms": total_us / 1000,
        "modules": len(rows),
        "top_level": [
            {
                "module": r.module,
                "cumulative_ms": r.cumulative_us / 1000,
                "self_ms": r.self_us / 1000,
            }
            for r in tops
        ],
        "packages": [
            {"package": k, "self_ms": v / 1000}
            for k, v in sorted(by_pkg.items(), key=lambda kv: -kv[1])[:top]
        ],
    }
