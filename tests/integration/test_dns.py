"""The one resolver (lib/dns): /etc/hosts, A and AAAA, every server at once, one hard deadline.

Against FakeDNS, a real UDP server answering with dnspython's wire format."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gce_watchdog.lib.dns import MAX_TTL, DnsError, DnsResolver, Resolved
from gce_watchdog.testing.simgce import FakeDNS
from kit.wait import wait_for


@pytest.mark.pure
def test_literal_ip_needs_no_server() -> None:
    r = DnsResolver(resolv_conf="/nonexistent")
    assert r.resolve("192.0.2.1", 0.1) == ["192.0.2.1"]
    assert r.resolve("::1", 0.1) == ["::1"]


@pytest.mark.process
@pytest.mark.parametrize(("ttl", "want"), [(60, 60.0), (0, 0.0), (86400, MAX_TTL)])
def test_lookup_gives_the_answers_ttl_capped(ttl: int, want: float) -> None:
    with FakeDNS(records={"a.test": ["192.0.2.7"]}, ttl=ttl) as dns:
        r = DnsResolver.from_strings([f"127.0.0.1:{dns.port}"])
        assert r.lookup("a.test", 1.0) == Resolved(["192.0.2.7"], want)
    # a literal IP, like an /etc/hosts entry, is read again every time: no TTL
    assert DnsResolver(resolv_conf="/nonexistent").lookup("192.0.2.1", 0.1).ttl == 0.0


@pytest.mark.pure
def test_hosts_file_first_without_servers(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.9.8.7 files.internal  # comment\n")
    r = DnsResolver(hosts_path=str(hosts), resolv_conf=str(tmp_path / "none"))
    assert r.resolve("FILES.internal.", 0.5) == ["10.9.8.7"]
    with pytest.raises(DnsError, match="no DNS servers configured"):
        r.resolve("other.internal", 0.5)


@pytest.mark.process
def test_explicit_servers_skip_the_hosts_file(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("10.9.8.7 a.test\n")
    with FakeDNS(records={"a.test": ["192.0.2.5"]}) as dns:
        r = DnsResolver.from_strings([f"127.0.0.1:{dns.port}"], hosts_path=str(hosts))
        assert r.resolve("a.test", 1.0) == ["192.0.2.5"]


@pytest.mark.process
def test_aaaa_when_there_is_no_a_record() -> None:
    with FakeDNS(
        records={"v6only.test": ["2001:db8::7"], "both.test": ["192.0.2.1", "2001:db8::1"]}
    ) as dns:
        r = DnsResolver.from_strings([f"127.0.0.1:{dns.port}"])
        assert r.resolve("v6only.test", 1.0) == ["2001:db8::7"]
        assert r.resolve("both.test", 1.0) == ["192.0.2.1"]  # IPv4 preferred


@pytest.mark.process
def test_every_server_at_once_under_one_deadline() -> None:
    with FakeDNS(records={}) as silent, FakeDNS(records={"a.test": ["192.0.2.8"]}) as good:
        silent.mode = "silent"
        r = DnsResolver.from_strings([f"127.0.0.1:{silent.port}", f"127.0.0.1:{good.port}"])
        t0 = time.monotonic()
        assert r.resolve("a.test", 30.0) == ["192.0.2.8"]
        # the good one answered; waiting on the silent one would have cost the 30 s lifetime
        assert time.monotonic() - t0 < 10
        # It was asked too: both queries left before the good answer came, but the silent
        # server counts a query on its own thread, which may not have run yet (1 run in 17).
        assert wait_for(lambda: silent.queries >= 1, timeout=10)
        good.mode = "silent"
        t0 = time.monotonic()
        with pytest.raises(DnsError, match="timed out"):
            r.resolve("a.test", 2.0)
        # one deadline for both servers: one after the other would take 4 s or more
        assert time.monotonic() - t0 < 3.5


@pytest.mark.process
def test_rcodes_are_named() -> None:
    with FakeDNS(records={"a.test": ["192.0.2.1"]}) as dns:
        r = DnsResolver.from_strings([f"127.0.0.1:{dns.port}"])
        with pytest.raises(DnsError, match="NXDOMAIN"):
            r.resolve("missing.test", 1.0)
        dns.mode = "servfail"
        with pytest.raises(DnsError, match="SERVFAIL"):
            r.resolve("a.test", 1.0)
