"""structlog set-up: one key=value line per event on stderr, which systemd sends to the journal.

Every line has a syslog priority (sd-daemon(3)): decisions and alarms at ``alert``/``crit``,
failures at ``err``/``warning``, routine lines at ``notice``/``info``/``debug``. Under systemd
(stderr is the journal stream named by ``$JOURNAL_STREAM``) each line starts with the ``<N>``
prefix that journald reads with the unit's default ``SyslogLevelPrefix=yes``, so
``journalctl -p warning -u gce-watchdog`` shows the decisions and failures only. On a terminal
the prefix is left out; the ``level=`` field says the same in words either way.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import IO, Any, TextIO

import structlog

from gce_watchdog.wire import vocab

# syslog(3) priorities, the numbers the <N> prefix carries.
EMERG, ALERT, CRIT, ERR, WARNING, NOTICE, INFO, DEBUG = range(8)
NAMES = ("emerg", "alert", "crit", "err", "warning", "notice", "info", "debug")
# A structlog method's priority when the call names none.
_METHOD = {
    "critical": CRIT,
    "exception": ERR,
    "error": ERR,
    "warning": WARNING,
    "warn": WARNING,
    "info": INFO,
    "debug": DEBUG,
}
# A serial event's priority when its fields do not change it (see priority_of).
_EVENT = {
    vocab.SHUTDOWN: ALERT,  # the agent is powering the VM off now
    vocab.WOULD_SHUTDOWN: CRIT,
    vocab.MEMORY_CLIMB: CRIT,  # the slow climb that wedged the original VM
    vocab.SETUP_FAILED: ERR,
    vocab.ERROR: ERR,  # an exception the agent caught and went on after
    vocab.PREEMPTED: WARNING,
    vocab.MAINTENANCE: WARNING,
    vocab.DISARM: WARNING,  # the watchdog will not act until it expires
    vocab.MEMORY_ACTION: WARNING,
    vocab.TICK: WARNING,  # only written while a probe fails: the ladder climbs or holds
    vocab.FAULT: WARNING,  # an injected outage is on (clear/expire: notice)
    vocab.SIGNAL: WARNING,
    vocab.WARN: WARNING,
    vocab.STALL: WARNING,
    vocab.START: NOTICE,
    vocab.STOP: NOTICE,
    vocab.RECOVERED: NOTICE,
    vocab.PHASE: NOTICE,
    vocab.EXIT: NOTICE,
    vocab.MEMORY_OK: NOTICE,
    vocab.ARM: NOTICE,
    vocab.INSTANCE: NOTICE,
    vocab.HEARTBEAT: INFO,
    vocab.MEM: INFO,
    vocab.ACTION: INFO,
    vocab.MEMORY_GPU: INFO,
}
_ACTION_FAILED = frozenset({"error", "fail", "timeout", "stuck"})  # a step that did not work


def priority_of(event: str, fields: Mapping[str, object]) -> int:
    """The syslog priority of one serial event mirrored to the journal (pure)."""
    if event == vocab.DRY_RUN_SHUTDOWN:
        return CRIT  # a dry run decides the same, but powers nothing off: an alarm
    if event == vocab.SHUTDOWN:
        # a dry run decides the same, but powers nothing off: an alarm, not an emergency
        return CRIT if str(fields.get("action", "")).replace("_", "-") == "dry-run" else ALERT
    if event == vocab.ACTION:
        return ERR if str(fields.get("status", "")) in _ACTION_FAILED else INFO
    if event == vocab.FAULT and fields.get("op") in ("clear", "expire"):
        return ERR if fields.get("why") == "install_failed" else NOTICE
    if event == vocab.STOP and fields.get("reason") not in (None, "sigterm", "sigint", "max_ticks"):
        return ERR  # the agent stopped for a reason nobody asked for
    if event == vocab.EXIT and str(fields.get("rc", "0")) != "0":
        return ERR
    if event == vocab.MEMORY_GPU and fields.get("st") not in (None, "ok", "absent"):
        return WARNING
    if event == vocab.MEMORY_ACTION and str(fields.get("rc", "0")) != "0":
        return ERR
    return _EVENT.get(event, INFO)


def journal_stream(stream: IO[str], env: Mapping[str, str]) -> bool:
    """True when ``stream`` is the journal stream systemd connected (``$JOURNAL_STREAM`` is
    ``DEVICE:INODE`` of it, systemd.exec(5)); a copy piped elsewhere gets no prefixes."""
    want = env.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


def render(prefix: bool) -> Callable[[Any, str, MutableMapping[str, Any]], str]:
    """The final processor: ``[<N>]timestamp=... level=NAME event=... k=v``."""
    kv = structlog.processors.KeyValueRenderer(
        key_order=["timestamp", "level", "event"], drop_missing=True
    )

    def _render(logger: Any, method: str, ed: MutableMapping[str, Any]) -> str:
        pri = ed.pop("priority", None)
        if not isinstance(pri, int) or not EMERG <= pri <= DEBUG:
            pri = _METHOD.get(method, INFO)
        ed["level"] = NAMES[pri]
        line = kv(logger, method, ed)
        return f"<{pri}>{line}" if prefix else line

    return _render


_configured = False


def setup(level: str = "info", stream: TextIO | None = None) -> None:
    global _configured
    if _configured:
        return
    out = stream or sys.stderr
    structlog.configure(
        processors=[
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            render(journal_stream(out, os.environ)),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get(name: str = "gce-watchdog") -> Any:
    return structlog.get_logger(name)


def mirror(log: Any) -> Callable[..., object]:
    """The Emitter's ``log``: each serial event to the journal at its own priority."""

    def _mirror(event: str, **kw: object) -> object:
        pri = priority_of(event, kw)
        # The method decides the level filter (debug lines are dropped at level info); the
        # priority decides the prefix and the level= word.
        method = (
            log.critical
            if pri <= CRIT
            else log.error
            if pri == ERR
            else log.warning
            if pri == WARNING
            else log.debug
            if pri == DEBUG
            else log.info
        )
        return method(event, priority=pri, **kw)

    return _mirror
