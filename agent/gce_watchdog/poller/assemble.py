"""Putting a boot's lines back in order when they arrive out of order, twice, or not at all.

The pure core of the Pub/Sub path (no clock, no I/O: times are passed in). Log entries reach the
workers of a subscription in any order, spread over the workers, and possibly more than once. Every
line a worker receives goes to the shared store first (the ledger's ``assembly_*`` tables, see
``assembly_store.AssemblyStore``); this module computes, from **the union of what all workers
stored** for one (instance, boot), the **gap-free prefix**: the lines with seq 0, 1, 2, ... up to
the first one nobody has received yet. A line past a gap is held; the verdict is only ever taken
over the prefix, so a ``shutdown`` that arrives before the ``exit rc=0`` written just ahead of it
cannot fail a finished job over.

A gap is waited for ``settle_s`` from the moment the earliest line held behind it was received.
If it has not filled by then, the boot is **gapped**: never decided from the stream (the missing
line may be the one that forbids a failover), left to the Compute API sweep, which reads the
serial port's whole record. Seqs start at 0 for every boot (``SeqAllocator``), so a first line
with seq 5 waits for 0-4.

A healthy boot writes a heartbeat every 5 min for as long as it runs. Past ``MAX_PREFIX`` lines
the store keeps what a verdict can depend on (lifecycle and terminal events, as the cursor's
compaction does) plus the ``KEEP_RECENT`` latest lines; ``compact`` names the lines to drop, and
the boot's ``floor`` (every seq below it was in the prefix) moves up, so a dropped line that is
delivered again is not a gap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gce_watchdog.poller.verdict import gpu_fault_event, terminal_kind
from gce_watchdog.wire import vocab
from gce_watchdog.wire.protocol import Event

MAX_PREFIX = 1024
KEEP_RECENT = 64
_KEEP = frozenset(
    {"start", "stop", "phase", "setup_failed", "exit", "shutdown", "preempted", "recovered"}
)


@dataclass(frozen=True)
class Received:
    """One stored line: the event and when a worker first received it (its clock)."""

    event: Event
    received_at: float


@dataclass(frozen=True)
class Assembly:
    """What the stored lines of one boot say."""

    prefix: tuple[Event, ...]  # gap-free, in seq order
    next_seq: int  # the first seq not in the prefix
    held: int  # lines stored past the gap
    held_since: float | None  # when the earliest of them was received (None: nothing held)

    @property
    def terminal(self) -> Event | None:
        """The prefix's first terminal event: the boot's verdict is final once there is one."""
        return next((e for e in self.prefix if terminal_kind(e) is not None), None)

    @property
    def fault(self) -> Event | None:
        """The prefix's first GPU fault (``verdict.gpu_fault_event``: a ``gpu_fault`` line, or a
        ``memory_gpu st=lost`` no later ``st=ok`` took back), or None."""
        return gpu_fault_event(self.prefix)

    @property
    def stuck(self) -> Event | None:
        """The prefix's first ``job_stuck`` line (the agent's signed word that the job made no
        progress for its window), or None."""
        return next((e for e in self.prefix if e.event == vocab.JOB_STUCK), None)

    def settled(self, now: float, settle_s: float) -> bool:
        """True when a gap has been waited for ``settle_s``: its missing lines are lost."""
        return self.held_since is not None and now - self.held_since >= settle_s


def assemble(lines: Sequence[Received], floor: int = 0) -> Assembly:
    """The prefix of one boot's stored lines (any order, duplicates allowed).

    ``floor``: every seq below it was in the prefix once (lines below it may have been compacted
    away), so the prefix runs from there on without waiting for them.
    """
    by_seq: dict[int, Received] = {}
    for r in lines:
        by_seq.setdefault(r.event.seq, r)
    nxt = max(floor, 0)
    while nxt in by_seq:
        nxt += 1
    prefix = tuple(by_seq[s].event for s in sorted(by_seq) if s < nxt)
    held = [r.received_at for s, r in by_seq.items() if s > nxt]
    return Assembly(prefix, nxt, len(held), min(held, default=None))


def compact(a: Assembly) -> tuple[list[int], int]:
    """Past MAX_PREFIX lines: (the seqs to drop, the new floor). Nothing to do: ([], 0)."""
    if len(a.prefix) <= MAX_PREFIX:
        return [], 0
    old = a.prefix[:-KEEP_RECENT]
    keep = {e.seq for e in [e for e in old if e.event in _KEEP][-MAX_PREFIX // 2 :]}
    return [e.seq for e in old if e.seq not in keep], a.next_seq
