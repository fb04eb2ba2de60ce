"""``gce-watchdog fetch URL -o PATH``: a download that survives a VM whose DNS is not ready yet.

Shape (deciding is separated from doing):

- :class:`FetchRetry` is the pure decision core: given the attempt number, the time spent, the
  server's ``Retry-After`` and a jitter sample, it says how long to wait, or to give up. It never
  lets a wait carry the run past the deadline.
- :class:`RateLimit` decides which failed attempts get a serial line (a 10-minute DNS outage must
  not flood the console).
- :func:`run_fetch` performs attempts through :func:`gce_watchdog.lib.retry.retry_call` (its
  ``next_wait`` asks the policy), through two narrow interfaces: a :class:`Resolver` (dnspython
  by default) and the HTTP attempt, which connects to the address that resolver returned (never
  re-resolving through the system resolver) while sending the URL's host in the ``Host`` header
  and in TLS SNI.

Exit codes (``docs/bootstrap.md``): 0 ok, 64 bad arguments, 65 checksum mismatch, 69 refused by
the server, 73 cannot write the target, 75 gave up at the deadline.

Heavy imports (dnspython, http.client, ssl, tenacity) happen inside the functions that use them:
this module is imported by every ``gce-watchdog`` invocation.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from gce_watchdog.lib import dns as dnslib
from gce_watchdog.lib.cli import EX_CANTCREAT, EX_DATAERR, EX_OK, EX_TEMPFAIL, EX_UNAVAILABLE
from gce_watchdog.lib.httpdate import parse_retry_after
from gce_watchdog.lib.retry import Backoff, retry_call
from gce_watchdog.wire import vocab

if TYPE_CHECKING:
    import random

    from gce_watchdog.vm.console import Emitter


DEFAULT_DEADLINE = 600.0  # 10 min: covers a fresh Spot VM's DNS start-up with a wide margin
# One DNS attempt: dnspython retries its servers within this lifetime. 5 s is the guest agent's
# spacing between DNS look-ups before it fetches start-up scripts.
DNS_LIFETIME = 5.0
CONNECT_TIMEOUT = 10.0  # TCP + TLS handshake; a SYN that is dropped shows up here
READ_TIMEOUT = 30.0  # between two received chunks; a stalled transfer is retried
MAX_REDIRECTS = 10  # what curl and requests allow by default (30 / 30), kept smaller
CHUNK = 64 * 1024
SERIAL_EVERY = 60.0  # at most one serial line per minute for failed attempts after the first
PROGRESS_EVERY = 0.5  # seconds between progress repaints on a terminal

# Attempts that fail for these reasons are retried; anything else is final.
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504}) | frozenset(range(505, 600))


# ---------------------------------------------------------------------------------------------
# Errors: each attempt ends in one of these (or success).


class FetchError(Exception):
    """A failed attempt. ``kind`` is a short token for serial lines (``dns``, ``http503`` ...)."""

    retryable = True
    rc = EX_TEMPFAIL

    def __init__(self, kind: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after = retry_after


class Refused(FetchError):
    """The server (or the URL) says no, and asking again will not change that."""

    retryable = False
    rc = EX_UNAVAILABLE


class ChecksumMismatch(FetchError):
    retryable = False
    rc = EX_DATAERR


class LocalError(FetchError):
    """The target cannot be written (permissions, disk full, not a directory)."""

    retryable = False
    rc = EX_CANTCREAT


class Interrupted(BaseException):
    """fetch itself was told to stop (SIGTERM, SIGINT): raised from the signal handler so every
    ``finally`` runs (the ``.part`` file goes) and the outcome line is still written."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# ---------------------------------------------------------------------------------------------
# Pure decision core.


@dataclass(frozen=True)
class FetchRetry:
    """When to try again. Exponential back-off with jitter, bounded by an absolute deadline.

    A wait is ``min(max_wait, initial * multiplier**(attempt-1))`` shortened by up to ``jitter`` of
    itself (so many VMs booting together spread out), at least the server's ``Retry-After``, and
    never longer than the time left minus ``min_attempt``: the last attempt starts before the
    deadline instead of the run overshooting it by a full back-off step.
    """

    deadline: float  # seconds from the start of the run
    initial: float = 1.0
    multiplier: float = 2.0
    max_wait: float = 30.0  # with a 10-min deadline: one try every ~30 s once DNS stays down
    jitter: float = 0.5
    # An attempt needs some time to be worth starting (DNS round trip + TCP handshake).
    min_attempt: float = 1.0

    def backoff(self, attempt: int, u: float) -> float:
        """The jittered back-off after failed attempt ``attempt`` (1-based); u in [0, 1)."""
        return Backoff(self.initial, self.multiplier, self.max_wait, self.jitter).wait(attempt, u)

    def next_wait(
        self, attempt: int, elapsed: float, retry_after: float | None, u: float
    ) -> float | None:
        """Seconds to wait before the next attempt, or None to give up now."""
        slack = self.deadline - elapsed - min(self.min_attempt, self.deadline / 10)
        if slack < 0:
            return None
        if retry_after is not None and retry_after > slack:
            return None  # the server asked us to come back after the deadline
        wait = max(self.backoff(attempt, u), retry_after or 0.0)
        return min(wait, slack)


@dataclass
class RateLimit:
    """Which failed attempts get a serial line: the first, then at most one per ``every`` s.

    ``suppressed`` counts the attempts not reported since the last line; the caller puts it on the
    next line it writes (``supp=N``) so nothing is silently lost.
    """

    every: float
    last: float | None = None
    suppressed: int = 0

    def allow(self, now: float) -> bool:
        if self.last is None or now - self.last >= self.every:
            self.last = now
            return True
        self.suppressed += 1
        return False

    def take_suppressed(self) -> int:
        n, self.suppressed = self.suppressed, 0
        return n


# ---------------------------------------------------------------------------------------------
# Arguments.


# What a printed URL keeps: scheme, host, port and path. Userinfo (a password, a token), the query
# (a signed URL's signature) and the fragment are removed everywhere a URL is shown (stderr, the
# console, the journal, files): the serial console is readable by anyone allowed
# getSerialPortOutput. Matches any string, URL or not.
_SHOWN_RE = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)?(?P<auth>[^/?#]*@)?(?P<rest>[^?#]*)"
)


def redact_url(raw: str) -> str:
    """raw without userinfo, query and fragment (also when raw is not a valid URL)."""
    m = _SHOWN_RE.match(raw)
    assert m is not None  # every group is optional
    return (m["scheme"] or "") + m["rest"]


@dataclass(frozen=True)
class Url:
    scheme: str
    host: str
    port: int
    target: str  # path + query, what goes on the request line
    # user:password from the URL, sent as HTTP Basic auth to this origin only (never shown)
    auth: tuple[str, str] | None = field(default=None, repr=False, compare=False)

    @property
    def netloc(self) -> str:
        default = 443 if self.scheme == "https" else 80
        h = f"[{self.host}]" if ":" in self.host else self.host
        return h if self.port == default else f"{h}:{self.port}"

    @property
    def origin(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)

    @property
    def shown(self) -> str:
        """The URL as messages show it: no credentials, no query."""
        return f"{self.scheme}://{self.netloc}{self.target.partition('?')[0]}"

    def __str__(self) -> str:
        return self.shown


def parse_url(raw: str) -> Url:
    """An http(s) URL with a host; raises ValueError with a readable message otherwise.

    ``user:password@`` becomes HTTP Basic auth (percent-decoded). Messages never repeat the
    userinfo, query or fragment of raw.
    """
    from urllib.parse import unquote, urlsplit

    raw = raw.strip()
    shown = redact_url(raw)
    bad = next((c for c in raw if ord(c) <= 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        # http.client refuses these on the request line: without this check every attempt would
        # fail the same way and the fetch would retry to its deadline instead of exiting 64.
        raise ValueError(
            f"bad URL {shown!r}: it contains {'a space' if bad == ' ' else repr(bad)}; "
            "percent-encode it (a space is %20)"
        )
    try:
        s = urlsplit(raw)
        port = s.port
    except ValueError as e:
        raise ValueError(f"bad URL {shown!r}: {e}") from None
    if s.scheme not in ("http", "https"):
        raise ValueError(f"bad URL {shown!r}: only http:// and https:// are supported")
    if not s.hostname:
        raise ValueError(f"bad URL {shown!r}: no host")
    auth = None
    if s.username is not None or s.password is not None:
        auth = (unquote(s.username or ""), unquote(s.password or ""))
    target = (s.path or "/") + (f"?{s.query}" if s.query else "")
    return Url(s.scheme, s.hostname, port or (443 if s.scheme == "https" else 80), target, auth)


def _full(url: Url) -> str:
    """The URL with its query (never printed: only to resolve a relative Location)."""
    return f"{url.scheme}://{url.netloc}{url.target}"


_SHA_RE = re.compile(r"[0-9a-fA-F]{64}\Z")


@dataclass(frozen=True)
class FetchRequest:
    url: Url
    output: Path
    deadline: float = DEFAULT_DEADLINE
    sha256: str | None = None
    mode: int = 0o644
    dns_servers: tuple[tuple[str, int], ...] = ()
    ca_file: str | None = None


# ---------------------------------------------------------------------------------------------
# Side-effect interfaces and their real implementations.


class Resolver(Protocol):
    def resolve(self, host: str, timeout: float) -> list[str]:
        """Addresses for host, or raise FetchError(kind='dns'). Bounded by timeout."""
        ...


@dataclass
class DnsResolver:
    """The one resolver (``gce_watchdog.lib.dns``): /etc/hosts then resolv.conf when no servers
    are given (both re-read on every attempt: early in boot resolv.conf may not exist yet, and
    that is one of the failures we wait out), A and AAAA from every server at once."""

    servers: tuple[tuple[str, int], ...] = ()
    hosts_path: str = dnslib.HOSTS_PATH
    resolv_conf: str = dnslib.RESOLV_CONF

    def resolve(self, host: str, timeout: float) -> list[str]:
        r = dnslib.DnsResolver(self.servers, self.hosts_path, self.resolv_conf)
        try:
            return r.resolve(host, max(0.05, timeout))
        except dnslib.DnsError as e:
            raise FetchError("dns", str(e)) from None


def _short(e: BaseException, limit: int = 160) -> str:
    s = " ".join(str(e).split()) or type(e).__name__
    return s if len(s) <= limit else s[: limit - 3] + "..."


_CONN_CLASSES: tuple[Any, Any] | None = None


def _connection_classes() -> tuple[Any, Any]:
    """HTTP(S) connections that dial a fixed address but speak to the URL's host name.

    Built on first use so ``http.client`` and ``ssl`` are not imported by every CLI call.
    """
    global _CONN_CLASSES
    if _CONN_CLASSES is not None:
        return _CONN_CLASSES
    import http.client
    import socket
    import ssl

    class PinnedHTTP(http.client.HTTPConnection):
        def __init__(self, host: str, port: int, addr: str, timeout: float, cutoff: Cutoff) -> None:
            super().__init__(host, port, timeout=timeout)
            self.addr = addr
            self.cutoff = cutoff

        def connect(self) -> None:
            # The address our resolver found, not getaddrinfo(self.host): the system resolver is
            # exactly what may not work yet.
            self.sock = socket.create_connection((self.addr, self.port), self.timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.cutoff.arm(self.sock)  # from here on the deadline bounds every byte

    class PinnedHTTPS(PinnedHTTP):
        def __init__(
            self,
            host: str,
            port: int,
            addr: str,
            timeout: float,
            cutoff: Cutoff,
            ctx: ssl.SSLContext,
        ) -> None:
            super().__init__(host, port, addr, timeout, cutoff)
            self.ctx = ctx

        def connect(self) -> None:
            super().connect()
            # SNI and certificate check against the URL's host name.
            self.sock = self.ctx.wrap_socket(self.sock, server_hostname=self.host)

    _CONN_CLASSES = (PinnedHTTP, PinnedHTTPS)
    return _CONN_CLASSES


class Cutoff:
    """The hard deadline of one connection: at ``at`` (a clock() value) the socket is shut down.

    Socket timeouts bound one read, not a transfer: a server that sends one byte a second, or a
    header line every 2 s, never trips them. A timer thread shutting the socket down makes every
    blocked read return at once; ``fired`` tells the reader that the end it saw was the deadline
    (an HTTP/1.0 body that ends at the deadline would otherwise look complete).
    """

    def __init__(self, seconds: float) -> None:
        import threading

        self.fired = False
        self._sock: Any = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(0.0, seconds), self._cut)
        self._timer.daemon = True

    def arm(self, sock: Any) -> None:
        with self._lock:
            self._sock = sock
        if not self._timer.is_alive() and not self.fired:
            self._timer.start()

    def _cut(self) -> None:
        import socket

        with self._lock:
            self.fired = True
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


# ---------------------------------------------------------------------------------------------
# One attempt.


@dataclass
class Progress:
    """A one-line progress display on a terminal (stderr only when it is a tty)."""

    stream: IO[str] | None
    clock: Callable[[], float]
    last: float | None = None

    def show(self, got: int, total: int | None, force: bool = False) -> None:
        if self.stream is None:
            return
        now = self.clock()
        if not force and self.last is not None and now - self.last < PROGRESS_EVERY:
            return
        self.last = now
        mib = got / 1048576
        if total:
            msg = f"\r  {mib:8.1f} / {total / 1048576:.1f} MiB {100 * got // total:3d}%"
        else:
            msg = f"\r  {mib:8.1f} MiB"
        self.stream.write(msg)
        self.stream.flush()

    def done(self) -> None:
        if self.stream is not None and self.last is not None:
            self.stream.write("\n")
            self.stream.flush()
            self.last = None


@dataclass
class Partial:
    """A body cut short, kept between the attempts of one run to be resumed with ``Range``.

    Only with a validator (a strong ``ETag``, else ``Last-Modified``) sent back as ``If-Range``: a
    file that changed on the server meanwhile comes back whole (200) and the partial is dropped.
    """

    path: str
    got: int
    hasher: Any  # sha256 over the bytes in path
    validator: str
    url: str  # the final URL (after redirects) the bytes came from
    total: int | None


def _validator(resp: Any) -> str | None:
    etag = resp.getheader("ETag")
    if etag and not etag.startswith("W/"):
        return str(etag)
    lm = resp.getheader("Last-Modified")
    return str(lm) if lm else None


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)\Z")


@dataclass
class Attempt:
    """Everything one HTTP attempt needs; ``run()`` returns bytes written or raises FetchError."""

    req: FetchRequest
    resolver: Resolver
    clock: Callable[[], float]
    wall: Callable[[], float]
    deadline_at: float  # clock() value of the deadline
    progress: Progress
    budget: float = DEFAULT_DEADLINE  # the whole run's deadline, in seconds
    ssl_context: Any = None
    resolved: dict[str, list[str]] = field(default_factory=dict)
    partial: Partial | None = None
    resumed: int = 0  # how many attempts continued a partial body (206)

    def left(self) -> float:
        return self.deadline_at - self.clock()

    def drop_partial(self) -> None:
        """Delete the kept partial body (a fresh start, or the end of the run)."""
        if self.partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.partial.path)
            self.partial = None

    def run(self) -> int:
        url = self.req.url
        for _ in range(MAX_REDIRECTS + 1):
            nxt = self._one(url)
            if isinstance(nxt, int):
                return nxt
            if url.scheme == "https" and nxt.scheme == "http":
                raise Refused("redirect", f"refusing redirect from https to plain http: {nxt}")
            url = nxt
        raise Refused("redirect", f"more than {MAX_REDIRECTS} redirects")

    def _one(self, url: Url) -> int | Url:
        import http.client
        import ssl

        # A short deadline still gets several DNS attempts: one may use at most a fifth of it.
        lifetime = min(DNS_LIFETIME, self.budget / 5, self.left())
        addrs = self.resolver.resolve(url.host, max(0.05, lifetime))
        self.resolved[url.host] = addrs
        last: FetchError | None = None
        for addr in addrs[:3]:  # a few addresses, not a long list: the deadline is shared
            try:
                return self._request(url, addr)
            except FetchError as e:
                if not e.retryable or e.kind not in ("connect", "refused"):
                    raise
                last = e
            except ssl.SSLCertVerificationError as e:
                # Retrying will not fix a certificate that does not match.
                raise Refused("tls", f"{url.host}: certificate check failed: {_short(e)}") from None
            except ssl.SSLError as e:
                raise FetchError("tls", f"{url.host}: TLS error: {_short(e)}") from None
            except http.client.HTTPException as e:
                raise FetchError(
                    "protocol", f"{url.host}: bad HTTP response: {_short(e)}"
                ) from None
            except OSError as e:  # anything the narrower handlers above did not classify
                raise FetchError("network", f"{url.host}: {_short(e)}") from None
        assert last is not None
        raise last

    def _request(self, url: Url, addr: str) -> int | Url:
        import base64
        import http.client
        import ssl

        http_cls, https_cls = _connection_classes()
        timeout = max(0.05, min(CONNECT_TIMEOUT, self.left()))
        cutoff = Cutoff(self.left())
        if url.scheme == "https":
            if self.ssl_context is None:
                self.ssl_context = ssl.create_default_context(cafile=self.req.ca_file)
            conn = https_cls(url.host, url.port, addr, timeout, cutoff, self.ssl_context)
        else:
            conn = http_cls(url.host, url.port, addr, timeout, cutoff)
        try:
            try:
                conn.connect()
            except ConnectionRefusedError:
                raise FetchError("refused", f"{addr}:{url.port}: connection refused") from None
            except TimeoutError:
                raise FetchError("connect", f"{addr}:{url.port}: connect timed out") from None
            except ssl.SSLError:
                if cutoff.fired:
                    raise self._deadline(0) from None
                raise
            except OSError as e:
                if cutoff.fired:
                    raise self._deadline(0) from None
                raise FetchError("connect", f"{addr}:{url.port}: {e.strerror or e}") from None
            # The socket itself: after a response that closes the connection (HTTP/1.0,
            # `Connection: close`) http.client drops conn.sock while the body is still to be read.
            sock = conn.sock
            try:
                sock.settimeout(max(0.05, min(READ_TIMEOUT, self.left())))
                conn.putrequest("GET", url.target, skip_accept_encoding=True)
                conn.putheader("User-Agent", "gce-watchdog-fetch/1")
                # The bytes as stored on the server: a .tar.gz stays the file its sha256 names.
                conn.putheader("Accept-Encoding", "identity")
                conn.putheader("Connection", "close")
                part = self.partial
                if part is not None and part.url == _full(url):
                    conn.putheader("Range", f"bytes={part.got}-")
                    conn.putheader("If-Range", part.validator)
                if url.auth is not None:
                    cred = base64.b64encode(f"{url.auth[0]}:{url.auth[1]}".encode()).decode()
                    conn.putheader("Authorization", f"Basic {cred}")
                conn.endheaders()
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                if cutoff.fired:
                    raise self._deadline(0) from None
                if isinstance(e, TimeoutError):
                    raise FetchError("timeout", f"{url.host}: no response in time") from None
                if isinstance(e, ssl.SSLError | http.client.HTTPException):
                    raise
                raise FetchError("connect", f"{url.host}: {e.strerror or _short(e)}") from None
            return self._response(url, sock, resp, cutoff)
        finally:
            cutoff.cancel()
            conn.close()

    def _deadline(self, got: int) -> FetchError:
        return FetchError("deadline", f"deadline of {self.budget:g}s reached after {got} bytes")

    def _response(self, url: Url, sock: Any, resp: Any, cutoff: Cutoff) -> int | Url:
        from urllib.parse import urljoin

        status: int = resp.status
        if status in (301, 302, 303, 307, 308):
            loc = resp.getheader("Location")
            if not loc:
                raise Refused(f"http{status}", f"HTTP {status} without a Location header")
            try:
                nxt = parse_url(urljoin(_full(url), loc))
            except ValueError as e:
                raise Refused("redirect", str(e)) from None
            # Credentials go to the origin they were given for, never across a redirect (curl's
            # rule); a Location with its own userinfo brings its own.
            if nxt.auth is None and nxt.origin == url.origin:
                nxt = Url(nxt.scheme, nxt.host, nxt.port, nxt.target, url.auth)
            return nxt
        if status in RETRY_STATUS:
            ra = parse_retry_after(resp.getheader("Retry-After"), self.wall())
            raise FetchError(f"http{status}", f"HTTP {status} {resp.reason}".strip(), ra)
        if status == 416 and self.partial is not None:
            self.drop_partial()  # the kept bytes do not fit the file any more: start over
            raise FetchError("range", f"{url.host}: HTTP 416 for the resumed range")
        if not 200 <= status < 300:
            raise Refused(f"http{status}", f"HTTP {status} {resp.reason} for {url.shown}".strip())
        return self._stream(url, sock, resp, cutoff)

    def _stream(self, url: Url, sock: Any, resp: Any, cutoff: Cutoff) -> int:
        import hashlib
        import http.client
        import tempfile

        out = self.req.output
        part, self.partial = self.partial, None
        if resp.status == 206:
            m = _CONTENT_RANGE.match(resp.getheader("Content-Range") or "")
            if part is None or m is None or int(m[1]) != part.got or part.url != _full(url):
                if part is not None:
                    self.partial = part
                    self.drop_partial()
                raise FetchError("range", f"{url.host}: a 206 that does not continue the file")
        elif part is not None:  # 200: the whole file again (it changed, or no ranges)
            self.partial = part
            self.drop_partial()
            part = None
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            if part is not None:
                fd, tmp = os.open(part.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC), part.path
            else:
                fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
        except OSError as e:
            if part is not None:
                with contextlib.suppress(OSError):
                    os.unlink(part.path)
            raise LocalError("local", f"cannot write beside {out}: {e.strerror or e}") from None
        total: int | None = resp.length  # Content-Length, None when chunked
        got = 0
        h = hashlib.sha256()
        if part is not None:
            self.resumed += 1
            got, h = part.got, part.hasher
            total = part.got + resp.length if resp.length is not None else part.total
        validator = _validator(resp)
        ranges = resp.status == 206 or (resp.getheader("Accept-Ranges") or "").lower() == "bytes"
        try:
            with os.fdopen(fd, "wb" if part is None else "ab") as f:
                while True:
                    left = self.left()
                    if left <= 0 or cutoff.fired:
                        raise self._deadline(got)
                    with contextlib.suppress(OSError):  # already shut down: the read says so
                        sock.settimeout(max(0.05, min(READ_TIMEOUT, left)))
                    try:
                        # read1: what has arrived (at most CHUNK), not a wait for a full CHUNK.
                        chunk = resp.read1(CHUNK)
                    except (OSError, http.client.HTTPException) as e:
                        if cutoff.fired:
                            raise self._deadline(got) from None
                        if isinstance(e, http.client.IncompleteRead):
                            raise FetchError(
                                "closed", f"connection closed after {got} bytes (chunked body)"
                            ) from None
                        raise FetchError(
                            "timeout" if isinstance(e, TimeoutError) else "closed",
                            f"transfer stalled after {got} bytes: {_short(e)}",
                        ) from None
                    if not chunk:
                        cutoff.cancel()
                        if cutoff.fired:  # the end we saw was the deadline's shutdown
                            raise self._deadline(got)
                        break
                    try:
                        f.write(chunk)
                    except OSError as e:
                        raise LocalError("local", f"writing {out}: {e.strerror or e}") from None
                    h.update(chunk)
                    got += len(chunk)
                    self.progress.show(got, total)
                if total is not None and got < total:
                    raise FetchError("closed", f"connection closed after {got} of {total} bytes")
                self.progress.show(got, total, force=True)
                if self.req.sha256 and h.hexdigest() != self.req.sha256.lower():
                    raise ChecksumMismatch(
                        "checksum",
                        f"sha256 mismatch: got {h.hexdigest()}, want {self.req.sha256.lower()}",
                    )
                try:
                    os.fchmod(f.fileno(), self.req.mode)
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as e:
                    raise LocalError("local", f"writing {out}: {e.strerror or e}") from None
            try:
                os.replace(tmp, out)
            except OSError as e:
                raise LocalError("local", f"cannot rename onto {out}: {e.strerror or e}") from None
            _fsync_dir(out.parent)
            return got
        except FetchError as e:
            if e.retryable and got > 0 and validator and ranges and self.left() > 0:
                # Cut short: keep what arrived, the next attempt asks for the rest.
                self.partial = Partial(tmp, got, h.copy(), validator, _full(url), total)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


# ---------------------------------------------------------------------------------------------
# The run: attempts under the policy, reported on serial and stderr.


@dataclass(frozen=True)
class FetchResult:
    rc: int
    attempts: int
    elapsed: float
    message: str
    bytes: int = 0


@dataclass
class FetchDeps:
    """The side effects of a run; tests inject fakes or short intervals."""

    emitter: Emitter | None = None
    resolver: Resolver | None = None
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random | None = None  # jitter source; a fresh Random when None
    stderr: IO[str] | None = None
    progress: IO[str] | None = None  # a tty stream, or None for no progress display
    serial_every: float = SERIAL_EVERY
    policy: FetchRetry | None = None


@dataclass
class _Voice:
    """What a run says: every message on stderr (when given one), and its ``fetch`` lines on the
    serial console: each retry rate-limited by ``limit``, the end always."""

    deps: FetchDeps
    limit: RateLimit
    host: str

    def say(self, msg: str) -> None:
        if self.deps.stderr is not None:
            self.deps.stderr.write(f"gce-watchdog fetch: {msg}\n")
            self.deps.stderr.flush()

    def retry(self, n: int, exc: FetchError, w: float, now: float) -> None:
        self.say(f"attempt {n} failed ({exc.kind}): {exc.message}; retrying in {w:.1f}s")
        if self.deps.emitter is not None and self.limit.allow(now):
            fields: dict[str, object] = {
                "out": "retry",
                "att": n,
                "host": self.host,
                "err": exc.kind,
                "wait": f"{int(w * 1000)}ms",
            }
            supp = self.limit.take_suppressed()
            if supp:
                fields["supp"] = supp
            text = vocab.fit_text(vocab.FETCH, fields, exc.message)
            self.deps.emitter.emit(vocab.FETCH, fields, text)

    def end(self, fields: dict[str, object], message: str, supp: bool = True) -> None:
        if self.deps.emitter is not None:
            n = self.limit.take_suppressed() if supp else 0
            if n:
                fields["supp"] = n
            text = vocab.fit_text(vocab.FETCH, fields, message)
            self.deps.emitter.emit(vocab.FETCH, fields, text, sync=True)


def run_fetch(req: FetchRequest, deps: FetchDeps) -> FetchResult:
    """Download req.url to req.output under the retry policy; never raises FetchError."""
    import random

    rng = deps.rng or random.Random()  # noqa: S311 - jitter, not cryptography
    policy = deps.policy or FetchRetry(deadline=req.deadline)
    resolver = deps.resolver or DnsResolver(req.dns_servers)
    clock = deps.clock
    t0 = clock()
    attempt = Attempt(
        req,
        resolver,
        clock,
        deps.wall,
        t0 + policy.deadline,
        Progress(deps.progress, clock),
        budget=policy.deadline,
    )
    voice = _Voice(deps, RateLimit(deps.serial_every), req.url.host[:40])
    host, dst = voice.host, req.output.name[:40] or "-"
    n = 0

    def next_wait(n: int, exc: BaseException) -> float | None:
        ra = exc.retry_after if isinstance(exc, FetchError) else None
        return policy.next_wait(n, clock() - t0, ra, rng.random())

    def before_sleep(n: int, exc: BaseException, w: float) -> None:
        assert isinstance(exc, FetchError)
        attempt.progress.done()
        voice.retry(n, exc, w, clock())

    def one(att: int) -> int:
        nonlocal n
        n = att
        return attempt.run()

    rc, out, message, nbytes = EX_OK, "ok", "", 0
    try:
        try:
            nbytes = retry_call(
                one,
                next_wait,
                retry_on=lambda e: isinstance(e, FetchError) and e.retryable,
                sleep=deps.sleep,
                before_sleep=before_sleep,
            )
        finally:
            attempt.drop_partial()  # never a .part left behind, whatever ended the run
        message = f"{nbytes} bytes to {req.output} in {clock() - t0:.1f}s after {n} attempt(s)"
        if attempt.resumed:
            message += f", resumed {attempt.resumed} time(s) with Range"
    except (Interrupted, KeyboardInterrupt) as e:
        import signal

        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        name = signal.Signals(signum).name
        rc, out, last_kind = 128 + signum, "killed", name.lower()
        message = f"stopped by {name} during attempt {n} after {clock() - t0:.1f}s"
    except FetchError as e:
        elapsed = clock() - t0
        rc = e.rc
        if e.retryable:
            out = "gave_up"
            message = f"gave up after {n} attempts in {elapsed:.1f}s, last error: {e.message}"
            if e.retry_after is not None:
                message += f" (server asked to retry after {e.retry_after:.0f}s)"
        else:
            out = {EX_DATAERR: "checksum", EX_CANTCREAT: "local"}.get(e.rc, "refused")
            message = f"attempt {n} failed, not retrying: {e.message}"
        last_kind = e.kind
    else:
        last_kind = ""
    if out == "killed":
        attempt.progress.done()
        voice.say(message)
        if deps.emitter is not None:
            fields = {"out": out, "att": n, "host": host, "dst": dst, "rc": rc, "err": last_kind}
            fields["dur"] = f"{clock() - t0:.1f}"
            voice.end(fields, message, supp=False)
        return FetchResult(rc, n, clock() - t0, message, 0)
    attempt.progress.done()
    elapsed = clock() - t0
    voice.say(message if rc else f"ok: {message}")
    fields = {"out": out, "att": n, "host": host, "dst": dst, "rc": rc, "dur": f"{elapsed:.1f}"}
    if rc == EX_OK:
        fields["bytes"] = nbytes
    else:
        fields["err"] = last_kind
    voice.end(fields, message)
    return FetchResult(rc, n, elapsed, message, nbytes)


# ---------------------------------------------------------------------------------------------
# CLI.


if __name__ == "__main__":
    # ``python -m gce_watchdog.bootstrap.fetch ARGS`` is ``gce-watchdog fetch ARGS``: the package's
    # entry point runs it (by name, so this library module does not import the CLI above it).
    import runpy

    sys.argv[1:1] = ["fetch"]
    runpy.run_module("gce_watchdog", run_name="__main__", alter_sys=True)
