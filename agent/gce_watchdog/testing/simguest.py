"""A simulated guest for :class:`testing.simcompute.FakeComputeAPI`: what the start-up script and
the agent write to the serial port of a VM that ``instances.insert`` created, from the VM's
metadata, so ``gce-watchdog validate`` can run its scenarios offline.

It plays, on the fake's serial port, signed protocol lines in the documented formats
(docs/serial-protocol.md): ``phase bootstrap``; a failing ``gce-watchdog-bootstrap`` step (an argv
``["false"]``) as ``setup_failed cause=job`` then ``end reason=setup_failed``; a ``curl`` step
for an ``.invalid`` host (RFC 6761: never resolves, curl exits 6) as the start-up script reports
it, ``setup_failed cause=infra rc=6``, then ``end``; else ``start``,
``phase workload``, and per agent tick: nothing while healthy (the agent writes no line for a
healthy tick), a ``tick rung=k/N`` line per failed tick of a fault, ``shutdown`` at ``N/N``, or
``fault op=expire`` and ``recovered`` when the fault's TTL ends first. A fault is taken from the
``gce-watchdog-fault`` metadata value only when the ``gce-watchdog-config`` drop-in enables
``faults_from_metadata`` and ``trust_metadata`` (else ``fault op=refused why=disabled`` or
``why=untrusted``, as the agent does). A finite
workload (``sleep N``) ends with ``exit rc=0``, ``phase done`` and ``end reason=done``. Every end
lingers (``gce-watchdog-linger``) repeating its line, then the guest powers off
(``guest_shutdown``: ``compute.instances.guestTerminate``, TERMINATED). A maintenance event
announced to the guest (``FakeInstance.maintenance_event``, what the metadata server serves at
``instance/maintenance-event``) is the agent's ``maintenance event=TERMINATE_ON_HOST_MAINTENANCE
was=NONE`` line at the next tick; when Compute Engine then stops the VM (it leaves RUNNING) the
job is killed as systemd stops it, ``exit rc=- sig=SIGTERM``, and the guest ends.

Time runs ``scale`` times faster than on a VM: the drop-in's ``agent.interval`` is the real tick
here, and seconds of the workload and the linger are multiplied by ``interval / 30``.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time

from gce_watchdog.testing.simcompute import FakeComputeAPI, FakeInstance
from gce_watchdog.testing.synth import Writer
from gce_watchdog.wire.protocol import LineKey

DEFAULT_INTERVAL_S = 30.0


class SimGuest:
    """Attach to a fake API: every inserted instance gets a guest thread."""

    def __init__(
        self,
        api: FakeComputeAPI,
        threshold: int = 10,
        boot_delay_s: float = 0.0,
        min_linger_s: float = 3.0,
    ):
        self.api = api
        self.threshold = threshold
        # The linger covers several polls of a poller that reads every VM in turn, however
        # fast the simulated clock runs (docs/actions.md: two polls plus the read).
        self.min_linger_s = min_linger_s
        self.boot_delay_s = boot_delay_s
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        api.on_insert.append(self._spawn)

    def close(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(5)

    def __enter__(self) -> SimGuest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, inst: FakeInstance) -> None:
        t = threading.Thread(target=self._guard, args=(inst,), daemon=True, name=inst.name)
        self.threads.append(t)
        t.start()

    def _guard(self, inst: FakeInstance) -> None:
        try:
            _Guest(self, inst).run()
        except BaseException as e:  # a test must see a crashed guest, not a silent VM
            self.errors.append(e)


class _Guest:
    def __init__(self, sim: SimGuest, inst: FakeInstance) -> None:
        self.sim = sim
        self.api = sim.api
        self.inst = inst
        md = inst.metadata
        dropin = md.get("gce-watchdog-config", "")
        m = re.search(r'interval\s*=\s*"?([0-9.]+)s?"?', dropin)
        self.interval = float(m.group(1)) if m else DEFAULT_INTERVAL_S
        self.scale = self.interval / DEFAULT_INTERVAL_S
        self.faults_on = bool(re.search(r"faults_from_metadata\s*=\s*true", dropin))
        # validate's VMs have a service account that can write their metadata (cloud-platform):
        # the agent obeys the fault attribute only with trust_metadata (daemon/mdtrust.py)
        self.trusted = bool(re.search(r"trust_metadata\s*=\s*true", dropin))
        # its own Ed25519 line key, announced for this instance id (protocol v3), as an agent does
        key = LineKey(secrets.token_bytes(32))
        self.w = Writer(boot=secrets.token_hex(4), key=key, inst=inst.id)
        self.n = sim.threshold

    def line(self, name: str, fields: dict[str, object], text: str = "") -> None:
        self.w.ts_ms = int(time.time() * 1000)
        self.api.append_serial(self.inst.name, self.w.line(name, fields, text, step_ms=0))

    def alive(self) -> bool:
        return not self.sim._stop.is_set() and not self.inst.deleted

    def wait(self, seconds: float) -> bool:
        """Sleep (bounded by the harness); False when the VM is gone or the harness stops."""
        self.sim._stop.wait(max(0.0, seconds))
        return self.alive()

    def run(self) -> None:
        if not self.wait(self.sim.boot_delay_s):
            return
        md = self.inst.metadata
        self.line("phase", {"ph": "bootstrap"})
        steps = json.loads(md.get("gce-watchdog-bootstrap") or "[]")
        for i, argv in enumerate(steps):
            if argv == ["false"]:
                fields = {"step": "bootstrap", "reason": f"step_{i + 1}", "rc": 1, "cause": "job"}
                self.line("setup_failed", fields, "a bootstrap step failed")
                self.end("setup_failed")
                return
            if argv and argv[0] == "curl" and any(".invalid/" in a for a in argv):
                # startup-script.sh run_steps: curl's 6 after the network checks is infra
                why = "curl exited with 6 (curl: network)"
                fields = {"step": f"bootstrap:md{i}", "reason": why, "rc": 6, "cause": "infra"}
                self.line("setup_failed", fields, why)
                self.end("setup_failed")
                return
        self.line(
            "start",
            {"v": "sim", "inst": self.inst.id, "name": self.inst.name, "bootid": "-",
             "cfg": "-", "pid": 1, "rung": f"0/{self.n}"},
        )  # fmt: skip
        self.line("phase", {"ph": "workload"})
        argv = json.loads(md.get("gce-watchdog-workload") or "[]")
        work_s: float | None = None
        if len(argv) == 2 and argv[0] == "sleep" and argv[1] != "infinity":
            work_s = float(argv[1]) * self.scale
        started = time.monotonic()
        rung = 0
        fault_until: float | None = None
        seen: str | None = None
        maintenance = "NONE"
        while self.wait(self.interval):
            if self.api.instance(self.inst.name).status != "RUNNING":
                # Compute Engine stopped it: systemd kills the job at the guest's shutdown
                dur = int((time.monotonic() - started) / self.scale)
                self.line("exit", {"rc": "-", "sig": "SIGTERM", "dur": dur})
                return
            if self.inst.maintenance_event != maintenance:
                was, maintenance = maintenance, self.inst.maintenance_event
                self.line("maintenance", {"event": maintenance, "was": was},
                          f"host maintenance event: {maintenance}")  # fmt: skip
            value = self.inst.metadata.get("gce-watchdog-fault")
            if value and value != seen:
                seen = value
                fault_until = self.fault(value)
                continue  # the first tick that meets the fault is the next one
            now = time.time()
            if fault_until is not None and now < fault_until:
                rung += 1
                if rung >= self.n:
                    self.line("shutdown", {"reason": "ladder", "rung": f"{rung}/{self.n}",
                                           "action": "poweroff", "chain": "poweroff"},
                              f"{rung}/{self.n}: shutting down")  # fmt: skip
                    self.linger("shutdown", {"reason": "ladder", "rung": f"{rung}/{self.n}",
                                             "action": "poweroff"})  # fmt: skip
                    return
                self.line("tick", {"rung": f"{rung}/{self.n}", "md": "fail/timeout/5001",
                                   "eg": "fail/timeout/5001", "dns": "ok", "ph": "workload"},
                          f"BOTH reachability probes FAILED ({rung}/{self.n})")  # fmt: skip
            elif fault_until is not None:
                self.line("fault", {"op": "expire", "id": "sim00001", "cut": "metadata+egress443"})
                if rung:
                    self.line("recovered", {"from": f"{rung}/{self.n}", "md": "ok", "eg": "ok"})
                rung, fault_until = 0, None
            if work_s is not None and time.monotonic() - started >= work_s:
                self.line("exit", {"rc": 0, "sig": "-", "dur": int(work_s / self.scale)})
                self.line("phase", {"ph": "done"})
                self.end("done")
                return

    def fault(self, value: str) -> float | None:
        """The agent's handling of a fault request (faults/request.py; only what validate sends)."""
        req = json.loads(value)
        if not self.faults_on or not self.trusted:
            why = "disabled" if not self.faults_on else "untrusted"
            self.line("fault", {"op": "refused", "req": req.get("id", "-"), "why": why})
            return None
        ttl = float(str(req["ttl"]).rstrip("s"))
        self.line("fault", {"op": "inject", "id": "sim00001", "cut": req["cut"],
                            "ttl": f"{int(ttl)}s", "until": "-", "rev": "systemd"})  # fmt: skip
        return time.time() + ttl

    def end(self, reason: str) -> None:
        fields: dict[str, object] = {"reason": reason, "action": "poweroff", "chain": "poweroff"}
        self.line("end", fields)
        self.linger("end", {"reason": reason, "action": "poweroff"})

    def linger(self, name: str, fields: dict[str, object]) -> None:
        raw = self.inst.metadata.get("gce-watchdog-linger", "75s").rstrip("s")
        left = max(float(raw) * self.scale, self.sim.min_linger_s)
        rep = 0
        step = max(self.interval / 2, 0.01)
        while left > 0 and self.wait(min(step, left)):
            left -= step
            rep += 1
            self.line(name, {**fields, "rep": rep, "left": f"{int(max(left, 0) * 1000)}ms"})
        if self.alive():
            self.api.guest_shutdown(self.inst.name)
