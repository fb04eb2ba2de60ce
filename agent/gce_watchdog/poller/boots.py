"""Boot order (pure): which of an instance's boots is current, and which are replays.

One rule for every reader (the polling reader, ``parse``, Cloud Logging evidence, the Pub/Sub
workers, ``report``; docs/serial-protocol.md, "Boot order"):

1. A boot's counter is the ``bc`` field of its verified lines (the agent's boot counter,
   incremented at every boot, never reused); ``bc=-`` or no ``bc`` (an agent before the
   counter) is *unknown* (None here).
2. The boot with the highest known counter is current: among the boots this read found and
   the ledger's record for the instance (the highest counter any reader saw, and its boot).
   Equal counters: the ledger's boot, else the one seen first.
3. A boot with a known counter at or below the highest, other than the highest's own boot,
   whose first line comes after the highest boot's first line (or when the highest boot is
   only in the ledger: anywhere) is a replay or a lost counter: it never decides and is
   *regressed* (the ``boot_regressed`` alarm). One whose first line comes before is simply an
   older boot (the window still holds it): never current, no alarm.
4. A boot of unknown counter first seen after the highest boot's first line (or when the
   highest boot is only in the ledger: anywhere) is current, the latest such by stream order:
   a VM that cannot count cannot be ordered by count.
5. No known counter anywhere (older agents only): the order before the counter, by stream
   position, with one use of the guest's signed time: a boot first seen later whose first line
   is more than REPLAY_BOUND_MS *older* than the current one's is a replay of an older boot
   (the one case a counter cannot cover: lines that carry none).

Positions are the reader's stream order of each boot's first verified line (0 = first seen);
the guest's clock orders nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gce_watchdog.wire.protocol import Event, bc_counter

# Rule 5 only (lines without a counter): a guest clock set back further than this between two
# boots is taken for a replay of an older boot (docs/serial-protocol.md, decoding rule 8).
REPLAY_BOUND_MS = 24 * 3600 * 1000
ALARM_BOOT_REGRESSED = "boot_regressed"

# A line's ``bc`` value as a counter (None: ``-``, absent or malformed): the wire's one check
parse_counter = bc_counter


@dataclass(frozen=True)
class Seen:
    """One boot a read found: its id, its counter (None: unknown), its position (the stream
    order of its first verified line) and its first line's signed time (rule 5 only)."""

    boot: str
    counter: int | None
    order: int
    first_ts_ms: int = 0


@dataclass(frozen=True)
class Record:
    """The ledger's record for an instance: the highest counter seen, its boot, and where it
    began (the reader's clock when a reader first received its first line; shown only)."""

    counter: int
    boot: str
    began: float = 0.0


@dataclass(frozen=True)
class Order:
    """The answer: the current boot (None: no boot), the regressed boots (stream order), and
    ``raise_to``: the boot of this read that holds a counter above the record's (the record
    to store; None when the record stands)."""

    current: str | None
    regressed: tuple[str, ...] = ()
    raise_to: Seen | None = None


def _by_position(seen: Iterable[Seen]) -> list[Seen]:
    return sorted(seen, key=lambda s: (s.order, s.boot))


def _old_rule(boots: Sequence[Seen]) -> str | None:
    """Rule 5: stream order, a boot first seen later whose first line is over REPLAY_BOUND_MS
    older than the current one's being a replay."""
    cur: Seen | None = None
    for b in boots:
        if cur is None or b.first_ts_ms >= cur.first_ts_ms - REPLAY_BOUND_MS:
            cur = b
    return cur.boot if cur is not None else None


def order(seen: Iterable[Seen], record: Record | None = None) -> Order:
    """The current boot and the regressed ones, by the rules above."""
    boots = _by_position(seen)
    known = [s for s in boots if s.counter is not None]
    best = max(
        known, key=lambda s: (s.counter or 0, -s.order), default=None
    )  # first seen wins a tie
    best_c = best.counter if best is not None and best.counter is not None else 0
    if record is not None and (best is None or best_c <= record.counter):
        top_counter, top_boot, raise_to = record.counter, record.boot, None
    elif best is not None:
        top_counter, top_boot, raise_to = best_c, best.boot, best
    else:
        return Order(_old_rule(boots))
    here = [s for s in boots if s.boot == top_boot]
    top_pos = here[0].order if here else None  # None: the highest boot is in the ledger only
    regressed = tuple(
        s.boot
        for s in boots
        if s.counter is not None
        and s.boot != top_boot
        and s.counter <= top_counter
        and (top_pos is None or s.order > top_pos)
    )
    later = [s for s in boots if s.counter is None and (top_pos is None or s.order > top_pos)]
    current = later[-1].boot if later else top_boot
    return Order(current, regressed, raise_to)


def counter_of(values: Iterable[str | None]) -> int | None:
    """A boot's counter from its verified lines' ``bc`` values (first known one wins)."""
    for v in values:
        c = parse_counter(v)
        if c is not None:
            return c
    return None


def seen_of(events: Iterable[Event]) -> list[Seen]:
    """The boots of ``events`` (verified, in stream order) as :class:`Seen`: position by first
    line, counter from their ``bc``, the earliest signed time (rule 5)."""
    found: dict[str, Seen] = {}
    for e in events:
        s = found.get(e.boot)
        c = parse_counter(e.get("bc"))
        if s is None:
            found[e.boot] = Seen(e.boot, c, len(found), e.ts_ms)
        elif (s.counter is None and c is not None) or e.ts_ms < s.first_ts_ms:
            found[e.boot] = Seen(
                e.boot,
                s.counter if s.counter is not None else c,
                s.order,
                min(s.first_ts_ms, e.ts_ms),
            )
    return list(found.values())
