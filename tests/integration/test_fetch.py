"""gce-watchdog fetch: the retry policy (pure, property-tested) and real downloads against local
HTTP(S) and DNS servers on 127.0.0.1 (gce_watchdog.testing.simgce.FakeDNS for name resolution)."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog import cli
from gce_watchdog.bootstrap.fetch import (
    DnsResolver,
    FetchDeps,
    FetchRequest,
    FetchRetry,
    Progress,
    RateLimit,
    parse_url,
    run_fetch,
)
from gce_watchdog.lib.cli import EX_CANTCREAT, EX_DATAERR, EX_TEMPFAIL, EX_UNAVAILABLE, EX_USAGE
from gce_watchdog.lib.dns import hosts_file_lookup
from gce_watchdog.lib.httpdate import parse_retry_after
from gce_watchdog.lib.netaddr import parse_dns_server
from gce_watchdog.testing.simgce import FakeDNS
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire import protocol
from hypothesis import given
from hypothesis import strategies as st
from kit.clocks import ManualClock
from kit.events import read_events

BODY = os.urandom(300_000)  # several read chunks, so "closed mid-body" really is mid-body

# ---------------------------------------------------------------------------------------------
# A scripted HTTP server: each request takes the next response from a list (the last repeats).


@dataclass
class Reply:
    status: int = 200
    body: bytes = BODY
    headers: dict[str, str] = field(default_factory=dict)
    cut_after: int | None = None  # send Content-Length for the full body, then close after N


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Srv

    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_GET(self) -> None:
        srv = self.server
        with srv.lock:
            srv.seen.append((self.path, self.headers.get("Host", ""), time.monotonic()))
            r = srv.script.pop(0) if len(srv.script) > 1 else srv.script[0]
        self.send_response(r.status)
        for k, v in r.headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(r.body)))
        self.end_headers()
        try:
            if r.cut_after is None:
                self.wfile.write(r.body)
            else:
                self.wfile.write(r.body[: r.cut_after])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.close_connection = True


class _Srv(ThreadingHTTPServer):
    daemon_threads = True
    script: list[Reply]
    seen: list[tuple[str, str, float]]
    lock: threading.Lock


class Scripted:
    def __init__(self, *script: Reply, tls: ssl.SSLContext | None = None) -> None:
        self.srv = _Srv(("127.0.0.1", 0), _Handler)
        self.srv.script = list(script) or [Reply()]
        self.srv.seen = []
        self.srv.lock = threading.Lock()
        if tls is not None:
            self.srv.socket = tls.wrap_socket(self.srv.socket, server_side=True)
        self.port = self.srv.server_address[1]
        self.t = threading.Thread(target=self.srv.serve_forever, daemon=True)

    def __enter__(self) -> Scripted:
        self.t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.srv.shutdown()
        self.srv.server_close()

    @property
    def seen(self) -> list[tuple[str, str, float]]:
        return self.srv.seen

    def url(self, path: str = "/file.bin", host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


def fast_policy(deadline: float = 20.0) -> FetchRetry:
    return FetchRetry(deadline=deadline, initial=0.05, max_wait=0.3, min_attempt=0.2)


def mem_emitter(tmp_path: Path) -> tuple[Emitter, MemorySink]:
    sink = MemorySink()
    return Emitter(
        sink, SeqAllocator(tmp_path / "state", "0badf00d"), "0badf00d", key=SYNTH_KEY
    ), sink


def fetch_events(sink: MemorySink) -> list[protocol.Event]:
    ours = [ln for ln in sink.lines if " key pk=" not in ln]
    evs = [protocol.decode_line(ln, pin=SYNTH_KEY.public) for ln in ours]
    assert all(isinstance(e, protocol.Event) for e in evs)
    return [e for e in evs if isinstance(e, protocol.Event) and e.event == "fetch"]


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".part"))


def req(url: str, out: Path, **kw: Any) -> FetchRequest:
    return FetchRequest(parse_url(url), out, **kw)


# ---------------------------------------------------------------------------------------------
# The pure core.


@pytest.mark.pure
@given(
    attempt=st.integers(1, 200),
    elapsed=st.floats(0, 700, allow_nan=False),
    retry_after=st.none() | st.floats(0, 5000, allow_nan=False),
    u=st.floats(0, 1, exclude_max=True),
    deadline=st.floats(0.5, 3600, allow_nan=False),
)
def test_policy_never_overshoots_the_deadline(
    attempt: int, elapsed: float, retry_after: float | None, u: float, deadline: float
) -> None:
    p = FetchRetry(deadline=deadline)
    w = p.next_wait(attempt, elapsed, retry_after, u)
    if w is None:
        return
    assert w >= 0
    assert elapsed + w <= deadline  # the next attempt starts before the deadline
    assert w <= max(p.max_wait, retry_after or 0)
    if retry_after is not None:
        assert w >= retry_after  # honoured whenever we do not give up


@pytest.mark.pure
@given(attempt=st.integers(1, 100), u=st.floats(0, 1, exclude_max=True))
def test_backoff_is_jittered_exponential_and_capped(attempt: int, u: float) -> None:
    p = FetchRetry(deadline=600)
    base = min(p.max_wait, p.initial * p.multiplier ** (attempt - 1))
    b = p.backoff(attempt, u)
    assert base * (1 - p.jitter) <= b <= base


@pytest.mark.pure
def test_policy_table() -> None:
    p = FetchRetry(deadline=10, initial=1, max_wait=8, jitter=0, min_attempt=1)
    assert [p.next_wait(a, 0, None, 0) for a in (1, 2, 3, 4, 5)] == [1, 2, 4, 8, 8]
    assert p.next_wait(1, 8.5, None, 0) == pytest.approx(0.5)  # clipped, not a full step
    assert p.next_wait(1, 9.5, None, 0) is None  # no time left for another attempt
    assert p.next_wait(1, 0, 3, 0) == 3  # Retry-After beats the back-off
    assert p.next_wait(1, 0, 60, 0) is None  # ... unless it points past the deadline


@pytest.mark.pure
def test_rate_limit_first_then_one_per_interval() -> None:
    r = RateLimit(every=60)
    got = [r.allow(t) for t in (0, 1, 2, 59, 60, 61, 130)]
    assert got == [True, False, False, False, True, False, True]
    assert r.take_suppressed() == 4 and r.take_suppressed() == 0


@pytest.mark.pure
def test_parse_retry_after() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("7", now) == 7
    assert parse_retry_after(None, now) is None
    assert parse_retry_after("soon", now) is None
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:30 GMT", now) == pytest.approx(10, abs=1)


@pytest.mark.pure
@pytest.mark.parametrize(
    "bad",
    [
        "ftp://x/y",
        "http://",
        "x",
        "http://h:99999/",
        "http://h/a b",
        "http://h/\x7f",
    ],
)
def test_parse_url_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_url(bad)


@pytest.mark.pure
def test_parse_url_and_dns_server() -> None:
    u = parse_url("https://Files.Example:8443/a/b?c=1")
    assert (u.scheme, u.host, u.port, u.target) == ("https", "files.example", 8443, "/a/b?c=1")
    assert parse_dns_server("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert parse_dns_server("10.0.0.2") == ("10.0.0.2", 53)
    assert parse_dns_server("[::1]:5300") == ("::1", 5300)
    for bad in ("dns.google", "1.2.3.4:x", "1.2.3.4:0"):
        with pytest.raises(ValueError):
            parse_dns_server(bad)


@pytest.mark.pure
def test_hosts_file_lookup(tmp_path: Path) -> None:
    h = tmp_path / "hosts"
    h.write_text("# c\n127.0.0.1 localhost\n10.1.2.3 files.internal files # x\nbogus line\n")
    assert hosts_file_lookup(h, "FILES.internal") == ["10.1.2.3"]
    assert hosts_file_lookup(h, "nope") == []
    assert hosts_file_lookup(tmp_path / "missing", "localhost") == []


@pytest.mark.pure
def test_progress_only_draws_on_the_given_stream() -> None:
    import io

    buf = io.StringIO()
    t = [0.0]
    p = Progress(buf, lambda: t[0])
    p.show(1048576, 2097152, force=True)
    t[0] += 0.1
    p.show(1572864, 2097152)  # too soon: no repaint
    p.done()
    assert buf.getvalue() == "\r       1.0 / 2.0 MiB  50%\n"
    Progress(None, time.monotonic).show(1, 2, force=True)  # no stream: nothing, no error


# ---------------------------------------------------------------------------------------------
# Real downloads.


@pytest.mark.process
def test_dns_broken_then_fixed_downloads_with_retries_recorded(tmp_path: Path) -> None:
    with (
        Scripted() as http,
        FakeDNS(records={"files.gcewd.test": ["127.0.0.1"]}, answer_after=1.2) as dns,
    ):
        em, sink = mem_emitter(tmp_path)
        out = tmp_path / "dl" / "file.bin"
        r = req(http.url(host="files.gcewd.test"), out, dns_servers=(("127.0.0.1", dns.port),))
        res = run_fetch(r, FetchDeps(emitter=em, policy=fast_policy(6), serial_every=0))
    assert res.rc == 0, res.message
    assert res.attempts >= 2
    assert out.read_bytes() == BODY
    assert leftovers(out.parent) == []
    # We connected to the address our resolver found and still named the host in Host:.
    assert http.seen[0][1] == f"files.gcewd.test:{http.port}"
    evs = fetch_events(sink)
    retries = [e for e in evs if e.get("out") == "retry"]
    assert retries and all(e.get("err") == "dns" for e in retries)
    final = evs[-1]
    assert final.get("out") == "ok" and final.get("att") == str(res.attempts)
    assert final.get("bytes") == str(len(BODY)) and final.get("rc") == "0"


def _config(tmp_path: Path) -> Path:
    (tmp_path / "serial.log").touch()  # the "serial device" (a missing one is unusable)
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f'[agent]\nstate_dir = "{tmp_path}/state"\nrun_dir = "{tmp_path}/run"\n'
        f'[serial]\ndevice = "{tmp_path}/serial.log"\nfallback_file = "{tmp_path}/fallback.log"\n'
    )
    return cfg


def _serial_events(tmp_path: Path) -> list[protocol.Event]:
    return read_events(tmp_path / "serial.log", forged_ok=False, rejected_ok=False)


@pytest.mark.process
def test_dns_never_fixed_exits_75_close_to_the_deadline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeDNS(records={}) as dns:
        dns.mode = "silent"
        out = tmp_path / "never.bin"
        t0 = time.monotonic()
        rc = cli.main(
            ["fetch", "http://files.gcewd.test/x", "-o", str(out), "--deadline", "3s",
             "--dns-server", f"127.0.0.1:{dns.port}", "--config", str(_config(tmp_path))]
        )  # fmt: skip
        took = time.monotonic() - t0
    assert rc == EX_TEMPFAIL
    # tried until close to its deadline, then gave up: never the endless retries of a loop
    # without one (the exact bound is checked on a fake clock below)
    assert 2.5 <= took < 15, took
    assert not out.exists() and leftovers(tmp_path) == []
    err = capsys.readouterr().err
    assert "gave up after" in err and "last error:" in err and "DNS timed out" in err
    evs = [e for e in _serial_events(tmp_path) if e.event == "fetch"]
    # Rate limit (default: one line per minute): the first failed attempt, then the outcome.
    assert [e.get("out") for e in evs] == ["retry", "gave_up"]
    final = evs[-1]
    attempts = int(final.get("att") or 0)
    assert attempts >= 2 and final.get("rc") == "75" and final.get("err") == "dns"
    assert final.get("supp") == str(attempts - 2)  # every unreported attempt is counted


@pytest.mark.process
def test_serial_rate_limit_caps_lines_but_stderr_has_every_attempt(tmp_path: Path) -> None:
    import io

    with FakeDNS(records={}) as dns:
        dns.mode = "servfail"  # fails fast: many attempts within the deadline
        em, sink = mem_emitter(tmp_path)
        err = io.StringIO()
        r = req("http://x.gcewd.test/", tmp_path / "o", dns_servers=(("127.0.0.1", dns.port),))
        policy = FetchRetry(deadline=2.0, initial=0.02, max_wait=0.05, min_attempt=0.1)
        res = run_fetch(r, FetchDeps(emitter=em, policy=policy, serial_every=0.5, stderr=err))
    assert res.rc == EX_TEMPFAIL and res.attempts >= 10
    evs = fetch_events(sink)
    assert len(evs) <= 2.0 / 0.5 + 2 < res.attempts
    assert err.getvalue().count("failed (dns)") == res.attempts - 1
    reported = sum(1 for e in evs if e.get("out") == "retry")
    supp = sum(int(e.get("supp") or 0) for e in evs)
    assert reported + supp == res.attempts - 1  # the last attempt is the outcome line


@pytest.mark.process
def test_503_503_200_succeeds_on_the_third_attempt(tmp_path: Path) -> None:
    script = [Reply(503, b"busy"), Reply(503, b"busy"), Reply()]
    with Scripted(*script) as http:
        em, sink = mem_emitter(tmp_path)
        out = tmp_path / "f"
        res = run_fetch(req(http.url(), out), FetchDeps(emitter=em, policy=fast_policy()))
    assert res.rc == 0 and res.attempts == 3 and len(http.seen) == 3
    assert out.read_bytes() == BODY
    assert [e.get("out") for e in fetch_events(sink)] == ["retry", "ok"]  # rate-limited


@pytest.mark.process
def test_retry_after_is_honoured(tmp_path: Path) -> None:
    waits: list[float] = []
    script = [Reply(429, b"slow down", {"Retry-After": "2"}), Reply()]
    with Scripted(*script) as http:
        res = run_fetch(
            req(http.url(), tmp_path / "f"),
            FetchDeps(policy=fast_policy(), sleep=waits.append),  # recorded, not slept
        )
    assert res.rc == 0 and res.attempts == 2
    assert waits == [2.0]


@pytest.mark.process
def test_retry_after_past_the_deadline_gives_up_at_once(tmp_path: Path) -> None:
    with Scripted(Reply(503, b"", {"Retry-After": "3600"})) as http:
        res = run_fetch(req(http.url(), tmp_path / "f"), FetchDeps(policy=fast_policy(5)))
    assert res.rc == EX_TEMPFAIL and res.attempts == 1
    assert "retry after 3600s" in res.message


@pytest.mark.process
def test_404_is_refused_after_one_attempt(tmp_path: Path) -> None:
    with Scripted(Reply(404, b"no")) as http:
        em, sink = mem_emitter(tmp_path)
        out = tmp_path / "f"
        res = run_fetch(req(http.url(), out), FetchDeps(emitter=em, policy=fast_policy()))
    assert res.rc == EX_UNAVAILABLE and res.attempts == 1 and len(http.seen) == 1
    assert "404" in res.message and not out.exists()
    (final,) = fetch_events(sink)
    assert final.get("out") == "refused" and final.get("err") == "http404"


@pytest.mark.process
def test_checksum_mismatch_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "f"
    with Scripted() as http:
        res = run_fetch(req(http.url(), out, sha256="0" * 64), FetchDeps(policy=fast_policy()))
        assert res.rc == EX_DATAERR and res.attempts == 1 and "sha256 mismatch" in res.message
        assert not out.exists() and leftovers(tmp_path) == []
        good = hashlib.sha256(BODY).hexdigest().upper()  # case-insensitive
        res = run_fetch(req(http.url(), out, sha256=good, mode=0o600), FetchDeps())
    assert res.rc == 0 and out.read_bytes() == BODY
    assert out.stat().st_mode & 0o7777 == 0o600


@pytest.mark.process
def test_closed_mid_body_is_retried_without_partial_file(tmp_path: Path) -> None:
    out = tmp_path / "f"
    with Scripted(Reply(cut_after=100_000), Reply()) as http:
        res = run_fetch(req(http.url(), out), FetchDeps(policy=fast_policy()))
    assert res.rc == 0 and res.attempts == 2 and out.read_bytes() == BODY
    assert leftovers(tmp_path) == []


@pytest.mark.process
def test_always_cut_short_gives_up_and_keeps_the_old_file(tmp_path: Path) -> None:
    out = tmp_path / "f"
    out.write_bytes(b"previous version")
    with Scripted(Reply(cut_after=100_000)) as http:
        res = run_fetch(req(http.url(), out), FetchDeps(policy=fast_policy(1.5)))
    assert res.rc == EX_TEMPFAIL and res.attempts >= 2
    assert "closed after 100000 of 300000 bytes" in res.message
    assert out.read_bytes() == b"previous version"  # replaced only by a complete download
    assert leftovers(tmp_path) == []


@pytest.mark.process
def test_redirects_are_followed(tmp_path: Path) -> None:
    with Scripted() as target, Scripted(Reply(302, b"", {"Location": target.url()})) as first:
        res = run_fetch(req(first.url("/moved"), tmp_path / "f"), FetchDeps())
    assert res.rc == 0 and (tmp_path / "f").read_bytes() == BODY
    assert len(first.seen) == 1 and len(target.seen) == 1


@pytest.mark.process
def test_connection_refused_is_retried_until_the_deadline(tmp_path: Path) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    res = run_fetch(
        req(f"http://127.0.0.1:{port}/", tmp_path / "f"), FetchDeps(policy=fast_policy(1))
    )
    assert res.rc == EX_TEMPFAIL and res.attempts >= 2 and "connection refused" in res.message


@pytest.mark.process
def test_unwritable_target_is_a_local_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with Scripted() as http:
        res = run_fetch(req(http.url(), blocker / "sub" / "f"), FetchDeps(policy=fast_policy()))
    assert res.rc == EX_CANTCREAT and res.attempts == 1


@pytest.mark.process
def test_hosts_file_is_used_without_dns_servers(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 files.gcewd.test\n")
    resolver = DnsResolver(hosts_path=str(hosts), resolv_conf=str(tmp_path / "none"))
    with Scripted() as http:
        res = run_fetch(
            req(http.url(host="files.gcewd.test"), tmp_path / "f"), FetchDeps(resolver=resolver)
        )
    assert res.rc == 0
    # No resolv.conf and not in hosts: a DNS failure, retried, then given up.
    res = run_fetch(
        req("http://other.gcewd.test/", tmp_path / "g"),
        FetchDeps(resolver=resolver, policy=fast_policy(0.8)),
    )
    assert res.rc == EX_TEMPFAIL and "no DNS servers configured" in res.message


@pytest.fixture
def tls_cert(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    key, crt = tmp_path / "key.pem", tmp_path / "crt.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=secure.gcewd.test", "-addext", "subjectAltName=DNS:secure.gcewd.test",
         "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    yield key, crt


@pytest.mark.process
def test_https_connects_to_the_resolved_address_with_sni(
    tmp_path: Path, tls_cert: tuple[Path, Path]
) -> None:
    key, crt = tls_cert
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(crt, key)
    sni: list[str | None] = []
    ctx.sni_callback = lambda sock, name, c: sni.append(name)  # type: ignore[assignment,misc,return-value]
    with (
        Scripted(tls=ctx) as https,
        FakeDNS(records={"secure.gcewd.test": ["127.0.0.1"]}) as dns,
    ):
        url = f"https://secure.gcewd.test:{https.port}/f"
        servers = (("127.0.0.1", dns.port),)
        res = run_fetch(
            req(url, tmp_path / "f", dns_servers=servers, ca_file=str(crt)), FetchDeps()
        )
        assert res.rc == 0, res.message
        assert sni == ["secure.gcewd.test"]
        assert https.seen[0][1] == f"secure.gcewd.test:{https.port}"
        # Without trusting the test CA the certificate check fails: refused, not retried.
        res = run_fetch(req(url, tmp_path / "g", dns_servers=servers), FetchDeps())
    assert res.rc == EX_UNAVAILABLE and res.attempts == 1 and "certificate" in res.message


@pytest.mark.pure
@pytest.mark.parametrize(
    "args",
    [
        ["http://h/x"],
        ["http://h/x", "-o", "OUT", "--sha256", "abc"],
        ["http://h/x", "-o", "OUT", "--mode", "rw"],
        ["http://h/x", "-o", "OUT", "--deadline", "0"],
        ["http://h/x", "-o", "OUT", "--dns-server", "dns.google"],
        ["gopher://h/x", "-o", "OUT"],
        ["http://h/my file.tar", "-o", "OUT"],
    ],
)
def test_bad_arguments_exit_64(tmp_path: Path, args: list[str]) -> None:
    argv = ["fetch", *[str(tmp_path / "o") if a == "OUT" else a for a in args]]
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    assert rc == EX_USAGE
    assert not (tmp_path / "o").exists()


@pytest.mark.process
def test_cli_success_writes_serial_outcome_and_no_progress_off_tty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "f"
    with Scripted() as http:
        rc = cli.main(["fetch", http.url(), "-o", str(out), "--config", str(_config(tmp_path))])
    assert rc == 0 and out.read_bytes() == BODY
    err = capsys.readouterr().err
    assert "ok:" in err and "\r" not in err  # stderr is not a tty: no progress display
    (final,) = [e for e in _serial_events(tmp_path) if e.event == "fetch"]
    assert final.get("out") == "ok" and final.get("dst") == "f"


@pytest.mark.pure
def test_ten_minute_dns_outage_on_a_fake_clock(tmp_path: Path) -> None:
    """The incident's case, in virtual time: bounded lines, deadline met to the millisecond."""
    import random

    from gce_watchdog.bootstrap.fetch import FetchError

    clock = ManualClock(0.0)

    class DeadDNS:
        def resolve(self, host: str, timeout: float) -> list[str]:
            clock.t += timeout  # every look-up runs into its full lifetime
            raise FetchError("dns", f"{host}: DNS timed out after {timeout:.1f}s")

    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(tmp_path, "0badf00d"), "0badf00d", wall=clock, key=SYNTH_KEY)
    r = req("https://astral.sh/uv/install.sh", tmp_path / "uv.sh", deadline=600.0)
    deps = FetchDeps(
        emitter=em, resolver=DeadDNS(), clock=clock, sleep=clock.sleep, rng=random.Random(1)
    )
    res = run_fetch(r, deps)
    assert res.rc == EX_TEMPFAIL
    assert 599.0 <= res.elapsed <= 600.0  # never past the deadline, not far before it
    assert 15 <= res.attempts <= 40
    evs = fetch_events(sink)
    assert len(evs) <= 600 / 60 + 2  # about one line a minute, whatever the attempt count
    retry_lines = [e for e in evs if e.get("out") == "retry"]
    supp = sum(int(e.get("supp") or 0) for e in evs)
    assert len(retry_lines) + supp == res.attempts - 1
    assert evs[-1].get("out") == "gave_up" and evs[-1].text.startswith("gave up after")
