"""The agent's log: one journal entry per event, with its fields; a key=value line elsewhere.

stdlib :mod:`logging` underneath (one logger, ``gce-watchdog``, one handler), behind
:class:`EventLog`: ``log.warning("serial_fallback", error=..., target=...)``, an event name and
its fields, as the serial lines have them. structlog was used here only as a timestamper and a
``k=v`` renderer, and importing it costs the daemon's import path 1.6 MiB RSS (asyncio and the
rest it imports; 5.1 MiB where ``rich`` is importable): docs/performance.md, "One logging
path".

Every line has a syslog priority (sd-daemon(3)): decisions and alarms at ``alert``/``crit``,
failures at ``err``/``warning``, routine lines at ``notice``/``info``/``debug``. Under systemd
(stderr is the journal stream named by ``$JOURNAL_STREAM``) each line starts with the ``<N>``
prefix that journald reads with the unit's default ``SyslogLevelPrefix=yes``, so
``journalctl -p warning -u gce-watchdog`` shows the decisions and failures only. On a terminal
the prefix is left out; the ``level=`` field says the same in words either way.

When stderr is the journal stream, each event goes instead as one structured entry through
journald's native protocol (a datagram to ``/run/systemd/journal/socket``,
systemd-journald.service(8), the "Native Journal Protocol" document, as sd_journal_sendv(3)
sends it): ``MESSAGE`` (the event
and its fields as one readable line, without a second timestamp), ``PRIORITY``,
``SYSLOG_IDENTIFIER=gce-watchdog`` and every field as ``GCEWD_<NAME>`` (``GCEWD_EVENT``,
``GCEWD_RUNG``, ...), so ``journalctl -o json`` users get them as data. A datagram that cannot be
sent (no socket, too big, journald gone) is written as the prefixed line on stderr instead: a line
is never lost.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import struct
import sys
import threading
from collections.abc import Callable, Mapping
from typing import IO, Any, TextIO

from gce_watchdog.wire import vocab

# syslog(3) priorities, the numbers the <N> prefix carries.
EMERG, ALERT, CRIT, ERR, WARNING, NOTICE, INFO, DEBUG = range(8)
NAMES = ("emerg", "alert", "crit", "err", "warning", "notice", "info", "debug")
# A logging level's priority when the call names none.
_LEVEL_PRIORITY = {
    logging.CRITICAL: CRIT,
    logging.ERROR: ERR,
    logging.WARNING: WARNING,
    logging.INFO: INFO,
    logging.DEBUG: DEBUG,
}
# The level that lets a priority through the logger's filter (debug lines are dropped at info).
_PRIORITY_LEVEL = {
    EMERG: logging.CRITICAL,
    ALERT: logging.CRITICAL,
    CRIT: logging.CRITICAL,
    ERR: logging.ERROR,
    WARNING: logging.WARNING,
    NOTICE: logging.INFO,
    INFO: logging.INFO,
    DEBUG: logging.DEBUG,
}
# The names a line gives the timestamp, the priority and the event: a field of the same name
# (the maintenance line's `event`) is written with a "_" after it (`event_`), never dropped.
RESERVED = ("timestamp", "level", "event")

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
        return WARNING  # a rehearsal: it would have acted, and nothing was done
    if event == vocab.SHUTDOWN:
        # an older agent's dry run (action=dry-run): a rehearsal, not an emergency
        return WARNING if str(fields.get("action", "")).replace("_", "-") == "dry-run" else ALERT
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


# systemd-journald.service(8): "/run/systemd/journal/socket: ... the native protocol".
JOURNAL_SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "gce-watchdog"
FIELD_PREFIX = "GCEWD_"
# journald's rule for a field name (systemd.journal-fields(7), sd_journal_sendv(3)): upper-case
# letters, digits and "_", not starting with "_" (those are trusted fields) or a digit, at most
# 64 characters. Our prefix takes care of the start.
_BAD_NAME_CHAR = re.compile(r"[^A-Z0-9_]")
MAX_FIELD_NAME = 64
SEND_TIMEOUT_S = 1.0  # a stalled journald must not hold the ladder: the line goes to stderr


def field_name(key: str) -> str:
    """``GCEWD_`` and the key in upper case, anything journald does not take as ``_``."""
    return (FIELD_PREFIX + _BAD_NAME_CHAR.sub("_", key.upper()))[:MAX_FIELD_NAME]


def encode_native(fields: list[tuple[str, str | bytes]]) -> bytes:
    """One entry in journald's native protocol: ``NAME=value\\n``, or, for a value holding a
    newline, ``NAME\\n``, its length as a 64-bit little-endian integer, the bytes as they are,
    ``\\n`` (binary-safe; the "Native Journal Protocol" document)."""
    out = bytearray()
    for name, value in fields:
        v = value.encode("utf-8", "replace") if isinstance(value, str) else value
        if b"\n" in v:
            out += name.encode("ascii") + b"\n" + struct.pack("<Q", len(v)) + v + b"\n"
        else:
            out += name.encode("ascii") + b"=" + v + b"\n"
    return bytes(out)


def _text(v: object) -> str:
    return v if isinstance(v, str) else str(v)


def journal_fields(ed: Mapping[str, Any], pri: int) -> list[tuple[str, str | bytes]]:
    """The entry for one event: MESSAGE, PRIORITY, SYSLOG_IDENTIFIER, then GCEWD_* (pure)."""
    event = _text(ed.get("event", ""))
    rest = [(k, v) for k, v in ed.items() if k not in ("event", "timestamp") and v is not None]
    text = next((_text(v) for k, v in rest if k == "text"), "")
    words = [event, *(f"{k}={_text(v)}" for k, v in rest if k != "text")]
    message = " ".join(w for w in words if w) + (f" | {text}" if text else "")
    out: list[tuple[str, str | bytes]] = [
        ("MESSAGE", message),
        ("PRIORITY", str(pri)),
        ("SYSLOG_IDENTIFIER", IDENTIFIER),
        (field_name("event"), event),
        (field_name("level"), NAMES[pri]),
    ]
    seen = {name for name, _ in out}
    for k, v in rest:
        name = field_name(k)
        if name not in seen:  # two keys that only differ in case or punctuation: first wins
            seen.add(name)
            out.append((name, v if isinstance(v, bytes) else _text(v)))
    return out


class JournalSender:
    """Datagrams to journald's native socket. ``send`` never raises: False means "not sent"."""

    def __init__(self, path: str = JOURNAL_SOCKET) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.failures = 0

    def send(self, data: bytes) -> bool:
        try:
            with self._lock:
                if self._sock is None:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                    s.settimeout(SEND_TIMEOUT_S)
                    self._sock = s
                self._sock.sendto(data, self.path)
            return True
        except OSError:  # no socket (not under systemd after all), EMSGSIZE, timeout, ...
            self.failures += 1
            return False


def fields_of(fields: Mapping[str, object]) -> dict[str, object]:
    """An event's fields for a log line (pure): None left out, a reserved name suffixed."""
    return {(k + "_" if k in RESERVED else k): v for k, v in fields.items() if v is not None}


def render_line(
    event: str, fields: Mapping[str, object], pri: int, prefix: bool, timestamp: str = ""
) -> str:
    """``[<N>]timestamp='...' level='NAME' event='...' k='v' ...`` (pure): values as Python
    literals (repr), so a value with spaces stays one value; the ``<N>`` prefix when asked."""
    head: list[tuple[str, object]] = [("timestamp", timestamp)] if timestamp else []
    head += [("level", NAMES[pri]), ("event", event)]
    line = " ".join(f"{k}={v!r}" for k, v in [*head, *fields_of(fields).items()])
    return f"<{pri}>{line}" if prefix else line


def iso_utc(t: float) -> str:
    """``2026-12-01T07:40:00.123456Z``: RFC 3339, UTC, microseconds."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class EventHandler(logging.Handler):
    """The one handler: under systemd (``sender`` given) each event as a native journal entry,
    or, when that cannot be sent, as the prefixed line on ``stream`` (the journal's too);
    elsewhere the plain ``k=v`` line. Never raises: a log line must not stop the ladder."""

    def __init__(self, stream: IO[str], sender: JournalSender | None, prefix: bool) -> None:
        super().__init__()
        self.stream = stream
        self.sender = sender
        self.prefix = prefix

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = str(record.msg)
            fields: Mapping[str, object] = getattr(record, "gcewd_fields", {})
            pri = getattr(record, "gcewd_priority", None)
            if not isinstance(pri, int) or not EMERG <= pri <= DEBUG:
                pri = _LEVEL_PRIORITY.get(record.levelno, INFO)
            if self.sender is not None:
                entry = encode_native(journal_fields({"event": event, **fields_of(fields)}, pri))
                if self.sender.send(entry):
                    return
            ts = "" if self.sender is not None else iso_utc(record.created)  # journald stamps
            self.write(render_line(event, fields, pri, self.prefix, ts))
        except Exception:  # logging's own contract: a handler never raises
            self.handleError(record)

    def write(self, line: str) -> None:
        """One line on the stream: called from emit only, under the lock ``Handler.handle``
        holds around it (no lock of its own)."""
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # stderr gone: nothing else is left to tell
            pass


class EventLog:
    """The agent's logger: an event name and its fields, at a level (``log.warning("x", a=1)``)
    or at a syslog priority (:meth:`event`, what the serial mirror uses)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    def event(self, name: str, fields: Mapping[str, object], priority: int) -> None:
        """One event at ``priority``, its fields as a mapping (any names, ``event`` included)."""
        level = _PRIORITY_LEVEL.get(priority, logging.INFO)
        if self.logger.isEnabledFor(level):
            extra = {"gcewd_fields": dict(fields), "gcewd_priority": priority}
            self.logger.log(level, name, extra=extra)

    def _at(self, level: int, name: str, fields: dict[str, object]) -> None:
        if self.logger.isEnabledFor(level):
            self.logger.log(level, name, extra={"gcewd_fields": fields})

    def debug(self, name: str, **fields: object) -> None:
        self._at(logging.DEBUG, name, fields)

    def info(self, name: str, **fields: object) -> None:
        self._at(logging.INFO, name, fields)

    def warning(self, name: str, **fields: object) -> None:
        self._at(logging.WARNING, name, fields)

    def error(self, name: str, **fields: object) -> None:
        self._at(logging.ERROR, name, fields)

    def critical(self, name: str, **fields: object) -> None:
        self._at(logging.CRITICAL, name, fields)


LOGGER = "gce-watchdog"


def setup(
    level: str = "info",
    stream: TextIO | None = None,
    env: Mapping[str, str] | None = None,
    journal_socket: str | None = None,
) -> None:
    """Give the ``gce-watchdog`` logger its one handler, once. Under systemd (the stream is
    ``$JOURNAL_STREAM``) events go to ``journal_socket`` (default ``$GCEWD_JOURNAL_SOCKET``,
    else :data:`JOURNAL_SOCKET`; the variable is for tests that must not write into the host's
    journal), with the prefixed line as the fallback; elsewhere the plain line."""
    logger = logging.getLogger(LOGGER)
    if any(isinstance(h, EventHandler) for h in logger.handlers):
        return
    out = stream or sys.stderr
    env = os.environ if env is None else env
    journal = journal_stream(out, env)
    sock = journal_socket or env.get("GCEWD_JOURNAL_SOCKET") or JOURNAL_SOCKET
    logger.addHandler(EventHandler(out, JournalSender(sock) if journal else None, journal))
    logger.setLevel(getattr(logging, level.upper(), logging.INFO))
    logger.propagate = False  # the root logger's handlers (none in the agent) never see them


def get() -> EventLog:
    return EventLog(logging.getLogger(LOGGER))


def mirror(log: EventLog) -> Callable[[str, Mapping[str, object]], object]:
    """The Emitter's ``log``: each serial event to the journal at its own priority. The fields
    come as a mapping: a field named ``event`` (the maintenance line's) is a field like any."""

    def _mirror(event: str, fields: Mapping[str, object]) -> None:
        log.event(event, fields, priority_of(event, fields))

    return _mirror
