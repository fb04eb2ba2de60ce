"""The one host:port parser: IPv6 brackets, ports, and its use by config validation."""

from __future__ import annotations

import ipaddress
import subprocess
from pathlib import Path

import pytest
from gce_watchdog.lib.netaddr import join_host_port, parse_dns_server, parse_host_port
from gce_watchdog.vm import config as cfgmod
from hypothesis import given
from hypothesis import strategies as st
from kit.cli import gcewd


@pytest.mark.pure
@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("www.google.com:443", ("www.google.com", 443)),
        ("10.0.0.1:53", ("10.0.0.1", 53)),
        ("[::1]:5353", ("::1", 5353)),
        ("[2001:db8::1]:443", ("2001:db8::1", 443)),
        (" host:1 ", ("host", 1)),
    ],
)
def test_host_port(raw: str, want: tuple[str, int]) -> None:
    assert parse_host_port(raw) == want


@pytest.mark.pure
@pytest.mark.parametrize(
    "raw",
    [
        "host",
        "host:",
        ":443",
        "host:abc",
        "host:0",
        "host:65536",
        "[::1]",
        "[::1]443",
        "[::1:443",
        "::1:443",
        "2001:db8::1:443",
        "[host]:1",
        "host:٣",
    ],
)
def test_host_port_refuses(raw: str) -> None:
    with pytest.raises(ValueError, match="not host:port"):
        parse_host_port(raw)


@pytest.mark.pure
@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("10.0.0.1", ("10.0.0.1", 53)),
        ("10.0.0.1:5353", ("10.0.0.1", 5353)),
        ("::1", ("::1", 53)),
        ("[::1]", ("::1", 53)),
        ("[::1]:5353", ("::1", 5353)),
    ],
)
def test_dns_server(raw: str, want: tuple[str, int]) -> None:
    assert parse_dns_server(raw) == want


@pytest.mark.pure
@pytest.mark.parametrize("raw", ["10.0.0.1:abc", "dns.google", "dns.google:53", "[::1]:x", ""])
def test_dns_server_refuses(raw: str) -> None:
    with pytest.raises(ValueError, match="bad DNS server"):
        parse_dns_server(raw)


@pytest.mark.pure
@given(
    st.one_of(
        st.ip_addresses(v=4).map(str),
        st.ip_addresses(v=6).map(str),
        st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z][a-z0-9-]{0,20}){0,3}", fullmatch=True),
    ),
    st.integers(1, 65535),
)
def test_join_then_parse_is_identity(host: str, port: int) -> None:
    assert parse_host_port(join_host_port(host, port)) == (host, port)


@pytest.mark.pure
@given(st.ip_addresses().map(str), st.integers(1, 65535))
def test_dns_server_roundtrip(ip: str, port: int) -> None:
    host, p = parse_dns_server(join_host_port(ip, port))
    assert (ipaddress.ip_address(host), p) == (ipaddress.ip_address(ip), port)


def _check(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    f = tmp_path / "c.toml"
    f.write_text(body)
    return gcewd("config", "check", str(f))


@pytest.mark.process
def test_config_check_refuses_a_bad_dns_server(tmp_path: Path) -> None:
    r = _check(tmp_path, '[egress]\ndns_servers = ["10.0.0.1:abc", "8.8.8.8"]\n')
    assert r.returncode == 78, r.stderr
    assert "egress.dns_servers" in r.stderr and "10.0.0.1:abc" in r.stderr
    assert "8.8.8.8'" not in r.stderr  # only the bad entry is named


@pytest.mark.process
def test_config_accepts_bracketed_ipv6(tmp_path: Path) -> None:
    r = _check(tmp_path, '[egress]\ndns_servers = ["[::1]:5353", "::1"]\ntargets = ["[::1]:443"]\n')
    assert r.returncode == 0, r.stderr


@pytest.mark.pure
def test_config_refuses_unbracketed_ipv6_target() -> None:
    with pytest.raises(cfgmod.InvalidConfig, match=r"egress.targets.*::1:443"):
        cfgmod.from_dict({"egress": {"targets": ["[2001:db8::1]:443", "::1:443"]}})
