"""``gce-watchdog report``: what one VM did, from its serial output, for people.

- :mod:`agent.report.model`: the pure part: decoded events (via :mod:`agent.poller.timeline`) into
  series (ladder rung, probe latencies, memory gauges), fault windows, markers, the action chain,
  and the poller's verdict (:func:`agent.poller.verdict.decide`).
- :mod:`agent.report.text`: the terminal table (no optional dependency).
- :mod:`agent.report.plot`: the PNG (matplotlib, the ``report`` extra, headless).
- :mod:`agent.report.html`: one self-contained HTML file (PNG as a data URI + event table).
- :mod:`agent.report.cli`: the command.

``docs/report.md`` documents the command and the choices behind it.
"""
