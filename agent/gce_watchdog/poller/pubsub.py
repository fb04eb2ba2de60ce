"""Event-driven ingestion: serial lines exported to Cloud Logging, sent to Pub/Sub by a log sink.

With ``serial-port-logging-enable=true`` GCE writes every console line of port 1 to Cloud Logging
as a LogEntry with ``logName``
``projects/P/logs/serialconsole.googleapis.com%2Fserial_port_1_output``, ``resource.type``
``gce_instance`` (labels ``instance_id``, ``zone``, ``project_id``), the line in ``textPayload``
and the instance name in ``labels["compute.googleapis.com/resource_name"]``. A log sink with
that filter and a Pub/Sub topic as destination publishes each entry, as JSON, as the data of one
message.

A worker (``gce-watchdog poll --pubsub projects/P/subscriptions/S``):

1. pulls a batch and decodes each LogEntry; lines that are not ours are acked at once;
2. puts our lines back in order per (instance id, boot) (``Assembler``: duplicates dropped, a gap
   waited for ``settle_s``, then declared lost) and decides over each boot's gap-free prefix. A
   boot with a line declared lost is never decided from the stream: the lost line may be the
   ``exit rc=0`` or ``setup_failed`` that forbids a failover. Its instance goes to ``gapped``,
   and the Compute API sweep reads its serial port (the whole record) and decides it there;
3. claims a failover in the ledger (durable when ``claim`` returns), announces it, marks it
   announced;
4. acks a message only once its line is in the prefix and any claim it led to is durable. A line
   held behind a gap is not acked: if the worker dies, Pub/Sub redelivers it;
5. every ``ANNOUNCE_SWEEP_S``, announces pending decisions whose claimer died before announcing
   (the lease lapsed): a worker killed between claim and ack is covered by the next one.

Only verdicts that a line proves are taken here (``self_shutdown``, ``preempted``). Silence and
stopped instances are not visible in a stream of lines: the slow Compute API sweep
(``FleetPoller`` over ``--label``) catches those, and polls VMs whose console is not exported.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gce_watchdog.poller.assemble import Assembler
from gce_watchdog.poller.ledger import BaseLedger, Decision
from gce_watchdog.poller.poller import PollOutcome, announced_outcome, lapsed_announcements
from gce_watchdog.poller.verdict import InstanceState, Policy, Verdict, VerdictKind, decide
from gce_watchdog.wire.protocol import (
    Event,
    Forged,
    Forgery,
    KeyAnnounce,
    decode_line,
)

SERIAL_LOG_SUFFIX = "/logs/serialconsole.googleapis.com%2Fserial_port_1_output"
NAME_LABEL = "compute.googleapis.com/resource_name"
SUBSCRIPTION_RE = re.compile(
    r"projects/[a-z][-a-z0-9:.]{4,61}[a-z0-9]/subscriptions/[A-Za-z][-\w.~+%]{2,254}\Z"
)
# Lines arrive within seconds of each other; a gap still open after this is a lost line.
DEFAULT_SETTLE_S = 2.0
# How often a worker looks for decisions whose claimer died before announcing them.
ANNOUNCE_SWEEP_S = 5.0
# Messages per pull (the API allows up to 1,000).
PULL_MAX = 500
# Messages kept per instance while its key announcement has not arrived yet (a shuffled stream):
# about a day of one healthy boot's lines. Past that they are left to Pub/Sub's redelivery.
WAITING_MAX = 4096
# Only these verdicts are proven by a line; the others need the instance's status or silence.
LINE_VERDICTS = frozenset({VerdictKind.SELF_SHUTDOWN, VerdictKind.PREEMPTED})


@dataclass(frozen=True)
class SerialLine:
    project: str
    zone: str
    instance_id: str
    instance: str  # the name ("" if the entry did not carry it)
    text: str


def parse_log_entry(data: bytes) -> SerialLine | None:
    """The serial line a sink's message carries, or None (another log, or not a LogEntry)."""
    try:
        entry = json.loads(data)
    except ValueError:
        return None
    if not isinstance(entry, dict) or not str(entry.get("logName", "")).endswith(SERIAL_LOG_SUFFIX):
        return None
    res = entry.get("resource") or {}
    labels = res.get("labels") or {} if isinstance(res, dict) else {}
    text = entry.get("textPayload")
    if not isinstance(text, str) or not isinstance(labels, dict) or not labels.get("instance_id"):
        return None
    name = (entry.get("labels") or {}).get(NAME_LABEL, "")
    return SerialLine(
        str(labels.get("project_id", "")),
        str(labels.get("zone", "")),
        str(labels["instance_id"]),
        str(name),
        text,
    )


@dataclass
class _Held:
    line: SerialLine
    ack_ids: list[str] = field(default_factory=list)


@dataclass
class WorkerStats:
    messages: int = 0
    lines: int = 0  # ours, decoded
    foreign: int = 0  # acked at once: not our line or not a serial LogEntry
    forged: int = 0  # intact lines of ours that do not authenticate (acked, never evidence)
    unverified: int = 0  # deliveries left unacked: no key pinned yet for the instance
    unpinned: int = 0  # instances whose lines arrived without a pin in the ledger (an alarm)
    decisions: int = 0
    announced: int = 0
    acked: int = 0
    gapped: int = 0  # instances left to the Compute API sweep: a boot of theirs lost a line
    latencies: list[float] = field(default_factory=list)  # publish time -> claim, seconds


class PubSubWorker:
    """Pull, assemble, decide, claim, ack. ``subscriber`` is a ``pubsub_v1.SubscriberClient``."""

    def __init__(
        self,
        subscriber: Any,
        subscription: str,
        ledger: BaseLedger,
        emit: Callable[[PollOutcome], None],
        policy: Policy | None = None,
        settle_s: float = DEFAULT_SETTLE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.subscriber = subscriber
        self.subscription = subscription
        self.ledger = ledger
        self.emit = emit
        self.policy = policy or Policy()
        self.asm = Assembler(settle_s)
        self.clock = clock
        self.stats = WorkerStats()
        # Per instance id, its pinned public key (protocol v3), from the ledger: shared with
        # every poller and worker, on any host, after any restart. A worker never places a
        # pin itself (a stream of log entries cannot show it has everything since the
        # instance's creation): the poll path places pins from byte 0 of the port, operators
        # pin by hand (`gce-watchdog pin`; the key with that fingerprint is then stored).
        self.keys: dict[str, bytes] = {}
        self._hand: dict[str, str] = {}  # instance id -> hand-pinned fingerprint (no key yet)
        self.unpinned: set[str] = set()  # instance ids seen without a pin: an alarm
        self.last_heard: dict[str, float] = {}  # instance id -> when its last line arrived
        self._held: dict[tuple[str, str, int], _Held] = {}  # (id, boot, seq) -> its messages
        self._info: dict[str, SerialLine] = {}  # instance id -> its latest line's identity
        self._published: dict[tuple[str, str, int], float] = {}
        self._last_sweep = 0.0
        self._lock = threading.Lock()
        # Boots decided here: their later lines and redeliveries are acked without a second look.
        # Bounded: a boot is decided once, and a worker's lifetime sees a bounded fleet.
        self._decided: set[tuple[str, str]] = set()
        # Instance ids with a boot whose stream lost a line: never decided here, polled by the
        # Compute API sweep instead (app's _sweep selects it). Bounded by the fleet.
        self.gapped: set[str] = set()
        # Per instance id, messages received before its pin (unacked meanwhile).
        self._waiting: dict[str, list[tuple[Any, SerialLine]]] = {}

    def pull(self, timeout: float) -> list[Any]:
        from google.api_core import exceptions as gexc

        try:
            resp = self.subscriber.pull(
                request={"subscription": self.subscription, "max_messages": PULL_MAX},
                timeout=timeout,
            )
        except (gexc.DeadlineExceeded, gexc.RetryError):
            return []
        return list(resp.received_messages)

    def step(self, timeout: float = 1.0) -> int:
        """One pull and everything it leads to; returns the number of messages received."""
        msgs = self.pull(timeout)
        now = self.clock()
        to_ack: list[str] = []
        grown: set[tuple[str, str]] = set()
        parsed = [parse_log_entry(rm.message.data) for rm in msgs]
        looked: set[str] = set()
        for iid in list(self._waiting):  # lines waiting for a pin: has one been stored since?
            self._lookup(iid, looked)
        for line in parsed:  # the batch's instances, and hand pins filled in by announcements
            if line is not None and line.instance_id not in self.keys:
                self._lookup(line.instance_id, looked)
                self._fill_hand_pin(line, now)
        self.stats.messages += len(msgs)
        # Lines that came before their instance's key (a shuffled stream) waited here, unacked;
        # those whose key is now pinned are taken first, in this step.
        ready = [iid for iid in self._waiting if iid in self.keys]
        items = [item for iid in ready for item in self._waiting.pop(iid)]
        for rm, line in [*items, *zip(msgs, parsed, strict=True)]:
            self._take(rm, line, now, to_ack, grown)
        grown.update(self.asm.settle(now))
        for iid, boot in sorted(grown):
            self._decide(iid, boot, now)
        to_ack += self._ackable()
        self.ack(to_ack)
        if now - self._last_sweep >= ANNOUNCE_SWEEP_S:
            self._last_sweep = now
            self.announce_pending(now)
        return len(msgs)

    def _lookup(self, iid: str, looked: set[str]) -> None:
        """The instance's pin from the ledger (once per step per instance)."""
        if iid in self.keys or iid in looked:
            return
        looked.add(iid)
        pin = self.ledger.get_pin(iid)
        if pin is None:
            return
        if pin.public is not None:
            self.keys[iid] = pin.public
            self._hand.pop(iid, None)
        else:
            self._hand[iid] = pin.fingerprint

    def _fill_hand_pin(self, line: SerialLine, now: float) -> None:
        """An announcement of the key an operator pinned by fingerprint: store its key."""
        fp = self._hand.get(line.instance_id)
        if fp is None or " key pk=" not in line.text:
            return
        res = decode_line(line.text)
        if (
            isinstance(res, KeyAnnounce)
            and res.version == 3
            and res.fingerprint == fp
            and res.inst in ("-", line.instance_id)
            and res.valid()
        ):
            stored = self.ledger.place_pin(line.instance_id, res.key, fp, now)
            if stored.public is not None:
                self.keys[line.instance_id] = stored.public
                self._hand.pop(line.instance_id, None)

    def _take(
        self,
        rm: Any,
        line: SerialLine | None,
        now: float,
        to_ack: list[str],
        grown: set[tuple[str, str]],
    ) -> None:
        """One received message: ack it, hold it, or wait for its instance's key."""
        pin = self.keys.get(line.instance_id) if line else None
        res = decode_line(line.text, None, pin) if line else None
        if isinstance(res, KeyAnnounce) and line is not None:
            # protocol v3: only the pinned key's announcement, for this very instance id (a
            # real line relabelled with another VM's id names its own), is accepted
            if pin is None:
                res = Forged(Forgery.NO_KEY, b"", res.event)
            elif res.version != 3 or res.key != pin:
                res = Forged(Forgery.UNPLACED if res.version == 3 else Forgery.V2, b"")
            elif res.inst not in ("-", line.instance_id):
                res = Forged(Forgery.RELABELLED, b"")
            elif not res.valid():
                res = Forged(Forgery.BAD_SIG, b"")
            else:
                res = res.event
        if isinstance(res, Forged) and res.reason == Forgery.NO_KEY and line is not None:
            # No key pinned yet: kept unacked until the instance's key announcement arrives
            # (then taken, in that step), at most WAITING_MAX per instance; past that, left to
            # Pub/Sub's redelivery. Never acked unread: a worker that dies loses nothing.
            self.stats.unverified += 1
            if line.instance_id not in self.unpinned:
                self.unpinned.add(line.instance_id)
                self.stats.unpinned += 1
            waiting = self._waiting.setdefault(line.instance_id, [])
            if len(waiting) < WAITING_MAX:
                waiting.append((rm, line))
            return
        if isinstance(res, Forged):
            self.stats.forged += 1
        ev = res
        if line is None or not isinstance(ev, Event):
            self.stats.foreign += 1
            to_ack.append(rm.ack_id)
            return
        self.stats.lines += 1
        self.last_heard[line.instance_id] = now
        self._info[line.instance_id] = line
        if (line.instance_id, ev.boot) in self._decided:
            to_ack.append(rm.ack_id)
            return
        key = (line.instance_id, ev.boot, ev.seq)
        self._held.setdefault(key, _Held(line)).ack_ids.append(rm.ack_id)
        pub = rm.message.publish_time
        if pub is not None and key not in self._published:
            self._published[key] = pub.timestamp()
        if self.asm.add(line.instance_id, ev, now):
            grown.add((line.instance_id, ev.boot))

    def _ackable(self) -> list[str]:
        """Messages whose line is in its boot's prefix (or whose boot was decided and dropped)."""
        out = []
        for key in list(self._held):
            iid, boot, seq = key
            s = self.asm.streams.get((iid, boot))
            if s is None or seq < s.next_seq:
                out += self._held.pop(key).ack_ids
                self._published.pop(key, None)
        return out

    def ack(self, ack_ids: list[str]) -> None:
        for i in range(0, len(ack_ids), 1000):
            chunk = ack_ids[i : i + 1000]
            self.subscriber.acknowledge(
                request={"subscription": self.subscription, "ack_ids": chunk}
            )
            self.stats.acked += len(chunk)

    def _decide(self, iid: str, boot: str, now: float) -> None:
        events = self.asm.events(iid, boot)
        if not events:
            return
        stream = self.asm.streams.get((iid, boot))
        if stream is not None and stream.lost:
            if iid not in self.gapped:
                self.gapped.add(iid)
                self.stats.gapped += 1
            return  # a lost line may be the one that forbids a failover: the API sweep decides
        verdict = decide(events, InstanceState("RUNNING"), now, self.policy)
        if verdict.kind not in LINE_VERDICTS:
            return
        line = self._info[iid]
        decision = self.ledger.claim(
            iid,
            boot,
            verdict.kind.value,
            verdict.reason,
            f"{line.project}/{line.zone}/{line.instance or iid}",
            now,
        )  # durable when it returns: only now may the lines that led here be acked
        self.stats.decisions += decision.won
        shutdown = [e for e in events if e.event in ("shutdown", "preempted")]
        pub = self._published.get((iid, boot, shutdown[0].seq)) if shutdown else None
        if pub is not None and decision.won:
            self.stats.latencies.append(self.clock() - pub)
        announce = decision.won or (
            decision.announced_at is None
            and self.ledger.take_announcement(decision.instance_id, decision.boot, now)
        )
        self._announce(line, verdict, decision, announce)
        self._decided.add((iid, boot))
        self.asm.forget(iid, boot)

    def _announce(
        self, line: SerialLine, verdict: Verdict, decision: Decision, announce: bool
    ) -> None:
        out = PollOutcome(
            line.instance or line.instance_id,
            decision.instance_id,
            "",
            verdict,
            decision=decision,
            announce=announce,
            project=line.project,
            zone=line.zone,
        )
        if announce:
            with self._lock:
                self.emit(out)
                if self.ledger.mark_announced(decision.instance_id, decision.boot, self.clock()):
                    self.stats.announced += 1

    def announce_pending(self, now: float) -> None:
        """Announce decisions claimed by a worker that died before announcing them."""
        for out in lapsed_announcements(self.ledger, now):
            with self._lock:
                self.emit(out)
                if announced_outcome(self.ledger, out, self.clock()):
                    self.stats.announced += 1

    @property
    def settle_deadline(self) -> float | None:
        return self.asm.next_deadline()
