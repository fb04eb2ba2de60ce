"""One self-contained HTML file: the PNG as a data URI, the summary, and every event in a table.

Nothing is loaded from anywhere (no scripts, no fonts, no external CSS): the file can be mailed or
attached to a ticket. Everything from the log is HTML-escaped.
"""

from __future__ import annotations

import base64
from html import escape

from gce_watchdog.report.model import VERDICT_WORDS, Report, verdict_class
from gce_watchdog.report.text import (
    COLUMNS,
    cells,
    cost_table,
    duration,
    fault_line,
    verdict_line,
)
from gce_watchdog.wire import vocab
from gce_watchdog.wire.protocol import format_ts

MAX_ROWS = 50_000  # event rows in the table (~10 MB of HTML); the rest is counted

# One colour per verdict class (model.VERDICT_WORDS): the badge's background, with white text, and
# a light tint of it behind the verdict line. Told apart without colour too: the badge's word.
# tests/integration/test_report_browser.py finds each colour in a real browser's screenshot.
COLOURS = {
    "failover": "#c62828",  # red: a job is being moved
    "alarm": "#e65100",  # orange: a human must look
    "dry-run": "#6a1b9a",  # purple: a rehearsal reached its decision, nothing was powered off
    "job-failed": "#795548",  # brown: the job's own failure, no failover
    # blue-grey: no evidence either way (not a neutral grey: anti-aliased text is full of those)
    "unknown": "#546e7a",
    "healthy": "#2e7d32",  # green: alive, or ended well
}
TINTS = {
    "failover": "#fdecea",
    "alarm": "#fff3e0",
    "dry-run": "#f3e5f5",
    "job-failed": "#efebe9",
    "unknown": "#eceff1",
    "healthy": "#e8f5e9",
}
_CSS = (
    """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em} h2{font-size:1.1em;margin-top:1.5em}
.verdict{padding:.6em 1em;border-radius:4px;border:1px solid}
.badge{display:inline-block;padding:.2em .7em;margin-right:.7em;border-radius:3px;color:#fff;
font-weight:bold;letter-spacing:.05em}
"""
    + "".join(
        f".v-{c} .badge{{background:{COLOURS[c]}}} .v-{c}{{background:{TINTS[c]};"
        f"border-color:{COLOURS[c]}}}\n"
        for c in COLOURS
    )
    + """table{border-collapse:collapse;font-size:12px;font-family:ui-monospace,monospace}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top}
tr.key td{background:#fff7e0} tr.shutdown td{background:#fde0e0}
img{max-width:100%;border:1px solid #ddd}
.note{color:#666}
"""
)
_KEY = vocab.HIGHLIGHT_EVENTS


def render(r: Report, png: bytes | None, png_note: str = "") -> str:
    """The page. ``png`` None: no plot (``png_note`` says why)."""
    e = escape
    v = r.verdict
    cls = verdict_class(r)
    out: list[str] = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>gce-watchdog report: {e(r.source or '-')}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>gce-watchdog report: {e(r.source or '-')}</h1>",
        f'<p class="verdict v-{cls}" id="verdict"><span class="badge">{VERDICT_WORDS[cls]}</span>'
        f"{e(verdict_line(r))}</p>",
    ]
    if v.evidence:
        out.append("<ul>" + "".join(f"<li><code>{e(x)}</code></li>" for x in v.evidence) + "</ul>")
    if png is not None:
        b64 = base64.b64encode(png).decode("ascii")
        out.append(f'<p><img alt="timeline" src="data:image/png;base64,{b64}"></p>')
    else:
        out.append(f'<p class="note">{e(png_note or "no plot")}</p>')
    out.append(
        f"<p>{r.size} bytes, {r.lines} console lines, {len(r.events)} events of ours; "
        f"{r.rejected} rejected, {r.forged} forged, {r.duplicates} duplicates, "
        f"{r.conflicts} seq conflicts, {len(r.seq_gaps)} sequence gaps, "
        f"{r.lost_lines} lines lost.</p>"
    )
    out.append(
        "<h2>Boots</h2><table><tr><th>boot</th><th>seq</th><th>lines</th><th>lost</th>"
        "<th>from</th><th>to</th><th>span</th></tr>"
    )
    for sec in r.sections:
        b = sec.info
        out.append(
            f"<tr><td>{e(b.boot)}</td><td>{b.first_seq}..{b.max_seq}</td><td>{b.count}</td>"
            f"<td>{b.lost}</td><td>{format_ts(b.first_ts_ms)}</td><td>{format_ts(b.last_ts_ms)}"
            f"</td><td>{duration(b.last_ts_ms - b.first_ts_ms)}</td></tr>"
        )
    out.append("</table>")
    if r.seq_gaps:
        out.append("<h2>Sequence gaps</h2><ul>")
        out.extend(
            f"<li>boot {e(g.boot)}: after seq {g.after} came {g.next} ({g.missing} lost)</li>"
            for g in r.seq_gaps
        )
        out.append("</ul>")
    if r.forged or r.key_conflict:
        why = ", ".join(f"{k} {n}" for k, n in sorted(r.forged_reasons.items()))
        two = "; two keys announced, no line decides" if r.key_conflict else ""
        out.append(f"<h2>ALARM: forged lines: {r.forged} ({e(why)}){e(two)}</h2><ul>")
        out.extend(f"<li><code>{e(s.rstrip())}</code></li>" for s in r.forged_samples)
        out.append("</ul>")
    if r.rejected:
        reasons = ", ".join(f"{k} {n}" for k, n in sorted(r.reject_reasons.items()))
        out.append(f"<h2>Rejected lines: {r.rejected} ({e(reasons)})</h2><ul>")
        out.extend(f"<li><code>{e(s.rstrip())}</code></li>" for s in r.reject_samples)
        out.append("</ul>")
    if r.faults:
        out.append("<h2>Injected faults</h2><ul>")
        out.extend(f"<li>{e(fault_line(w).strip())}</li>" for w in r.faults)
        out.append("</ul>")
    if r.costs:  # the terminal's table, as it is (docs/report.md, "What it cost")
        lines = list(cost_table(r))[1:]
        out.append(f"<h2>What it cost</h2><pre>{e(chr(10).join(lines))}</pre>")
    # One table per boot with the terminal table's columns (every event: no collapsing here).
    out.append("<h2>Events</h2>")
    head = "<tr>" + "".join(f"<th>{e(c)}</th>" for c in COLUMNS) + "</tr>"
    shown = 0
    for sec in r.sections:
        if shown >= MAX_ROWS:
            break
        out.append(f"<h3>boot {e(sec.boot)}</h3><table>{head}")
        for ev in sec.events[: MAX_ROWS - shown]:
            cls = "shutdown" if ev.event == vocab.SHUTDOWN else "key" if ev.event in _KEY else ""
            row = "".join(f"<td>{e(c)}</td>" for c in cells(ev, format_ts(ev.ts_ms)))
            out.append(f'<tr class="{cls}">{row}</tr>')
            shown += 1
        out.append("</table>")
    if shown < len(r.events) or r.dropped_events:
        more = len(r.events) - shown
        out.append(f'<p class="note">{more + r.dropped_events} more events not shown.</p>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"
