"""The validation scenarios and their judgement, pure: what each scenario does to its VM, what
it must show, and the verdict with its evidence from what was observed. No clock, no network.

Times in an :class:`Observation` are seconds (Unix time): the console's lines carry the VM's
clock, "left RUNNING" is when ``validate`` first read another status from the API, the decision
is the ledger's ``decided_at`` (the machine running ``validate``). Both clocks are NTP-synced
on GCE; the report says which clock each figure comes from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gce_watchdog.wire import vocab
from gce_watchdog.wire.protocol import Event

# The fault a wedge cuts: both of the agent's paths (docs/fault-injection.md).
WEDGE_CUT = "metadata+egress443"
# A bootstrap step whose download fails on DNS: ``.invalid`` never resolves (RFC 6761 6.4:
# resolvers "SHOULD generate immediate negative responses"), so curl exits 6 ("Couldn't resolve
# host", curl(1) EXIT CODES), which the start-up script calls cause=infra after its network
# checks passed (docs/bootstrap.md). --max-time bounds a resolver that does not answer (rc 28,
# infra too).
DNS_FAILING_STEP = ("curl", "-fsS", "--max-time", "20", "-o", "/dev/null",
                    "https://gcewd-validate.invalid/")  # fmt: skip
# The agent's maintenance line of a stop that is coming (instance/maintenance-event)
MAINTENANCE_TERMINATE = "TERMINATE_ON_HOST_MAINTENANCE"


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    workload: tuple[str, ...] | None  # the job's argv (gce-watchdog-workload); None: no job
    bootstrap: tuple[tuple[str, ...], ...] = ()  # gce-watchdog-bootstrap steps
    fault_ticks: int | None = None  # a fault lasting this many ticks; None: no fault
    expect_failover: int = 0
    expect_shutdown: bool = False  # the agent's ladder must write its shutdown line
    expect_recovered: bool = False
    expect_off: bool = False  # the VM must leave RUNNING by itself
    expect_reaped: bool = False  # the poller (reap) must delete the ended VM
    expect_verdicts: tuple[str, ...] = ()  # acceptable poller verdict kinds (empty: any)
    # validate calls instances.simulateMaintenanceEvent once the job ran healthy
    maintenance: bool = False

    def fault_request(self, run: str, interval_s: float, threshold: int) -> str | None:
        """The ``gce-watchdog-fault`` metadata value for this scenario (None: no fault)."""
        if self.fault_ticks is None:
            return None
        ticks = threshold + 10 if self.fault_ticks < 0 else self.fault_ticks
        # A flap lasts ``ticks`` intervals minus half of one: the tick after them passes.
        ttl = max(1.0, ticks * interval_s - (interval_s / 2 if self.fault_ticks > 0 else 0))
        return json.dumps(
            {"id": f"{run}-{self.name}", "cut": WEDGE_CUT, "ttl": f"{ttl:g}s"},
            separators=(",", ":"),
        )


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "wedge",
            "both paths cut until the ladder powers the VM off: one failover",
            workload=("sleep", "infinity"),
            fault_ticks=-1,  # longer than the ladder: threshold + 10 ticks
            expect_failover=1,
            expect_shutdown=True,
            expect_off=True,
            expect_verdicts=("self_shutdown",),
        ),
        Scenario(
            "done",
            "a short job finishes: no failover, the VM ends and is reaped",
            workload=("sleep", "30"),
            expect_off=True,
            expect_reaped=True,
            expect_verdicts=("workload_ok",),
        ),
        Scenario(
            "setup-failed",
            "a bootstrap step fails (cause=job): no failover",
            workload=("sleep", "30"),
            bootstrap=(("false",),),
            expect_off=True,
            expect_verdicts=("setup_failed",),
        ),
        Scenario(
            "setup-failed-infra",
            "a bootstrap download fails on DNS (curl exit 6, cause=infra): one failover",
            workload=("sleep", "30"),
            bootstrap=(DNS_FAILING_STEP,),
            expect_failover=1,
            expect_off=True,
            expect_verdicts=("setup_failed_infra",),
        ),
        Scenario(
            "maintenance",
            "GCE stops the VM for host maintenance (simulateMaintenanceEvent): one failover",
            workload=("sleep", "infinity"),
            maintenance=True,
            expect_failover=1,
            expect_off=True,
            expect_verdicts=("host_maintenance",),
        ),
        Scenario(
            "flap",
            "a 9-tick outage that recovers: no shutdown, no failover",
            workload=("sleep", "infinity"),
            fault_ticks=9,
            expect_recovered=True,
            expect_verdicts=("healthy",),
        ),
    )
}
DEFAULT_SCENARIOS = tuple(SCENARIOS)


@dataclass
class Observation:
    """What ``validate`` saw of one scenario's VM (times: Unix seconds; None: not seen)."""

    scenario: str
    instance: str
    fault_at: float | None = None  # the `fault op=inject` line (VM clock)
    fault_refused: str | None = None  # a `fault op=refused` line's why
    first_rung_at: float | None = None  # the first 1/N tick after the fault (VM clock)
    top_rung_at: float | None = None  # the first N/N line (VM clock)
    shutdown_at: float | None = None  # the first `shutdown` line of the boot (VM clock)
    shutdown_read_at: float | None = None  # when validate read it (validate's clock)
    recovered_at: float | None = None
    left_running_at: float | None = None  # validate's clock
    decided_at: float | None = None  # the ledger (validate's clock)
    maintenance_at: float | None = None  # validate asked for the maintenance event (its clock)
    notice_at: float | None = None  # the agent's maintenance TERMINATE line (VM clock)
    failovers: int = 0  # FAILOVER decisions in the ledger for this VM
    verdict: str | None = None  # the poller's last verdict kind
    final_status: str | None = None  # the API's last answer ("gone": 404)
    deleted: bool = False
    reaped_by_poller: bool = False
    timed_out: bool = False
    notes: list[str] = field(default_factory=list)

    def observe_line(self, ev: Event, read_at: float | None = None) -> None:
        """Fold one console line in (in the order read; ``read_at``: validate's clock)."""
        ts = ev.ts_ms / 1000.0
        f = ev.fields_dict
        if ev.event == vocab.FAULT and f.get("op") == "inject" and self.fault_at is None:
            self.fault_at = ts
        elif ev.event == vocab.FAULT and f.get("op") == "refused" and self.fault_refused is None:
            self.fault_refused = f.get("why", "?")
        elif ev.event == vocab.SHUTDOWN:
            if self.shutdown_at is None and "rep" not in f and "resume" not in f:
                self.shutdown_at = ts
                self.shutdown_read_at = read_at
        elif ev.event == vocab.RECOVERED and self.recovered_at is None and self.fault_at:
            self.recovered_at = ts
        elif ev.event == vocab.MAINTENANCE and f.get("event") == MAINTENANCE_TERMINATE:
            self.notice_at = self.notice_at or ts
        rung = _rung(f.get("rung"))
        if rung is not None and self.fault_at is not None and ts >= self.fault_at:
            k, n = rung
            if k >= 1 and self.first_rung_at is None:
                self.first_rung_at = ts
            if k >= n and self.top_rung_at is None:
                self.top_rung_at = ts

    def timings(self) -> dict[str, float | None]:
        """Seconds from the fault to each milestone (None: not seen, or no fault)."""
        t0 = self.fault_at

        def since(t: float | None) -> float | None:
            return _between(t0, t)

        return {
            "fault_to_first_rung_s": since(self.first_rung_at),
            "fault_to_top_rung_s": since(self.top_rung_at),
            "fault_to_shutdown_line_s": since(self.shutdown_at),
            "fault_to_left_running_s": since(self.left_running_at),
            "fault_to_decision_s": since(self.decided_at),
            "fault_to_recovered_s": since(self.recovered_at),
            # validate's clock both: from its simulateMaintenanceEvent call
            "maintenance_to_left_running_s": _between(self.maintenance_at, self.left_running_at),
            "maintenance_to_decision_s": _between(self.maintenance_at, self.decided_at),
        }


def _between(t0: float | None, t: float | None) -> float | None:
    """Seconds from ``t0`` to ``t``, to the millisecond (None: either not seen)."""
    return None if t0 is None or t is None else round(t - t0, 3)


def _rung(value: str | None) -> tuple[int, int] | None:
    if not value or "/" not in value:
        return None
    a, _, b = value.partition("/")
    if not (a.isdigit() and b.isdigit()) or int(b) == 0:
        return None
    return int(a), int(b)


@dataclass(frozen=True)
class Judgement:
    scenario: str
    passed: bool
    evidence: tuple[str, ...]  # one line per check, "ok: ..." or "FAIL: ..."


def judge(s: Scenario, o: Observation) -> Judgement:
    """Whether the observation meets the scenario's expectation; every check is evidence."""
    ev: list[str] = []

    def check(ok: bool, what: str) -> None:
        ev.append(("ok: " if ok else "FAIL: ") + what)

    if o.timed_out:
        check(False, "the scenario did not finish within its deadline")
    if o.fault_refused:
        cause = (
            "the VM's agent does not trust its metadata (watch.trust_metadata; docs/actions.md)"
            if o.fault_refused == "untrusted"
            else "faults from metadata are not enabled on this VM (watch.faults_from_metadata)"
        )
        check(False, f"the agent refused the fault (why={o.fault_refused}): {cause}")
    check(o.failovers == s.expect_failover,
          f"failovers in the ledger: {o.failovers} (expected {s.expect_failover})")  # fmt: skip
    if s.fault_ticks is not None:
        check(o.fault_at is not None, "the fault's inject line was read")
        check(o.first_rung_at is not None, "the ladder climbed (1/N read after the fault)")
    if s.expect_shutdown:
        check(o.top_rung_at is not None, "the ladder reached the top (N/N read)")
        check(o.shutdown_at is not None, "the shutdown line was read")
        read, left = o.shutdown_read_at, o.left_running_at
        check(read is not None and (left is None or read < left),
              "the shutdown line was read while the VM was RUNNING")  # fmt: skip
    else:
        check(o.shutdown_at is None, "no shutdown line")
    if s.expect_recovered:
        check(o.recovered_at is not None, "the recovered line was read")
    if s.maintenance:
        check(o.maintenance_at is not None, "the maintenance event was simulated")
        # shown, never required: GCE documents no notice before a simulated stop
        ev.append(
            "info: the agent's maintenance notice was read"
            if o.notice_at is not None
            else "info: no maintenance notice was read (none is documented for a simulated stop)"
        )
    if s.expect_off:
        check(o.left_running_at is not None, "the VM left RUNNING by itself")
    if s.expect_reaped:
        check(o.reaped_by_poller, "the poller reaped the ended VM")
    if s.expect_failover:
        check(o.decided_at is not None, "the poller recorded its decision")
    if s.expect_verdicts:
        want = " or ".join(s.expect_verdicts)
        check(o.verdict in s.expect_verdicts, f"the poller's verdict: {o.verdict} (want {want})")
    check(o.deleted, "the VM was deleted at the end")
    passed = all(not line.startswith("FAIL") for line in ev)
    return Judgement(s.name, passed, tuple(ev))


def report_entry(s: Scenario, o: Observation, j: Judgement) -> dict[str, Any]:
    """One scenario in the JSON report."""
    return {
        "scenario": s.name,
        "summary": s.summary,
        "instance": o.instance,
        "passed": j.passed,
        "evidence": list(j.evidence),
        "failovers": o.failovers,
        "expected_failovers": s.expect_failover,
        "verdict": o.verdict,
        "final_status": o.final_status,
        "deleted": o.deleted,
        "reaped_by_poller": o.reaped_by_poller,
        "timings": o.timings(),
        "clocks": {
            "fault, rungs, shutdown line, recovered": "the VM (console lines)",
            "left RUNNING, decision, maintenance": "the machine running validate (API, ledger)",
        },
        "notes": list(o.notes),
    }


def select(names: Sequence[str]) -> list[Scenario]:
    """The scenarios named (in the order given); ValueError names an unknown one."""
    bad = [n for n in names if n not in SCENARIOS]
    if bad:
        raise ValueError(f"unknown scenario(s) {', '.join(bad)}; known: {', '.join(SCENARIOS)}")
    return [SCENARIOS[n] for n in dict.fromkeys(names)]
