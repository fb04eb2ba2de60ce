"""A fake Compute Engine API: a real HTTP server on 127.0.0.1 with the real serial-port semantics.

Used by the poller's tests, the e2e test, the benchmarks and the action-chain tests. It serves the
few ``compute/v1`` calls this project makes, under ``/compute/v1`` like the real service::

    GET    /compute/v1/projects/{p}/zones/{z}/instances/{name}/serialPort?port=1&start=N
    GET    /compute/v1/projects/{p}/zones/{z}/instances/{name}
    GET    /compute/v1/projects/{p} and /compute/v1/projects/{p}/zones/{z} (404 unless known)
    DELETE /compute/v1/projects/{p}/zones/{z}/instances/{name}?requestId=UUID
    POST   /compute/v1/projects/{p}/zones/{z}/instances/{name}/stop?requestId=UUID
    GET    /compute/v1/projects/{p}/aggregated/instances?filter=F&maxResults=N&pageToken=T

``instances.aggregatedList`` answers as the API does: ``items`` keyed ``zones/ZONE``, each with an
``instances`` list, or, for a known zone with none that match, a ``warning`` with code
``NO_RESULTS_ON_PAGE``; ``nextPageToken`` while more remain (``maxResults`` 0..500, default 500).
The fake's filter understands the label forms the poller sends: ``labels.KEY = "VALUE"`` (AIP-160)
and ``labels.KEY:*`` (has the label); any other filter is a 400, like a malformed one on GCE.

Semantics copied from the API reference of ``instances.getSerialPortOutput``:

- only the most recent ``window`` bytes (1 MiB by default) are kept; a ``start`` that refers to
  discarded output is moved to the oldest byte still held, and that adjusted value is returned
  as ``start``;
- a negative ``start`` means "the most recent ``-start`` bytes", bounded by the retained window;
- ``next`` is the offset to pass as ``start`` on the following call;
- int64 fields (``start``, ``next``, ``id``) are JSON strings, as in every Compute API response.

Where the reference is silent the fake chooses: a ``start`` beyond the end returns no contents
with ``start = next = end`` (a reader sees ``next`` below its offset, i.e. a reset buffer).

Every request needs ``Authorization: Bearer <token>`` with an accepted token (401 otherwise).
Tests can make an endpoint hang (sleep past the client's timeout), refuse (403) or rate-limit
for the next N calls: ``RATE_LIMIT`` answers as GCE does, 403 with reason ``rateLimitExceeded``
in the error body (Compute Engine docs, "API rate limits": "a 403 error with the reason
rateLimitExceeded"); ``TOO_MANY_REQUESTS`` is a 429 with the same reason, what Google front ends
answer for other APIs (a client must take both).
``delete`` and ``stop`` honour ``requestId``: the same id returns the same operation and does
not act twice.

Usage::

    with FakeComputeAPI(token="t") as api:
        api.add_instance("vm-1", spot=True)
        api.append_serial("vm-1", b"hello\\n")
        client = ComputeClient.create(credentials, api_base=api.base_url)  # lib.compute
"""

from __future__ import annotations

import enum
import itertools
import json
import re
import socket
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

DEFAULT_WINDOW = 1024 * 1024  # the API keeps "the most recent 1 MB" of serial output
DEFAULT_HANG_S = 30.0  # longer than any client read timeout a test would use

_LIST_RE = re.compile(r"^/compute/v1/projects/(?P<project>[^/]+)/aggregated/instances$")
_LABEL_EQ_RE = re.compile(r'^labels\.(?P<key>[a-z][-_a-z0-9]*)\s*=\s*"(?P<value>[-_a-z0-9]*)"$')
_LABEL_HAS_RE = re.compile(r"^labels\.(?P<key>[a-z][-_a-z0-9]*):\*$")
MAX_RESULTS = 500  # the API's default and maximum page size for aggregatedList
_PATH_RE = re.compile(
    r"^/compute/v1/projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/instances/(?P<name>[^/]+)"
    r"(?P<rest>/serialPort|/stop)?$"
)


class Fault(enum.Enum):
    """What an endpoint does instead of answering normally."""

    HANG = "hang"  # sleep hang_s before answering (the client's read timeout fires first)
    REFUSE = "refuse"  # 403 forbidden
    # Compute Engine docs, "API rate limits": "a 403 error with the reason rateLimitExceeded"
    RATE_LIMIT = "rate_limit"  # 403 with reason rateLimitExceeded, as GCE answers
    TOO_MANY_REQUESTS = "too_many_requests"  # 429 with reason rateLimitExceeded
    SERVER_ERROR = "server_error"  # 503 backendError


ENDPOINTS = ("serial", "get", "delete", "stop", "list", "scope")
# A project, or a zone of a project: known once an instance was added there (or add_zone).
_SCOPE_RE = re.compile(r"^/compute/v1/projects/(?P<project>[^/]+)(?:/zones/(?P<zone>[^/]+))?$")


@dataclass(frozen=True)
class Call:
    """One request as the server saw it."""

    method: str
    endpoint: str  # serial | get | delete | stop | unknown
    path: str
    query: dict[str, str]
    authorized: bool
    status: int


@dataclass
class FakeInstance:
    name: str
    project: str
    zone: str
    id: str
    status: str = "RUNNING"
    spot: bool = False
    termination_action: str = "STOP"
    deleted: bool = False
    total: int = 0  # bytes ever written to serial port 1
    retained: bytearray = field(default_factory=bytearray)
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class _FaultPlan:
    fault: Fault
    remaining: int  # calls left to affect; -1 = every call until cleared


class FakeComputeAPI:
    """A threaded HTTP server pretending to be ``compute.googleapis.com``; a context manager."""

    def __init__(
        self,
        token: str | list[str] = "test-token",  # noqa: S107 (a fake server's test token)
        window: int = DEFAULT_WINDOW,
        hang_s: float = DEFAULT_HANG_S,
        host: str = "127.0.0.1",
    ) -> None:
        self.tokens = {token} if isinstance(token, str) else set(token)
        self.window = window
        self.hang_s = hang_s
        self.retry_after: str | None = "1"  # the Retry-After header of a RATE_LIMIT fault
        self.host = host
        self.calls: list[Call] = []
        self.operations: dict[str, dict[str, Any]] = {}  # requestId -> operation
        self._instances: dict[tuple[str, str, str], FakeInstance] = {}
        self._zones: set[tuple[str, str]] = set()  # projects and zones that exist (add_zone)
        self._faults: dict[str, _FaultPlan] = {}
        # per-instance and per-project faults (a slow VM; a project out of quota)
        self._instance_faults: dict[str, _FaultPlan] = {}
        self._project_faults: dict[str, _FaultPlan] = {}
        self.zones: set[tuple[str, str]] = set()  # (project, zone) pairs a list reports
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._ids = itertools.count(4_000_000_000_000_000_001)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> FakeComputeAPI:
        handler = _make_handler(self)
        self._server = ThreadingHTTPServer((self.host, 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing.set()  # wakes any hanging handler
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> FakeComputeAPI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def port(self) -> int:
        assert self._server is not None, "server not started"
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        """What a client uses in place of https://compute.googleapis.com/compute/v1."""
        return f"http://{self.host}:{self.port}/compute/v1"

    # -- test controls ----------------------------------------------------------------------

    def add_instance(
        self,
        name: str,
        project: str = "test-project",
        zone: str = "us-central1-a",
        status: str = "RUNNING",
        spot: bool = False,
        termination_action: str = "STOP",
        instance_id: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> FakeInstance:
        inst = FakeInstance(
            name=name,
            project=project,
            zone=zone,
            id=instance_id or str(next(self._ids)),
            status=status,
            spot=spot,
            termination_action=termination_action,
            labels=dict(labels or {}),
        )
        with self._lock:
            self._instances[(project, zone, name)] = inst
            self.zones.add((project, zone))
        return inst

    def instance(self, name: str) -> FakeInstance:
        """The instance with this name (in any project/zone); KeyError if none."""
        with self._lock:
            for (_, _, n), inst in self._instances.items():
                if n == name:
                    return inst
        raise KeyError(name)

    def append_serial(self, name: str, data: bytes) -> None:
        """Write bytes to the instance's serial port 1, dropping what falls out of the window."""
        inst = self.instance(name)
        with self._lock:
            inst.total += len(data)
            inst.retained += data
            excess = len(inst.retained) - self.window
            if excess > 0:
                del inst.retained[:excess]

    def reset_serial(self, name: str) -> None:
        """Empty the port as if the instance were recreated (offsets restart at 0)."""
        inst = self.instance(name)
        with self._lock:
            inst.total = 0
            inst.retained = bytearray()

    def set_status(self, name: str, status: str) -> None:
        inst = self.instance(name)
        with self._lock:
            inst.status = status

    def set_fault(self, endpoint: str, fault: Fault | None, count: int = -1) -> None:
        """Make the next ``count`` calls to ``endpoint`` (or all, -1) fail; None clears it."""
        if endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {endpoint!r}; one of {ENDPOINTS}")
        with self._lock:
            if fault is None:
                self._faults.pop(endpoint, None)
            else:
                self._faults[endpoint] = _FaultPlan(fault, count)

    def set_instance_fault(self, name: str, fault: Fault | None, count: int = -1) -> None:
        """Every call about instance ``name`` (get, serial, delete, stop) fails this way."""
        with self._lock:
            if fault is None:
                self._instance_faults.pop(name, None)
            else:
                self._instance_faults[name] = _FaultPlan(fault, count)

    def set_project_fault(self, project: str, fault: Fault | None, count: int = -1) -> None:
        """Every call in ``project`` fails this way (e.g. its rate quota is spent)."""
        with self._lock:
            if fault is None:
                self._project_faults.pop(project, None)
            else:
                self._project_faults[project] = _FaultPlan(fault, count)

    def calls_to(self, endpoint: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.endpoint == endpoint]

    # -- request handling (called from server threads) --------------------------------------

    def _take_fault(self, endpoint: str, project: str = "", name: str = "") -> Fault | None:
        with self._lock:
            for table, key in (
                (self._faults, endpoint),
                (self._project_faults, project),
                (self._instance_faults, name),
            ):
                plan = table.get(key) if key else None
                if plan is None:
                    continue
                if plan.remaining > 0:
                    plan.remaining -= 1
                    if plan.remaining == 0:
                        del table[key]
                return plan.fault
            return None

    def _handle(
        self, method: str, raw_path: str, auth: str | None
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        parts = urlsplit(raw_path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        m = _PATH_RE.match(parts.path) or _LIST_RE.match(parts.path)
        rest = m.group("rest") if m and "rest" in m.groupdict() else None
        scope = _SCOPE_RE.match(parts.path) if m is None and method == "GET" else None
        endpoint = "scope" if scope else "unknown"
        if m and "name" not in m.groupdict():
            endpoint = "list" if method == "GET" else "unknown"
        elif m:
            endpoint = {None: "get" if method == "GET" else "delete", "/serialPort": "serial"}.get(
                rest, "stop"
            )
            if (endpoint, method) not in {
                ("get", "GET"),
                ("delete", "DELETE"),
                ("serial", "GET"),
                ("stop", "POST"),
            }:
                endpoint = "unknown"
        token = auth[len("Bearer ") :] if auth and auth.startswith("Bearer ") else None
        authorized = token in self.tokens
        if scope is not None:
            status, body, headers = self._scope(scope, authorized)
        else:
            status, body, headers = self._dispatch(method, endpoint, m, query, authorized)
        with self._lock:
            self.calls.append(Call(method, endpoint, parts.path, query, authorized, status))
        return status, body, headers

    def _scope(
        self, m: re.Match[str], authorized: bool
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """projects.get / zones.get: 404 with the API's wording for what does not exist."""
        if not authorized:
            return (
                401,
                _error(401, "Request is missing required authentication credential.", "required"),
                {},
            )
        project, zone = m.group("project"), m.group("zone")
        with self._lock:
            zones = {(p, z) for p, z, _ in self._instances} | self._zones
        if project not in {p for p, _ in zones}:
            what = f"projects/{project}"
            return 404, _error(404, f"The resource '{what}' was not found", "notFound"), {}
        if zone is None:
            return 200, {"kind": "compute#project", "name": project}, {}
        if (project, zone) not in zones:
            what = f"projects/{project}/zones/{zone}"
            return 404, _error(404, f"The resource '{what}' was not found", "notFound"), {}
        return 200, {"kind": "compute#zone", "name": zone, "status": "UP"}, {}

    def add_zone(self, project: str, zone: str) -> None:
        """Make a project and zone exist without any instance in them."""
        with self._lock:
            self._zones.add((project, zone))

    def _dispatch(
        self,
        method: str,
        endpoint: str,
        m: re.Match[str] | None,
        query: dict[str, str],
        authorized: bool,
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        if not authorized:
            return (
                401,
                _error(401, "Request is missing required authentication credential.", "required"),
                {"WWW-Authenticate": 'Bearer realm="https://accounts.google.com/"'},
            )
        if m is None or endpoint == "unknown":
            return 404, _error(404, "The requested URL was not found.", "notFound"), {}
        groups = m.groupdict()
        fault = self._take_fault(endpoint, groups["project"], groups.get("name") or "")
        if fault is Fault.HANG:
            self._closing.wait(self.hang_s)
        elif fault is Fault.REFUSE:
            return 403, _error(403, "Required permission denied.", "forbidden"), {}
        elif fault in (Fault.RATE_LIMIT, Fault.TOO_MANY_REQUESTS):
            code = 403 if fault is Fault.RATE_LIMIT else 429
            return (
                code,
                _error(
                    code,
                    "Rate Limit Exceeded",
                    "rateLimitExceeded",
                    domain="usageLimits",
                ),
                {"Retry-After": self.retry_after} if self.retry_after is not None else {},
            )
        elif fault is Fault.SERVER_ERROR:
            return 503, _error(503, "Backend Error", "backendError"), {}
        if endpoint == "list":
            return self._list(m.group("project"), query)
        project, zone, name = m.group("project"), m.group("zone"), m.group("name")
        with self._lock:
            inst = self._instances.get((project, zone, name))
            if endpoint in ("delete", "stop"):
                rid = query.get("requestId")
                if rid:
                    try:
                        uuid.UUID(rid)
                    except ValueError:
                        bad = "Invalid value for field 'requestId'"
                        return 400, _error(400, bad, "invalid"), {}
                    if rid in self.operations:
                        return 200, self.operations[rid], {}
            if inst is None or inst.deleted:
                what = f"projects/{project}/zones/{zone}/instances/{name}"
                return 404, _error(404, f"The resource '{what}' was not found", "notFound"), {}
            if endpoint == "get":
                return 200, _instance_json(inst), {}
            if endpoint == "serial":
                return self._serial(inst, query)
            op = _operation(inst, endpoint)
            if endpoint == "delete":
                inst.deleted = True
                inst.status = "TERMINATED"
            else:
                inst.status = "TERMINATED"
            if query.get("requestId"):
                self.operations[query["requestId"]] = op
            return 200, op, {}

    def _list(
        self, project: str, query: dict[str, str]
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        flt = query.get("filter", "").strip()
        match: Any = None
        if flt:
            eq, has = _LABEL_EQ_RE.match(flt), _LABEL_HAS_RE.match(flt)
            if eq:
                match = lambda i: i.labels.get(eq["key"]) == eq["value"]  # noqa: E731
            elif has:
                match = lambda i: has["key"] in i.labels  # noqa: E731
            else:
                return 400, _error(400, f"Invalid value for field 'filter': '{flt}'", "invalid"), {}
        try:
            size = int(query.get("maxResults", str(MAX_RESULTS)))
            offset = int(query.get("pageToken") or "0", 16) if query.get("pageToken") else 0
        except ValueError:
            return 400, _error(400, "Invalid value for 'maxResults' or 'pageToken'", "invalid"), {}
        if not 0 <= size <= MAX_RESULTS:
            return (
                400,
                _error(400, f"Invalid value for field 'maxResults': '{size}'", "invalid"),
                {},
            )
        size = size or MAX_RESULTS
        with self._lock:
            if not any(p == project for p, _ in self.zones):
                what = f"projects/{project}"
                return 404, _error(404, f"The resource '{what}' was not found", "notFound"), {}
            matching = sorted(
                (i for (p, _, _), i in self._instances.items() if p == project and not i.deleted),
                key=lambda i: (i.zone, i.name),
            )
            matching = [i for i in matching if match is None or match(i)]
            page = [
                _instance_json(i) | {"labels": dict(i.labels)}
                for i in matching[offset : offset + size]
            ]
            zones = sorted(z for p, z in self.zones if p == project)
        items: dict[str, Any] = {}
        for z in zones:
            here = [i for i in page if i["zone"].endswith(f"/zones/{z}")]
            if here:
                items[f"zones/{z}"] = {"instances": here}
            else:
                items[f"zones/{z}"] = {
                    "warning": {
                        "code": "NO_RESULTS_ON_PAGE",
                        "message": "There are no results for scope 'zones/" + z + "' on this page.",
                        "data": [{"key": "scope", "value": f"zones/{z}"}],
                    }
                }
        body: dict[str, Any] = {
            "kind": "compute#instanceAggregatedList",
            "id": f"projects/{project}/aggregated/instances",
            "items": items,
            "selfLink": f"https://www.googleapis.com/compute/v1/projects/{project}/aggregated/instances",
        }
        if offset + size < len(matching):
            body["nextPageToken"] = format(offset + size, "x")
        return 200, body, {}

    def _serial(
        self, inst: FakeInstance, query: dict[str, str]
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        try:
            port = int(query.get("port", "1"))
            start = int(query.get("start", "0"))
        except ValueError:
            return 400, _error(400, "Invalid value for 'port' or 'start'", "invalid"), {}
        if not 1 <= port <= 4:
            return 400, _error(400, f"Invalid value for field 'port': '{port}'", "invalid"), {}
        total = inst.total if port == 1 else 0
        data = bytes(inst.retained) if port == 1 else b""
        oldest = total - len(data)
        if start < 0:
            s = max(total + start, oldest)
        elif start > total:
            s = total
        else:
            s = max(start, oldest)
        contents = data[s - oldest :]
        base = f"projects/{inst.project}/zones/{inst.zone}/instances/{inst.name}"
        return (
            200,
            {
                "kind": "compute#serialPortOutput",
                "contents": contents.decode("utf-8", errors="replace"),
                "start": str(s),
                "next": str(total),
                "selfLink": f"https://www.googleapis.com/compute/v1/{base}/serialPort",
            },
            {},
        )


def _error(code: int, message: str, reason: str, domain: str = "global") -> dict[str, Any]:
    return {
        "error": {
            "code": code,
            "message": message,
            "errors": [{"message": message, "domain": domain, "reason": reason}],
        }
    }


def _instance_json(inst: FakeInstance) -> dict[str, Any]:
    base = f"projects/{inst.project}/zones/{inst.zone}"
    return {
        "kind": "compute#instance",
        "id": inst.id,
        "name": inst.name,
        "status": inst.status,
        "zone": f"https://www.googleapis.com/compute/v1/{base}",
        "selfLink": f"https://www.googleapis.com/compute/v1/{base}/instances/{inst.name}",
        "scheduling": {
            "provisioningModel": "SPOT" if inst.spot else "STANDARD",
            "preemptible": inst.spot,
            "instanceTerminationAction": inst.termination_action,
        },
    }


def _operation(inst: FakeInstance, kind: str) -> dict[str, Any]:
    base = f"projects/{inst.project}/zones/{inst.zone}"
    op_id = uuid.uuid4().int % 10**19
    return {
        "kind": "compute#operation",
        "id": str(op_id),
        "name": f"operation-{op_id}",
        "operationType": kind,
        "status": "DONE",
        "progress": 100,
        "targetId": inst.id,
        "targetLink": f"https://www.googleapis.com/compute/v1/{base}/instances/{inst.name}",
        "zone": f"https://www.googleapis.com/compute/v1/{base}",
    }


def _make_handler(api: FakeComputeAPI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Headers and body go out in two writes: without NODELAY, Nagle + delayed ACK
            # add ~40 ms to every keep-alive response.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)  # stop takes an empty body; drain what was sent
            status, body, headers = api._handle(
                method, self.path, self.headers.get("Authorization")
            )
            blob = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(blob)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(blob)
            except OSError:
                pass  # the client gave up (hang fault): nothing to answer

        def do_GET(self) -> None:
            self._serve("GET")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:
            pass  # tests read api.calls instead

    return Handler
