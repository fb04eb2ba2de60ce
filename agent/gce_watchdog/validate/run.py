"""A validation run: create the plan's VMs, drive each scenario, judge it, delete everything.

The poller runs in-process (:class:`poller.poller.Poller`, the code of ``gce-watchdog poll``,
with ``reap``) on a temporary SQLite ledger, reading only what the Compute API serves. Every VM is
deleted in a ``finally`` (also on Ctrl-C, SIGTERM or an error), then the run's label is swept; a
``validate`` killed with SIGKILL leaves VMs that ``validate --cleanup RUN`` (by label) deletes,
and that delete themselves at ``scheduling.maxRunDuration`` anyway.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gce_watchdog.lib.compute import ComputeAPIError, SerialChunk
from gce_watchdog.lib.files import atomic_write
from gce_watchdog.poller.ledgers import Ledger, open_ledger
from gce_watchdog.poller.poller import Poller
from gce_watchdog.poller.reader import CursorStore
from gce_watchdog.poller.verdict import Policy
from gce_watchdog.validate.gce import ValidateApi
from gce_watchdog.validate.plan import LABEL, Plan, VMPlan
from gce_watchdog.validate.progress import Progress
from gce_watchdog.validate.scenarios import (
    SCENARIOS,
    Judgement,
    Observation,
    judge,
    report_entry,
)
from gce_watchdog.wire import vocab
from gce_watchdog.wire.protocol import Event

FAULT_KEY = "gce-watchdog-fault"
BOOT_DEADLINE_S = 15 * 60.0  # insert to the agent's first line (boot, install)
SPIN_S = 0.25  # the spinner's pace on a terminal (the wait between polls is cut in slices)
QUIET_S = 30.0  # off a terminal: the longest a run goes without a line (a boot takes minutes)


@dataclass
class Timing:
    """How ``validate`` paces itself (tests shrink these; the defaults suit real GCE)."""

    poll_every_s: float = 10.0
    agent_interval_s: float = 30.0
    threshold: int = 10
    healthy_ticks: int = 2  # the agent runs this many intervals healthy before the fault
    boot_deadline_s: float = BOOT_DEADLINE_S
    scenario_deadline_s: float = 30 * 60.0  # insert to the scenario's end


@dataclass
class VMState:
    plan: VMPlan
    obs: Observation
    serial: bytearray = field(default_factory=bytearray)  # serial-NAME.log: the poller's reads
    offset: int = 0  # the port offset `serial` ends at
    seen_events: int = 0  # lines of the poller's timeline already folded in
    events: list[Event] = field(default_factory=list)
    inserted_at: float | None = None
    workload_at: float | None = None
    fault_sent: bool = False
    seen_running: bool = False
    finished: bool = False
    judgement: Judgement | None = None
    told: list[str] = field(default_factory=list)  # the milestones already said, in order


class Interrupted(Exception):
    """SIGTERM (Ctrl-C is KeyboardInterrupt): stop and clean up."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(_sig: int, _frame: object) -> None:
        raise Interrupted("SIGTERM")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class Run:
    def __init__(
        self,
        plan: Plan,
        api: ValidateApi,
        out_dir: Path,
        timing: Timing | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        log: TextIO | None = None,
    ) -> None:
        self.plan = plan
        self.api = api
        self.out_dir = out_dir
        self.t = timing or Timing()
        self.clock = clock
        self.sleep = sleep
        self.log = log
        self.vms = [VMState(v, Observation(v.scenario, v.name)) for v in plan.vms]
        self.created: list[str] = []
        self.progress = Progress(log or sys.stderr, clock)

    def say(self, msg: str) -> None:
        """One step line on stderr, with the time since the run began."""
        self.progress.step(msg)

    def _tell(self, vm: VMState) -> None:
        """Say each milestone the VM reached since the last poll, once, in order."""
        for key, text in milestones(vm):
            if key not in vm.told:
                vm.told.append(key)
                self.say(f"{vm.plan.name}: {text}")

    def _wait(self, seconds: float) -> None:
        """The wait between polls; on a terminal, in slices that turn the spinner; elsewhere a
        line after QUIET_S without one, so that a log never looks stuck."""
        if not self.progress.tty:
            self.sleep(seconds)
            if self.clock() - self.progress.last_step >= QUIET_S:
                self.say("still waiting for: " + ", ".join(_state(vm) for vm in self.vms))
            return
        end = self.clock() + seconds
        while (left := end - self.clock()) > 0:
            self.progress.waiting("waiting for: " + ", ".join(_state(vm) for vm in self.vms))
            self.sleep(min(SPIN_S, left))

    # -- the run --------------------------------------------------------------------------------
    def execute(self) -> int:
        """Create, drive, judge, delete; 0 only when every scenario met its expectation."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        p = self.plan
        work = Path(tempfile.mkdtemp(prefix=f"gcewd-validate-{p.run}-"))
        interrupted: str | None = None
        ledger = open_ledger(work / "ledger.sqlite", owner=f"validate-{p.run}")
        try:
            with _sigterm_raises():
                try:
                    poller = Poller(
                        self.api.client, CursorStore(work / "cursors"), p.project, p.zone,
                        ledger, Policy(), reap=True, on_read=self._keep_serial,
                    )  # fmt: skip
                    self._create()
                    self._drive(poller, ledger)
                except (KeyboardInterrupt, Interrupted) as e:
                    interrupted = str(e) or "Ctrl-C"
                    self.say(f"interrupted ({interrupted}): deleting what this run created")
                except (ComputeAPIError, TimeoutError) as e:
                    interrupted = f"API error: {e}"
                    self.say(f"{interrupted}; deleting what this run created")
                finally:
                    self.progress.close()
                    self._cleanup()
        finally:
            ledger.close()
            # The ledger is evidence (one FAILOVER row per wedge): kept with the report.
            with contextlib.suppress(OSError):
                shutil.copyfile(work / "ledger.sqlite", self.out_dir / "ledger.sqlite")
            shutil.rmtree(work, ignore_errors=True)
        return self._report(interrupted)

    def _create(self) -> None:
        p = self.plan
        for vm in self.vms:
            self.say(f"creating {vm.plan.name} ({vm.plan.scenario})")
            self.created.append(vm.plan.name)  # before the call: it may land and we be killed
            op = self.api.insert(p.project, p.zone, vm.plan.body)
            vm.inserted_at = self.clock()
            self.api.wait(p.project, p.zone, op)
        self.say(f"{len(self.vms)} VM(s) created; waiting for their agents' first lines")

    def _drive(self, poller: Poller, ledger: Ledger) -> None:
        while not all(vm.finished for vm in self.vms):
            for vm in self.vms:
                if not vm.finished:
                    self._step(vm, poller, ledger)
                    self._tell(vm)
            if not all(vm.finished for vm in self.vms):
                self._wait(self.t.poll_every_s)

    def _step(self, vm: VMState, poller: Poller, ledger: Ledger) -> None:
        p, o, s = self.plan, vm.obs, SCENARIOS[vm.plan.scenario]
        now = self.clock()
        out = poller.poll(vm.plan.name)
        self._observe(vm, poller, now)
        if out.verdict is not None:
            o.verdict = out.verdict.kind.value
        status = "gone" if out.status == "MISSING" else out.status
        if out.reaped and not o.reaped_by_poller:
            o.reaped_by_poller = True
            o.notes.append(f"reaped by the poller ({out.reaped})")
        if status == "RUNNING":
            vm.seen_running = True
        elif status and vm.seen_running and o.left_running_at is None:
            o.left_running_at = now
        if status:
            o.final_status = status
        mine = [d for d in ledger.decisions.all() if d.instance == poller.path(vm.plan.name)]
        o.failovers = len(mine)
        if mine and o.decided_at is None:
            o.decided_at = mine[0].decided_at
        # The fault, once the agent has run healthy for a few intervals.
        req = s.fault_request(p.run, self.t.agent_interval_s, self.t.threshold)
        healthy_for = self.t.healthy_ticks * self.t.agent_interval_s
        if (
            req is not None
            and not vm.fault_sent
            and vm.workload_at is not None
            and now - vm.workload_at >= healthy_for
        ):
            if any(_rung_above_zero(e) for e in vm.events):
                o.notes.append("the ladder was above 0 before the fault (not healthy)")
            self.say(f"{vm.plan.name}: requesting the fault {req}")
            self.api.set_metadata(p.project, p.zone, vm.plan.name, FAULT_KEY, req)
            vm.fault_sent = True
        # The maintenance event, after the same healthy intervals.
        started = vm.workload_at is not None and now - vm.workload_at >= healthy_for
        if s.maintenance and o.maintenance_at is None and started:
            self.say(f"{vm.plan.name}: simulating a host maintenance event")
            self.api.simulate_maintenance(p.project, p.zone, vm.plan.name)
            o.maintenance_at = now
        vm.finished = self._finished(vm, now)

    def _finished(self, vm: VMState, now: float) -> bool:
        s, o = SCENARIOS[vm.plan.scenario], vm.obs
        started = vm.inserted_at or now
        if vm.workload_at is None and not vm.events and now - started > self.t.boot_deadline_s:
            o.timed_out = True
            o.notes.append("no line from the VM within the boot deadline")
            return True
        if now - started > self.t.scenario_deadline_s:
            o.timed_out = True
            return True
        if o.fault_refused:
            return True
        if s.expect_failover:
            return o.decided_at is not None and o.left_running_at is not None
        if s.expect_recovered:
            return o.recovered_at is not None
        if s.expect_off:
            off = o.left_running_at is not None and o.verdict in s.expect_verdicts
            return off and (o.reaped_by_poller or not s.expect_reaped)
        return False

    def _keep_serial(self, name: str, chunk: SerialChunk) -> None:
        """Each read the poller made (its ``on_read``): the console it judged is the one saved.
        A read of its own before each poll once missed a VM that stopped between the two (the
        API serves no console once a VM is not RUNNING) and saved an empty log."""
        vm = next((v for v in self.vms if v.plan.name == name), None)
        if vm is None:
            return
        if chunk.next < vm.offset:  # the port restarted at 0; the poller reads it again
            vm.obs.notes.append("console log: the port restarted")
            vm.offset = 0
        if chunk.start > vm.offset:
            vm.obs.notes.append(f"console log: {chunk.start - vm.offset} bytes lost")
        elif chunk.next <= vm.offset:
            return  # read again (a fresh cursor): already kept
        vm.serial += chunk.contents[max(0, vm.offset - chunk.start) :]
        vm.offset = chunk.next

    def _observe(self, vm: VMState, poller: Poller, now: float) -> None:
        """Fold in the lines the poller read in its last poll: the evidence is what the poller
        saw (its own reads, before it decides and reaps), never a second read that could race
        with a delete."""
        events = poller.reader.cursor(self.plan.project, self.plan.zone, vm.plan.name).timeline
        evs = events.events
        if len(evs) < vm.seen_events:  # the poller started the VM's cursor over
            vm.seen_events = 0
        for ev in evs[vm.seen_events :]:
            vm.obs.observe_line(ev, now)
            vm.events.append(ev)
            if ev.event == vocab.PHASE and ev.fields_dict.get("ph") == "workload":
                vm.workload_at = vm.workload_at or now
        vm.seen_events = len(evs)

    # -- cleanup --------------------------------------------------------------------------------
    def _cleanup(self) -> None:
        """Delete every VM this run created, then anything else with its label; bounded."""
        p = self.plan
        self.say("deleting the run's VMs")
        names = list(dict.fromkeys(self.created))
        with contextlib.suppress(ComputeAPIError):
            names += [n for z, n, _ in self.api.run_instances(p.project, p.run) if z == p.zone]
        left = cleanup(self.api, p.project, p.zone, list(dict.fromkeys(names)), p.run, self.say)
        for vm in self.vms:
            vm.obs.deleted = vm.plan.name not in left

    # -- the report ------------------------------------------------------------------------------
    def _report(self, interrupted: str | None) -> int:
        self.say(f"writing the report and the timelines in {self.out_dir}/")
        entries = []
        ok = interrupted is None
        for vm in self.vms:
            s = SCENARIOS[vm.plan.scenario]
            vm.judgement = judge(s, vm.obs)
            ok = ok and vm.judgement.passed
            entries.append(report_entry(s, vm.obs, vm.judgement) | self._timeline(vm))
            mark = "PASS" if vm.judgement.passed else "FAIL"
            self.say(f"{mark} {s.name}: " + "; ".join(vm.judgement.evidence))
        doc: dict[str, Any] = {
            "run": self.plan.run,
            "project": self.plan.project,
            "zone": self.plan.zone,
            "passed": ok,
            "interrupted": interrupted,
            "plan": self.plan.to_json(),
            "scenarios": entries,
        }
        atomic_write(self.out_dir / "validate.json", (json.dumps(doc, indent=2) + "\n").encode())
        self.say(f"report: {self.out_dir / 'validate.json'}")
        return 0 if ok else 1

    def _timeline(self, vm: VMState) -> dict[str, Any]:
        """The VM's console (serial-NAME.log) and its `report` page (and PNG with matplotlib)."""
        name = vm.plan.name
        log = self.out_dir / f"serial-{name}.log"
        atomic_write(log, bytes(vm.serial))
        files = {"serial": log.name}
        try:
            from gce_watchdog.poller.verdict import InstanceState
            from gce_watchdog.report.html import render
            from gce_watchdog.report.model import build_report

            status = vm.obs.final_status if vm.obs.final_status != "gone" else "TERMINATED"
            r = build_report(bytes(vm.serial), source=log.name, instance=InstanceState(status))
            png: bytes | None = None
            note = ""
            try:
                import io

                from gce_watchdog.report import plot

                buf = io.BytesIO()
                plot.write_png(r, buf)
                png = buf.getvalue()
                (self.out_dir / f"timeline-{name}.png").write_bytes(png)
                files["png"] = f"timeline-{name}.png"
            except Exception as e:  # matplotlib missing or failing: the page says so
                note = f"no plot: {e}"
            (self.out_dir / f"timeline-{name}.html").write_text(render(r, png, note))
            files["html"] = f"timeline-{name}.html"
        except Exception as e:  # a report must never lose the verdicts
            vm.obs.notes.append(f"timeline not written: {e}")
        return {"files": files}


def milestones(vm: VMState) -> list[tuple[str, str]]:
    """The milestones a scenario's VM has reached, in the order a run meets them (pure): the
    step lines of the progress."""
    o = vm.obs
    out: list[tuple[str, str]] = []
    if vm.events:
        out.append(("booted", "its agent's first line (booted, installed)"))
    if vm.workload_at is not None:
        out.append(("workload", "the workload runs"))
    if o.fault_at is not None:
        out.append(("fault", "the fault is on (fault inject)"))
    if o.fault_refused is not None:
        out.append(("refused", f"the fault was refused ({o.fault_refused})"))
    if o.first_rung_at is not None:
        out.append(("climb", "the ladder climbs"))
    if o.shutdown_at is not None:
        out.append(("shutdown", "the agent decided (shutdown line)"))
    for ev in vm.events:  # the job's own ending, and the chain's steps
        f = ev.fields_dict
        if ev.event == vocab.PHASE and f.get("ph") == "done":
            out.append(("done", "the job is done (phase done)"))
        elif ev.event == vocab.SETUP_FAILED:
            out.append(("setup_failed", f"its set-up failed (step {f.get('step', '-')})"))
        elif ev.event == vocab.END:
            out.append(("end", f"its ending started (end reason={f.get('reason', '-')})"))
        elif ev.event == vocab.ACTION and f.get("status") == "start":
            step = f.get("step", "-")
            what = "lingering, so the poller reads it" if step == "linger" else step
            out.append((f"step-{step}", f"chain step: {what}"))
    if o.recovered_at is not None:
        out.append(("recovered", "recovered"))
    if o.decided_at is not None:
        out.append(("decided", f"the poller decided: {o.failovers} failover(s)"))
    if o.left_running_at is not None:
        out.append(("left", f"no longer RUNNING ({o.final_status})"))
    if vm.finished:
        end = "timed out" if o.timed_out else f"verdict {o.verdict or '-'}"
        out.append(("finished", f"scenario finished ({end})"))
    return out


def _state(vm: VMState) -> str:
    """One VM in the waiting line: its scenario and its latest milestone."""
    last = vm.told[-1] if vm.told else ("created" if vm.inserted_at else "waiting")
    return f"{vm.plan.scenario} ({last})"


def _rung_above_zero(ev: Any) -> bool:
    r = ev.fields_dict.get("rung") or ""
    return ev.event == vocab.TICK and r[:1].isdigit() and not r.startswith("0/")


def cleanup(
    api: ValidateApi,
    project: str,
    zone: str | None,
    names: list[str],
    run: str,
    say: Callable[[str], None],
    within: float = 600.0,
) -> list[str]:
    """Delete ``names`` (in ``zone``) and wait until each is gone; returns those still there."""
    left: list[str] = []
    for name in names:
        z = zone or ""
        try:
            op = api.delete(project, z, name)
            if op is not None:
                api.wait(project, z, op, within)
            if api.get(project, z, name) is not None:
                left.append(name)
            else:
                say(f"deleted {name}")
        except (ComputeAPIError, TimeoutError) as e:
            say(f"could not delete {name}: {e}")
            left.append(name)
    if left:
        say(f"still there: {', '.join(left)}: run `gce-watchdog validate --cleanup {run}`")
    return left


def cleanup_label(
    api: ValidateApi, project: str, run: str | None, say: Callable[[str], None]
) -> int:
    """``validate --cleanup [RUN]``: delete every VM with the run's label (any run: None)."""
    found = api.run_instances(project, run)
    if not found:
        say(f"nothing labelled {LABEL}{'=' + run if run else ''} in {project}")
        return 0
    left = []
    for zone, name, inst in found:
        r = str((inst.get("labels") or {}).get(LABEL, run or ""))
        left += cleanup(api, project, zone, [name], r, say)
    return 0 if not left else 1
