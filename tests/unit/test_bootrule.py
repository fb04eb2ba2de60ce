"""Issue 35 item 1 (writer side): the boot counter's rule, vm/bootrule.py (pure).

Simulated boots of one instance: writers per boot, the file lost, a boot whose first write
fails. The counter a boot carries is never one an earlier boot carried, grows with the boots,
and is ``-`` only where the counter was lost or could not be written."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from gce_watchdog.vm.bootrule import (
    MAX_COUNT,
    Plan,
    Stored,
    Unusable,
    parse,
    plan,
    render,
    unwritable,
    wire_value,
)
from gce_watchdog.wire.protocol import valid_bc
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

A = "a" * 32
B = "b" * 32


def test_the_first_boot_of_an_instance_counts_1_and_writes_it_first() -> None:
    assert plan(None, False, A) == Plan(1, True)


def test_a_later_writer_of_the_boot_reads_the_value_back() -> None:
    assert plan(Stored(7, A), True, A) == Plan(7, False)


def test_a_new_boot_counts_one_more_and_writes_it_first() -> None:
    assert plan(Stored(7, A), True, B) == Plan(8, True)


def test_a_lost_file_never_restarts_at_1() -> None:
    p = plan(None, True, A)
    assert p.value is None and not p.write and "lost" in p.problem
    q = plan(Unusable("is a symlink (not followed)"), False, A)
    assert q.value is None and not q.write and "symlink" in q.problem


def test_an_operators_seed_of_0_counts_1_at_the_next_boot() -> None:
    assert plan(Stored(0, "0" * 32), True, A) == Plan(1, True)
    # a seed naming the current boot is not a value of it: the boot counts one more
    assert plan(Stored(0, A), True, A) == Plan(1, True)


def test_the_counter_never_wraps() -> None:
    p = plan(Stored(MAX_COUNT, A), True, B)
    assert p.value is None and "maximum" in p.problem
    assert plan(Stored(MAX_COUNT, A), True, A) == Plan(MAX_COUNT, False)


@pytest.mark.parametrize(
    "data",
    [b"", b"1 " + A.encode(), b"01 " + A.encode() + b"\n", b"1 " + b"g" * 32 + b"\n",
     b"1 2 " + A.encode() + b"\n", b"1000000000000 " + A.encode() + b"\n", b"\xff\n",
     b"-1 " + A.encode() + b"\n", "\u0661 ".encode() + A.encode() + b"\n"],
)  # fmt: skip
def test_a_damaged_file_is_unusable_never_read_as_a_counter(data: bytes) -> None:
    assert isinstance(parse(data), Unusable)


@given(st.integers(0, MAX_COUNT), st.text("0123456789abcdef", min_size=32, max_size=32))
def test_the_file_format_round_trips(n: int, bid: str) -> None:
    assert parse(render(Stored(n, bid))) == Stored(n, bid)


@given(st.one_of(st.none(), st.integers(1, MAX_COUNT)))
def test_every_value_is_a_valid_bc_field(v: int | None) -> None:
    assert valid_bc(wire_value(v))


@dataclass
class Sim:
    """One instance's state dir across boots: the file, whether the key exists."""

    stored: Stored | Unusable | None = None
    key: bool = False

    def writer(self, boot_id: str, write_fails: bool) -> tuple[int | None, str]:
        """One writer's first line of a boot (the edge's steps, the rule's answers);
        ``write_fails``: the state dir takes no write from it (full, read-only)."""
        p = plan(self.stored, self.key, boot_id)
        if p.write and p.value is not None:
            if write_fails:
                p = unwritable("ENOSPC")
            else:
                self.stored = Stored(p.value, boot_id)
        if not write_fails:
            self.key = True  # the first line creates the key (a dir that took no write: none)
        return p.value, p.problem


boots = st.lists(
    st.tuples(
        st.integers(1, 4),  # writers in the boot (no cache: each applies the rule)
        st.booleans(),  # the boot's first write fails (state dir full or read-only)
        st.sampled_from(["keep", "lose", "damage"]),  # what happens to the file before it
    ),
    min_size=1,
    max_size=12,
)


@given(boots)
def test_a_value_is_never_carried_by_two_boots_and_grows_with_the_boots(
    spec: list[tuple[int, bool, str]],
) -> None:
    sim = Sim()
    seen: dict[int, int] = {}  # value -> the boot that carried it
    last = 0
    lost = False
    for i, (writers, fails, fate) in enumerate(spec):
        if fate == "lose" and i:
            sim.stored, lost = None, True
        elif fate == "damage" and i:
            sim.stored, lost = Unusable("is not '<counter> <boot id>'"), True
        boot_id = f"{i:032x}"
        values = []
        for w in range(writers):
            v, why = sim.writer(boot_id, fails and w == 0)
            values.append(v)
            if v is None:
                # '-' only where the counter is lost or this boot's first write failed
                assert lost or (fails and w == 0), why
                assert why
        for v in values:
            if v is None:
                continue
            assert seen.setdefault(v, i) == i, f"value {v} of boot {seen[v]} reused by boot {i}"
            assert v >= last
            last = v
        if not lost and not fails:
            # nothing went wrong: every writer of the boot carries the same number
            assert len(set(values)) == 1 and values[0] is not None


@given(st.integers(1, 30), st.data())
def test_with_nothing_lost_boot_n_carries_n(n: int, data: st.DataObject) -> None:
    sim = Sim()
    for i in range(n):
        writers = data.draw(st.integers(1, 3))
        got = {sim.writer(f"{i:032x}", False)[0] for _ in range(writers)}
        assert got == {i + 1}
