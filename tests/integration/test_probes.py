"""Probes against real local servers on loopback: verdicts and reasons, never exceptions."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from gce_watchdog.daemon.ladder import ProbeVerdict
from gce_watchdog.daemon.probes import (
    AddressCache,
    EgressProbe,
    Prober,
    probe_metadata,
)
from gce_watchdog.lib.dns import DnsResolver
from gce_watchdog.testing.simgce import FakeDNS, FakeMetadataServer, TcpListener
from kit.ports import free_port
from kit.wait import wait_for


@pytest.fixture
def mds() -> FakeMetadataServer:
    with FakeMetadataServer() as s:
        yield s


@pytest.mark.process
def test_metadata_ok_returns_instance_id(mds: FakeMetadataServer) -> None:
    r = probe_metadata(mds.url, 2.0)
    assert (r.verdict, r.reason, r.detail) == (ProbeVerdict.OK, "ok", mds.info.id)
    assert mds.count("/instance/id") == 1


@pytest.mark.process
@pytest.mark.parametrize(
    ("mode", "reason"), [("http_503", "http_503"), ("bad_flavor", "bad_flavor")]
)
def test_metadata_bad_answers(mds: FakeMetadataServer, mode: str, reason: str) -> None:
    mds.set_mode(mode)
    r = probe_metadata(mds.url, 2.0)
    assert (r.verdict, r.reason) == (ProbeVerdict.FAIL, reason)


@pytest.mark.process
def test_metadata_slow_server_times_out_within_deadline(mds: FakeMetadataServer) -> None:
    mds.set_mode("slow", delay=30.0)
    t0 = time.monotonic()
    r = probe_metadata(mds.url, 0.3)
    took = time.monotonic() - t0
    assert (r.verdict, r.reason) == (ProbeVerdict.FAIL, "timeout")
    # cut at its deadline, not when the server answers 30 s later (the bound is that contrast,
    # not this machine's speed)
    assert took < 10


@pytest.mark.process
def test_a_counted_outage_fails_exactly_n_probes_then_ends_itself(mds: FakeMetadataServer) -> None:
    ended = threading.Event()
    mds.set_outage_for(3, on_end=ended.set)
    other = probe_metadata(mds.base + "/computeMetadata/v1/instance/name", 0.2)
    assert (other.verdict, other.reason) == (ProbeVerdict.FAIL, "timeout")  # hangs, not counted
    got = [probe_metadata(mds.url, 0.2).verdict for _ in range(4)]
    assert got == [ProbeVerdict.FAIL] * 3 + [ProbeVerdict.OK]
    assert ended.is_set() and mds.mode == "ok"
    assert probe_metadata(mds.url, 2.0).verdict is ProbeVerdict.OK  # and stays ended
    with pytest.raises(ValueError, match="probes"):
        mds.set_outage_for(-1)


@pytest.mark.process
def test_metadata_refused_and_bad_url() -> None:
    r = probe_metadata(f"http://127.0.0.1:{free_port()}/computeMetadata/v1/instance/id", 1.0)
    assert (r.verdict, r.reason) == (ProbeVerdict.FAIL, "refused")
    assert probe_metadata("https://x/", 1.0).verdict is ProbeVerdict.UNKNOWN


@pytest.mark.process
def test_metadata_requires_google_flavor_header(mds: FakeMetadataServer) -> None:
    # The server answers 403 to requests without the header; ours sends it, so this is the
    # server's side of the contract checked with a plain client.
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(mds.url, timeout=2)
    assert ei.value.code == 403


@pytest.mark.process
def test_egress_connects_to_any_target(tmp_path: Path) -> None:
    with TcpListener() as up:
        dead = free_port()
        p = EgressProbe(
            [("127.0.0.1", dead), ("127.0.0.1", up.port)],
            1.0,
            0.5,
            None,
            AddressCache(tmp_path / "c.json"),
        )
        r, dns = p()
        assert (r.verdict, r.reason, dns) == (ProbeVerdict.OK, "ok", "-")
    p = EgressProbe([("127.0.0.1", dead)], 1.0, 0.5, None, AddressCache(None))
    r, _ = p()
    assert (r.verdict, r.reason) == (ProbeVerdict.FAIL, "refused")


class OffsetClock:
    """Real monotonic time plus a jump a test makes (connect deadlines keep running)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


@pytest.mark.process
def test_egress_uses_cached_addresses_when_dns_fails(tmp_path: Path) -> None:
    cache_file = tmp_path / "dns-cache.json"
    clock = OffsetClock()
    with TcpListener() as up, FakeDNS(records={"egress.test": ["127.0.0.1"]}) as dns:
        resolver = DnsResolver.from_strings([f"127.0.0.1:{dns.port}"])
        p = EgressProbe(
            [("egress.test", up.port)], 1.5, 0.5, resolver, AddressCache(cache_file), clock
        )
        r, d = p()
        assert (r.verdict, d) == (ProbeVerdict.OK, "ok")
        assert cache_file.exists()
        dns.mode = "silent"  # DNS wedged: the probe must still reach 443 on the cached address
        clock.offset = 61.0  # past the answer's TTL (FakeDNS: 60 s), so the name is asked again
        r, d = p()
        assert (r.verdict, d) == (ProbeVerdict.OK, "fail")
        # a restarted agent (new cache object, same file) keeps the addresses
        p2 = EgressProbe([("egress.test", up.port)], 1.5, 0.5, resolver, AddressCache(cache_file))
        r, d = p2()
        assert (r.verdict, d) == (ProbeVerdict.OK, "fail")


@pytest.mark.process
def test_egress_reuses_an_answer_within_its_ttl_while_the_probe_succeeds() -> None:
    clock = OffsetClock()
    with TcpListener() as up, FakeDNS(records={"egress.test": ["127.0.0.1"]}) as dns:
        resolver = DnsResolver.from_strings([f"127.0.0.1:{dns.port}"])
        p = EgressProbe([("egress.test", up.port)], 1.5, 0.5, resolver, AddressCache(None), clock)

        def both_served(before: int) -> int:
            # A look-up sends A and AAAA at once and returns on the A answer: the AAAA query
            # may reach the server's count after the probe returned (a loaded machine showed
            # it). Wait for both, so that a later count only moves for a new look-up.
            assert wait_for(lambda: dns.queries >= before + 2, 10), dns.queries
            return dns.queries

        r, d = p()  # the first tick asks DNS
        assert (r.verdict, d) == (ProbeVerdict.OK, "ok") and dns.queries > 0
        asked = both_served(0)
        for _ in range(5):  # healthy ticks inside the 60 s TTL: no query at all
            r, d = p()
            assert (r.verdict, d) == (ProbeVerdict.OK, "ok")
        assert dns.queries == asked
        clock.offset = 61.0  # the TTL ran out: asked again (A and AAAA), then reused again
        assert p()[1] == "ok" and dns.queries > asked
        asked = both_served(asked)
        up.stop()  # 443 refused: the tick after it asks DNS again (an outage says what DNS does)
        r, _ = p()
        assert r.verdict is ProbeVerdict.FAIL and dns.queries == asked
        dns.mode = "silent"
        r, d = p()
        assert (r.verdict, d) == (ProbeVerdict.FAIL, "fail") and dns.queries > asked


@pytest.mark.process
def test_egress_without_any_address_fails_with_reason(tmp_path: Path) -> None:
    with FakeDNS(records={}) as dns:
        dns.mode = "servfail"
        resolver = DnsResolver.from_strings([f"127.0.0.1:{dns.port}"])
        p = EgressProbe([("nowhere.test", 443)], 1.0, 0.5, resolver, AddressCache(None))
        r, d = p()
    assert (r.verdict, r.reason, d) == (ProbeVerdict.FAIL, "no_address", "fail")


@pytest.mark.pure
def test_tick_runs_probes_concurrently() -> None:
    """Both probes wait for each other at a barrier: they pass it only if they run at the same
    time (one after the other, the first would wait alone until the barrier broke)."""
    from gce_watchdog.daemon.tick import ProbeResult

    both = threading.Barrier(2)
    met: list[str] = []

    def meet(name: str) -> None:
        both.wait(timeout=10)
        met.append(name)

    def slow_md(budget):  # type: ignore[no-untyped-def]
        meet("md")
        return ProbeResult(ProbeVerdict.FAIL, "timeout", 400)

    def slow_eg(budget):  # type: ignore[no-untyped-def]
        meet("eg")
        return ProbeResult(ProbeVerdict.FAIL, "timeout", 400), "-"

    p = Prober(slow_md, slow_eg, timeout=30)
    try:
        r = p.tick()
    finally:
        p.close()
    assert sorted(met) == ["eg", "md"]
    assert r.metadata.verdict is ProbeVerdict.FAIL and r.egress.verdict is ProbeVerdict.FAIL


@pytest.mark.pure
def test_probe_exceptions_become_unknown_not_raise() -> None:
    class Boom:
        def resolve(self, host: str, lifetime: float) -> list[str]:
            raise RuntimeError("resolver exploded")

    p = EgressProbe([("x.test", 443)], 0.5, 0.2, Boom(), AddressCache(None))
    r, d = p()
    assert r.verdict is ProbeVerdict.FAIL and r.reason == "no_address" and d == "fail"


@pytest.mark.process
def test_resolver_hard_deadline_and_rcodes(tmp_path: Path) -> None:
    with FakeDNS(records={"a.test": ["192.0.2.7", "192.0.2.8"]}) as dns:
        r = DnsResolver.from_strings([f"127.0.0.1:{dns.port}"])
        assert sorted(r.resolve("a.test", 1.0)) == ["192.0.2.7", "192.0.2.8"]
        t0 = time.monotonic()
        with pytest.raises(OSError, match="NXDOMAIN"):
            r.resolve("missing.test", 30.0)
        assert time.monotonic() - t0 < 10  # an answer, not the 30 s timeout
        dns.mode = "silent"
        t0 = time.monotonic()
        with pytest.raises(OSError, match="timed out"):
            r.resolve("a.test", 2.0)
        took = time.monotonic() - t0
        # exactly the budget: one hard deadline. Never before it; a second try or a second
        # budget would take 4 s or more (the upper bound is that contrast, not load luck).
        assert 1.99 <= took < 3.5


@pytest.mark.pure
def test_resolver_reads_resolv_conf(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text(
        "# dhclient\nsearch c.proj.internal\nnameserver 169.254.169.254\n"
        "nameserver not-an-ip\nnameserver 192.0.2.53\n"
    )
    r = DnsResolver(resolv_conf=str(conf))
    assert r._targets() == [("169.254.169.254", 53), ("192.0.2.53", 53)]
    with pytest.raises(OSError, match="no DNS servers configured"):
        DnsResolver(resolv_conf=str(tmp_path / "missing")).resolve("a.test", 0.1)


@pytest.mark.process
def test_metadata_absurd_status_line_is_a_failure_not_an_exception() -> None:
    # int() refuses more than 4300 digits: a status line like this must not escape the probe.
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def answer() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 " + b"9" * 5000 + b" OK\r\nMetadata-Flavor: Google\r\n\r\n")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        r = probe_metadata(f"http://127.0.0.1:{srv.getsockname()[1]}/", 2.0)
    finally:
        t.join(2.0)
        srv.close()
    assert (r.verdict, r.reason) == (ProbeVerdict.FAIL, "bad_response")


@pytest.mark.pure
def test_tick_turns_a_raising_probe_into_unknown() -> None:
    from gce_watchdog.daemon.tick import ProbeResult

    def boom(budget: float) -> ProbeResult:
        raise KeyError("a bug in a probe")

    def eg(budget: float) -> tuple[ProbeResult, str]:
        return ProbeResult(ProbeVerdict.OK, "ok", 1), "ok"

    p = Prober(boom, eg, timeout=0.5)
    try:
        r = p.tick()
    finally:
        p.close()
    assert (r.metadata.verdict, r.metadata.reason) == (ProbeVerdict.UNKNOWN, "internal_KeyError")
    assert r.egress.verdict is ProbeVerdict.OK


@pytest.mark.process
def test_resolver_reaches_a_bracketed_ipv6_server_with_a_port() -> None:
    # "[::1]:5353" used to be split into host "::1]:5353", port 53: dns=fail forever, silently.
    with FakeDNS(host="::1", records={"v6.test": ["192.0.2.9"]}) as dns:
        r = DnsResolver.from_strings([f"[::1]:{dns.port}"])
        assert r.resolve("v6.test", 1.0) == ["192.0.2.9"]
        assert dns.answered >= 1
