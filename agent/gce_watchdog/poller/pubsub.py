"""Event-driven ingestion: serial lines exported to Cloud Logging, sent to Pub/Sub by a log sink.

With ``serial-port-logging-enable=true`` GCE writes every console line of port 1 to Cloud Logging
as a LogEntry with ``logName``
``projects/P/logs/serialconsole.googleapis.com%2Fserial_port_1_output``, ``resource.type``
``gce_instance`` (labels ``instance_id``, ``zone``, ``project_id``), the line in ``textPayload``
and the instance name in ``labels["compute.googleapis.com/resource_name"]``. A log sink with
that filter and a Pub/Sub topic as destination publishes each entry, as JSON, as the data of one
message.

A subscription's messages are spread over its workers (``gce-watchdog poll --pubsub
projects/P/subscriptions/S``, any number, on any hosts), a pull may return fewer messages than
asked, in any order, and any message may come again (at-least-once; docs/poller.md "Many
workers"). So a worker keeps no assembly state of its own: the ledger's store holds it
(``assembly_*`` tables: PostgreSQL for many hosts, SQLite for one). Each worker:

1. pulls a batch and decodes each LogEntry; lines that are not ours are acked at once;
2. pins an instance's line key from its announcement in the **pin store** (first pin wins,
   whoever received it: ``PinStore``), and verifies each line against the pinned key. A line
   whose instance has no pin yet is stored raw and verified when the key arrives;
3. stores the batch's lines (``assembly_store``: durable when it returns), then looks again, under
   the boot's row lock, at every boot the batch touched: the gap-free prefix of the union of what
   **all** workers stored (``assemble``). A terminal event in the prefix decides: a failover
   verdict is claimed in the ledger (exactly once, whoever gets there first), any other verdict
   ends the boot. A gap held past ``settle_s`` makes the boot **gapped**: never decided from the
   stream (the lost line may be the ``exit rc=0`` or ``setup_failed`` that forbids a failover),
   left to the Compute API sweep, which reads the serial port's whole record;
4. acks the batch only then: a worker that dies anywhere before that has its messages
   redelivered, and the next one stores nothing twice and looks again;
5. announces: each announcement is printed (``emit``) when its claim is made, before the ack,
   and marked done at once; with ``deliver`` (``--publish``, ``--on-failover``) it is delivered
   after the ack instead, and marked done only once that succeeded. The claimer first; every
   ``ANNOUNCE_SWEEP_S``, decisions whose claimer died unannounced, or whose delivery failed,
   once their lease lapsed.

A decision is claimed and announced under the names the Compute API gives for the instance id
(``identity``, ``poller/identity.py``), never under the LogEntry's labels.

A decided, ended or gapped boot's lines are deleted; its row stays as a tombstone (so a
redelivery is acked without a second look) until ``TOMBSTONE_S`` after its last line. A worker's
memory is a bounded cache of pins plus one batch: it does not grow with the fleet's history.

Only verdicts that a line proves are taken here (``self_shutdown``, ``preempted``, ``gpu_fault``
and ``job_stuck``: a GPU fault or a signed ``job_stuck`` line in the prefix is looked at like a
terminal event, with the same pure rule as the polling reader, ``verdict.decide``, so a job whose
``exit rc=0`` precedes it in the prefix is never failed over; with ``--on-gpu-fault report`` or
``--on-job-stuck report`` it decides nothing here). Silence
and stopped instances are not visible in a stream of lines: the slow Compute API sweep
(``FleetPoller`` over ``--label``) catches those, and polls VMs whose console is not exported.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gce_watchdog.poller.assemble import assemble, compact
from gce_watchdog.poller.assembly_store import (
    DECIDED,
    ENDED,
    GAPPED,
    OPEN,
    AssemblyStore,
    BootLines,
    BootUpdate,
    RawLine,
    StoredLine,
)
from gce_watchdog.poller.boots import ALARM_BOOT_REGRESSED, Record, Seen, counter_of, parse_counter
from gce_watchdog.poller.boots import order as boot_order
from gce_watchdog.poller.identity import Identities, Identity, IdentityUnavailable
from gce_watchdog.poller.ledger import Decision, DecisionStore
from gce_watchdog.poller.ledgers import Ledger
from gce_watchdog.poller.pin_store import PinStore
from gce_watchdog.poller.poller import PollOutcome, announced_outcome, lapsed_announcements
from gce_watchdog.poller.verdict import (
    InstanceState,
    Policy,
    Verdict,
    VerdictKind,
    decide,
    gpu_fault_event,
)
from gce_watchdog.wire import vocab
from gce_watchdog.wire.protocol import (
    REKEY_EVENT,
    Event,
    Forged,
    Forgery,
    KeyAnnounce,
    Retirees,
    decode_line,
    parse_rekey,
    pk_fingerprint,
    shown_rekey,
    verify,
)

SERIAL_LOG_SUFFIX = "/logs/serialconsole.googleapis.com%2Fserial_port_1_output"
NAME_LABEL = "compute.googleapis.com/resource_name"
# Lines arrive within seconds of each other; a gap still open after this is a lost line.
DEFAULT_SETTLE_S = 2.0
# How often a worker looks for decisions whose claimer died before announcing them.
ANNOUNCE_SWEEP_S = 5.0
# Messages per pull (the API allows up to 1,000).
PULL_MAX = 500
# Pins kept in a worker's memory (a pin never changes once set, so a cache is always right).
PIN_CACHE = 65_536
# Signatures a worker verified, kept so that a copy of the line (journald's copy, a duplicate,
# a redelivery) is not verified again: keyed by the key and the line's signed bytes, oldest out.
VERIFIED_KEEP = 4096
# Decision latencies kept for the stats (the latest ones).
LATENCY_KEEP = 100_000
# A closed boot's tombstone outlives every redelivery of its lines: a subscription retains
# unacked messages for at most 7 days (Pub/Sub docs, messageRetentionDuration).
TOMBSTONE_S = 8 * 86_400.0
# How often a worker looks for gaps held past settle_s and prunes old tombstones.
HOUSEKEEPING_S = 1.0
# A decision whose instance the Compute API could not identify is looked at again after this.
IDENTITY_RETRY_S = 30.0
# Only these verdicts are proven by a line; the others need the instance's status or silence.
LINE_VERDICTS = frozenset(
    {VerdictKind.SELF_SHUTDOWN, VerdictKind.PREEMPTED, VerdictKind.GPU_FAULT, VerdictKind.JOB_STUCK}
)


@dataclass(frozen=True)
class SerialLine:
    project: str
    zone: str
    instance_id: str
    instance: str  # the name ("" if the entry did not carry it)
    text: str


def serial_text(payload: str) -> str:
    """A serial-port textPayload as one console line. Cloud Logging keeps the line's end as a
    literal ``\\r\\n`` (GoogleCloudPlatform/khi, googlecloudlogserialport fieldset_test.go), a
    real CR/LF may be there too; both are cut. ``\\xNN`` escapes of other bytes and a journald
    prefix stay: a line of ours is printable ASCII and the decoder finds its marker anywhere."""
    text = payload
    while True:
        cut = text.removesuffix("\\r\\n").removesuffix("\\n").rstrip("\r\n")
        if cut == text:
            return text
        text = cut


def _maybe_stale(res: object) -> bool:
    """A result that a pin moved by another worker would explain."""
    return isinstance(res, Forged) and res.reason in (
        Forgery.BAD_SIG,
        Forgery.UNPLACED,
        Forgery.BAD_REKEY,
        Forgery.RETIRED,
    )


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
    top = entry.get("labels")
    name = top.get(NAME_LABEL, "") if isinstance(top, dict) else ""
    return SerialLine(
        str(labels.get("project_id", "")),
        str(labels.get("zone", "")),
        str(labels["instance_id"]),
        str(name),
        serial_text(text),
    )


@dataclass
class WorkerStats:
    messages: int = 0
    lines: int = 0  # ours, decoded
    foreign: int = 0  # acked at once: not our line or not a serial LogEntry
    forged: int = 0  # intact lines of ours that do not authenticate (acked, never evidence)
    unverified: int = 0  # lines stored raw: no key pinned yet for the instance
    dropped: int = 0  # raw lines past UNVERIFIED_MAX for their instance (acked, not stored)
    unpinned: int = 0  # batches' instances seen without a pin in the ledger (an alarm)
    rekeys: int = 0  # pins this worker moved through a verified rekey line
    retired: int = 0  # lines of a key rotated away from, after the rotation (not forged)
    verified_again: int = 0  # signature checks answered by the worker's cache of verified lines
    decisions: int = 0
    announced: int = 0
    acked: int = 0
    gapped: int = 0  # boots this worker left to the Compute API sweep: a line was lost
    ended: int = 0  # boots whose verdict is final and no failover
    relabelled: int = 0  # decisions whose LogEntry named another instance than the API (alarm)
    unknown: int = 0  # decisions whose instance id no configured project has (alarm, left)
    unidentified: int = 0  # looks the API could not answer who the instance is (retried)
    latencies: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=LATENCY_KEEP)
    )  # publish time of the deciding line -> claim, seconds
    # publish time of the last line the decision needed (the deciding line or one before it,
    # published after it) -> claim: the pipeline's own share of the latency, seconds
    ready_latencies: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=LATENCY_KEEP)
    )


def _received(rm: Any) -> tuple[bytes, str, float | None]:
    """A received message's (data, ack id, publish time): from the protobuf under the client's
    proto-plus wrapper where there is one (``_pb``: its fields read without the wrapper's
    conversions, a measurable share of a worker's CPU per message), else as attributes."""
    pb = getattr(rm, "_pb", None)
    if pb is not None:
        m = pb.message
        t = m.publish_time if m.HasField("publish_time") else None
        return m.data, pb.ack_id, None if t is None else t.seconds + t.nanos / 1e9
    pub = rm.message.publish_time
    return rm.message.data, rm.ack_id, None if pub is None else pub.timestamp()


def _needed_by(seen: BootLines, pub: float, last: int) -> float:
    """When the last line a decision needed was published: the latest of the first copies of
    each seq up to the deciding line's (``last``; a line displaced in transit, or its first copy
    lost, can be published after the deciding line: the boot waited for it, not the pipeline)."""
    first: dict[int, float] = {}
    for r, p in seen.lines:
        if p is not None and r.event.seq <= last:
            first[r.event.seq] = min(p, first.get(r.event.seq, p))
    return max([pub, *first.values()])


def _stuck(ev: Event) -> bool:
    """A signed ``job_stuck`` line: its boot is looked at when it is stored."""
    return ev.event == vocab.JOB_STUCK


def _stderr(msg: str) -> None:
    print(f"gce-watchdog poll: {msg}", file=sys.stderr, flush=True)


class PubSubWorker:
    """Pull, store, assemble, decide, claim, ack. ``subscriber`` is a
    ``pubsub_v1.SubscriberClient`` (or anything with its ``pull``/``acknowledge``).
    ``identity``: who an instance id is (project, zone, name), from the Compute API
    (``identity.ComputeIdentities``); a LogEntry's labels never name a decision. ``log``: alarms."""

    def __init__(
        self,
        subscriber: Any,
        subscription: str,
        ledger: Ledger,
        emit: Callable[[PollOutcome], None],
        policy: Policy | None = None,
        settle_s: float = DEFAULT_SETTLE_S,
        clock: Callable[[], float] = time.time,
        pins: PinStore | None = None,
        pull_max: int = PULL_MAX,
        *,
        identity: Identities,
        log: Callable[[str], None] = _stderr,
        deliver: Callable[[int], bool] | None = None,
    ) -> None:
        self.subscriber = subscriber
        self.subscription = subscription
        self.ledger = ledger
        self.decisions: DecisionStore = ledger.decisions
        self.assembly: AssemblyStore = ledger.assembly
        self.emit = emit
        self.policy = policy or Policy()
        self.settle_s = settle_s
        self.clock = clock
        self.pins: PinStore = pins or ledger.pins
        self.pull_max = pull_max
        self.identity = identity
        self.log = log
        # --on-failover (and --publish): by token; the announcement is marked done only if True
        self.deliver = deliver
        self._due: list[PollOutcome] = []  # announced in this step: delivered after the ack
        self.stats = WorkerStats()
        self._pin_cache: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        # Pins that moved (a rekey line, here or by another worker): the newest key and the one
        # it retired, ahead of the batch's own lookup; and when a pin was last looked up again.
        self._moved: collections.OrderedDict[str, tuple[bytes, Retirees]] = (
            collections.OrderedDict()
        )
        self._relooked: dict[str, float] = {}
        # the highest boot counter on record per instance, as last seen (bounded like the pins)
        self._counters: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._verified: dict[bytes, None] = {}  # key + signature + body, oldest first
        self.unpinned: set[str] = set()  # instance ids seen without a pin (at most PIN_CACHE)
        self._last_sweep = 0.0
        self._last_housekeeping = 0.0
        self._lock = threading.Lock()

    def pull(self, timeout: float) -> list[Any]:
        from google.api_core import exceptions as gexc

        try:
            resp = self.subscriber.pull(
                request={"subscription": self.subscription, "max_messages": self.pull_max},
                timeout=timeout,
            )
        except (gexc.DeadlineExceeded, gexc.RetryError):
            return []
        return list(resp.received_messages)

    def step(self, timeout: float = 1.0) -> int:
        """One pull and everything it leads to; returns the number of messages received."""
        msgs = self.pull(timeout)
        now = self.clock()
        self.stats.messages += len(msgs)
        to_ack: list[str] = []
        lines: list[StoredLine] = []
        raw: list[RawLine] = []
        parsed = [(rm, parse_log_entry(rm[0])) for rm in map(_received, msgs)]
        ours = [(rm, ln) for rm, ln in parsed if ln is not None]
        to_ack += [rm[1] for rm, ln in parsed if ln is None]
        self.stats.foreign += len(parsed) - len(ours)
        hand: dict[str, str] = {}
        pins = self._pinned([ln.instance_id for _, ln in ours], hand)
        new_pins: set[str] = set()
        for _rm, ln in ours:  # a hand pin's key, from an announcement with its fingerprint
            fp = hand.get(ln.instance_id)
            if fp is None or " key pk=" not in ln.text:
                continue
            res = decode_line(ln.text)
            if (
                isinstance(res, KeyAnnounce)
                and res.version == 3
                and res.fingerprint == fp
                and res.inst in ("-", ln.instance_id)
                and res.valid()
            ):
                stored = self.pins.place_pin(ln.instance_id, res.key, fp, now)
                if stored.public is not None:
                    pins[ln.instance_id] = self._cache(ln.instance_id, stored.public)
                    new_pins.add(ln.instance_id)
        for (_data, ack_id, published), ln in ours:
            to_ack.append(ack_id)  # after the store below returned
            self._classify(ln, pins.get(ln.instance_id), now, published, lines, raw)
        touched, dropped = self._store(lines, raw)
        self.stats.unverified += len(raw) - dropped
        self.stats.dropped += dropped
        # A raw line stored just now, or a key pinned just now: either this worker sees the
        # other's write or the other worker sees this one's (each writes, then reads).
        later = self._pinned(sorted({r.instance_id for r in raw}), {})
        for iid in sorted({r.instance_id for r in raw} - set(later)):
            if iid not in self.unpinned and len(self.unpinned) < PIN_CACHE:
                self.unpinned.add(iid)  # an alarm: lines of an instance nobody pinned
                self.stats.unpinned += 1
        for iid in sorted(new_pins | set(later)):
            touched |= self._verify_raw(iid, pins.get(iid) or later[iid], now)
        if now - self._last_housekeeping >= HOUSEKEEPING_S:
            self._last_housekeeping = now
            touched.update(self.assembly.gaps_due(now - self.settle_s))
            # raw lines whose pin the poll path (or an operator) has placed since
            waiting = self.assembly.raw_instances()
            for iid, key in self._pinned(waiting, {}).items():
                touched |= self._verify_raw(iid, key, now)
            self.assembly.prune(now - TOMBSTONE_S)
        self._look(touched, now)  # one transaction for every boot the pull led to
        self.ack(to_ack)  # every line is stored and every decision it led to is claimed
        due, self._due = self._due, []
        for out in due:  # after the ack: a slow hook never holds a batch past its deadline
            self._done(out)
        if now - self._last_sweep >= ANNOUNCE_SWEEP_S:
            self._last_sweep = now
            self.announce_pending(now)
        return len(msgs)

    def _pinned(self, instance_ids: list[str], hand: dict[str, str]) -> dict[str, bytes]:
        """The pinned public keys of those instances that have one; hand pins without a key
        yet go to ``hand`` (id -> fingerprint)."""
        out = {i: self._pin_cache[i] for i in instance_ids if i in self._pin_cache}
        looked = self.pins.get_pins(sorted({i for i in instance_ids if i not in out}))
        for iid, pin in sorted(looked.items()):  # one query for the batch's uncached ones
            if pin.public is not None:
                out[iid] = self._cache(iid, pin.public)
            else:
                hand[iid] = pin.fingerprint
        return out

    def _cache(self, instance_id: str, key: bytes) -> bytes:
        self._pin_cache[instance_id] = key
        self._pin_cache.move_to_end(instance_id)
        while len(self._pin_cache) > PIN_CACHE:
            self._pin_cache.popitem(last=False)
        return key

    def _verify(self, public: bytes, body: bytes, sig: bytes) -> bool:
        """``wire.verify`` with a bounded memory of the signatures it accepted: the same bytes
        under the same key verify the same way, so only a success is kept (a forged line is
        checked every time; the cache cannot be filled but by lines that verify)."""
        seen = public + sig + body  # 32 and 64 bytes, then the body: no two splits alike
        if seen in self._verified:
            self.stats.verified_again += 1
            return True
        if not verify(public, body, sig):
            return False
        self._verified[seen] = None
        if len(self._verified) > VERIFIED_KEEP:
            del self._verified[next(iter(self._verified))]
        return True

    def _classify(
        self,
        ln: SerialLine,
        key: bytes | None,
        now: float,
        published: float | None,
        lines: list[StoredLine],
        raw: list[RawLine],
    ) -> None:
        """One line of a serial LogEntry: a verified line to store, a raw one, or neither."""
        iid = ln.instance_id
        retired: Retirees = ()
        if key is not None and iid in self._moved:
            key, retired = self._moved[iid]
        res = decode_line(ln.text, None, key, retired, self._verify)
        if key is not None and _maybe_stale(res) and self._relooked.get(iid) != now:
            # another worker may have moved the pin (a rekey line): look it up once per batch
            self._relooked[iid] = now
            if len(self._relooked) > PIN_CACHE:
                self._relooked.clear()
            pin = self.pins.get_pin(iid)
            if pin is not None and pin.public is not None and pin.public != key:
                key, retired = pin.public, pin.retired
                self._move(iid, key, retired)
                res = decode_line(ln.text, None, key, retired, self._verify)
        if isinstance(res, Event) and res.event == REKEY_EVENT and key is not None:
            res = self._rekey(ln, key, retired, res, now)
        if isinstance(res, Forged) and res.reason == Forgery.RETIRED:
            self.stats.retired += 1
            return
        if isinstance(res, KeyAnnounce):
            # protocol v3: only the pinned key's announcement, for this very instance id (a
            # real line relabelled with another VM's id names its own), is accepted
            if key is None:
                res = Forged(Forgery.NO_KEY, b"", res.event)
            elif res.version != 3 or res.key != key:
                res = Forged(Forgery.UNPLACED if res.version == 3 else Forgery.V2, b"")
            elif res.inst not in ("-", ln.instance_id):
                res = Forged(Forgery.RELABELLED, b"")
            elif not res.valid():
                res = Forged(Forgery.BAD_SIG, b"")
            else:
                res = res.event
        if isinstance(res, Forged) and res.reason == Forgery.NO_KEY and res.event is not None:
            raw.append(
                RawLine(ln.instance_id, ln.project, ln.zone, ln.instance, ln.text, now, published)
            )
            return
        if isinstance(res, Forged):
            self.stats.forged += 1
            return
        if not isinstance(res, Event):
            self.stats.foreign += 1
            return
        self.stats.lines += 1
        lines.append(
            StoredLine(ln.instance_id, ln.project, ln.zone, ln.instance, res, now, published)
        )

    def _move(self, iid: str, key: bytes, retired: Retirees) -> None:
        self._cache(iid, key)
        self._moved[iid] = (key, retired)
        self._moved.move_to_end(iid)
        while len(self._moved) > PIN_CACHE:
            self._moved.popitem(last=False)

    def _rekey(
        self, ln: SerialLine, key: bytes, retired: Retirees, ev: Event, now: float
    ) -> Event | Forged:
        """A rekey line that verified under the pin (or the retired key's rekey into the pin):
        the ledger's pin moves (compare-and-set: the workers that got copies move it once)."""
        parsed = parse_rekey(ev)
        if parsed is None:
            return Forged(Forgery.BAD_REKEY, b"", ev)
        new, inst = parsed
        if new == key or any(new == r.public for r in retired):
            # a rotation already followed (a copy, a redelivery): signed by the key of then
            return shown_rekey(ev, retired[-1].public if retired else None)
        if inst != ln.instance_id:  # a real rekey of another VM (the same key) relabelled
            return Forged(Forgery.RELABELLED, b"", ev)
        stored = self.pins.rekey_pin(
            ln.instance_id, key, new, pk_fingerprint(new), ev.boot, ev.seq, now
        )
        if stored is not None and stored.public is not None:
            self._move(ln.instance_id, stored.public, stored.retired)
            self.stats.rekeys += stored.public == new
        return shown_rekey(ev, key)

    def _verify_raw(self, instance_id: str, key: bytes, now: float) -> set[tuple[str, str]]:
        """Verify the raw lines any worker stored for an instance now pinned."""
        stored = self.assembly.unverified(instance_id)
        if not stored:
            return set()
        lines: list[StoredLine] = []
        for r in stored:
            ln = SerialLine(r.project, r.zone, instance_id, r.name, r.text)
            self._classify(ln, key, r.received_at, r.published, lines, [])
        touched, _ = self._store(lines, [])
        self.assembly.drop_unverified(instance_id, [r.text for r in stored])
        return touched

    def _store(
        self, lines: list[StoredLine], raw: list[RawLine]
    ) -> tuple[set[tuple[str, str]], int]:
        """``assembly.store``, the boots to look at with those of the GPU faults among the
        lines (none with --on-gpu-fault report) added: looked at like those the store returns
        (its terminal lines'). A fault stored past a gap another worker fills is looked at again
        when the look's hint comes due (``assembly.gaps_due``: ``settle_s`` after the held
        line's receipt), then decided."""
        touched, dropped = self.assembly.store(lines, raw)
        self._raise_counters(lines)
        if not self.policy.gpu_fault_report:
            touched |= {
                (ln.instance_id, ln.event.boot) for ln in lines if gpu_fault_event([ln.event])
            }
        if not self.policy.job_stuck_report:
            touched |= {(ln.instance_id, ln.event.boot) for ln in lines if _stuck(ln.event)}
        return touched, dropped

    def _look(self, boots: set[tuple[str, str]], now: float) -> None:
        """Look at boots' stored lines (one transaction for all); claim, end, gap, or wait."""
        # per boot: (the verdict, its deciding line's seq)
        verdicts: dict[tuple[str, str], tuple[Verdict, int]] = {}
        counters: dict[tuple[str, str], int] = {}  # the boot counter (bc) of each boot looked at

        def judge(seen: BootLines) -> BootUpdate:
            c = counter_of(r.event.get("bc") for r, _ in seen.lines)
            if c is not None:
                counters[(seen.instance_id, seen.boot)] = c
            a = assemble([r for r, _ in seen.lines], seen.floor)
            # a GPU fault or a stuck job decides like a terminal event, unless the policy only
            # reports it
            fault = None if self.policy.gpu_fault_report else a.fault
            stuck = None if self.policy.job_stuck_report else a.stuck
            if a.terminal is not None or fault is not None or stuck is not None:
                v = decide(list(a.prefix), InstanceState("RUNNING"), now, self.policy)
                if v.kind in LINE_VERDICTS and v.failover:
                    by = {VerdictKind.GPU_FAULT: fault, VerdictKind.JOB_STUCK: stuck}.get(
                        v.kind, a.terminal
                    )
                    assert by is not None
                    verdicts[(seen.instance_id, seen.boot)] = (v, by.seq)
                    # closed once the claim is durable; until then, a hint to look again (the
                    # instance's identity unavailable, or this worker dead before its claim)
                    return BootUpdate(OPEN, now + IDENTITY_RETRY_S - self.settle_s)
                if a.terminal is not None:
                    return BootUpdate(ENDED, None)
            if a.settled(now, self.settle_s):
                return BootUpdate(GAPPED, None)
            drop, floor = compact(a)
            return BootUpdate(OPEN, a.held_since, tuple(drop), floor)

        looked = self.assembly.update_many(sorted(boots), judge)
        for key in self._regressed(counters, verdicts, looked, now):
            del verdicts[key]  # a replay or a lost counter never decides
        for _seen, upd in looked.values():
            if upd.state == GAPPED:
                self.stats.gapped += 1
            elif upd.state == ENDED:
                self.stats.ended += 1
        who: dict[tuple[str, str], Identity] = {}
        for key, (verdict, _by) in sorted(verdicts.items()):
            found = self._identify(looked[key][0], verdict)
            if found is not None:
                who[key] = found
        decided = sorted(who)
        # one transaction for the pull's claims: durable when it returns, only then may the
        # lines that led to them be acked
        decisions = self.decisions.claim_many(
            [
                (*k, verdicts[k][0].kind.value, verdicts[k][0].reason, who[k].target)
                for k in decided
            ],
            now,
        )
        self.assembly.set_states(decided, DECIDED)  # one transaction
        printed: list[PollOutcome] = []
        for key, decision in zip(decided, decisions, strict=True):
            (seen, _), (verdict, by) = looked[key], verdicts[key]
            self.stats.decisions += decision.won
            pub = next((p for r, p in seen.lines if r.event.seq == by), None)
            if pub is not None and decision.won:
                self.stats.latencies.append(self.clock() - pub)
                self.stats.ready_latencies.append(self.clock() - _needed_by(seen, pub, by))
            announce = decision.won or (
                decision.announced_at is None
                and self.decisions.take_announcement(decision.instance_id, decision.boot, now)
            )
            w = who[key]
            line = SerialLine(w.project, w.zone, seen.instance_id, w.name, "")  # the API's names
            if (out := self._announce(line, verdict, decision, announce)) is not None:
                printed.append(out)
        marks = [(o.decision.instance_id, o.decision.boot) for o in printed if o.decision]
        marked = self.decisions.mark_announced_many(marks, self.clock())  # one transaction
        with self._lock:
            self.stats.announced += marked

    def _raise_counters(self, lines: list[StoredLine]) -> None:
        """Raise the ledger's record of each instance's highest boot counter by the verified
        lines just stored (poller/boots.py): only where a counter is above the one this worker
        last saw stand (a bounded cache: a new boot costs one transaction, a line none)."""
        top: dict[tuple[str, str], int] = {}
        for ln in lines:
            c = parse_counter(ln.event.get("bc"))
            key = (ln.instance_id, ln.event.boot)
            if c is not None and c > top.get(key, 0):
                top[key] = c
        for (iid, boot), c in sorted(top.items(), key=lambda kv: kv[1]):
            if c > self._counters.get(iid, 0):
                rec = self.ledger.freshness.raise_boot(iid, Record(c, boot, self.clock()))
                self._counters[iid] = rec.counter
                self._counters.move_to_end(iid)
                while len(self._counters) > PIN_CACHE:
                    self._counters.popitem(last=False)

    def _regressed(
        self,
        counters: dict[tuple[str, str], int],
        verdicts: dict[tuple[str, str], tuple[Verdict, int]],
        looked: dict[tuple[str, str], tuple[BootLines, BootUpdate]],
        now: float,
    ) -> list[tuple[str, str]]:
        """The boot order (poller/boots.py) where a message's boot is judged: a boot that would
        decide with a counter at or below the ledger's record of the instance's highest,
        not the record's own boot, is a replay or a lost counter: it never decides, its row is
        ended, and ``boot_regressed`` is raised (the journal, the ledger's alarms). A boot
        without a counter (an older agent) is judged as before. The worker's own liveness
        rules (gaps, settle) are unchanged."""
        store = self.ledger.freshness  # raised as the lines were stored (_raise_counters)
        out = []
        for key in sorted(verdicts):
            iid, boot = key
            seen = boot_order([Seen(boot, counters.get(key), 0)], store.boot_record(iid))
            if boot not in seen.regressed:
                continue
            out.append(key)
            lines = looked[key][0]
            path = f"{lines.project}/{lines.zone}/{lines.name or '-'}"  # as its LogEntry says
            self.log(
                f"ALARM alarm={ALARM_BOOT_REGRESSED} instance id {iid} boot {boot}: its boot "
                f"counter {counters.get(key)} is at or below the instance's highest (a replay or "
                f"a lost counter): its {verdicts[key][0].kind.value} never decides"
            )
            self.decisions.raise_alarm(iid, ALARM_BOOT_REGRESSED, path, "-", {}, now)
        if out:
            self.assembly.set_states(out, ENDED)
        return out

    def _identify(self, seen: BootLines, verdict: Verdict) -> Identity | None:
        """The instance as the Compute API names it, or None: nothing is claimed now. Not found
        (deleted, or no configured project has it): an alarm, and the boot is left to the
        Compute API sweep (gapped). The API could not say: the boot's hint brings it back in
        ``IDENTITY_RETRY_S``. LogEntry labels that disagree with the API: an alarm; the API wins."""
        iid, what = seen.instance_id, f"the {verdict.kind.value} of instance id {seen.instance_id}"
        logged = f"{seen.project}/{seen.zone}/{seen.name or '-'}"
        try:
            who = self.identity.resolve(iid)
        except IdentityUnavailable as e:
            self.stats.unidentified += 1
            self.log(
                f"{what} (boot {seen.boot}) is not claimed yet: the Compute API could not say "
                f"which instance it is ({e}); looking again in {IDENTITY_RETRY_S:g}s"
            )
            return None
        if who is None:
            self.stats.unknown += 1
            self.log(
                f"ALARM: {what} (boot {seen.boot}) is not announced: no instance with that id in "
                f"the configured projects (deleted, or another project); its LogEntry said "
                f"{logged}. Left to the Compute API sweep"
            )
            self.assembly.set_state(iid, seen.boot, GAPPED)
            self.stats.gapped += 1
            return None
        if (seen.project, seen.zone) != (who.project, who.zone) or seen.name not in ("", who.name):
            self.stats.relabelled += 1
            self.log(
                f"ALARM: a LogEntry of instance id {iid} named it {logged}, the Compute API "
                f"says {who.target} (forged or relabelled labels): decided as {who.target}"
            )
        return who

    def heard(self, instance_id: str) -> tuple[float | None, bool]:
        """(when any worker last received a line of the instance, whether a boot of it lost a
        line): the Compute API sweep polls it if silent past the drain timeout, or gapped."""
        return self.assembly.heard(instance_id)

    def fleet_size(self) -> int:
        """Instances heard from on the stream, by any worker (the brake's share is of these)."""
        return self.assembly.instances()

    @property
    def gapped(self) -> set[str]:
        """Instance ids with a boot left to the Compute API sweep (any worker's doing)."""
        return {iid for iid, _, _ in self.assembly.boots(GAPPED)}

    def ack(self, ack_ids: list[str]) -> None:
        for i in range(0, len(ack_ids), 1000):
            chunk = ack_ids[i : i + 1000]
            self.subscriber.acknowledge(
                request={"subscription": self.subscription, "ack_ids": chunk}
            )
            self.stats.acked += len(chunk)

    def _announce(
        self, line: SerialLine, verdict: Verdict, decision: Decision, announce: bool
    ) -> PollOutcome | None:
        """Print the decision if this worker announces it. Returned: an announcement printed
        that the caller marks announced (with the others of its pull: one transaction)."""
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
        if not announce:
            return None
        with self._lock:
            self.emit(out)
        if self.deliver is None:
            return out  # the printed line is the announcement: marked at once
        self._due.append(out)  # delivered after the ack
        return None

    def _done(self, out: PollOutcome) -> None:
        """Deliver an announced decision (when ``deliver`` is given), then mark it announced.

        Only the holder of the decision's announcement lease delivers: the lease is renewed
        first (``hold_announcement``), so a lease that lapsed while this worker was busy and was
        taken over by another worker is left to that one. A delivery that fails leaves the
        announcement pending: once the lease lapses any worker's ``announce_pending`` (this one
        included) takes it over and delivers again, as does one after this worker died."""
        d = out.decision
        assert d is not None
        if self.deliver is not None:
            if not self.decisions.hold_announcement(d.instance_id, d.boot, self.clock()):
                return  # another worker holds it now, or it was announced meanwhile
            if not self.deliver(d.token):
                return
        with self._lock:
            if announced_outcome(self.decisions, out, self.clock()):
                self.stats.announced += 1

    def announce_pending(self, now: float) -> None:
        """Announce (and deliver) decisions whose claimer died before that, or whose delivery
        failed: their announcement lease has lapsed."""
        for out in lapsed_announcements(self.decisions, now):
            with self._lock:
                self.emit(out)
            self._done(out)

    def next_gap(self) -> float | None:
        """When the oldest open gap (any worker's) is due to be declared lost, or None."""
        since = self.assembly.next_gap()
        return None if since is None else since + self.settle_s
