"""The one host:port parser (IPv6 in brackets, RFC 3986 section 3.2.2) and IP literal checks.

Used by config validation, the egress probe targets, the DNS server lists of the probes and of
``fetch``: one reading of ``"[::1]:5353"`` everywhere.
"""

from __future__ import annotations

import ipaddress


def is_ip(s: str) -> bool:
    """Whether ``s`` is an IPv4 or IPv6 literal (no brackets, no port)."""
    try:
        ipaddress.ip_address(s)
    except ValueError:
        return False
    return True


def parse_host_port(raw: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port``, ``[v6]:port``; with ``default_port`` also ``host``, ``[v6]`` and a bare IPv6
    literal. Returns ``(host, port)`` with the brackets removed; raises ValueError with a readable
    message. An IPv6 address with a port needs the brackets: ``2001:db8::1:53`` is one address.
    """
    s = raw.strip()
    port_text: str | None
    if s.startswith("["):
        host, sep, rest = s[1:].partition("]")
        if not sep or ":" not in host:
            raise ValueError(f"not host:port: {raw!r} (want [IPv6]:PORT)")
        if rest and not rest.startswith(":"):
            raise ValueError(f"not host:port: {raw!r}")
        port_text = rest[1:] if rest else None
    elif s.count(":") == 1:
        host, _, port_text = s.partition(":")
    elif ":" in s:
        if not is_ip(s):
            raise ValueError(f"not host:port: {raw!r} (an IPv6 address goes in brackets)")
        host, port_text = s, None
    else:
        host, port_text = s, None
    if not host:
        raise ValueError(f"not host:port: {raw!r} (no host)")
    if port_text is None:
        if default_port is None:
            raise ValueError(f"not host:port: {raw!r} (no port)")
        return host, default_port
    if not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"not host:port: {raw!r} (port {port_text!r} is not a number)")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"not host:port: {raw!r} (port out of range)")
    return host, port


def parse_dns_server(raw: str) -> tuple[str, int]:
    """``IP``, ``IP:PORT``, ``IPv6`` or ``[IPv6]:PORT`` -> (ip, port), port 53 by default."""
    try:
        host, port = parse_host_port(raw, 53)
    except ValueError as e:
        raise ValueError(f"bad DNS server {raw!r}: want IP or IP:PORT ({e})") from None
    if not is_ip(host):
        raise ValueError(f"bad DNS server {raw!r}: {host!r} is not an IP address")
    return host, port


def join_host_port(host: str, port: int) -> str:
    """The inverse of :func:`parse_host_port`: brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
