"""``gce-watchdog fetch`` against servers somebody else wrote (issue 17, items 1-4 and 8).

- stock ``python3 -m http.server`` (HTTP/1.0, the connection closes after every response);
- nginx from Debian's packages (``make apt-test`` installs it; the package's service is never
  started): its own process on a loopback port from a temp config, with and without keep-alive,
  chunked (SSI), gzip (``gzip on`` and ``gzip_static always``), and HTTPS with a CA made here by
  the openssl CLI;
- redirects across hosts (names from the fake DNS), credentials kept to their origin;
- senders that trickle (one body byte a second, a header line every 2 s, one header byte a second)
  against a hard ``--deadline``, and fetch itself stopped by SIGTERM / SIGINT;
- ``-o`` onto a device, a FIFO, a socket; secrets in URLs; ``GCEWD_CONFIG``.

Every case runs the real CLI in a child process (exit codes, signals, stderr as a user sees them).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.testing.simgce import FakeDNS
from gce_watchdog.wire import protocol
from kit.ports import free_port, free_ports

pytestmark = pytest.mark.process

BODY = os.urandom(200_000)
TEXT = b"".join(b"line %06d of a text file served through SSI\n" % i for i in range(5000))
STARTUP_WAIT = 20.0  # bound on a server or child process getting ready (a loaded 2-core machine)
SECRETS = ("TOKEN123", "SIG456", "FRAG789", "alice")


def wait_for(cond: Callable[[], bool], what: str, limit: float = STARTUP_WAIT) -> None:
    """Until cond() holds (an event: a port open, a file there), at most limit seconds."""
    end = time.monotonic() + limit
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {limit}s: {what}")
        time.sleep(0.05)


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Running the CLI.


@dataclass
class Run:
    rc: int
    stderr: str
    elapsed: float
    events: list[protocol.Event]
    serial: bytes


def config(tmp: Path) -> Path:
    cfg = tmp / "config.toml"
    (tmp / "serial.log").touch()  # the "serial device": a missing one is unusable (fallback file)
    cfg.write_text(
        f'[agent]\nstate_dir = "{tmp}/state"\nrun_dir = "{tmp}/run"\n'
        f'[serial]\ndevice = "{tmp}/serial.log"\nfallback_file = "{tmp}/fallback.log"\n'
    )
    return cfg


def fetch_argv(url: str, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "gce_watchdog.bootstrap.fetch", url, "-o", str(out), *args]


def serial_of(tmp: Path) -> tuple[bytes, list[protocol.Event]]:
    path = tmp / "serial.log"
    data = path.read_bytes() if path.exists() else b""
    events, _ = protocol.decode_all(data)
    return data, [e for e in events if e.event == "fetch"]


def fetch(tmp: Path, url: str, out: Path, *args: str, env: dict[str, str] | None = None) -> Run:
    argv = fetch_argv(url, out, *args)
    if env is None:
        argv += ["--config", str(config(tmp))]
    t0 = time.monotonic()
    p = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )
    elapsed = time.monotonic() - t0
    data, events = serial_of(tmp)
    return Run(p.returncode, p.stderr, elapsed, events, data)


def parts(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".part")) if d.exists() else []


def outcome(run: Run) -> protocol.Event:
    assert run.events, f"no fetch line on the console; stderr: {run.stderr}"
    return run.events[-1]


# ---------------------------------------------------------------------------------------------
# Stock python3 -m http.server.


@pytest.fixture
def stock_server(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """`python3 -m http.server` (the system's python3 when there is one) serving tmp/www."""
    www = tmp_path / "www"
    (www / "dir").mkdir(parents=True)
    (www / "file.bin").write_bytes(BODY)
    (www / "dir" / "index.html").write_bytes(b"<p>index</p>\n")
    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    port = free_port()
    proc = subprocess.Popen(
        [py, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(www), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: port_open(port), "http.server listening")
        yield port, www
    finally:
        proc.terminate()
        proc.wait(10)


def test_stock_http_server_http10_downloads(tmp_path: Path, stock_server: tuple[int, Path]) -> None:
    port, _ = stock_server
    out = tmp_path / "dl" / "file.bin"
    run = fetch(tmp_path, f"http://127.0.0.1:{port}/file.bin", out, "--deadline", "30s")
    assert run.rc == 0, run.stderr
    assert out.read_bytes() == BODY
    ev = outcome(run)
    assert (ev.get("out"), ev.get("rc"), ev.get("bytes")) == ("ok", "0", str(len(BODY)))
    assert parts(out.parent) == []


def test_stock_http_server_redirect_then_http10_body(
    tmp_path: Path, stock_server: tuple[int, Path]
) -> None:
    # http.server answers /dir with a 301 to /dir/ (HTTP/1.0, closed), then the index page.
    port, www = stock_server
    out = tmp_path / "index.html"
    run = fetch(tmp_path, f"http://127.0.0.1:{port}/dir", out, "--deadline", "30s")
    assert run.rc == 0, run.stderr
    assert out.read_bytes() == (www / "dir" / "index.html").read_bytes()


# ---------------------------------------------------------------------------------------------
# nginx from Debian's packages.

NGINX_CONF = """\
daemon off;
master_process off;
worker_processes 1;
error_log {d}/error.log;
pid {d}/nginx.pid;
events {{ worker_connections 64; }}
http {{
    access_log {d}/access.log;
    client_body_temp_path {d}/tmp-body;
    proxy_temp_path {d}/tmp-proxy;
    fastcgi_temp_path {d}/tmp-fastcgi;
    uwsgi_temp_path {d}/tmp-uwsgi;
    scgi_temp_path {d}/tmp-scgi;
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{port};
        listen 127.0.0.1:{tls_port} ssl;
        server_name secure.test;
        ssl_certificate {d}/server.pem;
        ssl_certificate_key {d}/server.key;
        root {d}/www;
        location /ka/ {{ keepalive_timeout 65; }}
        location /close/ {{ keepalive_timeout 0; }}
        location /chunked/ {{ ssi on; ssi_types *; }}
        location /gzip/ {{ gzip on; gzip_types *; gzip_min_length 0; }}
        location /gzstatic/ {{ gzip_static always; }}
    }}
}}
"""


def make_ca(d: Path, name: str) -> Path:
    """A CA and a server certificate for name (openssl CLI); returns the CA file."""

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ssl("req", "-x509", *ec, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem", "-days", "2",
        "-subj", "/CN=gce-watchdog test CA")  # fmt: skip
    ssl("req", *ec, "-keyout", f"{d}/server.key", "-out", f"{d}/server.csr", "-subj", f"/CN={name}")
    (d / "ext.cnf").write_text(
        f"subjectAltName=DNS:{name}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
    )
    ssl("x509", "-req", "-in", f"{d}/server.csr", "-CA", f"{d}/ca.pem", "-CAkey", f"{d}/ca.key",
        "-CAcreateserial", "-out", f"{d}/server.pem", "-days", "2",
        "-extfile", f"{d}/ext.cnf")  # fmt: skip
    return d / "ca.pem"


@dataclass
class Nginx:
    port: int
    tls_port: int
    ca: Path
    www: Path


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[Nginx]:
    binary = shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None
    )
    if binary is None or shutil.which("openssl") is None:
        pytest.skip("nginx or openssl missing: `make apt-test` installs them (as root)")
    d = tmp_path / "nginx"
    www = d / "www"
    for sub in ("ka", "close", "chunked", "gzip", "gzstatic"):
        (www / sub).mkdir(parents=True)
    (www / "ka" / "data.bin").write_bytes(BODY)
    (www / "close" / "data.bin").write_bytes(BODY)
    (www / "chunked" / "data.txt").write_bytes(TEXT)
    (www / "gzip" / "data.txt").write_bytes(TEXT)
    (www / "gzstatic" / "data.txt.gz").write_bytes(gzip.compress(TEXT, mtime=0))
    ca = make_ca(d, "secure.test")
    port, tls_port = free_ports(2)  # distinct: two free_port() calls may give one port
    (d / "nginx.conf").write_text(NGINX_CONF.format(d=d, port=port, tls_port=tls_port))
    proc = subprocess.Popen(
        [binary, "-p", f"{d}/", "-e", f"{d}/error.log", "-c", f"{d}/nginx.conf"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        err = d / "error.log"
        wait_for(
            lambda: (port_open(port) and port_open(tls_port)) or proc.poll() is not None,
            "nginx listening",
        )
        assert proc.poll() is None, err.read_text() if err.exists() else "nginx exited"
        yield Nginx(port, tls_port, ca, www)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def raw_headers(port: int, path: str, extra: str = "") -> dict[str, str]:
    """The response headers nginx sends an HTTP/1.1 client (to check the counterpart's setup)."""
    with socket.create_connection(("127.0.0.1", port), 5) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head)}


@pytest.mark.parametrize(
    ("path", "want"),
    [("/ka/data.bin", BODY), ("/close/data.bin", BODY), ("/chunked/data.txt", TEXT)],
    ids=["keep-alive", "no-keep-alive", "chunked"],
)
def test_nginx_downloads(tmp_path: Path, nginx: Nginx, path: str, want: bytes) -> None:
    out = tmp_path / "out.bin"
    sha = hashlib.sha256(want).hexdigest()
    run = fetch(tmp_path, f"http://127.0.0.1:{nginx.port}{path}", out, "--sha256", sha)
    assert run.rc == 0, run.stderr
    assert out.read_bytes() == want
    assert outcome(run).get("out") == "ok"


def test_nginx_setup_is_what_the_cases_claim(nginx: Nginx) -> None:
    """The counterpart really does what the cases above rely on."""
    assert raw_headers(nginx.port, "/chunked/data.txt").get("transfer-encoding") == "chunked"
    gz = raw_headers(nginx.port, "/gzip/data.txt", "Accept-Encoding: gzip\r\n")
    assert gz.get("content-encoding") == "gzip"
    assert "content-encoding" not in raw_headers(nginx.port, "/gzip/data.txt")
    assert raw_headers(nginx.port, "/gzstatic/data.txt").get("content-encoding") == "gzip"


def test_nginx_gzip_on_gives_the_file_itself(tmp_path: Path, nginx: Nginx) -> None:
    out = tmp_path / "data.txt"
    run = fetch(tmp_path, f"http://127.0.0.1:{nginx.port}/gzip/data.txt", out)
    assert run.rc == 0, run.stderr
    assert out.read_bytes() == TEXT, "fetch asks for identity; nginx honours it"


def test_gzip_encoded_response_is_stored_as_sent(tmp_path: Path, nginx: Nginx) -> None:
    # gzip_static always: Content-Encoding gzip whatever the client asked. fetch stores the bytes
    # as the server holds them (like curl without --compressed and pip): the .gz file, whose
    # sha256 is the one an operator can compute on the server.
    stored = (nginx.www / "gzstatic" / "data.txt.gz").read_bytes()
    out = tmp_path / "data.txt.gz"
    sha = hashlib.sha256(stored).hexdigest()
    run = fetch(tmp_path, f"http://127.0.0.1:{nginx.port}/gzstatic/data.txt", out, "--sha256", sha)
    assert run.rc == 0, run.stderr
    assert out.read_bytes() == stored


def test_https_with_a_ca_made_in_the_test(tmp_path: Path, nginx: Nginx) -> None:
    with FakeDNS(records={"secure.test": ["127.0.0.1"]}) as dns:
        url = f"https://secure.test:{nginx.tls_port}/ka/data.bin"
        common = ("--dns-server", f"127.0.0.1:{dns.port}", "--deadline", "20s")
        out = tmp_path / "s.bin"
        run = fetch(tmp_path, url, out, "--ca-file", str(nginx.ca), *common)
        assert run.rc == 0, run.stderr
        assert out.read_bytes() == BODY
        # Without the CA the certificate is not trusted: refused at once, not retried.
        out2 = tmp_path / "untrusted.bin"
        bad = fetch(tmp_path, url, out2, *common)
    assert bad.rc == 69, bad.stderr
    assert not out2.exists() and parts(tmp_path) == []
    assert "certificate" in bad.stderr


# ---------------------------------------------------------------------------------------------
# Redirects across hosts (and where credentials go).


class Recording(BaseHTTPRequestHandler):
    """HTTP/1.0 (closes after each response). ``routes``: path (no query) -> (status, headers,
    body)."""

    server: RecordingServer

    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_GET(self) -> None:
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        route = self.path.partition("?")[0]
        status, headers, body = self.server.routes.get(route, (404, {}, b"no\n"))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class RecordingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, routes: dict[str, tuple[int, dict[str, str], bytes]]) -> None:
        super().__init__(("127.0.0.1", 0), Recording)
        self.routes = routes
        self.seen: list[tuple[str, str | None]] = []
        self.port = int(self.server_address[1])
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def __enter__(self) -> RecordingServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


def test_redirect_across_hosts_to_stock_server_and_credentials_stay_home(
    tmp_path: Path, stock_server: tuple[int, Path]
) -> None:
    port, _ = stock_server
    records = {"a.test": ["127.0.0.1"], "b.test": ["127.0.0.1"]}
    with FakeDNS(records=records) as dns, RecordingServer({}) as b:
        b.routes["/hop"] = (302, {"Location": f"http://127.0.0.1:{port}/file.bin"}, b"")
        with RecordingServer({}) as a:
            a.routes["/start"] = (301, {"Location": f"http://b.test:{b.port}/hop"}, b"")
            out = tmp_path / "r.bin"
            url = f"http://alice:TOKEN123@a.test:{a.port}/start?sig=SIG456#FRAG789"
            run = fetch(tmp_path, url, out, "--dns-server", f"127.0.0.1:{dns.port}")
    assert run.rc == 0, run.stderr
    assert out.read_bytes() == BODY
    want = "Basic " + base64.b64encode(b"alice:TOKEN123").decode()
    assert a.seen == [("/start?sig=SIG456", want)], "credentials go to their own host"
    assert b.seen == [("/hop", None)], "...and never across a redirect to another host"
    assert_no_secret(run)


# ---------------------------------------------------------------------------------------------
# Senders that trickle: the deadline is a hard bound.


def listen() -> tuple[socket.socket, int]:
    """A listening loopback socket and its port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock, int(sock.getsockname()[1])


class Trickle:
    """A raw TCP server sending ``head`` then ``body`` one piece per ``every`` seconds."""

    def __init__(self, pieces: Iterator[bytes] | list[bytes], every: float) -> None:
        self.pieces = list(pieces)
        self.every = every
        self.sent = threading.Event()  # set once the first two pieces went out
        self.stop = threading.Event()
        self.sock, self.port = listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        with c:
            try:
                c.recv(4096)
                for i, piece in enumerate(self.pieces):
                    c.sendall(piece)
                    if i >= 1:
                        self.sent.set()
                    if self.stop.wait(self.every):
                        return
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def body_byte_per_second() -> list[bytes]:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nConnection: close\r\n\r\n"
    return [head] + [b"x"] * 1000


def header_line_every_2s() -> list[bytes]:
    return [b"HTTP/1.1 200 OK\r\n"] + [b"X-Slow: %d\r\n" % i for i in range(1000)]


def header_byte_per_second() -> list[bytes]:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n" + b"X-" * 1000
    return [bytes([c]) for c in head]


DEADLINE = 4.0
SLACK = 4.0  # interpreter start-up and exit on a loaded machine; the trickle would go on for 1000 s


@pytest.mark.parametrize(
    ("pieces", "every"),
    [(body_byte_per_second(), 1.0), (header_line_every_2s(), 2.0), (header_byte_per_second(), 1.0)],
    ids=["body-byte-per-s", "header-line-every-2s", "header-byte-per-s"],
)
def test_trickling_sender_is_cut_at_the_deadline(
    tmp_path: Path, pieces: list[bytes], every: float
) -> None:
    srv = Trickle(pieces, every)
    try:
        out = tmp_path / "dl" / "slow.bin"
        url = f"http://127.0.0.1:{srv.port}/slow.bin"
        run = fetch(tmp_path, url, out, "--deadline", f"{DEADLINE:g}s")
    finally:
        srv.close()
    assert run.rc == 75, run.stderr
    assert run.elapsed < DEADLINE + SLACK, f"took {run.elapsed:.1f}s with a {DEADLINE}s deadline"
    ev = outcome(run)
    assert (ev.get("out"), ev.get("rc")) == ("gave_up", "75"), ev
    assert not out.exists() and parts(out.parent) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stopped_by_a_signal_leaves_no_part_and_says_so(tmp_path: Path, sig: int) -> None:
    srv = Trickle(body_byte_per_second(), 0.2)
    out = tmp_path / "dl" / "slow.bin"
    out.parent.mkdir()
    argv = fetch_argv(f"http://127.0.0.1:{srv.port}/x", out, "--config", str(config(tmp_path)))
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert srv.sent.wait(STARTUP_WAIT), "the body started"
        wait_for(lambda: bool(parts(out.parent)), "a .part file while the body arrives")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=STARTUP_WAIT)
    finally:
        srv.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 128 + sig, err
    assert parts(out.parent) == [] and not out.exists()
    _, events = serial_of(tmp_path)
    assert events, "an outcome line"
    ev = events[-1]
    name = signal.Signals(sig).name.lower()
    assert (ev.get("out"), ev.get("err"), ev.get("rc")) == ("killed", name, str(128 + sig)), ev


# ---------------------------------------------------------------------------------------------
# -o refuses what is not a regular file.


def test_output_onto_device_fifo_socket_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock_path))
    link = tmp_path / "null-link"
    link.symlink_to("/dev/null")
    try:
        for target in (Path("/dev/null"), fifo, sock_path, link):
            before = os.stat(target, follow_symlinks=False)
            run = fetch(tmp_path, "http://127.0.0.1:9/x", target, "--deadline", "2s")
            assert run.rc == 64, (target, run.stderr)
            assert "regular file" in run.stderr
            after = os.stat(target, follow_symlinks=False)
            assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino), target
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------
# No secret shown.


def assert_no_secret(run: Run) -> None:
    for secret in SECRETS:
        assert secret not in run.stderr, f"{secret} on stderr: {run.stderr}"
        assert secret.encode() not in run.serial, f"{secret} on the console"


@pytest.mark.parametrize("status", [403, 404, 503])
def test_no_secret_in_any_message(tmp_path: Path, status: int) -> None:
    with RecordingServer({"/f": (status, {}, b"no\n")}) as srv:
        url = f"http://alice:TOKEN123@127.0.0.1:{srv.port}/f?sig=SIG456#FRAG789"
        run = fetch(tmp_path, url, tmp_path / "f", "--deadline", "3s")
    assert run.rc == (75 if status == 503 else 69), run.stderr
    assert f"http://127.0.0.1:{srv.port}/f" in run.stderr or status == 503, run.stderr
    assert_no_secret(run)


def test_bad_url_messages_hide_secrets(tmp_path: Path) -> None:
    run = fetch(tmp_path, "ftp://alice:TOKEN123@h/x?sig=SIG456#FRAG789", tmp_path / "f")
    assert run.rc == 64
    assert "ftp://h/x" in run.stderr
    assert_no_secret(run)


# ---------------------------------------------------------------------------------------------
# GCEWD_CONFIG (what the start-up script exports to bootstrap steps).


def test_gcewd_config_is_honoured(tmp_path: Path, stock_server: tuple[int, Path]) -> None:
    port, _ = stock_server
    cfg = config(tmp_path)
    run = fetch(
        tmp_path,
        f"http://127.0.0.1:{port}/file.bin",
        tmp_path / "f.bin",
        env={"GCEWD_CONFIG": str(cfg)},
    )
    assert run.rc == 0, run.stderr
    assert outcome(run).get("out") == "ok", "the line went to the configured console"
    assert (tmp_path / "state" / "signing.key").exists(), "and the configured state dir (the key)"
    assert list((tmp_path / "run").glob("seq.*")), "and the configured run dir (the counter)"


# ---------------------------------------------------------------------------------------------
# Range: a body cut short is resumed where it stopped, by nginx's own 206.


class CuttingRelay:
    """A TCP relay in front of nginx: the first response is cut ``cut`` bytes into its body (a
    connection that dies mid-transfer), later ones pass whole. Records each request's head;
    ``between`` runs after the cut, before the next connection is served."""

    def __init__(self, upstream: int, cut: int, between: Callable[[], None] | None = None) -> None:
        self.upstream, self.cut, self.between = upstream, cut, between
        self.requests: list[str] = []
        self.sock, self.port = listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                self._serve(c, len(self.requests))

    def _serve(self, c: socket.socket, n: int) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = c.recv(4096)
            if not data:
                return
            head += data
        self.requests.append(head.decode("latin-1"))
        with socket.create_connection(("127.0.0.1", self.upstream), 10) as up:
            up.sendall(head)
            buf = b""
            while True:
                data = up.recv(65536)
                if not data:
                    break
                buf += data
                if n == 0 and b"\r\n\r\n" in buf:
                    limit = buf.index(b"\r\n\r\n") + 4 + self.cut
                    if len(buf) >= limit:
                        buf = buf[:limit]
                        break
            c.sendall(buf)
        if n == 0 and self.between is not None:
            self.between()

    def close(self) -> None:
        self.sock.close()


def statuses(nginx: Nginx, path: str) -> list[str]:
    log = (nginx.www.parent / "access.log").read_text().splitlines()
    return [ln.split('"')[2].split()[0] for ln in log if f"GET {path} " in ln]


def test_cut_short_body_is_resumed_with_range(tmp_path: Path, nginx: Nginx) -> None:
    relay = CuttingRelay(nginx.port, cut=50_000)
    try:
        out = tmp_path / "r.bin"
        sha = hashlib.sha256(BODY).hexdigest()
        run = fetch(tmp_path, f"http://127.0.0.1:{relay.port}/ka/data.bin", out, "--sha256", sha)
    finally:
        relay.close()
    assert run.rc == 0, run.stderr
    assert out.read_bytes() == BODY
    assert len(relay.requests) == 2
    assert "Range: bytes=50000-" in relay.requests[1] and "If-Range: " in relay.requests[1]
    assert statuses(nginx, "/ka/data.bin") == ["200", "206"], "nginx sent the rest as a 206"
    assert "resumed 1 time(s) with Range" in run.stderr
    assert parts(tmp_path) == []


def test_file_changed_between_attempts_comes_back_whole(tmp_path: Path, nginx: Nginx) -> None:
    new = os.urandom(120_000)

    def change() -> None:
        (nginx.www / "ka" / "data.bin").write_bytes(new)  # new size and mtime: a new ETag

    relay = CuttingRelay(nginx.port, cut=50_000, between=change)
    try:
        out = tmp_path / "r.bin"
        run = fetch(tmp_path, f"http://127.0.0.1:{relay.port}/ka/data.bin", out)
    finally:
        relay.close()
    assert run.rc == 0, run.stderr
    assert out.read_bytes() == new, "never the old file's head glued to the new file's tail"
    assert "Range: bytes=50000-" in relay.requests[1]
    assert statuses(nginx, "/ka/data.bin") == ["200", "200"], "If-Range did not match: whole"
