"""What it cost in `report`: a signed dump of two boots (a wedge with its ladder and linger, then
a clean finish) against a hand computation, in the model, the text table, the plot and --json."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from gce_watchdog.poller.cost import Cost, boot_cost
from gce_watchdog.report.model import build_report
from gce_watchdog.report.text import render
from gce_watchdog.testing.synth import T0_MS, Writer
from kit.cli import gcewd
from kit.schemas import validate

T0 = T0_MS / 1000


def two_boots() -> bytes:
    """Boot 1 (aaaa0001): progress until 1200 s, rungs fail from 1290 s, shutdown decided at
    1350 s, the linger repeats it until 1390 s. Boot 2 (bbbb0002) from 1450 s: progress, result
    at 2050 s, exit at 2060 s. Every time is T0 + these seconds."""
    w = Writer(boot="aaaa0001")
    out = w.line("phase", {"ph": "workload"}, step_ms=600_000)
    out += w.line("progress", {"step": "100"}, step_ms=600_000)
    out += w.line("progress", {"step": "200"}, step_ms=60_000)
    out += w.line("tick", {"rung": "0/3", "md": "ok/ok/3", "eg": "ok/ok/4"}, step_ms=30_000)
    out += w.line("tick", {"rung": "1/3", "md": "fail/timeout/5001"}, step_ms=30_000)
    out += w.line("tick", {"rung": "2/3", "md": "fail/timeout/5001"}, step_ms=30_000)
    out += w.line("shutdown", {"reason": "ladder", "rung": "3/3"}, "off", step_ms=20_000)
    out += w.line("shutdown", {"reason": "ladder", "rung": "3/3", "rep": "1"}, step_ms=20_000)
    out += w.line("shutdown", {"reason": "ladder", "rung": "3/3", "rep": "2"})
    w.reboot("bbbb0002", gap_ms=60_000 - 30_000)  # the default step already went by: 1450 s
    out += w.line("phase", {"ph": "workload"}, step_ms=300_000)
    out += w.line("progress", {"step": "300"}, step_ms=300_000)
    out += w.line("result", {"status": "ok"}, step_ms=10_000)
    out += w.line("exit", {"rc": "0"})
    return out


# billed 0..1390 and 1450..2060; useful 0..1200 and 1450..2050; ladder 1290..1350; linger
# 1350..1390; no zombie (a dump knows no deletion); a3-highgpu-8g: 8 GPUs
WEDGE = Cost(billed=1390, useful=1200, ladder=60, linger=40, zombie=0, gpu=1390 * 8)
CLEAN = Cost(billed=610, useful=600, ladder=0, linger=0, zombie=0, gpu=610 * 8)


@pytest.mark.pure
def test_the_model_and_the_text_table_match_the_hand_computation() -> None:
    r = build_report(two_boots(), gpus=8, machine_type="a3-highgpu-8g")
    assert [f.boot for f in r.costs] == ["aaaa0001", "bbbb0002"]
    assert r.costs[0].start == T0
    assert [boot_cost(f) for f in r.costs] == [WEDGE, CLEAN]
    assert r.total_cost == WEDGE + CLEAN
    text = "\n".join(render(r))
    assert "what it cost (a3-highgpu-8g; GPUs: 8):" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line[:2] == "  "}
    assert rows["aaaa0001"] == ["23m10s", "20m00s", "1m00s", "40s", "0s", "11120"]
    assert rows["total"] == ["33m20s", "30m00s", "1m00s", "40s", "0s", "16000"]


@pytest.mark.pure
def test_the_html_page_has_the_table() -> None:
    from gce_watchdog.report.html import render as render_html

    page = render_html(build_report(two_boots(), gpus=8, machine_type="a3-highgpu-8g"), None)
    assert "<h2>What it cost</h2>" in page and "11120" in page and "16000" in page


@pytest.mark.pure
def test_the_plot_draws_the_cost_bands() -> None:
    pytest.importorskip("matplotlib")
    from gce_watchdog.report import plot

    r = build_report(two_boots(), gpus=8)
    fig = plot.figure(r)
    labels = fig.axes[1].get_legend_handles_labels()[1]
    assert {"useful 30m00s", "ladder 1m00s", "linger 40s"} <= set(labels)
    plot.write_png(r, io.BytesIO())


@pytest.mark.process
def test_report_prints_what_it_cost(tmp_path: Path) -> None:
    dump = tmp_path / "serial.log"
    dump.write_bytes(two_boots())
    text = gcewd("report", "--machine-type", "a3-highgpu-8g", str(dump))
    assert text.returncode == 0, text.stderr
    assert "what it cost (a3-highgpu-8g; GPUs: 8):" in text.stdout
    out = gcewd("report", "--json", "--gpus", "2", str(dump))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    validate("report", doc)
    total = doc["cost"]["total"]
    assert (total["billed_seconds"], total["useful_seconds"], total["gpu_seconds"]) == (
        2000,
        1800,
        4000,
    )
    first = doc["cost"]["boots"][0]
    assert (first["ladder_seconds"], first["linger_seconds"], first["gpus"]) == (60, 40, 2)
    assert first["final"] == "2025-11-30T04:20:44Z"  # T0 + 1350 s
