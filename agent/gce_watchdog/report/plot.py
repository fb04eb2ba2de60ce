"""The PNG: an event strip and three data axes on one UTC clock-time axis (matplotlib, the
``report`` extra).

0. the event strip: one horizontal label per marker (phase, start, stop, setup_failed, exit,
   recovered, shutdown, memory_climb, boots, fault windows), laid out in rows so that no two
   labels overlap; markers too close to tell apart share a label;
1. ladder rung per boot (step line) with the threshold line;
2. probe latency per probe (log scale), marker shape by verdict;
3. memory per gauge (GiB) with the pass band (``band_gib`` wide, centred on the gauge's median
   in each boot).

A marker's line crosses every axis (a real shutdown solid red, a dry-run one dashed orange), fault
windows are shaded on every axis. The time axis spans the data (plus 2 %) and reads as clock time
(``HH:MM:SS``; ``MM-DD HH:MM`` past a day), the date in the axis label. Rendered with the Agg
canvas directly (no pyplot: no global figure state, no display needed).
"""

from __future__ import annotations

import importlib
import statistics
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any

from gce_watchdog.lib.extras import install_hint, this_install
from gce_watchdog.poller.cost import boot_intervals
from gce_watchdog.report.model import Marker, Report, is_dry_run
from gce_watchdog.report.text import duration
from gce_watchdog.wire import vocab

WIDTH_PX = 1400
HEIGHT_PX = 1000
DPI = 100
N_AXES = 4  # the event strip and three data axes
_DAY_MS = 86_400_000
_VERDICT_MARKER = {"ok": "o", "fail": "x", "unknown": "^"}
_PROBE_COLOUR = {"metadata": "tab:blue", "egress": "tab:green"}
_MARKER_COLOUR = {
    "phase": "tab:purple",
    "start": "tab:gray",
    "stop": "tab:gray",
    "setup_failed": "tab:orange",
    "exit": "tab:brown",
    "recovered": "tab:green",
    "would_shutdown": "tab:red",
    "preempted": "tab:orange",
    "shutdown": "red",
    "dry_run": "tab:orange",
    "memory_climb": "tab:red",
    "memory_ok": "tab:green",
    "boot": "black",
    "fault": "darkorange",
}
_LABEL_FONT = 7
_LABEL_GAP_PX = 6  # clear space between two labels on one row
_STRIP_ROWS = 6  # label rows in the event strip
# A shared label lists this many markers by name, then "+N": a label is read at a glance.
_CLUSTER_NAMES = 2
# Which markers a shared label names first (lower first): decisions, then failures, then context.
_RANK = {
    "shutdown": 0,
    "dry_run": 0,
    "setup_failed": 1,
    "would_shutdown": 1,
    "preempted": 2,
    "memory_climb": 2,
    "boot": 2,
    "exit": 3,
    "recovered": 3,
    "fault": 3,
    "phase": 4,
}


@dataclass(frozen=True)
class StripLabel:
    """One label in the event strip: the markers it stands for (time order) and its text."""

    x: float  # matplotlib date number of the first marker
    kinds: tuple[str, ...]
    texts: tuple[str, ...]

    @property
    def text(self) -> str:
        shown = " · ".join(self.texts[:_CLUSTER_NAMES])
        more = len(self.texts) - _CLUSTER_NAMES
        return f"{shown} +{more}" if more > 0 else shown


class MatplotlibMissing(RuntimeError):
    """The ``report`` extra is not installed."""


def _mpl() -> Any:
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
    except ImportError:
        hint = install_hint("report", this_install())
        raise MatplotlibMissing(f"the PNG needs matplotlib, not installed: {hint}") from None
    matplotlib.use("Agg", force=True)  # headless whatever MPLBACKEND says
    return matplotlib


def _x(ts_ms: int) -> float:
    """Matplotlib date number (days since 1970-01-01, its default epoch) of a timestamp."""
    return ts_ms / _DAY_MS


def dry_run_shutdown(m: Marker, r: Report) -> bool:
    """A shutdown decided with ``agent.action = "dry-run"``: nothing was powered off."""
    if m.kind == vocab.DRY_RUN_SHUTDOWN:  # since protocol v2: the dry run's own event
        return True
    if m.kind != vocab.SHUTDOWN:
        return False
    for ev in r.actions:
        if ev.boot == m.boot and ev.event == vocab.SHUTDOWN and ev.ts_ms == m.ts_ms:
            return is_dry_run(ev)
    return False


def _title(r: Report) -> str:
    v = r.verdict
    line = f"verdict {v.kind.value} ({'FAILOVER' if v.failover else 'no failover'}): {v.reason}"
    if any(dry_run_shutdown(m, r) for m in r.markers):
        line = "DRY RUN: the agent decided to shut down but powered nothing off\n" + line
    return f"gce-watchdog report: {r.source or '-'}\n" + line[:220]


def figure(r: Report) -> Any:
    """The matplotlib Figure (tests count its axes); raises MatplotlibMissing."""
    _mpl()
    # Typed as Any on purpose: mypy must pass with and without the optional extra installed.
    mdates: Any = importlib.import_module("matplotlib.dates")
    agg: Any = importlib.import_module("matplotlib.backends.backend_agg")
    mfig: Any = importlib.import_module("matplotlib.figure")

    fig = mfig.Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    agg.FigureCanvasAgg(fig)
    axes = fig.subplots(N_AXES, 1, sharex=True, gridspec_kw={"height_ratios": [1.1, 3, 3, 3]})
    ax_s, ax_l, ax_p, ax_m = axes
    fig.suptitle(_title(r), fontsize=10)
    _ladder(ax_l, r)
    _probes(ax_p, r)
    _memory(ax_m, r)
    for ax in axes:
        _shared(ax, r)
    start, end = r.start_ms, r.end_ms
    span_ms = 0
    if start is not None and end is not None:
        span_ms = end - start
        # 2 % each side so the first and last points are not on the frame; 1 s at least so a
        # log of one line still has a visible axis.
        pad = max(span_ms * 0.02, 1_000)
        ax_m.set_xlim(_x(int(start - pad)), _x(int(end + pad)))
        loc = mdates.AutoDateLocator(minticks=4, maxticks=9)
        ax_m.xaxis.set_major_locator(loc)
        fmt = "%H:%M:%S" if span_ms < _DAY_MS else "%m-%d %H:%M"
        ax_m.xaxis.set_major_formatter(mdates.DateFormatter(fmt, tz=UTC))
        first = datetime.fromtimestamp(start / 1000, tz=UTC).strftime("%Y-%m-%d")
        last = datetime.fromtimestamp(end / 1000, tz=UTC).strftime("%Y-%m-%d")
        ax_m.set_xlabel(f"time (UTC), {first}" + (f" .. {last}" if last != first else ""))
    else:
        ax_m.set_xlabel("time (UTC)")
    fig.subplots_adjust(left=0.07, right=0.83, top=0.91, bottom=0.06, hspace=0.12)
    _strip(ax_s, fig, _strip_items(r))
    return fig


def _strip_items(r: Report) -> list[tuple[float, str, str]]:
    """(x, kind, text) of everything the event strip labels, in time order."""
    items: list[tuple[float, str, str]] = []
    for m in r.markers:
        if m.kind in (vocab.SHUTDOWN, vocab.DRY_RUN_SHUTDOWN) and dry_run_shutdown(m, r):
            label = m.label.replace("SHUTDOWN", "would shut down").removesuffix(" dry-run")
            items.append((_x(m.ts_ms), "dry_run", f"DRY RUN: {label}"))
        else:
            items.append((_x(m.ts_ms), m.kind, m.label))
    for i, sec in enumerate(r.sections):
        if i:  # the first boot starts at the left edge anyway
            items.append((_x(sec.info.first_ts_ms), "boot", f"boot {sec.boot}"))
    for w in r.faults:
        items.append((_x(w.start_ms), "fault", f"fault {w.cut}"))
    items.sort(key=lambda t: t[0])
    return items


def layout_strip(
    items: list[tuple[float, str, str]], width_of: Any, x_px: Any, right_px: float, rows: int
) -> list[tuple[StripLabel, int]]:
    """Labels and their rows, no two overlapping on a row.

    ``width_of(text)`` measures a label in pixels, ``x_px(x)`` places a date number in pixels.
    Markers closer than ``merge_px`` share a label; if the labels do not fit in ``rows`` rows,
    ``merge_px`` doubles and the layout starts over (at worst one label for everything: it
    always ends). Every marker is in exactly one label.
    """
    merge_px = 2.0
    while True:
        clusters: list[list[tuple[float, str, str]]] = []
        for it in items:
            if clusters and x_px(it[0]) - x_px(clusters[-1][0][0]) <= merge_px:
                clusters[-1].append(it)
            else:
                clusters.append([it])
        labels = []
        for c in clusters:
            ranked = sorted(c, key=lambda it: _RANK.get(it[1], 5))  # stable: time order within
            labels.append(
                StripLabel(c[0][0], tuple(k for _, k, _ in ranked), tuple(t for _, _, t in ranked))
            )
        row_end = [float("-inf")] * rows
        placed: list[tuple[StripLabel, int]] = []
        for lab in labels:
            x0 = x_px(lab.x)
            w = width_of(lab.text)
            if x0 + w > right_px:  # near the right edge: the label ends at its marker
                x0 -= w
            row = next((k for k in range(rows) if x0 >= row_end[k] + _LABEL_GAP_PX), None)
            if row is None:
                break
            row_end[row] = x0 + w
            placed.append((lab, row))
        else:
            return placed
        merge_px *= 2


def _strip(ax: Any, fig: Any, items: list[tuple[float, str, str]]) -> None:
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_ylabel("events", rotation=0, ha="right", va="center")
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    if not items:
        ax.text(0.5, 0.5, "no marker event", transform=ax.transAxes, ha="center", color="gray")
        return
    renderer = fig.canvas.get_renderer()
    to_px = ax.transData.transform
    probe = ax.text(0, 0, "", fontsize=_LABEL_FONT)

    def width_of(s: str) -> float:
        probe.set_text(s)
        return float(probe.get_window_extent(renderer).width) + 2

    def x_px(x: float) -> float:
        return float(to_px((x, 0.5))[0])

    right = float(ax.get_window_extent(renderer).x1)
    placed = layout_strip(items, width_of, x_px, right, _STRIP_ROWS)
    inv = ax.transData.inverted()
    for lab, row in placed:
        x0 = x_px(lab.x)
        w = width_of(lab.text)
        left = x0 - w if x0 + w > right else x0 + 1
        y = 1 - (row + 0.5) / _STRIP_ROWS
        colour = _MARKER_COLOUR.get(lab.kinds[0], "tab:gray")
        ax.text(
            float(inv.transform((left, 0))[0]),
            y,
            lab.text,
            fontsize=_LABEL_FONT,
            color=colour,
            va="center",
            ha="left",
            gid="marker-label",
        )
    probe.remove()


# What it cost, as bands along the bottom of the ladder axis (docs/report.md, "What it cost").
COST_BANDS = (
    ("useful", "tab:green"),
    ("ladder", "tab:orange"),
    ("linger", "tab:red"),
    ("zombie", "tab:gray"),
)


def _cost_bands(ax: Any, r: Report) -> None:
    total = r.total_cost
    for cat, colour in COST_BANDS:
        spans = [iv for f in r.costs for iv in boot_intervals(f)[cat]]
        secs = getattr(total, cat)
        for i, (a, b) in enumerate(spans):
            label = f"{cat} {duration(int(secs * 1000))}" if i == 0 else None
            x0, x1 = _x(int(a * 1000)), _x(int(b * 1000))
            ax.axvspan(x0, x1, ymin=0, ymax=0.07, color=colour, alpha=0.6, lw=0, label=label)


def _ladder(ax: Any, r: Report) -> None:
    ax.set_ylabel("ladder rung")
    _cost_bands(ax, r)
    by_boot: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for p in r.rungs:
        by_boot[p.boot].append((_x(p.ts_ms), p.rung))
    for i, pts in enumerate(by_boot.values()):
        xs, ys = zip(*pts, strict=True)
        ax.step(xs, ys, where="post", color="tab:red", lw=1.5, label="rung" if i == 0 else None)
        ax.plot(xs, ys, ".", color="tab:red", ms=3)
    thr = r.threshold
    if thr is not None:
        ax.axhline(thr, color="black", ls="--", lw=1, label=f"threshold {thr}")
        ax.set_ylim(-0.5, thr + 1.5)
    if not r.rungs:
        ax.text(0.5, 0.5, "no rung in any line", transform=ax.transAxes, ha="center", color="gray")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def _probes(ax: Any, r: Report) -> None:
    ticker: Any = importlib.import_module("matplotlib.ticker")
    ax.set_ylabel("probe latency (ms)")
    ax.set_yscale("log")
    drawn = False
    for probe in ("metadata", "egress"):
        pts = [p for p in r.probes if p.probe == probe and p.latency_ms is not None]
        if not pts:
            continue
        drawn = True
        c = _PROBE_COLOUR[probe]
        xs = [_x(p.ts_ms) for p in pts]
        ys = [max(p.latency_ms or 0, 1) for p in pts]  # log scale: 0 ms drawn at 1 ms
        for boot in dict.fromkeys(p.boot for p in pts):  # no line across a reboot
            seg = [(x, y) for x, y, p in zip(xs, ys, pts, strict=True) if p.boot == boot]
            bx, by = zip(*seg, strict=True)
            ax.plot(bx, by, "-", color=c, lw=0.6, alpha=0.6)
        for verdict, marker in _VERDICT_MARKER.items():
            sel = [(x, y) for x, y, p in zip(xs, ys, pts, strict=True) if p.verdict == verdict]
            if sel:
                sx, sy = zip(*sel, strict=True)
                ax.plot(sx, sy, marker, color=c, ms=4, ls="none", label=f"{probe} {verdict}")
    # Fixed decades from 1 ms to past the 5 s probe timeout, plain numbers: a fast path and a
    # timeout both stay readable on one scale.
    top = max([p.latency_ms or 0 for p in r.probes] + [10_000])
    ax.set_ylim(0.8, top * 1.5)
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    if not drawn:
        ax.text(
            0.5,
            0.5,
            "no probe latency in any line",
            transform=ax.transAxes,
            ha="center",
            color="gray",
        )
    else:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def _memory(ax: Any, r: Report) -> None:
    ax.set_ylabel("memory (GiB)")
    series: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for p in r.memory:
        series[p.gauge][p.boot].append((_x(p.ts_ms), p.gib))
    colours = [
        "tab:blue",
        "tab:orange",
        "tab:green",
        "tab:purple",
        "tab:brown",
        "tab:pink",
        "tab:olive",
        "tab:cyan",
        "tab:gray",
        "tab:red",
    ]
    for i, (gauge, boots) in enumerate(sorted(series.items())):
        c = colours[i % len(colours)]
        for j, pts in enumerate(boots.values()):
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, ".-", color=c, lw=1, ms=3, label=gauge if j == 0 else None)
            mid = statistics.median(ys)
            half = r.band_gib / 2
            # one sample: a band 1 s wide, visible without stretching the axis
            one = 0.5 / 86_400
            lo, hi = (xs[0], xs[-1]) if len(xs) > 1 else (xs[0] - one, xs[0] + one)
            ax.fill_between(
                [lo, hi],
                mid - half,
                mid + half,
                color=c,
                alpha=0.12,
                lw=0,
                label=f"pass band {r.band_gib:g} GiB" if i == 0 and j == 0 else None,
            )
    if not series:
        ax.text(
            0.5, 0.5, "no mem line in this log", transform=ax.transAxes, ha="center", color="gray"
        )
    else:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def _shared(ax: Any, r: Report) -> None:
    """Fault windows, boot lines and marker lines on one axis (their labels: the event strip)."""
    for w in r.faults:
        ax.axvspan(_x(w.start_ms), _x(w.end_ms), color="tab:orange", alpha=0.15, lw=0)
    for i, sec in enumerate(r.sections):
        if i:
            ax.axvline(_x(sec.info.first_ts_ms), color="black", ls="--", lw=0.8)
    for m in r.markers:
        if m.kind == vocab.SHUTDOWN:
            if dry_run_shutdown(m, r):
                ax.axvline(_x(m.ts_ms), color=_MARKER_COLOUR["dry_run"], ls="--", lw=1.5)
            else:
                ax.axvline(_x(m.ts_ms), color="red", lw=1.8)
        else:
            ax.axvline(_x(m.ts_ms), color=_MARKER_COLOUR.get(m.kind, "tab:gray"), ls=":", lw=1)
    ax.grid(True, alpha=0.3)


def write_png(r: Report, out: IO[bytes]) -> None:
    """Render the report as a WIDTH_PX x HEIGHT_PX PNG into ``out``."""
    fig = figure(r)
    fig.savefig(out, format="png", dpi=DPI)
