"""A simulated GCE environment made of real servers, for tests, the demo and the VM end-to-end test.

- :class:`FakeMetadataServer`: a real HTTP server speaking the metadata server's dialect: the
  ``Metadata-Flavor: Google`` request/response header, instance id/name/zone/hostname, project id,
  attributes, the default service account, its scopes (``compute.readonly`` by default: it cannot
  write the VM's metadata, so the agent obeys the metadata attributes; ``set_scopes``) and its
  token (the path google-auth's Compute Engine credentials use), ``wait_for_change`` long
  polls with ETags, and fault modes (slow, hang, 503, missing flavor header, refused).
- :class:`TcpListener`: accepts and closes TCP connections (stands in for "the internet on 443").
- :class:`FakeDNS`: a UDP DNS server (dnspython message codec) that can answer only after a delay,
  never, or with SERVFAIL.
- :class:`StaticFileServer`: serves a folder (the wheelhouse of the VM test).
- :class:`SimGCE`: all of the above together, plus a control socket (a Unix socket on the
  filesystem, so tests in another network namespace can still reach it).

Run standalone (e.g. inside a network namespace): ``python -m gce_watchdog.testing.simgce --help``.
Nothing here is used by the agent at run time.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

from gce_watchdog.lib.files import atomic_write

FLAVOR = "Metadata-Flavor"
TOKEN = "ya29.fake-token-for-tests"  # noqa: S105 - a fake token for the fake server
MODES = ("ok", "slow", "hang", "http_503", "bad_flavor", "refuse")


# What the fake service account has by default: no scope that can write instance metadata
# (compute.readonly; logging and monitoring writes, what an agent VM needs besides).
READONLY_SCOPES = (
    "https://www.googleapis.com/auth/compute.readonly",
    "https://www.googleapis.com/auth/logging.write",
    "https://www.googleapis.com/auth/monitoring.write",
)


@dataclass
class SimInstance:
    id: str = "4520031799277582145"
    name: str = "sim-vm-1"
    zone: str = "us-central1-a"
    project: str = "sim-project"
    numeric_project: str = "123456789012"
    attributes: dict[str, str] = field(default_factory=dict)
    preempted: str = "FALSE"
    maintenance_event: str = "NONE"
    # The default service account's scopes (instance/service-accounts/default/scopes, one a
    # line); None: the VM has no service account (its paths answer 404). By default a scope that
    # cannot write metadata, so the agent obeys the disarm and fault attributes (daemon/
    # mdtrust.py); a test of the metadata trust check sets cloud-platform or compute.
    scopes: list[str] | None = field(default_factory=lambda: list(READONLY_SCOPES))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    sim: FakeMetadataServer


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_GET(self) -> None:
        self.server.sim._handle(self)


class FakeMetadataServer:
    """A real HTTP metadata server on (host, port); port 0 picks a free one."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, info: SimInstance | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.info = info or SimInstance()
        self.mode = "ok"
        self.delay = 0.0  # seconds, for mode "slow"
        self.requests: list[str] = []
        self._cond = threading.Condition()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # A counted outage (set_outage_for): probes still to hang, and what ends the outage
        self._probes_left: int | None = None
        self._on_outage_end: Callable[[], None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> FakeMetadataServer:
        srv = _Server((self.host, self.port), _Handler)
        srv.sim = self
        self.port = srv.server_address[1]
        self._server = srv
        self._thread = threading.Thread(target=srv.serve_forever, name="fake-mds", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeMetadataServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The agent's default probe URL on this server."""
        return f"{self.base}/computeMetadata/v1/instance/id"

    # -- control --------------------------------------------------------------------------------
    def set_mode(self, mode: str, delay: float = 0.0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        with self._cond:
            self.mode, self.delay = mode, delay
            self._cond.notify_all()

    def set_outage_for(self, probes: int, on_end: Callable[[], None] | None = None) -> None:
        """Hang every request until ``probes`` probes (requests for :attr:`url`) have hung; the
        next probe ends the outage itself (mode "ok", then ``on_end``) before it is answered.

        Ends an outage after an exact number of agent ticks whatever the load, where a watcher
        that restores the mode on seeing a line can be late by a tick.
        """
        if probes < 0:
            raise ValueError("probes must be >= 0")
        with self._cond:
            self.mode, self.delay = "hang", 0.0
            self._probes_left, self._on_outage_end = probes, on_end
            self._cond.notify_all()

    def _count_probe(self, path: str) -> None:
        """Apply a counted outage to one request (see set_outage_for)."""
        on_end = None
        with self._cond:
            if self._probes_left is None or path != urlsplit(self.url).path:
                return
            if self._probes_left > 0:
                self._probes_left -= 1
                return
            self._probes_left, on_end, self._on_outage_end = None, self._on_outage_end, None
            self.mode = "ok"
            self._cond.notify_all()
        if on_end is not None:
            on_end()

    def set_attribute(self, key: str, value: str | None) -> None:
        with self._cond:
            if value is None:
                self.info.attributes.pop(key, None)
            else:
                self.info.attributes[key] = value
            self._cond.notify_all()

    def set_scopes(self, scopes: list[str] | None) -> None:
        """The default service account's scopes (None: the VM has none)."""
        with self._cond:
            self.info.scopes = None if scopes is None else list(scopes)
            self._cond.notify_all()

    def set_preempted(self, value: bool = True) -> None:
        with self._cond:
            self.info.preempted = "TRUE" if value else "FALSE"
            self._cond.notify_all()

    def set_maintenance(self, event: str) -> None:
        with self._cond:
            self.info.maintenance_event = event
            self._cond.notify_all()

    def count(self, path_suffix: str) -> int:
        return sum(1 for p in list(self.requests) if p.endswith(path_suffix))

    # -- serving --------------------------------------------------------------------------------
    def _value(self, path: str, query: dict[str, list[str]]) -> tuple[int, str, str]:
        """(status, body, content type) for a metadata path, under self._cond."""
        i = self.info
        v1 = "/computeMetadata/v1/"
        if path in ("", "/"):
            return 200, "computeMetadata/\n", "application/text"
        if not path.startswith(v1):
            return 404, "not found\n", "text/html"
        rel = path[len(v1) :]
        sa = "instance/service-accounts/default/"
        simple = {
            "instance/id": i.id,
            "instance/name": i.name,
            "instance/hostname": f"{i.name}.{i.zone}.c.{i.project}.internal",
            "instance/zone": f"projects/{i.numeric_project}/zones/{i.zone}",
            "project/project-id": i.project,
            "project/numeric-project-id": i.numeric_project,
            "instance/preempted": i.preempted,
            "instance/maintenance-event": i.maintenance_event,
            sa + "email": f"{i.numeric_project}-compute@developer.gserviceaccount.com",
        }
        if rel.startswith(sa.rstrip("/")) and i.scopes is None:  # no service account
            return 404, "not found\n", "text/html"
        if rel in simple:
            return 200, simple[rel], "application/text"
        if rel == sa + "scopes":  # one scope a line, as the metadata server lists them
            return 200, "".join(f"{x}\n" for x in i.scopes or ()), "application/text"
        if rel in (sa, sa.rstrip("/")):
            info = {
                "aliases": ["default"],
                "email": simple[sa + "email"],
                "scopes": list(i.scopes or ()),
            }
            return 200, json.dumps(info), "application/json"
        if rel == sa + "token":
            body = json.dumps({"access_token": TOKEN, "expires_in": 3599, "token_type": "Bearer"})
            return 200, body, "application/json"
        if rel == "instance/attributes/":
            return 200, "".join(f"{k}\n" for k in sorted(i.attributes)), "application/text"
        if rel.startswith("instance/attributes/"):
            key = rel[len("instance/attributes/") :]
            if key in i.attributes:
                return 200, i.attributes[key], "application/text"
        return 404, "not found\n", "text/html"

    def _handle(self, h: _Handler) -> None:
        split = urlsplit(h.path)
        query = parse_qs(split.query)
        self.requests.append(split.path)
        self._count_probe(split.path)
        with self._cond:
            mode, delay = self.mode, self.delay
        if mode == "refuse":
            # Closest a listening socket gets to "connection refused": reset without answering.
            with contextlib.suppress(OSError):
                h.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
            h.close_connection = True
            return
        if mode == "hang":
            # Never answer (a wedged path): hold the connection until the mode changes or stop.
            with self._cond:
                self._cond.wait_for(lambda: self.mode != "hang" or self._stopping.is_set(), 3600)
            h.close_connection = True
            return
        if mode == "slow" and delay > 0:
            self._stopping.wait(delay)
        if h.headers.get(FLAVOR) != "Google":
            self._send(h, 403, "Missing Metadata-Flavor:Google header.\n", "text/html", "")
            return
        if mode == "http_503":
            self._send(h, 503, "service unavailable\n", "text/html", "Google")
            return
        with self._cond:
            status, body, ctype = self._value(split.path, query)
            if status == 200 and query.get("wait_for_change", ["false"])[0] == "true":
                status, body, ctype = self._wait_for_change(split.path, query, body)
        etag = hashlib.sha256(body.encode()).hexdigest()[:16]
        flavor = "" if mode == "bad_flavor" else "Google"
        self._send(h, status, body, ctype, flavor, etag)

    def _wait_for_change(
        self, path: str, query: dict[str, list[str]], body: str
    ) -> tuple[int, str, str]:
        """Block (holding the condition) until the value's ETag differs from last_etag."""
        last = query.get("last_etag", [""])[0]
        try:
            timeout = float(query.get("timeout_sec", ["60"])[0])
        except ValueError:
            timeout = 60.0
        deadline = time.monotonic() + min(timeout, 3600)

        def changed() -> bool:
            cur = self._value(path, query)[1]
            return hashlib.sha256(cur.encode()).hexdigest()[:16] != last

        if last:
            while not changed() and not self._stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        return self._value(path, query)

    @staticmethod
    def _send(h: _Handler, status: int, body: str, ctype: str, flavor: str, etag: str = "") -> None:
        data = body.encode()
        with contextlib.suppress(OSError):
            h.send_response(status)
            if flavor:
                h.send_header(FLAVOR, flavor)
            h.send_header("Content-Type", ctype)
            h.send_header("Content-Length", str(len(data)))
            if etag:
                h.send_header("ETag", etag)
            h.end_headers()
            h.wfile.write(data)


class _SocketService:
    """A bound socket served by one thread; subclasses make the socket and handle one wake-up."""

    name = "socket-service"

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _make_socket(self) -> socket.socket:
        raise NotImplementedError

    def _serve_one(self, sock: socket.socket) -> None:
        """Handle one accept/recv; raises TimeoutError when idle (0.2 s poll)."""
        raise NotImplementedError

    def start(self) -> Self:
        s = self._make_socket()
        s.settimeout(0.2)  # the stop flag is checked this often
        self.port = s.getsockname()[1]
        self._sock = s
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stop.is_set():
            try:
                self._serve_one(sock)
            except TimeoutError:
                continue
            except OSError:
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class TcpListener(_SocketService):
    """Accepts TCP connections and closes them: a stand-in for a reachable 443 endpoint."""

    name = "fake-443"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self.accepted = 0

    def _make_socket(self) -> socket.socket:
        fam = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, self.port))
        s.listen(64)
        return s

    def _serve_one(self, sock: socket.socket) -> None:
        c, _ = sock.accept()
        self.accepted += 1
        c.close()


class FakeDNS(_SocketService):
    """UDP DNS server answering A and AAAA queries from a table (IPv4 or IPv6 ``host``).

    A resolver that is not ready yet is silence, measured from the client's side only, never from
    when this server started (a slow boot must not eat the silence, docs/e2e.md):
    ``silent_queries``: the first N queries get no answer; ``answer_after``: no answer for this
    many seconds from the first query seen. ``mode``: ``ok``, ``silent`` (never answers),
    ``servfail``. ``on_query(name, answered)`` is called for every query (a log, a test's event).
    """

    name = "fake-dns"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        records: dict[str, list[str]] | None = None,
        answer_after: float = 0.0,
        ttl: int = 60,
        clock: Callable[[], float] = time.monotonic,
        silent_queries: int = 0,
        on_query: Callable[[str, bool], None] | None = None,
    ) -> None:
        super().__init__(host, port)
        self.records = {k.rstrip(".").lower(): v for k, v in (records or {}).items()}
        self.answer_after = answer_after
        self.ttl = ttl  # seconds, on every answer's RRset
        self.silent_queries = silent_queries
        self.mode = "ok"
        self.queries = 0
        self.answered = 0
        self._clock = clock
        self._first: float | None = None  # when the first query arrived
        self._on_query = on_query

    def _make_socket(self) -> socket.socket:
        fam = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_DGRAM)
        s.bind((self.host, self.port))
        return s

    def _silent(self) -> bool:
        """Whether the query just counted gets no answer."""
        now = self._clock()
        if self._first is None:
            self._first = now
        if self.mode == "silent" or self.queries <= self.silent_queries:
            return True
        return now - self._first < self.answer_after

    def _serve_one(self, sock: socket.socket) -> None:
        import dns.flags
        import dns.message
        import dns.rcode
        import dns.rdatatype
        import dns.rrset

        data, addr = sock.recvfrom(4096)
        self.queries += 1
        silent = self._silent()
        try:
            q = dns.message.from_wire(data)
        except Exception:  # garbage in, no answer out
            return
        if self._on_query is not None:
            name = q.question[0].name.to_text() if q.question else "?"
            self._on_query(name, not silent)
        if silent:
            return
        r = dns.message.make_response(q)
        r.flags |= dns.flags.RA
        if self.mode == "servfail":
            r.set_rcode(dns.rcode.SERVFAIL)
        else:
            for question in q.question:
                name = question.name.to_text().rstrip(".").lower()
                ips = self.records.get(name)
                if ips is None:
                    r.set_rcode(dns.rcode.NXDOMAIN)
                elif question.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                    v6 = question.rdtype == dns.rdatatype.AAAA
                    mine = [ip for ip in ips if (":" in ip) == v6]
                    if mine:  # none: NOERROR with no data, as a real server says
                        rtype = "AAAA" if v6 else "A"
                        rrset = dns.rrset.from_text(question.name, self.ttl, "IN", rtype, *mine)
                        r.answer.append(rrset)
        self.answered += 1
        with contextlib.suppress(OSError):
            sock.sendto(r.to_wire(), addr)


class StaticFileServer:
    """Serves a folder over HTTP (the wheelhouse for the VM test)."""

    def __init__(self, root: str | Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self.root, self.host, self.port = Path(root), host, port
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> StaticFileServer:
        class Quiet(SimpleHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

        handler = partial(Quiet, directory=str(self.root))
        self._server = ThreadingHTTPServer((self.host, self.port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="files", daemon=True).start()
        return self

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> StaticFileServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SimGCE:
    """Metadata server + 443 listener + DNS (+ optional file server) with one control surface."""

    def __init__(
        self,
        metadata: tuple[str, int] = ("127.0.0.1", 0),
        tcp: tuple[str, int] | None = ("127.0.0.1", 0),
        dns: tuple[str, int] | None = None,
        records: dict[str, list[str]] | None = None,
        files: str | None = None,
        files_addr: tuple[str, int] = ("127.0.0.1", 0),
        dns_after: float = 0.0,
        info: SimInstance | None = None,
        dns_silent_queries: int = 0,
        on_dns_query: Callable[[str, bool], None] | None = None,
        dns_ttl: int = 60,
    ) -> None:
        self.metadata = FakeMetadataServer(*metadata, info=info)
        self.tcp = TcpListener(*tcp) if tcp else None
        self._tcp_addr = tcp
        self.dns = (
            FakeDNS(
                *dns,
                records=records,
                answer_after=dns_after,
                silent_queries=dns_silent_queries,
                on_query=on_dns_query,
                ttl=dns_ttl,
            )
            if dns
            else None
        )
        self.files = StaticFileServer(files, *files_addr) if files else None

    def start(self) -> SimGCE:
        self.metadata.start()
        for part in (self.tcp, self.dns, self.files):
            if part is not None:
                part.start()
        return self

    def stop(self) -> None:
        for part in (self.files, self.dns, self.tcp):
            if part is not None:
                part.stop()
        self.metadata.stop()

    def __enter__(self) -> SimGCE:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_egress(self, up: bool) -> None:
        """Open or close the 443 listener (closed: connections are refused)."""
        if self.tcp is None:
            return
        if up and self.tcp._sock is None:
            self.tcp.start()
        elif not up and self.tcp._sock is not None:
            self.tcp.stop()

    def outage(self, down: bool, metadata_mode: str = "hang") -> None:
        """Both paths down (metadata hangs, 443 refused) or both back up."""
        self.metadata.set_mode(metadata_mode if down else "ok")
        self.set_egress(not down)

    def outage_for(self, ticks: int) -> None:
        """Both paths down for exactly ``ticks`` of the agent's probes, then both back up, ended
        by the metadata server when the next probe arrives (set_outage_for)."""
        self.set_egress(False)
        self.metadata.set_outage_for(ticks, on_end=lambda: self.set_egress(True))

    def command(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Apply one control command (what the control socket accepts)."""
        op = cmd.get("op")
        if op == "metadata_mode":
            self.metadata.set_mode(str(cmd["mode"]), float(cmd.get("delay", 0)))
        elif op == "egress":
            self.set_egress(bool(cmd["up"]))
        elif op == "outage":
            self.outage(bool(cmd["down"]), str(cmd.get("mode", "hang")))
        elif op == "attribute":
            self.metadata.set_attribute(str(cmd["key"]), cmd.get("value"))
        elif op == "preempt":
            self.metadata.set_preempted(bool(cmd.get("value", True)))
        elif op == "maintenance":
            self.metadata.set_maintenance(str(cmd["event"]))
        elif op == "dns_mode" and self.dns is not None:
            self.dns.mode = str(cmd["mode"])
        elif op == "stats":
            pass
        else:
            return {"ok": False, "error": f"unknown op {op!r}"}
        return {
            "ok": True,
            "metadata_requests": len(self.metadata.requests),
            "tcp_accepted": self.tcp.accepted if self.tcp else 0,
            "dns_queries": self.dns.queries if self.dns else 0,
            "dns_answered": self.dns.answered if self.dns else 0,
        }


class _ControlHandler(socketserver.StreamRequestHandler):
    server: _ControlServer

    def handle(self) -> None:
        for raw in self.rfile:
            try:
                reply = self.server.sim.command(json.loads(raw))
            except (ValueError, KeyError, TypeError) as e:
                reply = {"ok": False, "error": str(e)}
            self.wfile.write((json.dumps(reply) + "\n").encode())


class _ControlServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    sim: SimGCE


@contextlib.contextmanager
def control_socket(sim: SimGCE, path: str) -> Iterator[None]:
    """Serve sim.command() as JSON lines on a Unix socket at path (reachable across netns)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    srv = _ControlServer(path, _ControlHandler)
    srv.sim = sim
    threading.Thread(target=srv.serve_forever, name="sim-control", daemon=True).start()
    try:
        yield
    finally:
        srv.shutdown()
        srv.server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def send_command(path: str, timeout: float = 5.0, **cmd: Any) -> dict[str, Any]:
    """Client side of the control socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall((json.dumps(cmd) + "\n").encode())
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
    reply: dict[str, Any] = json.loads(buf or b"{}")
    return reply


def _addr(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host, int(port)


def _print_query(name: str, answered: bool) -> None:
    print(f"dns {time.time():.3f} {name} {'answered' if answered else 'silent'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gce_watchdog.testing.simgce", description=__doc__)
    p.add_argument("--metadata", default="127.0.0.1:0", help="HOST:PORT of the metadata server")
    p.add_argument("--tcp", default=None, help="HOST:PORT of the 443 stand-in listener")
    p.add_argument("--dns", default=None, help="HOST:PORT of the UDP DNS server")
    p.add_argument("--record", action="append", default=[], help="NAME=IP[,IP] DNS A record")
    p.add_argument(
        "--dns-after",
        type=float,
        default=0.0,
        help="no DNS answer until SECONDS after the first query",
    )
    p.add_argument(
        "--dns-silent-queries", type=int, default=0, help="the first N DNS queries get no answer"
    )
    p.add_argument("--dns-ttl", type=int, default=60, help="TTL (seconds) of every DNS answer")
    p.add_argument("--dns-log", action="store_true", help="print every DNS query on stdout")
    p.add_argument("--dns-never", action="store_true", help="DNS never answers")
    p.add_argument("--attr", action="append", default=[], help="KEY=VALUE instance attribute")
    p.add_argument("--attr-file", action="append", default=[], help="KEY=PATH attribute from file")
    p.add_argument("--files", default=None, help="folder to serve")
    p.add_argument("--files-addr", default="127.0.0.1:0", help="HOST:PORT of the file server")
    p.add_argument("--instance-name", default=None)
    p.add_argument("--instance-id", default=None, help="instance/id (e.g. the fake API's id)")
    p.add_argument("--project-id", default=None, help="project/project-id")
    p.add_argument("--control", default=None, help="Unix socket path for control commands")
    p.add_argument("--ready-file", default=None, help="write the bound ports here as JSON")
    a = p.parse_args(argv)

    info = SimInstance()
    if a.instance_name:
        info.name = a.instance_name
    if a.instance_id:
        info.id = a.instance_id
    if a.project_id:
        info.project = a.project_id
    for kv in a.attr:
        k, _, v = kv.partition("=")
        info.attributes[k] = v
    for kv in a.attr_file:
        k, _, path = kv.partition("=")
        info.attributes[k] = Path(path).read_text()
    records: dict[str, list[str]] = {}
    for kv in a.record:
        k, _, v = kv.partition("=")
        records[k] = v.split(",")
    sim = SimGCE(
        metadata=_addr(a.metadata),
        tcp=_addr(a.tcp) if a.tcp else None,
        dns=_addr(a.dns) if a.dns else None,
        records=records,
        files=a.files,
        files_addr=_addr(a.files_addr),
        dns_after=a.dns_after,
        info=info,
        dns_silent_queries=a.dns_silent_queries,
        on_dns_query=_print_query if a.dns_log else None,
        dns_ttl=a.dns_ttl,
    )
    if a.dns_never and sim.dns is not None:
        sim.dns.mode = "silent"
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with sim, contextlib.ExitStack() as stack:
        if a.control:
            stack.enter_context(control_socket(sim, a.control))
        if a.ready_file:
            ports = {
                "metadata": sim.metadata.port,
                "tcp": sim.tcp.port if sim.tcp else None,
                "dns": sim.dns.port if sim.dns else None,
                "files": sim.files.port if sim.files else None,
            }
            # atomic: a reader polling for the file never sees it empty or half written
            atomic_write(a.ready_file, json.dumps(ports).encode())
        stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
