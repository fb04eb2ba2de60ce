"""``poll --log changes``: which outcomes are written, and each round's summary line."""

from __future__ import annotations

from dataclasses import replace

import pytest
from gce_watchdog.poller.journal import (
    Journal,
    Said,
    alarm,
    is_change,
    said_of,
    summary_text,
)
from gce_watchdog.poller.ledger import Decision
from gce_watchdog.poller.poller import PollOutcome
from gce_watchdog.poller.verdict import Verdict, VerdictKind
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

NAMES = ("vm-0", "vm-1", "vm-2")


def outcome(
    name: str = "vm-0",
    kind: VerdictKind | None = VerdictKind.HEALTHY,
    *,
    iid: str | None = None,  # None: id-NAME
    error: str | None = None,
    decided: bool = False,
    announce: bool = False,
    forged: int = 0,
) -> PollOutcome:
    v = None if kind is None else Verdict(kind, f"reason of {kind.value}", "b1", ("ev",))
    d = None
    if decided:
        d = Decision(iid or name, "b1", 7, kind.value if kind else "-", "r", name, "me", 1.0, True)
    return PollOutcome(
        name, f"id-{name}" if iid is None else iid, "RUNNING", v, decision=d, error=error,
        announce=announce, forged=forged, project="p", zone="z",
    )  # fmt: skip


def test_first_sight_then_only_changes() -> None:
    j = Journal()
    healthy = outcome()
    assert j.admit(healthy)  # first sight
    assert not j.admit(healthy) and not j.admit(healthy)  # unchanged repeats
    assert j.admit(outcome(kind=VerdictKind.WORKLOAD_OK))  # a new verdict
    assert not j.admit(outcome(kind=VerdictKind.WORKLOAD_OK))
    assert j.admit(outcome("vm-1"))  # another instance: its own first sight
    t = j.close_round()
    assert (t.outcomes, t.written) == (6, 3)
    assert t.kinds == {"healthy": 4, "workload_ok": 2}
    assert j.close_round().outcomes == 0  # the next round counts from zero


def test_errors_alarms_and_decisions_are_always_written() -> None:
    j = Journal()
    err = outcome(kind=None, error="API unreachable", iid="")
    assert j.admit(err) and j.admit(err)  # every error
    assert j.admit(outcome())  # back from an error: a change
    forged = outcome(forged=2)
    assert alarm(forged) and j.admit(forged) and j.admit(forged)  # every alarm
    unread = outcome(kind=VerdictKind.ENDED_UNREAD)
    assert j.admit(unread) and j.admit(unread)  # an alarm verdict, every time
    wedge = VerdictKind.SUSPECTED_WEDGE
    announced = outcome(kind=wedge, decided=True, announce=True)
    assert announced.action == "failover" and j.admit(announced)
    repeat = outcome(kind=wedge, decided=True)
    assert repeat.action == "already_decided"
    assert j.admit(repeat)  # the first already_decided: the action changed
    assert not j.admit(repeat) and not j.admit(repeat)  # then quiet: the repeats
    reaped = replace(repeat, reaped="operation-1")
    assert j.admit(reaped)


def test_another_vm_under_the_same_name_is_a_first_sight() -> None:
    j = Journal()
    assert j.admit(outcome(iid="111"))
    assert not j.admit(outcome(iid="111"))
    assert j.admit(outcome(iid="222"))  # deleted and recreated with the same name
    # an error carries no id: the next outcome compares with the id said before it
    assert j.admit(outcome(kind=None, error="timeout", iid=""))
    assert said_of(outcome(kind=None, error="x", iid=""), Said("222", "healthy", "none")) == Said(
        "222", None, "error"
    )


def test_every_writes_everything_and_still_counts() -> None:
    j = Journal(every=True)
    assert all(j.admit(outcome()) for _ in range(5))
    t = j.close_round()
    assert (t.outcomes, t.written) == (5, 5)


def test_the_memory_is_bounded_and_forgets_the_least_recently_written() -> None:
    j = Journal(remember=2)
    for name in NAMES:
        assert j.admit(outcome(name))
    assert len(j.seen) == 2 and ("p", "z", "vm-0") not in j.seen
    assert j.admit(outcome("vm-0"))  # forgotten: a first sight again
    assert not j.admit(outcome("vm-2"))


def test_summary_text() -> None:
    j = Journal()
    for name, kind in [("a", VerdictKind.HEALTHY), ("b", VerdictKind.HEALTHY),
                       ("c", VerdictKind.WORKLOAD_OK)]:  # fmt: skip
        j.admit(outcome(name, kind))
    j.admit(outcome("a"))
    j.admit(outcome("d", None, error="boom"))
    assert summary_text(j.close_round()) == (
        "5 outcome(s): healthy 3, error 1, workload_ok 1; 4 written, 1 unchanged"
    )
    assert summary_text(j.close_round()) == "0 outcome(s): none; 0 written, 0 unchanged"


# -- properties ---------------------------------------------------------------------------------

KINDS = [VerdictKind.HEALTHY, VerdictKind.WORKLOAD_OK, VerdictKind.SUSPECTED_WEDGE,
         VerdictKind.ENDED_UNREAD, None]  # fmt: skip


@st.composite
def outcomes(draw: st.DrawFn) -> PollOutcome:
    kind = draw(st.sampled_from(KINDS))
    decided = kind is not None and kind.failover and draw(st.booleans())
    return outcome(
        draw(st.sampled_from(NAMES)),
        kind,
        iid=draw(st.sampled_from(["", "1", "2"] if kind is None else ["1", "2"])),
        error="e" if kind is None else None,
        decided=decided,
        announce=decided and draw(st.booleans()),
        forged=draw(st.sampled_from([0, 0, 0, 1])),
    )  # fmt: skip


@given(st.lists(outcomes(), max_size=60))
def test_nothing_changes_silently(seq: list[PollOutcome]) -> None:
    """Whatever the sequence: each outcome is written or says exactly what the last written
    outcome of its instance said; errors, alarms and decisions are always written; the tally
    counts every outcome once."""
    j = Journal()
    last: dict[str, Said] = {}
    written = 0
    for out in seq:
        w = j.admit(out)
        before = last.get(out.instance)
        if out.error or alarm(out) or out.announce or before is None:
            assert w
        if w:
            written += 1
            last[out.instance] = said_of(out, before)
        else:
            assert before is not None and said_of(out, before) == before
            assert not is_change(before, out)
    t = j.close_round()
    assert t.outcomes == len(seq) and t.written == written
    assert sum(t.kinds.values()) == len(seq)


@given(st.lists(outcomes(), max_size=40))
def test_every_is_everything(seq: list[PollOutcome]) -> None:
    j = Journal(every=True)
    assert all(j.admit(o) for o in seq)
    assert j.close_round().written == len(seq)
