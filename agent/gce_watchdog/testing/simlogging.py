"""A fake Cloud Logging API (``entries.list`` only): a real HTTP server on 127.0.0.1.

Used by the poller's Cloud Logging evidence tests (docs/fakes.md lists each behaviour with its
reference). Served under ``/v2`` like the real service:

- **Method.** ``POST /v2/entries:list`` with a JSON body ``resourceNames``, ``filter``,
  ``orderBy``, ``pageSize``, ``pageToken``; the answer has ``entries`` and, when more remain,
  ``nextPageToken`` (Logging API reference, "Method: entries.list"). Another path: 404.
- **Auth.** Without ``Authorization: Bearer <token>`` for the fake's token: 401
  ``UNAUTHENTICATED`` (Google's "AIP-193 errors" status mapping).
- **resourceNames.** Required: an empty list is 400 ``INVALID_ARGUMENT``; only entries of the
  projects named are searched ("Referencing a parent resource that is not listed in
  resource_names will cause the filter to return no results", the ``filter`` field's docs).
- **pageSize.** Default 50; negative or over 1000 is 400 ("If the value is negative or exceeds
  1000, the request is rejected", the ``pageSize`` field's docs).
- **orderBy.** ``timestamp asc`` (the default) or ``timestamp desc``; anything else 400 ("the
  only permitted values are ``timestamp asc`` (default) and ``timestamp desc``").
- **filter.** A subset of the Logging query language: comparisons ``FIELD="VALUE"`` on
  ``logName``, ``resource.type``, ``resource.labels.instance_id`` and ``timestamp>=``/``>``/
  ``<=``/``<`` RFC 3339, joined by ``AND`` (Logging docs, "Logging query language"). A filter
  the fake cannot read is refused with 400, never silently widened.
- **Entries.** The serial export's shape: ``logName``
  ``projects/P/logs/serialconsole.googleapis.com%2Fserial_port_1_output``, resource
  ``gce_instance`` with ``instance_id``/``zone`` labels, a ``textPayload`` as exported (the
  caller writes literal ``\\r\\n``, ``\\xNN`` escapes and journald prefixes into it, as
  GoogleCloudPlatform/khi's serial-port field set test shows them).
- **Faults.** ``set_status(code)`` answers every call with that status and a Google error body
  (a 403 ``PERMISSION_DENIED`` without ``logging.logEntries.list``, a 404), until cleared.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SERIAL_LOG_ID = "serialconsole.googleapis.com%2Fserial_port_1_output"
_STATUS_NAME = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL",
                503: "UNAVAILABLE"}  # fmt: skip
_TERM = re.compile(
    r"^\s*(logName|resource\.type|resource\.labels\.instance_id|timestamp)\s*"
    r'(=|>=|<=|>|<)\s*"([^"]*)"\s*$'
)


def _ts(raw: str) -> float:
    return dt.datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()


@dataclass
class FakeEntry:
    project: str
    instance_id: str
    text: str
    timestamp: float
    zone: str = "us-central1-a"
    log_id: str = SERIAL_LOG_ID

    def to_json(self) -> dict[str, Any]:
        t = dt.datetime.fromtimestamp(self.timestamp, dt.UTC).isoformat(timespec="microseconds")
        return {
            "logName": f"projects/{self.project}/logs/{self.log_id}",
            "resource": {
                "type": "gce_instance",
                "labels": {
                    "project_id": self.project,
                    "instance_id": self.instance_id,
                    "zone": self.zone,
                },
            },
            "textPayload": self.text,
            "timestamp": t.replace("+00:00", "Z"),
        }

    def value(self, name: str) -> str:
        if name == "logName":
            return f"projects/{self.project}/logs/{self.log_id}"
        if name == "resource.type":
            return "gce_instance"
        return self.instance_id  # resource.labels.instance_id


@dataclass
class Call:
    path: str
    body: dict[str, Any]
    status: int


@dataclass
class FakeLoggingAPI:
    token: str = "tok"  # noqa: S105 (the fake's own test token)
    host: str = "127.0.0.1"
    entries: list[FakeEntry] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    _status: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    # -- control -----------------------------------------------------------------------------
    def add_serial(
        self, project: str, instance_id: str, text: str, timestamp: float, zone: str = ""
    ) -> None:
        with self._lock:
            self.entries.append(
                FakeEntry(project, instance_id, text, timestamp, zone or "us-central1-a")
            )

    def set_status(self, status: int | None) -> None:
        with self._lock:
            self._status = status

    def start(self) -> FakeLoggingAPI:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                status, out = api._handle(self.path, self.headers.get("Authorization"), raw)
                blob = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(blob)))
                self.end_headers()
                self.wfile.write(blob)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((self.host, 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def base_url(self) -> str:
        assert self._server is not None, "server not started"
        return f"http://{self.host}:{self._server.server_address[1]}/v2"

    # -- the method ---------------------------------------------------------------------------
    def _handle(self, path: str, auth: str | None, raw: bytes) -> tuple[int, dict[str, Any]]:
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = None
        status, out = self._answer(path, auth, body)
        with self._lock:
            self.calls.append(Call(path, body if isinstance(body, dict) else {}, status))
        return status, out

    def _answer(self, path: str, auth: str | None, body: Any) -> tuple[int, dict[str, Any]]:
        if path.split("?")[0] != "/v2/entries:list":
            return _error(404, f"no method at {path}")
        if auth != f"Bearer {self.token}":
            return _error(401, "Request had invalid authentication credentials.")
        with self._lock:
            fault = self._status
        if fault is not None:
            return _error(fault, "The caller does not have permission" if fault == 403 else "")
        if not isinstance(body, dict):
            return _error(400, "Invalid JSON payload received.")
        names = body.get("resourceNames") or []
        projects = {n.split("/", 1)[1] for n in names if str(n).startswith("projects/")}
        if not names:
            return _error(400, "resourceNames is required")
        size = body.get("pageSize", 50)
        if not isinstance(size, int) or size < 0 or size > 1000:
            return _error(400, "pageSize must be 0 to 1000")
        size = size or 50
        order = body.get("orderBy", "timestamp asc")
        if order not in ("timestamp asc", "timestamp desc"):
            return _error(400, f"orderBy {order!r} is not supported")
        try:
            terms = _parse_filter(str(body.get("filter", "")))
        except ValueError as e:
            return _error(400, f"invalid filter: {e}")
        with self._lock:
            found = [e for e in self.entries if e.project in projects and _match(e, terms)]
        found.sort(key=lambda e: e.timestamp, reverse=order == "timestamp desc")
        start = int(body.get("pageToken") or 0)
        page = found[start : start + size]
        out: dict[str, Any] = {"entries": [e.to_json() for e in page]}
        if start + size < len(found):
            out["nextPageToken"] = str(start + size)
        return 200, out


def _parse_filter(flt: str) -> list[tuple[str, str, str]]:
    if not flt.strip():
        return []
    terms = []
    for part in re.split(r"\s+AND\s+", flt.strip()):
        m = _TERM.match(part)
        if m is None:
            raise ValueError(f"cannot read {part!r}")
        terms.append((m.group(1), m.group(2), m.group(3)))
    return terms


def _match(e: FakeEntry, terms: list[tuple[str, str, str]]) -> bool:
    for name, op, value in terms:
        if name == "timestamp":
            t = _ts(value)
            ok = {">=": e.timestamp >= t, ">": e.timestamp > t, "<=": e.timestamp <= t,
                  "<": e.timestamp < t, "=": e.timestamp == t}[op]  # fmt: skip
        else:
            ok = op == "=" and e.value(name) == value
        if not ok:
            return False
    return True


def _error(code: int, message: str) -> tuple[int, dict[str, Any]]:
    status = _STATUS_NAME.get(code, "UNKNOWN")
    return code, {"error": {"code": code, "message": message or status, "status": status}}
