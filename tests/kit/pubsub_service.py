"""Pub/Sub as the service behaves, in front of the real emulator (issue 23 item 6).

The emulator is real (kit/pubsub_emulator.py) but kinder than the service: it hands a whole
backlog to one pull (observed; googleapis/nodejs-pubsub#1646). The service does not:

- a pull may return fewer messages than asked (pubsub.v1.json ``PullRequest.maxMessages``, and
  the same text in google-cloud-pubsub's ``types/pubsub.py``: "The Pub/Sub system may return
  fewer than the number specified"), and the messages of one subscription are spread over all
  its subscribers (Pub/Sub docs, "Subscription overview": with several subscribers on one
  subscription each message goes to one of them; the GCE-REFERENCES Pub/Sub row);
- delivery is at-least-once, and a message not acked within the ack deadline is sent again
  (``Subscription.ackDeadlineSeconds``: "The approximate amount of time ... Pub/Sub waits for the
  subscriber to acknowledge receipt before resending the message"; the minimum is 10 s), in any
  order (no ordering keys: a Logging sink sets none).

``ServiceLikeSubscriber`` wraps a real ``SubscriberClient``: each pull asks the emulator for a
random 1..``max_messages`` (so several workers pulling one subscription share its backlog, a
spreader in effect), and withholds a share of what it got: neither handed to the worker nor
acked, so the **emulator** redelivers it after the ack deadline. Nothing is simulated that the
emulator does itself.

``exported_entry`` builds a LogEntry as a Cloud Logging sink publishes a serial port 1 line: the
``textPayload`` ends in a literal ``\\r\\n``, may carry ``\\xNN`` escapes and ANSI colour
sequences, and a line forwarded by journald to the console has journald's prefix
(GoogleCloudPlatform/khi, ``googlecloudlogserialport/contract/fieldset_test.go``; the Cloud
Logging row of ../shared/GCE-REFERENCES.md).
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass, field
from typing import Any

SERIAL_LOG = "serialconsole.googleapis.com%2Fserial_port_1_output"
# The end of every exported serial line: the console's CR LF, kept as the 4 characters \r\n.
CRLF = "\\r\\n"


def exported_text(line: str, host: str, journald: bool) -> str:
    """The textPayload of one console line: bare (the agent writes ttyS0 itself) or as journald
    forwards it (``ForwardToConsole=``: ISO time, host, identifier[pid]), with the CR LF kept."""
    if journald:
        return f"2026-12-01T05:00:00+0000 {host} gce-watchdog[812]: {line}{CRLF}"
    return f"{line}{CRLF}"


# Console noise as the export shows it: ANSI colours and UTF-8 bytes as \xNN escapes, and
# systemd's own \x2d escape of '-' in unit names (khi's fieldset_test.go has these forms).
NOISE = (
    "[  OK  ] Started \\x1b[0;1;39mgoogle-guest-agent.service\\x1b[0m - Google Compute Engine"
    " Guest Agent." + CRLF,
    "         Unmounting \\x1b[0;1;39mvar-lib-docker\\xe2\\x80\\xa6\\x2dmerged.mount\\x1b[0m..."
    + CRLF,
    "2026-12-01T05:00:01+0000 vm kernel: [   12.345678] EXT4-fs (sda1): resizing filesystem" + CRLF,
)


def exported_entry(
    project: str, iid: str, name: str, text: str, zone: str = "us-central1-a", rnd: Any = None
) -> bytes:
    """A LogEntry as a Cloud Logging sink publishes it (LogEntry JSON, serial port 1)."""
    r = rnd or random
    return json.dumps(
        {
            "insertId": f"{r.getrandbits(48):x}",
            "logName": f"projects/{project}/logs/{SERIAL_LOG}",
            "resource": {
                "type": "gce_instance",
                "labels": {"instance_id": iid, "project_id": project, "zone": zone},
            },
            "labels": {"compute.googleapis.com/resource_name": name},
            "textPayload": text,
            "timestamp": "2026-12-01T05:00:00.123456Z",
            "receiveTimestamp": "2026-12-01T05:00:00.456789Z",
            "severity": "DEFAULT",
        }
    ).encode()


@dataclass
class _Response:
    received_messages: list[Any]


@dataclass
class Counts:
    pulls: int = 0
    received: int = 0  # from the emulator
    handed: int = 0  # to the worker
    withheld: int = 0  # left unacked on purpose: the emulator redelivers them
    acked: int = 0
    sizes: list[int] = field(default_factory=list)  # messages handed per pull


class ServiceLikeSubscriber:
    """``pull`` and ``acknowledge`` of a ``SubscriberClient``, as the service behaves."""

    def __init__(
        self,
        real: Any,
        max_messages: int = 20,
        withhold: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.real = real
        self.max_messages = max_messages
        self.withhold = withhold
        self.rnd = random.Random(seed)
        self.counts = Counts()
        self._lock = threading.Lock()

    def pull(self, request: dict[str, Any], timeout: float | None = None) -> _Response:
        cap = max(1, min(int(request.get("max_messages", 1)), self.max_messages))
        with self._lock:
            n = self.rnd.randint(1, cap)  # "may return fewer than the number specified"
        resp = self.real.pull(
            request={"subscription": request["subscription"], "max_messages": n}, timeout=timeout
        )
        got = list(resp.received_messages)
        handed = []
        with self._lock:
            for m in got:
                if self.rnd.random() < self.withhold:
                    self.counts.withheld += 1  # lost on the way: redelivered after the deadline
                else:
                    handed.append(m)
            self.counts.pulls += 1
            self.counts.received += len(got)
            self.counts.handed += len(handed)
            self.counts.sizes.append(len(handed))
        return _Response(handed)

    def acknowledge(self, request: dict[str, Any]) -> None:
        self.real.acknowledge(request=request)
        with self._lock:
            self.counts.acked += len(request["ack_ids"])

    def close(self) -> None:
        self.real.close()


@dataclass
class Fleet:
    """A fleet's exported console stream and what each VM's lines say."""

    messages: list[bytes]
    wedged: set[str]  # instance ids whose agent shut the VM down (ladder): fail over, once
    finished: set[str]  # the job exited 0, then the agent shut down: never a failover
    healthy: set[str]  # still running, heartbeats only: nothing to decide
    names: dict[str, str]  # instance id -> name


def fleet_stream(
    rnd: random.Random,
    vms: int,
    project: str,
    base_id: int = 4_000_000_000,
    spread: float | None = None,
    transit: int = 0,
) -> Fleet:
    """Every VM's lines as exported, one in five healthy and one in five finished, the rest
    wedged; journald copies of a quarter of the lines, duplicates of a fifth of all messages,
    console noise. ``spread`` None: the whole stream shuffled (a Logging sink sets no ordering
    key; the hardest case). A number: the VMs run side by side, line i of every VM around
    position i, each message displaced by up to ``spread`` lines (reordering in transit) and a
    duplicate up to 5 lines after its original (a late redelivery): a fleet's stream over time,
    for measuring latency. ``transit``: then each message is also moved up to that many
    messages later in the stream (a delay in transit that does not grow with the fleet: the
    bench gives its seconds times the publish rate)."""
    from gce_watchdog.testing.synth import Writer

    fleet = Fleet([], set(), set(), set(), {})
    keyed: list[tuple[float, bytes]] = []
    for i in range(vms):
        iid, name = f"{base_id + i}", f"vm-{i:05d}"
        fleet.names[iid] = name
        w = Writer(boot=f"{rnd.getrandbits(32):08x}")
        evs: list[tuple[str, dict[str, str]]] = [
            ("start", {"v": "1"}),
            ("phase", {"ph": "workload"}),
        ]
        kind = i % 5
        if kind == 0:
            evs += [("heartbeat", {"ph": "workload"}) for _ in range(5)]
            fleet.healthy.add(iid)
        else:
            evs += [("tick", {"rung": f"{r}/10", "md": "fail", "eg": "fail"}) for r in range(1, 5)]
            if kind == 1:
                evs.append(("exit", {"rc": "0"}))
                fleet.finished.add(iid)
            else:
                fleet.wedged.add(iid)
            evs.append(("shutdown", {"reason": "ladder", "rung": "10/10"}))
        texts = [ln for ev, f in evs for ln in w.line(ev, f).decode().splitlines()]
        for n, t in enumerate(texts):
            at = n + rnd.uniform(0, spread or 0)
            keyed.append((at, exported_entry(project, iid, name, exported_text(t, name, False),
                                             rnd=rnd)))  # fmt: skip
            if rnd.random() < 0.25:  # journald's copy of the same line
                keyed.append((at + rnd.uniform(0, 1), exported_entry(
                    project, iid, name, exported_text(t, name, True), rnd=rnd)))  # fmt: skip
        noise = exported_entry(project, iid, name, rnd.choice(NOISE), rnd=rnd)
        keyed.append((rnd.uniform(0, len(texts)), noise))
    keyed += [(at + rnd.uniform(0, 5), m) for at, m in
              (rnd.choice(keyed) for _ in range(len(keyed) // 5))]  # fmt: skip
    if spread is None:
        rnd.shuffle(keyed)
    else:
        keyed.sort(key=lambda x: x[0])
        if transit:
            moved = [(i + rnd.uniform(0, transit), m) for i, (_, m) in enumerate(keyed)]
            keyed = sorted(moved, key=lambda x: x[0])
    fleet.messages = [m for _, m in keyed]
    return fleet
