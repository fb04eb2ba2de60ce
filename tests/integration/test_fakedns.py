"""The fake DNS's "late resolver": silence is timed by the client's queries, never by the server's
start (issue 17 item 10: a VM that took 54 s to boot found a 40 s silence already over)."""

from __future__ import annotations

import queue

import dns.exception
import dns.message
import dns.query
import dns.rdatatype
import pytest
from gce_watchdog.testing.simgce import FakeDNS
from kit.clocks import ManualClock

pytestmark = pytest.mark.process

# How long one query waits for an answer that must come (loopback) or must not (silence). The
# silent case is also confirmed by the server's own record of the query (on_query), so a short
# wait does not make the check pass by itself.
QUERY_WAIT = 2.0


def ask(port: int, seen: queue.Queue[tuple[str, bool]]) -> tuple[bool, bool]:
    """One A query for a.test: (answered on the wire, answered per the server's record)."""
    q = dns.message.make_query("a.test", dns.rdatatype.A)
    try:
        r = dns.query.udp(q, "127.0.0.1", port=port, timeout=QUERY_WAIT)
        wire = bool(r.answer)
    except dns.exception.Timeout:
        wire = False
    name, answered = seen.get(timeout=QUERY_WAIT)
    assert name == "a.test."
    return wire, answered


def test_silence_runs_from_the_first_query_not_from_the_start() -> None:
    clock = ManualClock(100.0)
    seen: queue.Queue[tuple[str, bool]] = queue.Queue()
    records = {"a.test": ["192.0.2.1"]}
    with FakeDNS(
        records=records, answer_after=30.0, clock=clock, on_query=lambda *a: seen.put(a)
    ) as d:
        clock.t = 1000.0  # a slow boot: long past 30 s since the server started
        assert ask(d.port, seen) == (False, False), "the first query starts the silence"
        clock.t = 1029.0
        assert ask(d.port, seen) == (False, False)
        clock.t = 1030.0
        assert ask(d.port, seen) == (True, True), "30 s after the first query it answers"
    assert (d.queries, d.answered) == (3, 1)


def test_silent_for_the_first_n_queries() -> None:
    seen: queue.Queue[tuple[str, bool]] = queue.Queue()
    records = {"a.test": ["192.0.2.1"]}
    with FakeDNS(records=records, silent_queries=3, on_query=lambda *a: seen.put(a)) as d:
        got = [ask(d.port, seen) for _ in range(5)]
    assert got == [(False, False)] * 3 + [(True, True)] * 2


def test_silent_mode_never_answers_and_says_so() -> None:
    seen: queue.Queue[tuple[str, bool]] = queue.Queue()
    with FakeDNS(records={"a.test": ["192.0.2.1"]}, on_query=lambda *a: seen.put(a)) as d:
        d.mode = "silent"
        assert ask(d.port, seen) == (False, False)
        d.mode = "ok"
        assert ask(d.port, seen) == (True, True)
