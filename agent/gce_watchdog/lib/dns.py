"""The one DNS resolver, for the egress probe and for ``fetch``.

- A literal IP is its own answer.
- Without configured servers, ``/etc/hosts`` first (what the system resolver reads first), then
  the ``nameserver`` lines of ``/etc/resolv.conf``, re-read on every look-up: early in boot the file
  may not exist yet, and DHCP may change it.
- A and AAAA queries go to every server at once over our own UDP sockets; the first server with
  an address wins (IPv4 preferred: an AAAA answer is held until that server's A answer says no
  data). ONE hard deadline covers it all: a silent resolver costs exactly the budget, never more.
- dnspython builds and parses the messages (``dns.message``); its stub resolver
  (``dns.resolver``/``dns.query``) is not used, because it pulls in asyncio and ssl (+2 MiB resident
  on the daemon) for nothing we need. dnspython is imported on first use, not at start-up.

Failures raise :class:`DnsError` (an ``OSError``) with one short message.

:meth:`DnsResolver.lookup` also gives the answer's TTL (the RRset's, capped at :data:`MAX_TTL`; 0
for a literal IP or an ``/etc/hosts`` entry, which are re-read every time), so a caller may reuse
the addresses while they are valid, as any stub cache does (the egress probe: docs/agent.md).
"""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

from gce_watchdog.lib.netaddr import is_ip, parse_dns_server

HOSTS_PATH = "/etc/hosts"
RESOLV_CONF = "/etc/resolv.conf"
MAX_NAMESERVERS = 3  # resolv.conf(5): at most three are used
_MAX_ANSWER = 4096  # bytes of a UDP answer we read (EDNS-less answers are at most 512)
MAX_TTL = 300.0  # seconds an answer is reused at most, whatever TTL it came with


class DnsError(OSError):
    """A look-up failed; the message says how (timeout, NXDOMAIN, no servers, ...)."""


class Resolver(Protocol):
    def resolve(self, host: str, lifetime: float) -> list[str]:
        """IPv4/IPv6 addresses of host within ``lifetime`` seconds; raises DnsError."""
        ...


class Resolved(NamedTuple):
    """Addresses and how long they may be reused (seconds; 0: ask again next time)."""

    addrs: list[str]
    ttl: float


@runtime_checkable
class TtlResolver(Protocol):
    def lookup(self, host: str, lifetime: float) -> Resolved:
        """Like :meth:`Resolver.resolve`, with the answer's TTL; raises DnsError."""
        ...


def lookup(resolver: Resolver, host: str, lifetime: float) -> Resolved:
    """The addresses of ``host`` and their TTL; a resolver that knows no TTL gives 0."""
    if isinstance(resolver, TtlResolver):
        return resolver.lookup(host, lifetime)
    return Resolved(resolver.resolve(host, lifetime), 0.0)


def hosts_file_lookup(path: str | Path, host: str) -> list[str]:
    """Addresses for host in an /etc/hosts style file."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    want = host.rstrip(".").lower()
    out: list[str] = []
    for line in text.splitlines():
        parts = line.split("#", 1)[0].split()
        if len(parts) >= 2 and want in (n.lower() for n in parts[1:]) and is_ip(parts[0]):
            out.append(parts[0])
    return out


def resolv_conf_servers(path: str | Path) -> list[tuple[str, int]]:
    """The usable ``nameserver`` lines of a resolv.conf; raises DnsError if none or unreadable."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        text = ""
    except OSError as e:
        raise DnsError(f"cannot read {path}: {e.strerror or e}") from None
    out: list[tuple[str, int]] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver" and is_ip(parts[1]):
            out.append((parts[1], 53))
    if not out:
        raise DnsError(f"no DNS servers configured in {path}")
    return out[:MAX_NAMESERVERS]


@dataclass
class DnsResolver:
    """See the module docstring. ``servers``: (ip, port) pairs; empty: the system configuration."""

    servers: tuple[tuple[str, int], ...] = ()
    hosts_path: str = HOSTS_PATH
    resolv_conf: str = RESOLV_CONF
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def from_strings(cls, servers: Sequence[str], **kw: Any) -> DnsResolver:
        """From config entries (``IP``, ``IP:PORT``, ``[IPv6]:PORT``); raises ValueError."""
        return cls(tuple(parse_dns_server(s) for s in servers), **kw)

    def _targets(self) -> list[tuple[str, int]]:
        return list(self.servers) if self.servers else resolv_conf_servers(self.resolv_conf)

    def resolve(self, host: str, lifetime: float) -> list[str]:
        return self.lookup(host, lifetime).addrs

    def queries(self, host: str) -> bool:
        """Whether a lookup of ``host`` would send a query (and so import dnspython): not an IP
        literal, and not answered by the hosts file (which is not read with ``servers``)."""
        if is_ip(host):
            return False
        return bool(self.servers) or not hosts_file_lookup(self.hosts_path, host)

    def lookup(self, host: str, lifetime: float) -> Resolved:
        if is_ip(host):
            return Resolved([host], 0.0)
        if not self.servers:
            found = hosts_file_lookup(self.hosts_path, host)
            if found:
                return Resolved(found, 0.0)
        return _query_all(host, self._targets(), lifetime, self.clock)


def preload() -> None:
    """Import the dnspython modules a query uses, now. The daemon calls it on its main thread:
    imported at the first lookup, on a probe's worker thread, their allocations stay in that
    thread's malloc arena, about 0.3 MiB more RSS for the same modules (docs/performance.md,
    "The RSS target")."""
    import dns.flags
    import dns.message
    import dns.rcode
    import dns.rdatatype  # noqa: F401


def _query_all(
    host: str, targets: list[tuple[str, int]], lifetime: float, clock: Callable[[], float]
) -> Resolved:
    import dns.message
    import dns.rdatatype

    deadline = clock() + lifetime
    name = host.rstrip(".") + "."
    queries = {
        rdtype: dns.message.make_query(name, rdtype)
        for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA)
    }
    socks: list[socket.socket] = []
    sel = selectors.DefaultSelector()
    # Per server: the answers still awaited, and AAAA addresses held until its A answer says none.
    pending: dict[tuple[str, int], set[int]] = {}
    held = Resolved([], 0.0)
    reasons: list[str] = []
    try:
        for ip, port in targets:
            fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
            s = socket.socket(fam, socket.SOCK_DGRAM)
            socks.append(s)
            s.setblocking(False)
            try:
                for q in queries.values():
                    s.sendto(q.to_wire(), (ip, port))
            except OSError:  # EPERM from a local DROP, no route: the other servers may answer
                reasons.append("unreachable")
                continue
            pending[(ip, port)] = set(queries)
            sel.register(s, selectors.EVENT_READ, (ip, port))
        while sel.get_map():
            left = deadline - clock()
            if left <= 0:
                reasons.append("timeout")
                break
            for key, _ in sel.select(left):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                server: tuple[str, int] = key.data
                try:
                    data, src = sock.recvfrom(_MAX_ANSWER)
                except OSError:
                    sel.unregister(sock)
                    reasons.append("unreachable")
                    continue
                if (src[0], src[1]) != server:
                    continue  # not from the server we asked: ignore (spoofing, strays)
                got = _answer(data, queries)
                if got is None:
                    continue  # garbage, truncated or not ours: wait for a valid answer
                rdtype, addrs, reason, ttl = got
                waiting = pending[server]
                waiting.discard(rdtype)
                if addrs and rdtype == dns.rdatatype.A:
                    return Resolved(addrs, ttl)
                if addrs:
                    held = held if held.addrs else Resolved(addrs, ttl)
                elif reason != "no_answer" or not waiting:
                    reasons.append(reason)
                if reason not in ("ok", "no_answer") or not waiting:
                    sel.unregister(sock)
                    if held.addrs and not waiting:
                        return held
        if held.addrs:
            return held
    finally:
        sel.close()
        for s in socks:
            s.close()
    raise DnsError(_failure(host, reasons, lifetime))


def _answer(data: bytes, queries: dict[Any, Any]) -> tuple[Any, list[str], str, float] | None:
    """(query type, addresses, reason, TTL capped at MAX_TTL) of an answer to one of ``queries``;
    None to ignore it."""
    import dns.flags
    import dns.message
    import dns.rcode

    try:
        r = dns.message.from_wire(data)
    except Exception:
        return None
    rdtype = next((t for t, q in queries.items() if q.is_response(r)), None)
    if rdtype is None:
        return None
    if r.flags & dns.flags.TC:
        return None
    if r.rcode() != dns.rcode.NOERROR:
        return rdtype, [], dns.rcode.to_text(r.rcode()), 0.0
    # CNAME chains are followed by dnspython; the final RRset holds the addresses
    chain = r.resolve_chaining() if isinstance(r, dns.message.QueryMessage) else None
    answer = chain.answer if chain is not None else None
    if answer is not None and answer.rdtype == rdtype:
        # the chain's smallest TTL (RFC 1034 4.3.2 / RFC 2181 5.2: the RRset's, every hop's)
        ttl = min([float(answer.ttl)] + [float(rr.ttl) for rr in r.answer])
        return rdtype, [rd.to_text() for rd in answer], "ok", max(0.0, min(ttl, MAX_TTL))
    return rdtype, [], "no_answer", 0.0


def _failure(host: str, reasons: list[str], lifetime: float) -> str:
    if "NXDOMAIN" in reasons:
        # Still a failure to retry for fetch: a resolver that is still starting (or a VPC zone
        # not yet attached) can say NXDOMAIN for a name that resolves a minute later.
        return f"{host}: no such name (NXDOMAIN)"
    rcodes = [r for r in reasons if r not in ("timeout", "unreachable", "no_answer")]
    if rcodes:
        return f"{host}: DNS servers failed ({rcodes[0]})"
    if "no_answer" in reasons:
        return f"{host}: no address (no A or AAAA record)"
    if "timeout" in reasons:
        return f"{host}: DNS timed out after {lifetime:.1f}s"
    return f"{host}: no DNS server reachable"
