"""``gce-watchdog report``: what one VM did, from its serial output, for people.

- :mod:`report.model`: the pure part: decoded events (via :mod:`gce_watchdog.poller.timeline`) into
  series (ladder rung, probe latencies, memory gauges), fault windows, markers, the action chain,
  and the poller's verdict (:func:`gce_watchdog.poller.verdict.decide`).
- :mod:`gce_watchdog.report.text`: the terminal table (no optional dependency).
- :mod:`gce_watchdog.report.plot`: the PNG (matplotlib, the ``report`` extra, headless).
- :mod:`gce_watchdog.report.html`: one self-contained HTML file (PNG as a data URI + event table).
- :mod:`gce_watchdog.report.cli`: the command.

``docs/report.md`` documents the command and the choices behind it.
"""
