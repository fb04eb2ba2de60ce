"""The instance's serial-port log in Cloud Logging: evidence for a VM that ended unread.

GCE serves serial output through the Compute API only while the VM is RUNNING; with serial-port
logging enabled (metadata ``serial-port-logging-enable``, off by default, blockable by org
policy: Compute Engine docs, "Viewing serial port output") the same output is also exported to
Cloud Logging, and stays readable after the VM is off. The poller reads it only for a VM that is
no longer RUNNING and whose last line read is not terminal (``--logging-evidence``,
docs/poller.md, "Evidence for an end").

One ``entries.list`` call (``POST https://logging.googleapis.com/v2/entries:list``; body
``resourceNames``, ``filter``, ``orderBy``, ``pageSize`` at most 1000, ``pageToken``; answer
``entries`` and ``nextPageToken``: the Logging API reference, "Method: entries.list"), at most
``max_pages`` pages. The log is ``projects/P/logs/serialconsole.googleapis.com%2Fserial_port_1_
output`` on the resource ``gce_instance`` (GoogleCloudPlatform/khi, ``googlecloudlogserialport``
field set). Its ``textPayload`` may carry a literal ``\\r\\n``, ``\\xNN`` escapes and a journald
prefix (same source): :func:`decode_payload` turns one back into the bytes the port carried; the
wire decoder finds our line after any prefix, as it does on the raw port.

Permission: ``logging.logEntries.list`` (e.g. ``roles/logging.viewer``) and an OAuth scope that
covers Logging (``logging.read`` or ``cloud-platform``). A refusal is never a verdict: the caller
treats any error as "no evidence".
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Any

from gce_watchdog.lib.compute import HTTPSession

DEFAULT_LOGGING_API_BASE = "https://logging.googleapis.com/v2"
SCOPES = ("https://www.googleapis.com/auth/logging.read",)
SERIAL_LOG_ID = "serialconsole.googleapis.com%2Fserial_port_1_output"
PAGE_SIZE = 1000  # entries.list refuses more than 1000
MAX_PAGES = 2  # at most two requests per instance and boot: the poller's request budget
_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})|\\r|\\n|\\t|\\\\")


class LoggingError(Exception):
    """Cloud Logging could not be read (any status, a transport error): never evidence."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def serial_log_name(project: str) -> str:
    return f"projects/{project}/logs/{SERIAL_LOG_ID}"


def serial_filter(project: str, instance_id: str, since: float | None) -> str:
    """The filter of one instance's serial port 1 export, from ``since`` (epoch s) on."""
    parts = [
        f'logName="{serial_log_name(project)}"',
        'resource.type="gce_instance"',
        f'resource.labels.instance_id="{instance_id}"',
    ]
    if since is not None:  # a time range keeps the query on indexed fields (entries.list docs)
        t = dt.datetime.fromtimestamp(since, dt.UTC).isoformat(timespec="seconds")
        parts.append(f'timestamp>="{t.replace("+00:00", "Z")}"')
    return " AND ".join(parts)


def _unescape(m: re.Match[bytes]) -> bytes:
    tok = m.group(0)
    if m.group(1) is not None:
        return bytes([int(m.group(1), 16)])
    return {b"\\r": b"\r", b"\\n": b"\n", b"\\t": b"\t", b"\\\\": b"\\"}[tok]


def decode_payload(text: str) -> bytes:
    """One entry's ``textPayload`` as the port's bytes, ending in exactly one newline: literal
    ``\\r\\n``/``\\xNN`` escapes undone, a trailing CR/LF (real or escaped) dropped."""
    raw = _ESCAPE.sub(_unescape, text.encode("utf-8", "surrogateescape"))
    return raw.rstrip(b"\r\n") + b"\n"


@dataclass
class LoggingClient:
    """``entries.list`` through an authorized session (its own scopes: see the module)."""

    session: HTTPSession
    base: str = DEFAULT_LOGGING_API_BASE
    timeout: float | tuple[float, float] = (10.0, 30.0)
    max_pages: int = MAX_PAGES

    def serial_lines(self, project: str, instance_id: str, since: float | None) -> bytes:
        """The instance's exported serial output from ``since`` on, oldest first, one line per
        entry. Read newest first (``timestamp desc``), so that the pages allowed always hold the
        end of the log, where a final line is; then put back in order. Raises LoggingError on
        any failure (a 403 without the permission, a 404, ...)."""
        body: dict[str, Any] = {
            "resourceNames": [f"projects/{project}"],
            "filter": serial_filter(project, instance_id, since),
            "orderBy": "timestamp desc",
            "pageSize": PAGE_SIZE,
        }
        out: list[bytes] = []
        url = self.base.rstrip("/") + "/entries:list"
        for _ in range(max(1, self.max_pages)):
            try:
                r = self.session.request("POST", url, json=body, timeout=self.timeout)
            except Exception as e:  # an edge: every failure is "no evidence"
                raise LoggingError(f"entries:list: {type(e).__name__}: {e}") from None
            try:
                answer = r.json()
            except ValueError:
                answer = None
            if r.status_code != 200 or not isinstance(answer, dict):
                raise LoggingError(f"entries:list answered {r.status_code}", r.status_code)
            for entry in answer.get("entries") or ():
                text = entry.get("textPayload") if isinstance(entry, dict) else None
                if isinstance(text, str):
                    out.append(decode_payload(text))
            token = answer.get("nextPageToken")
            if not isinstance(token, str) or not token:
                break
            body["pageToken"] = token
        return b"".join(reversed(out))

    def close(self) -> None:
        self.session.close()


def create_logging_client(
    credentials: Any = None, base: str | None = None, max_pages: int = MAX_PAGES
) -> LoggingClient:
    """A client on an ``AuthorizedSession`` (``credentials`` None: application defaults with
    the ``logging.read`` scope; tests pass a token's credentials)."""
    import google.auth
    from google.auth.transport.requests import AuthorizedSession

    if credentials is None:
        credentials, _ = google.auth.default(scopes=list(SCOPES))
    session = AuthorizedSession(credentials)  # type: ignore[no-untyped-call]
    return LoggingClient(session, base or DEFAULT_LOGGING_API_BASE, max_pages=max_pages)
