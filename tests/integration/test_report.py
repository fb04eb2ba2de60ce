"""gce-watchdog report: from the poller tests' logs and from lines the real agent wrote."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.cli import main
from gce_watchdog.daemon.ladder import ProbeVerdict
from gce_watchdog.daemon.service import Agent, Deps, LadderStore
from gce_watchdog.daemon.tick import ProbeResult, TickReport, TickResult
from gce_watchdog.poller.timeline import parse_bytes
from gce_watchdog.poller.verdict import InstanceState, Policy, VerdictKind, decide
from gce_watchdog.report import html, text
from gce_watchdog.report.model import build_report
from gce_watchdog.testing.synth import (
    SYNTH_KEY,
    T0_MS,
    corpus_lines,
    interleave,
    realistic_dump,
    splice,
)
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire.protocol import format_ts
from kit.corpus import scenario_one_boot_with_damage
from kit.fakes import FakeClock, FakeNotifier, ScriptedProber
from kit.paths import CORPUS, REPO

try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False
needs_mpl = pytest.mark.skipif(not HAVE_MPL, reason="matplotlib (gce-watchdog[report]) absent")


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from the PNG signature and IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    w, h = struct.unpack(">II", data[16:24])
    return w, h


# -- a log the real agent writes ------------------------------------------------------------------


def tr(md: str, eg: str, mdl: int, egl: int) -> TickResult:
    def pr(v: str, lat: int, why: str) -> ProbeResult:
        return ProbeResult(ProbeVerdict(v), "ok" if v == "ok" else why, lat)

    return TickResult(pr(md, mdl, "timeout"), pr(eg, egl, "connect_timeout"), "ok")


def agent_lines(
    tmp: Path,
    boot: str,
    wall0: float,
    script: list[TickResult],
    ticks: int,
    extra: dict[int, list[tuple[str, dict[str, object], str]]],
) -> list[str]:
    """Lines of one boot as the agent writes them: the real Agent with a fake clock and prober;
    ``extra[n]`` are lines other writers (fault CLI, memory monitor, phases) add after tick n
    (n = 0: before the agent starts)."""
    clock = FakeClock(start=1000.0, wall0=wall0)
    sink = MemorySink()
    (tmp / boot).mkdir()
    em = Emitter(sink, SeqAllocator(tmp / boot, boot), boot, clock.wall, key=SYNTH_KEY)

    def on_shutdown(reason: str, rung: int, thr: int, **k: object) -> None:  # the chain writes
        em.emit(
            "shutdown",
            {
                "reason": reason,
                "rung": f"{rung}/{thr}",
                "action": "poweroff",
                "chain": "linger+poweroff",
            },
            "shutting down",
            sync=True,
        )
        em.emit("action", {"step": "linger", "status": "ok", "ms": 75000})
        em.emit("action", {"step": "poweroff", "status": "dry_run"}, "would power off")

    def hook(rep: TickReport) -> None:
        for name, fields, txt in extra.get(rep.n, []):
            em.emit(name, fields, txt)

    cfg = cfgmod.replace(
        cfgmod.Config(), agent={"interval": 30.0, "probe_timeout": 5.0, "heartbeat_every": 3}
    )
    deps = Deps(
        emitter=em,
        prober=ScriptedProber(script, clock),
        clock=clock,
        notifier=FakeNotifier(),
        store=LadderStore(tmp / boot / "ladder.json", boot),
        on_shutdown=on_shutdown,
        phase=lambda: "workload",
        tick_hooks=[hook],
    )
    for name, fields, txt in extra.get(0, []):
        em.emit(name, fields, txt)
    Agent.from_config(cfg, deps).run(threading.Event(), max_ticks=ticks)
    return list(sink.lines)


def wedge_and_reboot(tmp: Path) -> tuple[bytes, list[str], list[str]]:
    """Boot 1: healthy, a fault injected, both probes fail 10 ticks, shutdown (a heartbeat is
    spliced by a kernel message). Boot 2: healthy, still running: the dump ends mid-line."""
    ok, bad = tr("ok", "ok", 3, 14), tr("fail", "fail", 5001, 5002)
    until = format_ts(T0_MS + 30_000 * 16)[:19] + "Z"
    mem = [
        ("mem", {"hu": "3.10", "ha": "25.00", "g0": f"{22 + 0.5 * k:.2f}"}, "") for k in range(17)
    ]
    extra1: dict[int, list[tuple[str, dict[str, object], str]]] = {
        0: [("phase", {"ph": "bootstrap"}, ""), ("phase", {"ph": "workload"}, "")],
        6: [
            (
                "fault",
                {
                    "op": "inject",
                    "id": "f1a2",
                    "cut": "metadata+egress443",
                    "ttl": "600s",
                    "until": until,
                    "rev": "timer",
                },
                "by <operator>",  # the signed trailer leaves ~30 bytes of text on this line
            )
        ],
        9: [("memory_climb", {"g": "gpu0", "slope": "0.017", "cur": "26.50"}, "")],
    }
    for k in range(0, 17, 2):
        extra1.setdefault(k, []).append(mem[k])
    b1 = agent_lines(tmp, "aaaa0001", T0_MS / 1000, [ok] * 6 + [bad] * 10, 16, extra1)
    extra2: dict[int, list[tuple[str, dict[str, object], str]]] = {
        0: [("phase", {"ph": "workload"}, "")],
        **{k: [("mem", {"hu": "3.00", "g0": "21.00"}, "")] for k in (3, 6, 9)},
    }
    b2 = agent_lines(tmp, "bbbb0002", T0_MS / 1000 + 3600, [ok], 9, extra2)
    b2 = b2[:-1]  # still running: no stop line yet
    console = corpus_lines(CORPUS)
    assert console
    ours1 = [ln.encode() + b"\n" for ln in b1]
    hb = next(i for i, ln in enumerate(b1) if " heartbeat " in ln)
    ours1[hb] = splice(ours1[hb])
    ours2 = [ln.encode() + b"\n" for ln in b2]
    ours2[-1] = ours2[-1][: len(ours2[-1]) // 2]  # the dump was taken mid-line
    data = interleave(console[:400], ours1, 9) + interleave(console[400:700], ours2, 11)
    data = data.rstrip(b"\n")
    return data, b1, b2


@pytest.mark.pure
def test_agent_log_timeline_faults_memory_and_verdict(tmp_path: Path) -> None:
    data, b1, b2 = wedge_and_reboot(tmp_path)
    r = build_report(data, source="vm.log")
    tl = parse_bytes(data)
    assert r.events == tl.events  # the report's events are the poller's decoding, untouched
    assert [s.boot for s in r.sections] == ["aaaa0001", "bbbb0002"]
    assert len(r.events) == len(b1) + len(b2) - 2  # the spliced heartbeat, the cut last line
    assert r.rejected == 2 and r.lost_lines == 1 and len(r.seq_gaps) == 1

    # The ladder per tick, boot 1: 0 while healthy, then 1..10 while both probes fail.
    rungs1 = [p.rung for p in r.rungs if p.boot == "aaaa0001"]
    climb = [x for x in rungs1 if x > 0]
    assert climb[:10] == list(range(1, 11)) and r.threshold == 10
    fails = [p for p in r.probes if p.boot == "aaaa0001" and p.verdict == "fail"]
    assert len(fails) == 20 and {p.latency_ms for p in fails} == {5001, 5002}
    assert {p.reason for p in fails} == {"timeout", "connect_timeout"}
    oks = [p for p in r.probes if p.verdict == "ok"]
    assert {(p.probe, p.latency_ms) for p in oks} == {("metadata", 3), ("egress", 14)}

    # The fault: injected at tick 6, never cleared: the reboot ended it.
    (w,) = r.faults
    assert (w.fault_id, w.cut, w.boot, w.end) == (
        "f1a2",
        "metadata+egress443",
        "aaaa0001",
        "reboot",
    )
    assert w.end_ms == r.sections[0].info.last_ts_ms

    gpu = [p.gib for p in r.memory if p.gauge == "gpu0_used" and p.boot == "aaaa0001"]
    assert gpu == [22 + 0.5 * k for k in range(0, 17, 2)][: len(gpu)] and len(gpu) >= 7
    kinds = [m.kind for m in r.markers]
    assert kinds.count("phase") == 3 and kinds.count("shutdown") == 1
    assert "memory_climb" in kinds and kinds.count("start") == 2
    assert [a.event for a in r.actions] == ["shutdown", "action", "action"]

    # The verdict is the poller's: the latest boot is alive, judged at its last line.
    assert r.verdict == decide(tl.events, InstanceState(), r.end_ms / 1000, Policy())
    assert r.verdict.kind is VerdictKind.HEALTHY and r.verdict.boot == "bbbb0002"

    out = "\n".join(text.render(r, width=200))
    assert "boot aaaa0001 (1 of 2)" in out and "boot bbbb0002 (2 of 2)" in out
    assert "2 rejected (checksum 2)" in out and "1 sequence gaps" in out
    assert "boot aaaa0001: after seq" in out and "(1 lost)" in out
    assert "f1a2 cut=metadata+egress443" in out and "ended by a reboot" in out
    assert "fail timeout 5001ms" in out and "fail connect_timeout 5002ms" in out
    assert out.rstrip().splitlines()[-1].startswith("verdict: healthy (no failover)")


@pytest.mark.pure
def test_poller_damage_scenario_reports_rejects_gaps_and_shutdown() -> None:
    data, expected, _ = scenario_one_boot_with_damage()
    r = build_report(data, source="damaged.log", instance=InstanceState("TERMINATED"))
    assert r.events == expected
    assert r.rejected == 3 and r.duplicates == 1 and r.lost_lines == 2
    assert [(g.after, g.next) for g in r.seq_gaps] == [(3, 5), (5, 7)]  # v3: 2 key lines
    assert r.verdict.kind is VerdictKind.SELF_SHUTDOWN and r.verdict.failover
    lines = list(text.render(r))
    assert any("3 rejected (checksum 3), 1 duplicates, 2 sequence gaps" in ln for ln in lines)
    assert lines[-1].startswith("verdict: self_shutdown (FAILOVER)")


@pytest.mark.pure
def test_routine_lines_in_a_row_collapse_into_one_row() -> None:
    from gce_watchdog.testing.synth import Writer

    w = Writer(boot="cccc0003")
    for k in range(5):
        w.event("heartbeat", {"rung": "0/10", "ph": "workload", "ticks": k, "mdl": 3, "egl": 9})
    w.event("tick", {"rung": "1/10", "md": "fail/timeout/5001", "eg": "fail/refused/2"})
    w.event("tick", {"rung": "1/10", "md": "unknown/no_route/0", "eg": "fail/refused/2"})
    w.event("phase", {"ph": "done"})
    w.event("phase", {"ph": "done"})
    rows = text.rows(w.written)
    assert [(r.first.event, r.count) for r in rows] == [
        ("heartbeat", 5),
        ("tick", 1),
        ("tick", 1),
        ("phase", 1),
        ("phase", 1),
    ]
    assert rows[0].last.get("ticks") == "4"
    assert text.probe_cell(rows[1].first, "md") == "fail timeout 5001ms"
    assert text.probe_cell(rows[0].first, "eg") == "ok 9ms"


@pytest.mark.pure
def test_no_line_of_ours_and_empty_input() -> None:
    for data in (b"", b"[    0.000000] Linux version 6.1\r\nplain console\n"):
        r = build_report(data)
        assert r.events == [] and r.sections == [] and r.verdict.kind is VerdictKind.UNKNOWN
        out = list(text.render(r))
        assert any("no gce-watchdog line" in ln for ln in out)
        assert "<table>" in html.render(r, None, "no plot")


# -- PNG and HTML ----------------------------------------------------------------------------------


@pytest.mark.pure
@needs_mpl
def test_png_is_a_valid_image_of_the_expected_size_with_four_axes(tmp_path: Path) -> None:
    import io

    from gce_watchdog.report import plot

    data, _, _ = wedge_and_reboot(tmp_path)
    r = build_report(data, source="vm.log")
    fig = plot.figure(r)
    assert len(fig.axes) == plot.N_AXES == 4
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels == ["events", "ladder rung", "probe latency (ms)", "memory (GiB)"]
    # the threshold line and the shaded fault window are drawn
    assert any(ln.get_label() == "threshold 10" for ln in fig.axes[1].get_lines())
    assert all(len(ax.patches) >= 1 for ax in fig.axes)
    buf = io.BytesIO()
    plot.write_png(r, buf)
    assert png_size(buf.getvalue()) == (plot.WIDTH_PX, plot.HEIGHT_PX) == (1400, 1000)
    # a log with no line of ours still renders the same frame
    buf2 = io.BytesIO()
    plot.write_png(build_report(b"console only\n"), buf2)
    assert png_size(buf2.getvalue()) == (1400, 1000)


def _drawn_texts(fig: Any) -> list[tuple[str, Any]]:
    """(text, window bbox) of every text the renderer draws: titles, labels, legends, the
    tick labels inside the view (matplotlib keeps stale ones outside it, undrawn)."""
    from matplotlib.text import Text

    fig.canvas.draw()
    rend = fig.canvas.get_renderer()
    stale: set[int] = set()
    for ax in fig.axes:
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = min(lo, hi), max(lo, hi)
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo <= tick.get_loc() <= hi:
                    stale.update({id(tick.label1), id(tick.label2)})
    return [
        (t.get_text(), t.get_window_extent(rend))
        for t in fig.findobj(Text)
        if t.get_visible() and t.get_text().strip() and id(t) not in stale
    ]


def _overlaps(fig: Any) -> list[tuple[str, str]]:
    boxes = _drawn_texts(fig)
    return [
        (a, b)
        for i, (a, ba) in enumerate(boxes)
        for b, bb in boxes[i + 1 :]
        if ba.overlaps(bb) and ba.intersection(ba, bb).width * ba.intersection(ba, bb).height > 1
    ]


def _marker_labels(fig: Any) -> list[str]:
    return [t.get_text() for t in fig.axes[0].texts if t.get_gid() == "marker-label"]


def _log(lines: list[tuple[int, str, dict[str, object], str]], boot: str = "aaaa0001") -> bytes:
    """A serial dump of our lines: (ms after T0, event, fields, text), after the boot's key."""
    from gce_watchdog.wire.protocol import encode, key_line, make_event

    return (
        key_line(boot, 0, T0_MS, SYNTH_KEY).encode()
        + b"\n"
        + key_line(boot, 1, T0_MS, SYNTH_KEY).encode()
        + b"\n"
        + b"".join(
            encode(make_event(name, boot, i, T0_MS + dt, f, t), SYNTH_KEY).encode() + b"\n"
            for i, (dt, name, f, t) in enumerate(lines, 2)
        )
    )


@pytest.mark.pure
@needs_mpl
def test_png_labels_never_overlap_and_every_marker_is_labelled(tmp_path: Path) -> None:
    from gce_watchdog.report import plot

    data, _, _ = wedge_and_reboot(tmp_path)
    r = build_report(data, source="vm.log")
    fig = plot.figure(r)
    assert _overlaps(fig) == []
    texts = " ".join(_marker_labels(fig))
    for want in ("bootstrap", "workload", "SHUTDOWN 10/10", "memory_climb gpu0", "boot bbbb0002"):
        assert want in texts
    # a crowd: 40 phase changes in 4 s, a shutdown inside them, labels cannot all fit
    crowd = [(k * 100, "phase", {"ph": f"step{k}"}, "") for k in range(40)]
    crowd.append((2050, "shutdown", {"reason": "ladder", "rung": "10/10"}, ""))
    crowd.append((600_000, "stop", {"reason": "sigterm"}, ""))
    r2 = build_report(_log(crowd))
    fig2 = plot.figure(r2)
    assert _overlaps(fig2) == []
    labels = _marker_labels(fig2)
    # every marker is in exactly one label: named, or counted in a "+N"
    named = sum(len(t.split(" +")[0].split(" · ")) for t in labels)
    counted = sum(int(t.rsplit("+", 1)[1]) for t in labels if re.search(r" \+\d+\Z", t))
    assert named + counted == len(r2.markers) == 42
    # the overlap check itself finds an overlap when there is one
    fig2.axes[1].text(0.5, 0.5, "AAAA", transform=fig2.axes[1].transAxes)
    fig2.axes[1].text(0.5, 0.5, "BBBB", transform=fig2.axes[1].transAxes)
    assert ("AAAA", "BBBB") in _overlaps(fig2)


@pytest.mark.pure
@needs_mpl
def test_png_setup_failed_without_ladder_data_is_labelled() -> None:
    from gce_watchdog.report import plot

    r = build_report(
        _log(
            [
                (0, "phase", {"ph": "bootstrap"}, ""),
                (16_000, "setup_failed", {"step": "fetch", "rc": "6"}, "uv download failed"),
            ]
        )
    )
    fig = plot.figure(r)
    assert r.rungs == []
    assert any("setup_failed fetch" in t for t in _marker_labels(fig))
    assert _overlaps(fig) == []


@pytest.mark.pure
@needs_mpl
def test_png_time_axis_fits_the_data_and_reads_as_clock_time() -> None:
    import matplotlib.dates as mdates
    from gce_watchdog.report import plot

    # a 16 s log: the axis must not be 75 s wide, every tick label is HH:MM:SS
    r = build_report(_log([(k * 1000, "heartbeat", {"rung": "0/10"}, "") for k in range(17)]))
    fig = plot.figure(r)
    lo, hi = fig.axes[-1].get_xlim()
    assert 16 <= (hi - lo) * 86_400 <= 18.5
    fig.canvas.draw()
    ticks = [t for t in fig.axes[-1].get_xticklabels() if t.get_text()]
    visible = [t for t in ticks if lo <= t.get_position()[0] <= hi]
    assert len(visible) >= 3
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d", t.get_text()) for t in visible)
    assert fig.axes[-1].get_xlabel() == "time (UTC), " + format_ts(T0_MS)[:10]
    assert mdates.num2date(lo).timestamp() * 1000 < T0_MS


@pytest.mark.pure
@needs_mpl
def test_png_dry_run_shutdown_is_not_drawn_as_a_real_one() -> None:
    from gce_watchdog.report import plot

    line = {"reason": "ladder", "rung": "10/10", "action": "dry-run"}
    r = build_report(_log([(0, "heartbeat", {"rung": "0/10"}, ""), (9000, "shutdown", line, "")]))
    fig = plot.figure(r)
    assert "DRY RUN" in fig.texts[0].get_text() if fig.texts else False
    assert any(t.startswith("DRY RUN: would shut down 10/10") for t in _marker_labels(fig))
    real = build_report(_log([(9000, "shutdown", {**line, "action": "poweroff"}, "")]))
    fig_real = plot.figure(real)
    assert "DRY RUN" not in fig_real.texts[0].get_text()
    assert any(t.startswith("SHUTDOWN 10/10") for t in _marker_labels(fig_real))


@pytest.mark.pure
def test_html_is_self_contained_and_has_every_event_escaped(tmp_path: Path) -> None:
    data, _, _ = wedge_and_reboot(tmp_path)
    r = build_report(data, source="vm<1>.log")
    png = b"\x89PNG\r\n\x1a\nfake" if not HAVE_MPL else None
    if HAVE_MPL:
        import io

        from gce_watchdog.report import plot

        buf = io.BytesIO()
        plot.write_png(r, buf)
        png = buf.getvalue()
    page = html.render(r, png)
    assert page.count("<tr class=") == len(r.events)
    for ev in r.events:
        assert f"<td>{ev.seq}</td><td>{ev.event}</td>" in page
    assert "by &lt;operator&gt;" in page
    assert "<operator>" not in page and "vm&lt;1&gt;.log" in page
    assert "data:image/png;base64," in page
    assert 'src="http' not in page and "<script" not in page  # nothing loaded from elsewhere
    assert "verdict: healthy" in page


# -- the command -----------------------------------------------------------------------------------


@pytest.mark.pure
@needs_mpl
def test_cli_writes_png_html_and_prints_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _, _ = wedge_and_reboot(tmp_path)
    log = tmp_path / "vm.log"
    log.write_bytes(data)
    png, page = tmp_path / "out.png", tmp_path / "out.html"
    rc = main(["report", str(log), "--png", str(png), "--html", str(page), "--now", "last"])
    out = capsys.readouterr().out
    assert rc == 0
    assert png_size(png.read_bytes()) == (1400, 1000)
    assert "data:image/png;base64," in page.read_text()
    assert "verdict: healthy (no failover)" in out and f"plot written to {png}" in out


@pytest.mark.pure
def test_cli_json_and_silence_is_judged_from_when_the_dump_was_received(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _, _ = wedge_and_reboot(tmp_path)
    log = tmp_path / "vm.log"
    log.write_bytes(data)
    # The dump was received (saved) an hour ago; its guest timestamps are a year older still,
    # which must not matter: silence is measured on the reader's clock only.
    saved = time.time() - 3600
    os.utime(log, (saved, saved))
    for now in ([], ["--now", "last"]):  # default: as of receipt
        assert main(["report", str(log), "--json", *now]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["verdict"]["kind"] == "healthy" and len(doc["boots"]) == 2
        assert doc["rejected"] == 2 and doc["faults"][0]["end"] == "reboot"
    # Judged now: nothing received for an hour from a running VM is a wedge...
    assert main(["report", str(log), "--json", "--now", "now"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"]["kind"] == "suspected_wedge"
    # ...and parse says exactly the same for the same bytes and the same times.
    for extra in ([], ["--now", "now"]):
        assert main(["report", str(log), "--json", *extra]) == 0
        rep = json.loads(capsys.readouterr().out)["verdict"]
        assert main(["parse", str(log), "--json", *extra]) == 0
        par = json.loads(capsys.readouterr().out)["verdict"]
        assert (rep["kind"], rep["boot"]) == (par["kind"], par["boot"])
    # --received places the receipt explicitly.
    rx = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(saved - 7200))
    assert main(["report", str(log), "--json", "--received", rx, "--now", "now"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"]["reason"].startswith("no line for 108")


@pytest.mark.pure
def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing.log")]) == 66
    assert "cannot read" in capsys.readouterr().err
    log = tmp_path / "x.log"
    log.write_bytes(b"")
    assert main(["report", str(log), "--now", "yesterday"]) == 64
    assert main(["report", str(log), "--drain-timeout", "soon"]) == 64
    assert main(["report", str(log), "--band-gib", "0"]) == 64
    assert (
        main(
            [
                "report",
                str(log),
                "--now",
                "last",
                "--html",
                str(tmp_path / "no/such/x.html"),
            ]
        )
        == 73
    )


@pytest.mark.process
def test_png_without_matplotlib_says_how_to_install_it(tmp_path: Path) -> None:
    """A fresh interpreter where importing matplotlib fails, as on a VM without the extra."""
    log = tmp_path / "x.log"
    log.write_bytes(b"console\n")
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from gce_watchdog.cli import main\n"
        f"rc1 = main(['report', {str(log)!r}, '--png', {str(tmp_path / 'o.png')!r}])\n"
        f"rc2 = main(['report', {str(log)!r}, '--html', {str(tmp_path / 'o.html')!r}])\n"
        "print('RC', rc1, rc2)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    assert "RC 69 0" in p.stdout  # --png: refused (EX_UNAVAILABLE); --html: written without plot
    assert "pip install 'gce-watchdog[report]'" in p.stderr
    assert not (tmp_path / "o.png").exists()
    page = (tmp_path / "o.html").read_text()
    assert "no plot" in page and "gce-watchdog[report]" in page


@pytest.mark.pure
def test_render_time_of_a_1mib_log() -> None:
    data, expected = realistic_dump(1024 * 1024, directory=CORPUS)
    t0 = time.perf_counter()
    r = build_report(data, source="1mib.log")
    lines = list(text.render(r))
    t_text = time.perf_counter() - t0
    assert len(r.events) == len(expected) and lines
    t_png = 0.0
    if HAVE_MPL:
        import io

        from gce_watchdog.report import plot

        t1 = time.perf_counter()
        plot.write_png(r, io.BytesIO())
        t_png = time.perf_counter() - t1
    print(f"1 MiB log: decode+table {t_text * 1000:.0f} ms, png {t_png * 1000:.0f} ms")
    assert t_text < 10 and t_png < 30  # generous: 2 shared CI cores


@pytest.mark.pure
def test_html_event_tables_have_the_terminal_tables_columns(tmp_path: Path) -> None:
    data, _, _ = wedge_and_reboot(tmp_path)
    r = build_report(data, source="vm.log")
    term = list(text.render(r, width=400))
    page = html.render(r, None, "no plot")
    heads = re.findall(r"<h3>boot (\w+)</h3><table><tr>(.*?)</tr>", page)
    assert [b for b, _ in heads] == [s.boot for s in r.sections]
    for _, head in heads:
        assert re.findall(r"<th>(.*?)</th>", head) == list(text.COLUMNS)
    term_head = next(ln for ln in term if ln.lstrip().startswith("time (UTC)"))
    assert term_head.split()[2:] == ["seq", "event", "rung", "metadata", "egress", "detail"]
    # a failing tick's cells are the same in both
    tick = next(e for e in r.events if e.event == "tick" and (e.get("md") or "").startswith("fail"))
    row = next(ln for ln in page.splitlines() if f"<td>{tick.seq}</td><td>tick</td>" in ln)
    assert "<td>fail timeout 5001ms</td>" in row and "<td>fail connect_timeout 5002ms</td>" in row


@pytest.mark.pure
def test_human_output_shows_units_and_the_wire_keeps_its_compact_fields() -> None:
    from gce_watchdog.wire.protocol import encode, make_event
    from gce_watchdog.wire.vocab import human_fields, human_value

    ev = make_event(
        "tick",
        "aaaa0001",
        7,
        T0_MS,
        {"rung": "3/10", "md": "fail/timeout/500", "eg": "ok/ok/3", "mdl": "12"},
    )
    assert human_fields(ev.fields) == "rung=3/10 md=fail timeout 500ms eg=ok 3ms mdl=12ms"
    assert " md=fail/timeout/500 eg=ok/ok/3 " in encode(ev, SYNTH_KEY)
    assert human_value("md", "unknown/dns") == "unknown dns"
    assert human_value("ph", "fail/timeout/500") == "fail/timeout/500"  # only probe fields
    r = build_report(encode(ev, SYNTH_KEY).encode() + b"\n", pin=SYNTH_KEY.public)
    [line] = [ln for ln in text.render(r, width=400) if " tick " in ln]
    assert "fail timeout 500ms" in line and "ok 3ms" in line and "/500" not in line
