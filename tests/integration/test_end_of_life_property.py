"""Issue 24, done-when: a finished job is never failed over; a wedge or a preemption always is.

The real poller (reader, verdict, ledger, reaper) against the faithful fake Compute API
(``serial_needs_running=True``: serial output only while RUNNING; a guest power-off or a
preemption keeps the VM STOPPING for a second, then TERMINATED; each recorded as a zone
operation), all on one simulated clock: nothing sleeps.

The **stop window** W is how long the guest stays RUNNING (readable) between the start of its
power-off and GCE's STOPPING: the guest's own shutdown (systemd stopping units). A preemption
gives the guest W too (GCE's notice; the agent may or may not write its ``preempted`` line).

The VM side is a documented MODEL of the agent's end-of-life chain (branch eol-agent,
``daemon/endoflife.py``, ``actions.linger`` default 75 s = two 30 s poll intervals plus a read's
latency): the job's terminal line is written, then an ``end`` line, then the VM stays RUNNING for
the linger, then the guest powers off: W seconds later GCE records
``compute.instances.guestTerminate`` and the VM goes STOPPING, then TERMINATED. The real chain is
not run here: its timing is the model's input, and its own tests cover its steps.

Cases are drawn from a seeded generator (deterministic, so a failure reproduces): completions
at random phases of the 30 s poll grid with stop windows of 2, 5, 15 and 60 s, ending in
``exit rc=0``, ``exit rc=3`` or ``setup_failed cause=job``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gce_watchdog.lib.compute import ComputeClient, ComputeRetry
from gce_watchdog.poller.ledger import Ledger
from gce_watchdog.poller.poller import Poller, PollOutcome
from gce_watchdog.poller.reader import CursorStore
from gce_watchdog.poller.verdict import Policy, VerdictKind
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.synth import Writer

P, Z = "test-project", "us-central1-a"
INTERVAL = 30.0
LINGER = 75.0  # actions.linger's default (eol-agent): 2 intervals + a read's latency
WINDOWS = (2.0, 5.0, 15.0, 60.0)
T0 = 1_800_000_000.0
ENDINGS: dict[str, tuple[str, dict[str, object], str]] = {
    "exit0": ("exit", {"rc": "0"}, "done"),
    "exit3": ("exit", {"rc": "3"}, "failed"),
    "setup_job": (
        "setup_failed",
        {"step": "deps", "reason": "pip", "rc": "1", "cause": "job"},
        "setup_failed",
    ),
}


def act(fn: Callable[[str], object], name: str) -> Callable[[], None]:
    def run() -> None:
        fn(name)

    return run


@dataclass
class VM:
    name: str
    kind: str  # an ENDINGS key, or wedge_silent, wedge_ladder, preempt
    at: float  # when it ends (simulated seconds since T0)
    linger: float
    preempted_line: bool = False
    outcomes: list[PollOutcome] = field(default_factory=list)


@dataclass
class Sim:
    api: FakeComputeAPI
    poller: Poller
    now: list[float]
    window: float  # the stop window: RUNNING between the power-off's start and STOPPING

    def run(self, vms: list[VM], until: float) -> None:
        """VM events and poll ticks in time order on the one clock."""
        events: list[tuple[float, int, Callable[[], None]]] = []
        writers: dict[str, Writer] = {}
        for i, vm in enumerate(vms):
            self.api.add_instance(vm.name, project=P, zone=Z, spot=vm.kind == "preempt")
            w = Writer(boot=f"{i:08x}", ts_ms=int(T0 * 1000))
            writers[vm.name] = w
            events += self._script(vm, w)
        ticks = [(T0 + k * INTERVAL, 1, lambda: None) for k in range(int(until / INTERVAL) + 1)]
        done: set[str] = set()
        for t, order, fn in sorted(events + ticks, key=lambda e: (e[0], e[1])):
            self.now[0] = t
            fn()
            if order != 1:
                continue
            for vm in vms:
                if vm.name in done:
                    continue
                out = self.poller.poll(vm.name)
                vm.outcomes.append(out)
                if out.reaped:  # deleted: nothing more to see
                    done.add(vm.name)

    def _script(self, vm: VM, w: Writer) -> list[tuple[float, int, Callable[[], None]]]:
        api, name = self.api, vm.name

        def line(
            t: float, ev: str, fields: dict[str, object]
        ) -> tuple[float, int, Callable[[], None]]:
            def write() -> None:
                w.ts_ms = int(t * 1000)
                api.append_serial(name, w.line(ev, fields))

            return (t, 0, write)

        out = [line(T0 + 1, "start", {"v": "1"}), line(T0 + 2, "phase", {"ph": "workload"})]
        end = T0 + vm.at
        if vm.kind in ENDINGS:
            ev, fields, reason = ENDINGS[vm.kind]
            out += [line(end, ev, fields), line(end, "end", {"reason": reason})]
            out.append((end + vm.linger + self.window, 0, act(api.guest_shutdown, name)))
        elif vm.kind == "wedge_ladder":  # the agent's ladder reached 10/10
            out.append(line(end, "shutdown", {"reason": "ladder", "rung": "10/10"}))
            out.append((end + vm.linger + self.window, 0, act(api.guest_shutdown, name)))
        elif vm.kind == "preempt":
            if vm.preempted_line:  # the agent saw the notice (not always: 30 s to do it)
                out.append(line(end, "preempted", {"kind": "spot"}))
            out.append((end + self.window, 0, act(api.preempt, name)))
        # wedge_silent: nothing more, ever; the VM stays RUNNING
        return out


@pytest.fixture
def sim_factory(tmp_path: Path) -> Iterator[Callable[[float], Sim]]:
    from google.oauth2.credentials import Credentials

    stack: list[tuple[FakeComputeAPI, ComputeClient, Ledger]] = []

    def make(window: float) -> Sim:
        now = [T0]
        api = FakeComputeAPI(
            token="tok", clock=lambda: now[0], stop_delay_s=1.0, serial_needs_running=True
        ).start()
        creds = Credentials("tok")  # type: ignore[no-untyped-call]
        retry = ComputeRetry(attempts=2, sleep=lambda s: None)  # a 503 while STOPPING: no wait
        client = ComputeClient.create(creds, api_base=api.base_url, retry=retry)
        ledger = Ledger(tmp_path / f"ledger-{window:g}-{len(stack)}.sqlite", "sim")
        ledger.__enter__()
        stack.append((api, client, ledger))
        poller = Poller(
            client, CursorStore(None), P, Z, ledger, Policy(), reap=True, clock=lambda: now[0]
        )
        return Sim(api, poller, now, window)

    yield make
    for api, client, ledger in stack:
        ledger.__exit__(None, None, None)
        client.close()
        api.close()


def completions(rng: random.Random, n: int, linger: float) -> list[VM]:
    kinds = list(ENDINGS)
    at = [60 + rng.uniform(0, INTERVAL) + INTERVAL * rng.randrange(3) for _ in range(n)]
    return [VM(f"vm-{i:03d}", kinds[i % len(kinds)], at[i], linger) for i in range(n)]


def failovers(vm: VM) -> int:
    return sum(1 for o in vm.outcomes if o.action == "failover")


@pytest.mark.parametrize("window", WINDOWS)
def test_completions_at_random_phases_never_fail_over_and_are_reaped(
    sim_factory: Callable[[float], Sim], window: float
) -> None:
    rng = random.Random(f"completions-{window}")
    vms = completions(rng, 51, LINGER)  # 4 windows x 51 = 204 completions
    sim = sim_factory(window)
    sim.run(vms, until=60 + 3 * INTERVAL + LINGER + window + 4 * INTERVAL)
    for vm in vms:
        assert failovers(vm) == 0, (vm, [o.verdict for o in vm.outcomes])
        last = vm.outcomes[-1]
        assert last.verdict is not None and not any(o.error for o in vm.outcomes)
        want = {
            "exit0": VerdictKind.WORKLOAD_OK,
            "exit3": VerdictKind.WORKLOAD_FAILED,
            "setup_job": VerdictKind.SETUP_FAILED,
        }[vm.kind]
        assert last.verdict.kind is want, (vm.name, vm.at, last.verdict.reason)
        assert last.reaped, (vm.name, last)  # the VM of an ended job is deleted
        assert sim.api.instance(vm.name).deleted
    # one requestId per (instance id, boot): every delete of one VM carries the same id
    ids: dict[str, set[str]] = {}
    for c in sim.api.calls_to("delete"):
        ids.setdefault(c.path.rsplit("/", 1)[-1], set()).add(c.query["requestId"])
    assert sorted(ids) == sorted(vm.name for vm in vms)
    assert all(len(v) == 1 for v in ids.values())


@pytest.mark.parametrize("window", WINDOWS)
def test_without_the_linger_a_missed_ending_is_an_alarm_never_a_failover(
    sim_factory: Callable[[float], Sim], window: float
) -> None:
    """The old start-up script's ending (power-off right after the line): most final lines land
    after the last read. The poller must not guess: ``ended_unread``, an alarm, no failover."""
    rng = random.Random(f"nolinger-{window}")
    vms = completions(rng, 30, 0.0)
    sim = sim_factory(window)
    sim.run(vms, until=60 + 3 * INTERVAL + window + 4 * INTERVAL)
    unread = 0
    for vm in vms:
        assert failovers(vm) == 0
        last = vm.outcomes[-1]
        assert last.verdict is not None
        if last.verdict.kind is VerdictKind.ENDED_UNREAD:
            unread += 1
            assert last.verdict.alarm and "guestTerminate" in last.verdict.reason
            assert not sim.api.instance(vm.name).deleted  # never reaped on a guess
    # the faithful fake really hides lines written after the last read: about 1 - W/30 of
    # them (measured 58, 49, 31, 0 of 60 for W = 2, 5, 15, 60 s); a window longer than the
    # interval always gives the poller one read
    if window < INTERVAL:
        assert unread > 0
    else:
        assert unread == 0


@pytest.mark.parametrize("window", WINDOWS)
def test_wedges_and_preemptions_each_fail_over_exactly_once(
    sim_factory: Callable[[float], Sim], window: float
) -> None:
    rng = random.Random(f"wedges-{window}")
    vms = []
    for i in range(12):
        at = 60 + rng.uniform(0, INTERVAL)
        kind = ("wedge_silent", "wedge_ladder", "preempt")[i % 3]
        vms.append(VM(f"vm-{i:03d}", kind, at, LINGER, preempted_line=rng.random() < 0.5))
    sim = sim_factory(window)
    sim.run(vms, until=60 + INTERVAL + 900 + 3 * INTERVAL)  # past the drain timeout
    want = {
        "wedge_silent": VerdictKind.SUSPECTED_WEDGE,
        "wedge_ladder": VerdictKind.SELF_SHUTDOWN,
        "preempt": VerdictKind.PREEMPTED,
    }
    for vm in vms:
        assert failovers(vm) == 1, (vm.name, vm.kind, [o.verdict for o in vm.outcomes])
        decided = next(o for o in vm.outcomes if o.action == "failover")
        assert decided.verdict is not None and decided.verdict.kind is want[vm.kind]
        assert sim.api.instance(vm.name).deleted  # --reap after a failover
