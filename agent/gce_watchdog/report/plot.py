"""The PNG: three stacked axes on one UTC time axis (matplotlib, the ``report`` extra).

1. ladder rung per boot (step line) with the threshold line;
2. probe latency per probe (log scale), marker shape by verdict;
3. memory per gauge (GiB) with the pass band (``band_gib`` wide, centred on the gauge's median
   in each boot) and ``memory_climb`` markers.

On every axis: shaded fault-injection windows, a dashed line at each boot, a red line at a
shutdown; phase changes and other key events are marked on the ladder axis. Rendered with the Agg
canvas directly (no pyplot: no global figure state, no display needed).
"""

from __future__ import annotations

import importlib
import statistics
from collections import defaultdict
from typing import IO, Any

from gce_watchdog.report.model import Report

WIDTH_PX = 1400
HEIGHT_PX = 1000
DPI = 100
N_AXES = 3
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
}


class MatplotlibMissing(RuntimeError):
    """The ``report`` extra is not installed."""


def _mpl() -> Any:
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
    except ImportError:
        raise MatplotlibMissing(
            "the PNG needs matplotlib: pip install 'gce-watchdog[report]'"
        ) from None
    matplotlib.use("Agg", force=True)  # headless whatever MPLBACKEND says
    return matplotlib


def _x(ts_ms: int) -> float:
    """Matplotlib date number (days since 1970-01-01, its default epoch) of a timestamp."""
    return ts_ms / _DAY_MS


def figure(r: Report) -> Any:
    """The matplotlib Figure (tests count its axes); raises MatplotlibMissing."""
    _mpl()
    # Typed as Any on purpose: mypy must pass with and without the optional extra installed.
    mdates: Any = importlib.import_module("matplotlib.dates")
    agg: Any = importlib.import_module("matplotlib.backends.backend_agg")
    mfig: Any = importlib.import_module("matplotlib.figure")

    fig = mfig.Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    agg.FigureCanvasAgg(fig)
    axes = fig.subplots(N_AXES, 1, sharex=True, gridspec_kw={"height_ratios": [3, 3, 3]})
    ax_l, ax_p, ax_m = axes
    v = r.verdict
    fig.suptitle(
        f"gce-watchdog report: {r.source or '-'}\nverdict {v.kind.value}"
        f" ({'FAILOVER' if v.failover else 'no failover'}): {v.reason}"[:220],
        fontsize=10,
    )
    _ladder(ax_l, r)
    _probes(ax_p, r)
    _memory(ax_m, r)
    for ax in axes:
        _shared(ax, r)
    start, end = r.start_ms, r.end_ms
    if start is not None and end is not None:
        pad = max((end - start) * 0.02, 30_000)
        ax_m.set_xlim(_x(int(start - pad)), _x(int(end + pad)))
        loc = mdates.AutoDateLocator()
        ax_m.xaxis.set_major_locator(loc)
        ax_m.xaxis.set_major_formatter(mdates.ConciseDateFormatter(loc))
    ax_m.set_xlabel("time (UTC)")
    fig.subplots_adjust(left=0.07, right=0.83, top=0.92, bottom=0.06, hspace=0.12)
    return fig


def _ladder(ax: Any, r: Report) -> None:
    ax.set_ylabel("ladder rung")
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
    ymax = (thr if thr is not None else 10) + 1
    for m in r.markers:
        if m.kind in ("shutdown", "memory_climb", "memory_ok"):
            continue  # shutdown: a line on every axis; memory: on the memory axis
        c = _MARKER_COLOUR.get(m.kind, "tab:gray")
        ax.axvline(_x(m.ts_ms), color=c, ls=":", lw=1)
        ax.text(
            _x(m.ts_ms),
            ymax,
            m.label,
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color=c,
            clip_on=True,
        )
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
            lo, hi = (xs[0], xs[-1]) if len(xs) > 1 else (xs[0] - 1e-4, xs[0] + 1e-4)
            ax.fill_between(
                [lo, hi],
                mid - half,
                mid + half,
                color=c,
                alpha=0.12,
                lw=0,
                label=f"pass band {r.band_gib:g} GiB" if i == 0 and j == 0 else None,
            )
    climbs = [m for m in r.markers if m.kind == "memory_climb"]
    for m in climbs:
        ax.axvline(_x(m.ts_ms), color="tab:red", ls=":", lw=1)
        ax.text(
            _x(m.ts_ms),
            1.0,
            m.label,
            transform=ax.get_xaxis_transform(),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color="tab:red",
        )
    if not series:
        ax.text(
            0.5, 0.5, "no mem line in this log", transform=ax.transAxes, ha="center", color="gray"
        )
    else:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def _shared(ax: Any, r: Report) -> None:
    for k, w in enumerate(r.faults):
        ax.axvspan(_x(w.start_ms), _x(w.end_ms), color="tab:orange", alpha=0.15, lw=0)
        if k < 8:  # labels beyond a handful only clutter; the table lists them all
            ax.text(
                _x(w.start_ms),
                0.02,
                f"fault {w.cut}",
                transform=ax.get_xaxis_transform(),
                fontsize=7,
                color="tab:orange",
                va="bottom",
            )
    for i, sec in enumerate(r.sections):
        if i:  # the first boot's start is the left edge anyway
            ax.axvline(_x(sec.info.first_ts_ms), color="black", ls="--", lw=0.8)
            ax.text(
                _x(sec.info.first_ts_ms),
                0.98,
                f" boot {sec.boot}",
                transform=ax.get_xaxis_transform(),
                fontsize=7,
                va="top",
            )
    for m in r.markers:
        if m.kind == "shutdown":
            ax.axvline(_x(m.ts_ms), color="red", lw=1.8)
            ax.text(
                _x(m.ts_ms),
                0.5,
                f" {m.label}",
                transform=ax.get_xaxis_transform(),
                fontsize=7,
                color="red",
                rotation=90,
                va="center",
            )
    ax.grid(True, alpha=0.3)


def write_png(r: Report, out: IO[bytes]) -> None:
    """Render the report as a WIDTH_PX x HEIGHT_PX PNG into ``out``."""
    fig = figure(r)
    fig.savefig(out, format="png", dpi=DPI)
