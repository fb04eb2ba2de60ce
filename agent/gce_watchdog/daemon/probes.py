"""Reachability probes. Each returns a verdict with a short reason and its latency; none raises.

One bounded attempt per tick: the ladder is the retry. :class:`Prober` runs both probes of a tick
concurrently, so a tick costs the slowest timeout, not their sum.

- Metadata: ``GET`` with ``Metadata-Flavor: Google`` over a plain socket (no proxies, by
  construction), under one hard deadline for connect + request + response headers. Passes only on
  HTTP 200 whose response carries ``Metadata-Flavor: Google``.
- Egress: TCP connect to port 443 of the configured targets; passes if any address of any target
  accepts. On GCE the metadata server is also the DNS server, so an egress probe that needed DNS
  would fail together with the metadata probe. Names are resolved with dnspython (bounded) when DNS
  works; the last good addresses are kept (and persisted) and used when it does not. DNS health is
  reported as its own field and never fails the egress verdict by itself.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gce_watchdog.daemon.ladder import ProbeVerdict
from gce_watchdog.daemon.tick import ProbeResult, TickResult
from gce_watchdog.lib.dns import DnsResolver, Resolver, lookup
from gce_watchdog.lib.dns import preload as preload_dns
from gce_watchdog.lib.files import read_json, write_json
from gce_watchdog.lib.netaddr import is_ip, parse_host_port
from gce_watchdog.vm.config import EgressSection

Clock = Callable[[], float]
_MAX_HEADER = 16 * 1024  # bytes of response we read at most; the metadata answer is tiny


def _errno_reason(e: OSError) -> str:
    if isinstance(e, TimeoutError | socket.timeout):
        return "timeout"
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, ConnectionResetError):
        return "reset"
    return {
        errno.ENETUNREACH: "net_unreachable",
        errno.EHOSTUNREACH: "host_unreachable",
        errno.EPERM: "blocked",  # a local firewall DROP/REJECT on output
        errno.EACCES: "blocked",
        errno.EADDRNOTAVAIL: "no_route",
        errno.EMFILE: "local_error",
        errno.ENFILE: "local_error",
        errno.ENOBUFS: "local_error",
    }.get(e.errno or 0, f"errno_{e.errno}")


# -- metadata probe ------------------------------------------------------------------------------


def _content_length(head: bytes) -> int:
    for ln in head.split(b"\r\n")[1:]:
        k, _, v = ln.partition(b":")
        if k.strip().lower() == b"content-length" and v.strip().isdigit():
            return int(v.strip())
    return 0


def probe_metadata(url: str, timeout: float, clock: Clock = time.monotonic) -> ProbeResult:
    """One GET of url with a hard deadline of ``timeout`` seconds. Never raises."""
    t0 = clock()

    def done(verdict: ProbeVerdict, reason: str, detail: str = "") -> ProbeResult:
        return ProbeResult(verdict, reason, int((clock() - t0) * 1000), detail)

    try:
        u = urlsplit(url)
        host = u.hostname or ""
        port = u.port or 80
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        if u.scheme != "http" or not host:
            return done(ProbeVerdict.UNKNOWN, "bad_url")
        deadline = t0 + timeout

        def left() -> float:
            rem = deadline - clock()
            if rem <= 0:
                raise TimeoutError
            return rem

        with socket.create_connection((host, port), timeout=left()) as s:
            req = (
                f"GET {path} HTTP/1.1\r\nHost: {host}\r\nMetadata-Flavor: Google\r\n"
                "User-Agent: gce-watchdog\r\nConnection: close\r\n\r\n"
            ).encode()
            s.settimeout(left())
            s.sendall(req)
            buf = b""
            while b"\r\n\r\n" not in buf and len(buf) < _MAX_HEADER:
                s.settimeout(left())
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
            head, sep, body = buf.partition(b"\r\n\r\n")
            # The body (the instance id for instance/id) is only a detail, read while time is
            # left: its first bytes, at most 64, often arrive in a segment after the headers.
            want = min(_content_length(head), 64)
            try:
                while sep and len(body) < want:
                    s.settimeout(left())
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    body += chunk
            except OSError:
                body = b""
    except OSError as e:
        return done(ProbeVerdict.FAIL, _errno_reason(e))
    except Exception as e:  # a probe never raises: anything unexpected is "unknown"
        return done(ProbeVerdict.UNKNOWN, f"internal_{type(e).__name__}")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2) if lines and lines[0] else []
    if (
        not sep
        or len(parts) < 2
        or not parts[0].startswith(b"HTTP/")
        or not (len(parts[1]) == 3 and parts[1].isdigit())  # int() refuses > 4300 digits
    ):
        return done(ProbeVerdict.FAIL, "bad_response" if buf else "closed")
    status = int(parts[1])
    if status != 200:
        return done(ProbeVerdict.FAIL, f"http_{status}")
    flavor = b""
    for ln in lines[1:]:
        k, _, v = ln.partition(b":")
        if k.strip().lower() == b"metadata-flavor":
            flavor = v.strip()
    if flavor != b"Google":
        return done(ProbeVerdict.FAIL, "bad_flavor")
    return done(ProbeVerdict.OK, "ok", body[:64].decode("ascii", "replace").strip())


# -- egress probe --------------------------------------------------------------------------------


class AddressCache:
    """Last good addresses per name, persisted as JSON so they survive an agent restart."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        raw = read_json(self.path) if self.path else None
        self._data: dict[str, list[str]] = {}
        if isinstance(raw, dict):
            for k, v in raw.items():
                if isinstance(k, str) and isinstance(v, list):
                    self._data[k] = [a for a in v if isinstance(a, str) and is_ip(a)]

    def get(self, host: str) -> list[str]:
        return list(self._data.get(host, []))

    def put(self, host: str, addrs: list[str]) -> None:
        if addrs and self._data.get(host) != addrs:
            self._data[host] = list(addrs)
            if self.path is not None:
                # Best effort: the in-memory copy still works.
                with contextlib.suppress(OSError):
                    write_json(self.path, self._data)


def connect_any(addrs: Sequence[tuple[str, int]], timeout: float, clock: Clock) -> str:
    """Start a non-blocking connect to every address at once; "ok" as soon as one succeeds,
    else the most telling failure reason once all failed or the deadline passed."""
    if not addrs:
        return "no_address"
    t0 = clock()
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    reasons: list[str] = []
    try:
        for host, port in addrs:
            fam = socket.AF_INET6 if ":" in host else socket.AF_INET
            try:
                s = socket.socket(fam, socket.SOCK_STREAM)
            except OSError as e:
                reasons.append(_errno_reason(e))
                continue
            socks.append(s)
            s.setblocking(False)
            rc = s.connect_ex((host, port))
            if rc == 0:
                return "ok"
            if rc not in (errno.EINPROGRESS, errno.EWOULDBLOCK):
                reasons.append(_errno_reason(OSError(rc, "")))
                continue
            sel.register(s, selectors.EVENT_WRITE)
        while sel.get_map():
            left = t0 + timeout - clock()
            if left <= 0:
                reasons.append("timeout")
                break
            for key, _ in sel.select(left):
                s = key.fileobj  # type: ignore[assignment]
                sel.unregister(s)
                err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err == 0:
                    return "ok"
                reasons.append(_errno_reason(OSError(err, "")))
    finally:
        sel.close()
        for s in socks:
            s.close()
    for preferred in ("timeout", "refused", "blocked"):
        if preferred in reasons:
            return preferred
    return reasons[0] if reasons else "timeout"


class EgressProbe:
    """TCP connect to the targets' port, resolving names with a fallback to cached addresses.

    A name's answer is reused within its DNS TTL (at most lib.dns.MAX_TTL) while the probe keeps
    succeeding: a healthy tick sends no query (the CPU of two look-ups a tick, issue 25). After a
    failed probe every name is asked again, so the ticks of an outage say what DNS does now.
    """

    def __init__(
        self,
        targets: Sequence[tuple[str, int]],
        timeout: float,
        dns_timeout: float,
        resolver: Resolver | None,
        cache: AddressCache,
        clock: Clock = time.monotonic,
    ) -> None:
        self.targets = list(targets)
        self.timeout = timeout
        self.dns_timeout = dns_timeout
        self.resolver = resolver
        self.cache = cache
        self.clock = clock
        self._valid: dict[str, tuple[list[str], float]] = {}  # name -> (addresses, valid until)
        self._last_ok = False

    def __call__(self, budget: float | None = None) -> tuple[ProbeResult, str]:
        """One probe, ending within ``timeout`` (or ``budget`` when that is shorter)."""
        t0 = self.clock()
        timeout = self.timeout if budget is None else min(self.timeout, budget)
        try:
            addrs, dns = self._addresses(t0)
            left = timeout - (self.clock() - t0)
            reason = connect_any(addrs, max(left, 0.001), self.clock)
        except Exception as e:  # never raise out of a probe
            ms = int((self.clock() - t0) * 1000)
            return ProbeResult(ProbeVerdict.UNKNOWN, f"internal_{type(e).__name__}", ms), "-"
        ms = int((self.clock() - t0) * 1000)
        verdict = ProbeVerdict.OK if reason == "ok" else ProbeVerdict.FAIL
        self._last_ok = verdict is ProbeVerdict.OK
        return ProbeResult(verdict, reason, ms), dns

    def _addresses(self, t0: float) -> tuple[list[tuple[str, int]], str]:
        out: list[tuple[str, int]] = []
        names = 0
        resolved = 0
        for host, port in self.targets:
            if is_ip(host):
                out.append((host, port))
                continue
            names += 1
            fresh: list[str] = []
            valid = self._valid.get(host)
            if self._last_ok and valid is not None and t0 < valid[1]:
                fresh = valid[0]  # within its TTL, and the last probe reached it: no query
            else:
                self._valid.pop(host, None)
                left = self.dns_timeout - (self.clock() - t0)
                if self.resolver is not None and left > 0.01:
                    try:
                        fresh, ttl = lookup(self.resolver, host, left)
                    except Exception:
                        fresh, ttl = [], 0.0
                    if fresh and ttl > 0:
                        self._valid[host] = (fresh, self.clock() + ttl)
            if fresh:
                resolved += 1
                self.cache.put(host, fresh)
            out.extend((a, port) for a in (fresh or self.cache.get(host)))
        dns = "-" if names == 0 else ("ok" if resolved else "fail")
        return out, dns


# -- both together -------------------------------------------------------------------------------


class Prober:
    """Runs the metadata and egress probes of one tick concurrently. Each probe is given the
    tick's budget (``tick(budget)``: at most ``timeout``, less for a tick that starts late in its
    slot, docs/agent.md "Schedule"). ``cap``: how long a tick waits for a probe at most (default
    ``timeout`` + 1 s); a probe still running then counts as failed with reason ``deadline``."""

    def __init__(
        self,
        metadata: Callable[[float], ProbeResult],
        egress: Callable[[float], tuple[ProbeResult, str]],
        timeout: float,
        cap: float | None = None,
    ) -> None:
        self._metadata = metadata
        self._egress = egress
        self.timeout = timeout
        self.cap = timeout + 1.0 if cap is None else cap
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="probe")
        self._lock = threading.Lock()

    def tick(self, budget: float | None = None) -> TickResult:
        budget = self.timeout if budget is None else min(self.timeout, budget)
        # Hard cap: the probes bound themselves; this only guards against a bug or a stuck
        # thread (or a name the metadata URL holds, resolved by getaddrinfo(3), which has no
        # deadline). A probe past the cap counts as a failure with reason "deadline".
        cap = self.cap
        with self._lock:
            try:
                fm: Future[ProbeResult] = self._pool.submit(self._metadata, budget)
                fe: Future[tuple[ProbeResult, str]] = self._pool.submit(self._egress, budget)
            except RuntimeError as e:  # cannot start a thread (memory pressure): unknown
                r = _internal(e)
                return TickResult(r, r, "-")
            late = ProbeResult(ProbeVerdict.FAIL, "deadline", int(cap * 1000))
            md = _result(fm, cap, lambda: late, _internal)
            eg = _result(fe, cap, lambda: (late, "-"), lambda e: (_internal(e), "-"))
        return TickResult(md, eg[0], eg[1])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _internal(e: BaseException) -> ProbeResult:
    return ProbeResult(ProbeVerdict.UNKNOWN, f"internal_{type(e).__name__}", 0)


def _result(
    f: Future[Any],
    timeout: float,
    on_timeout: Callable[[], Any],
    on_error: Callable[[Exception], Any],
) -> Any:
    try:
        return f.result(timeout=timeout)
    except FutureTimeout:
        # Still queued behind a stuck worker: drop it, or every tick would add to the backlog.
        f.cancel()
        return on_timeout()
    except Exception as e:  # a probe that broke its "never raises" contract must not stop ticks
        return on_error(e)


def build_prober(
    egress: EgressSection,
    metadata_url: str,
    timeout: float,
    state_dir: str,
    clock: Clock = time.monotonic,
    dns_timeout: float | None = None,
    cap: float | None = None,
) -> Prober:
    """The real prober: egress to ``egress.targets`` (its own section), the metadata server at
    ``metadata_url``, ``timeout`` for each probe (``agent.probe_timeout``), the DNS cache in
    ``state_dir``. ``dns_timeout`` (default ``egress.dns_timeout``) and ``cap`` (see
    :class:`Prober`) for a caller with a deadline of its own (``check --npd``)."""
    targets = [parse_host_port(t) for t in egress.targets]
    resolver: Resolver | None
    if any(not is_ip(h) for h, _ in targets):
        try:
            resolver = DnsResolver.from_strings(egress.dns_servers)
        except Exception:  # no usable resolver config at all: cached addresses only
            resolver = None
        if resolver is not None and any(resolver.queries(h) for h, _ in targets):
            preload_dns()  # on this thread, not at the first lookup on a worker's
    else:
        resolver = None
    cache = AddressCache(Path(state_dir) / "dns-cache.json")
    dns = egress.dns_timeout if dns_timeout is None else dns_timeout
    probe = EgressProbe(targets, timeout, dns, resolver, cache, clock)
    url = metadata_url

    def metadata(budget: float) -> ProbeResult:
        return probe_metadata(url, min(timeout, budget), clock)

    return Prober(metadata, probe, timeout, cap)
