"""The poller's journal: bytes a day for a fleet polled every 30 s, ``--log every`` against
``--log changes`` (issue 38: ``poll --json`` under systemd wrote about 1 KB per instance per
round, 2.8 GB a day for 1,000 VMs).

Usage::

    python -m bench.journal [--vms 1000] [--interval 30] [--hours 2] [--seed 38]

A simulated fleet, round by round, through the poller's own code: every outcome is a real
``PollOutcome`` (a real ``Verdict``, evidence lines rendered from signed lines), filtered by the
real ``Journal`` (poller/journal.py) and written by the real ``format_outcome`` (the JSON the
unit writes) into a byte counter, with the fleet round's stderr line (and, with ``--log
changes``, its summary) as ``poll`` writes it. Nothing is timed: the figures are bytes. A day
is the rounds after the first, scaled to 24 h, plus the first round once (a process's first
sight of every VM: once per start, and one start a day).

The churn (docs/performance.md, "The poller's journal"), per VM, seeded:

- a job lasts an exponential time of mean ``JOB_MEAN_H`` hours; its VM then ends
  ``workload_ok`` (93 %), ``workload_failed`` (5 %) or wedges (2 %: ``suspected_wedge``, a
  failover, ``already_decided`` until reaped); it is reaped ``REAP_ROUNDS`` rounds later and a new
  VM (a new name and id) takes its place, first seen with no line of ours yet (``unknown``) for
  ``BOOT_ROUNDS`` rounds, then ``healthy``;
- a Spot preemption every ``PREEMPT_DAYS`` days per VM on average (``preempted``: a failover);
- a poll fails (an API error after its retries) once in ``ERROR_EVERY`` polls;
- a healthy VM's reason names its silence in seconds, which changes every round: it is what
  ``--log every`` repeats and ``--log changes`` does not.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "agent"))

from gce_watchdog.poller.app import format_outcome  # noqa: E402
from gce_watchdog.poller.journal import Journal, summary_text  # noqa: E402
from gce_watchdog.poller.ledger import Decision  # noqa: E402
from gce_watchdog.poller.poller import PollOutcome  # noqa: E402
from gce_watchdog.poller.reader import ReadResult  # noqa: E402
from gce_watchdog.poller.verdict import Verdict, VerdictKind  # noqa: E402
from gce_watchdog.testing.synth import Writer  # noqa: E402

JOB_MEAN_H = 6.0
BOOT_ROUNDS = 2
REAP_ROUNDS = 2
PREEMPT_DAYS = 3.0
ERROR_EVERY = 2000
ENDINGS = ((VerdictKind.WORKLOAD_OK, 0.93), (VerdictKind.WORKLOAD_FAILED, 0.05),
           (VerdictKind.SUSPECTED_WEDGE, 0.02))  # fmt: skip
T0 = 1_796_000_000.0
LOG_PREFIX = "gce-watchdog poll: "  # what _log puts before each stderr line
MB = 1_000_000


@dataclass
class Vm:
    name: str
    iid: str
    born: int  # round
    job_end: int  # round the job ends
    ended: VerdictKind | None = None
    ended_at: int = 0
    token: int = 0
    evidence: tuple[str, ...] = ()


@dataclass
class Counts:
    bytes: int = 0
    lines: int = 0

    def add(self, line: str) -> None:
        self.bytes += len(line.encode()) + 1  # and its newline
        self.lines += 1


@dataclass
class Fleet:
    vms: int
    interval_s: float
    rng: random.Random
    made: int = 0
    tokens: int = 0
    live: list[Vm] = field(default_factory=list)

    def new_vm(self, now: int) -> Vm:
        self.made += 1
        rounds_per_h = 3600 / self.interval_s
        job = max(BOOT_ROUNDS + 1, int(self.rng.expovariate(1 / JOB_MEAN_H) * rounds_per_h))
        w = Writer(boot=f"{self.made:08x}", inst=str(10**18 + self.made))
        hb = w.event("heartbeat", {"rung": "0/10", "ph": "workload", "streak": 120}, "ok")
        ev = (hb.render(), "status=RUNNING")
        return Vm(f"job-{self.made:06d}", str(10**18 + self.made), now, now + job, evidence=ev)

    def outcome(self, vm: Vm, r: int) -> tuple[PollOutcome, bool]:
        """The VM's outcome this round, and whether it is gone after it (reaped)."""
        common = {"project": "my-project", "zone": "us-central1-a"}
        if self.rng.random() < 1 / ERROR_EVERY:
            err = "Compute API: gave up after 5 attempts: 503 Service Unavailable"
            return PollOutcome(vm.name, "", "-", None, error=err, **common), False
        read = ReadResult(fetched=310, new=310, lost=0, reset=False, new_events=1)
        rounds_per_day = 86400 / self.interval_s
        if vm.ended is None and self.rng.random() < 1 / (PREEMPT_DAYS * rounds_per_day):
            vm.ended, vm.ended_at = VerdictKind.PREEMPTED, r
        elif vm.ended is None and r >= vm.job_end:
            vm.ended, vm.ended_at = _ending(self.rng.random()), r
        if r - vm.born < BOOT_ROUNDS:
            why = "no line of ours yet (booting?)"
            v = Verdict(VerdictKind.UNKNOWN, why, None, ("status=RUNNING",))
            return PollOutcome(vm.name, vm.iid, "RUNNING", v, read=read, **common), False
        if vm.ended is None:
            silent = self.rng.randrange(1, 30)
            reason = f"last line {silent}s ago in phase workload"
            ev = (*vm.evidence, f"silent={silent}s", "phase=workload")
            v = Verdict(VerdictKind.HEALTHY, reason, vm.evidence[0][:8], ev)
            return PollOutcome(vm.name, vm.iid, "RUNNING", v, read=read, **common), False
        return self._ended(vm, r, read, common)

    def _ended(
        self, vm: Vm, r: int, read: ReadResult, common: dict[str, Any]
    ) -> tuple[PollOutcome, bool]:
        assert vm.ended is not None
        kind = vm.ended
        gone = r - vm.ended_at >= REAP_ROUNDS
        status = "RUNNING" if kind is VerdictKind.SUSPECTED_WEDGE else "TERMINATED"
        ev = (*vm.evidence, f"status={status}")
        v = Verdict(kind, f"{kind.value}: the job's end as the lines and GCE say", "b", ev)
        decision, announce = None, False
        if v.failover:
            if not vm.token:
                self.tokens += 1
                vm.token = self.tokens
                announce = True
            decision = Decision(vm.iid, "b", vm.token, kind.value, v.reason, vm.name,
                                "poller-1", T0, announce)  # fmt: skip
        reaped = "operation-" + vm.iid if gone else None
        out = PollOutcome(vm.name, vm.iid, status, v, read=read, decision=decision,
                          announce=announce, reaped=reaped, **common)  # fmt: skip
        return out, gone


def _ending(x: float) -> VerdictKind:
    """How a job ends, for x uniform in [0, 1)."""
    acc = 0.0
    for kind, p in ENDINGS:
        acc += p
        if x < acc:
            return kind
    return ENDINGS[-1][0]


def simulate(vms: int, interval_s: float, hours: float, seed: int = 38) -> dict[str, Any]:
    """Both modes over the same simulated rounds; bytes and lines, and per day."""
    rng = random.Random(seed)  # noqa: S311 (a seeded simulation, not a secret)
    fleet = Fleet(vms, interval_s, rng)
    fleet.live = [fleet.new_vm(-BOOT_ROUNDS) for _ in range(vms)]
    for vm in fleet.live:  # a fleet already running (booted): what is left of its jobs
        vm.job_end = int(rng.expovariate(1 / JOB_MEAN_H) * 3600 / interval_s)
    every, changes = Journal(every=True), Journal()
    # the first round apart: a process's first sight of every VM, once per start
    first_every, first_changes = Counts(), Counts()
    n_every, n_changes = Counts(), Counts()
    rounds = max(2, int(hours * 3600 / interval_s))
    outcomes = 0
    for r in range(rounds):
        if r == 1:
            first_every, first_changes = n_every, n_changes
            n_every, n_changes = Counts(), Counts()
        at = T0 + r * interval_s
        new = gone = 0
        keep: list[Vm] = []
        for vm in fleet.live:
            out, done = fleet.outcome(vm, r)
            outcomes += 1
            line = format_outcome(out, True, at)
            if every.admit(out):
                n_every.add(line)
            if changes.admit(out):
                n_changes.add(line)
            if done:
                gone += 1
            else:
                keep.append(vm)
        while len(keep) < vms:
            keep.append(fleet.new_vm(r + 1))
            new += 1
        fleet.live = keep
        head = (f"{LOG_PREFIX}round {r + 1}: {vms} VMs in 1 project(s) ({new} new, {gone} gone), "
                f"{vms} polled in 4.2s, 2 list page(s)")  # fmt: skip
        n_every.add(head)
        every.close_round()
        n_changes.add(f"{head}; {summary_text(changes.close_round())}")
    steady_day = 86400 / ((rounds - 1) * interval_s)
    return {
        "vms": vms,
        "interval_s": interval_s,
        "hours_simulated": rounds * interval_s / 3600,
        "rounds": rounds,
        "outcomes": outcomes,
        "vms_replaced": fleet.made - vms,
        "failovers": fleet.tokens,
        "object_bytes_mean": round(n_every.bytes / max(1, n_every.lines)),
        "every": _per_day(first_every, n_every, steady_day),
        "changes": _per_day(first_changes, n_changes, steady_day),
        "ratio": round(
            (first_every.bytes + n_every.bytes * steady_day)
            / max(1.0, first_changes.bytes + n_changes.bytes * steady_day),
            1,
        ),
        "model": {
            "job_mean_h": JOB_MEAN_H,
            "preempt_days": PREEMPT_DAYS,
            "error_every": ERROR_EVERY,
            "seed": seed,
        },
    }


def _per_day(first: Counts, steady: Counts, day: float) -> dict[str, float]:
    """A day of rounds after the first, plus the first round once (one start a day)."""
    return {
        "first_round_bytes": first.bytes,
        "steady_bytes": steady.bytes,
        "mb_per_day": round((first.bytes + steady.bytes * day) / MB, 2),
        "lines_per_day": round(first.lines + steady.lines * day),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vms", type=int, default=1000)
    ap.add_argument("--interval", type=float, default=30.0)
    ap.add_argument("--hours", type=float, default=2.0, help="simulated (default 2)")
    ap.add_argument("--seed", type=int, default=38)
    a = ap.parse_args(argv)
    print(json.dumps(simulate(a.vms, a.interval, a.hours, a.seed), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
