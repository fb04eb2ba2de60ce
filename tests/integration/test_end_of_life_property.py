"""Issue 24, done-when: a finished job is never failed over; a wedge or a preemption always is.

The real poller (reader, verdict, ledger, reaper) against the faithful fake Compute API
(``serial_needs_running=True``: serial output only while RUNNING; a guest power-off or a
preemption keeps the VM STOPPING for a second, then TERMINATED; each recorded as a zone
operation), and on the VM side the REAL agent chain (:meth:`ActionChain.end_of_life`, what
``gce-watchdog end`` runs; :meth:`ActionChain.execute` for the ladder), all on one simulated
clock: nothing sleeps. Each chain runs in its own thread, a cooperative actor: its clock's
``sleep`` hands control back to the event loop, which wakes it at the simulated time (the
poller polls only while every chain is parked). Its edges: lines go to the fake's serial port
(signed like the agent's), ``systemctl poweroff`` schedules the guest's power-off, the API step
(``agent.action`` stop or delete) calls the fake through the real ``GoogleComputeApi``.

The **stop window** W is how long the guest stays RUNNING (readable) between the start of its
power-off and GCE's STOPPING: the guest's own shutdown (systemd stopping units). A preemption
gives the guest W too (GCE's notice; the agent may or may not write its ``preempted`` line).
A chain whose VM is no longer RUNNING is never woken again (the guest is gone).

Cases are drawn from a seeded generator (deterministic, so a failure reproduces): completions
at random phases of the 30 s poll grid with stop windows of 2, 5, 15 and 60 s, ending in
``exit rc=0``, ``exit rc=3`` or ``setup_failed cause=job``, with ``agent.action`` poweroff,
stop or delete, and the chain's default linger (``actions.linger``).
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from gce_watchdog.daemon.actions import ActionChain, GoogleComputeApi, RunResult
from gce_watchdog.daemon.metawatch import InstanceInfo
from gce_watchdog.lib.compute import ComputeClient, ComputeRetry
from gce_watchdog.poller.ledgers import Ledger, open_ledger
from gce_watchdog.poller.poller import Poller, PollOutcome
from gce_watchdog.poller.reader import CursorStore
from gce_watchdog.poller.verdict import Policy, VerdictKind
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.synth import Writer
from gce_watchdog.vm import config as cfgmod

pytestmark = pytest.mark.process

P, Z = "test-project", "us-central1-a"
INTERVAL = 30.0
LINGER = float(cfgmod.ActionsSection().linger)  # the chain's own default: 2 intervals + a read
WINDOWS = (2.0, 5.0, 15.0, 60.0)
ACTIONS = ("poweroff", "stop", "delete")
T0 = 1_800_000_000.0
# How long the event loop waits (real time) for a woken chain to park again, and a chain for
# its API thread's answer from the local fake: bounded, an event, never a sleep.
REAL_BOUND_S = 30.0
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


class PoweredOff(BaseException):
    """Raised in a parked chain whose VM is gone: its thread ends (the chain catches only
    ``Exception``: a power-off is not an error of a step)."""


@dataclass
class VM:
    name: str
    kind: str  # an ENDINGS key, or wedge_silent, wedge_ladder, preempt
    at: float  # when it ends (simulated seconds since T0)
    linger: float | None = None  # None: the chain's default; 0: the old script (no agent)
    action: str = "poweroff"  # agent.action
    preempted_line: bool = False
    outcomes: list[PollOutcome] = field(default_factory=list)
    chain: ActionChain | None = None


class World:
    """One simulated clock; events and cooperative actors (chain threads) in time order."""

    def __init__(self, now: list[float]) -> None:
        self.now = now
        self._q: list[tuple[float, int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._back = threading.Semaphore(0)
        self.errors: list[BaseException] = []

    def at(self, t: float, fn: Callable[[], None], order: int = 0) -> None:
        heapq.heappush(self._q, (t, order, next(self._seq), fn))

    def run(self, until: float) -> None:
        while self._q and self._q[0][0] <= until:
            t, _, _, fn = heapq.heappop(self._q)
            self.now[0] = max(self.now[0], t)
            fn()

    # -- actors ----------------------------------------------------------------------------
    def spawn(self, t: float, body: Callable[[], None]) -> None:
        """Start ``body`` in a thread at ``t``; it runs until it parks (a clock sleep) or ends."""

        def main() -> None:
            try:
                body()
            except PoweredOff:
                pass
            except BaseException as e:  # surfaced by the test, never lost
                self.errors.append(e)
            finally:
                self._back.release()

        def start() -> None:
            threading.Thread(target=main, name="chain", daemon=True).start()
            self._wait_parked()

        self.at(t, start)

    def park(self, seconds: float, alive: Callable[[], bool]) -> None:
        """Called on a chain's thread: sleep ``seconds`` of simulated time."""
        go = threading.Semaphore(0)
        dead = [False]

        def wake() -> None:
            dead[0] = not alive()
            go.release()
            self._wait_parked()

        self.at(self.now[0] + max(0.0, seconds), wake)
        self._back.release()
        go.acquire()
        if dead[0]:
            raise PoweredOff

    def _wait_parked(self) -> None:
        if not self._back.acquire(timeout=REAL_BOUND_S):
            raise AssertionError("a chain neither parked nor ended")


@dataclass
class SimClock:
    """The chain's clock on the world's time (``lib.clock.Clock``)."""

    world: World
    alive: Callable[[], bool]

    def monotonic(self) -> float:
        return self.world.now[0]

    def wall(self) -> float:  # lib.clock.Clock; the chain reads no wall time
        return self.monotonic()

    def sleep(self, seconds: float) -> None:
        if threading.current_thread().name != "chain":
            raise AssertionError("only a chain's own thread sleeps in this simulation")
        self.world.park(seconds, self.alive)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        # the API step's thread calls the local fake: its answer is an event, bounded
        if event.wait(REAL_BOUND_S):
            return True
        self.sleep(seconds)
        return event.is_set()


@dataclass
class SerialEmitter:
    """The chain's emitter edge: signed lines (as the agent's) onto the fake's serial port."""

    api: FakeComputeAPI
    name: str
    writer: Writer
    now: list[float]

    def emit(
        self,
        event: str,
        fields: Mapping[str, object] | Iterable[tuple[str, object]] = (),
        text: str = "",
        sync: bool = False,
    ) -> None:
        self.writer.ts_ms = int(self.now[0] * 1000)
        self.api.append_serial(self.name, self.writer.line(event, fields, text))


@dataclass
class Sim:
    api: FakeComputeAPI
    poller: Poller
    client: ComputeClient
    now: list[float]
    window: float  # the stop window: RUNNING between the power-off's start and STOPPING

    def run(self, vms: list[VM], until: float) -> None:
        """VM events, chains and poll ticks in time order on the one clock."""
        world = World(self.now)
        for i, vm in enumerate(vms):
            self.api.add_instance(
                vm.name,
                project=P,
                zone=Z,
                spot=vm.kind == "preempt" or vm.action == "delete",
                termination_action="DELETE" if vm.action == "delete" else "STOP",
            )
            w = Writer(boot=f"{i:08x}", ts_ms=int(T0 * 1000))
            self._script(world, vm, w)
        done: set[str] = set()

        def tick() -> None:
            for vm in vms:
                if vm.name in done:
                    continue
                out = self.poller.poll(vm.name)
                vm.outcomes.append(out)
                if out.reaped:  # deleted: nothing more to see
                    done.add(vm.name)

        for k in range(int(until / INTERVAL) + 1):
            world.at(T0 + k * INTERVAL, tick, order=1)
        world.run(T0 + until)
        assert not world.errors, world.errors

    def _chain(self, world: World, vm: VM, w: Writer) -> ActionChain:
        api, name = self.api, vm.name
        inst = api.instance(name)

        def alive() -> bool:
            i = api.instance(name)
            return not i.deleted and i.status == "RUNNING"

        def runner(argv: Sequence[str], timeout: float) -> RunResult:
            # systemctl poweroff (or --force): the guest's shutdown takes the stop window
            def off() -> None:
                if alive():  # not already stopped or deleted by the API step
                    api.guest_shutdown(name)

            world.at(self.now[0] + self.window, off)
            return RunResult(0)

        info = InstanceInfo(P, Z, name, inst.id)
        chain = ActionChain(
            cfgmod.ActionsSection(),
            vm.action,
            "/nonexistent",
            cast(Any, SerialEmitter(api, name, w, self.now)),
            keepalive=lambda: None,
            runner=runner,
            clock=SimClock(world, alive),
            api=GoogleComputeApi(api.base_url, 10.0, client=self.client),
            instance=lambda: info,
            jitter=lambda: 0.5,
        )
        vm.chain = chain
        return chain

    def _script(self, world: World, vm: VM, w: Writer) -> None:
        api, name = self.api, vm.name

        def line(t: float, ev: str, fields: dict[str, object]) -> None:
            def write() -> None:
                w.ts_ms = int(t * 1000)
                api.append_serial(name, w.line(ev, fields))

            world.at(t, write)

        line(T0 + 1, "start", {"v": "1"})
        line(T0 + 2, "phase", {"ph": "workload"})
        end = T0 + vm.at
        if vm.kind in ENDINGS:
            ev, fields, reason = ENDINGS[vm.kind]
            line(end, ev, fields)  # the job's terminal line, drained by its writer
            if vm.linger == 0.0:  # the old start-up script: power-off right after the line
                world.at(end + self.window, act(api.guest_shutdown, name))
            else:  # gce-watchdog end: the agent's one end-of-life chain
                chain = self._chain(world, vm, w)
                world.spawn(end, lambda: chain.end_of_life(reason, linger=vm.linger))
        elif vm.kind == "wedge_ladder":  # the agent's ladder reached 10/10: its real chain
            chain = self._chain(world, vm, w)
            world.spawn(end, lambda: chain.execute("ladder", 10, 10))
        elif vm.kind == "preempt":
            if vm.preempted_line:  # the agent saw the notice (not always: 30 s to do it)
                line(end, "preempted", {"kind": "spot"})
            world.at(end + self.window, act(api.preempt, name))
        # wedge_silent: nothing more, ever; the VM stays RUNNING


@pytest.fixture
def sim_factory(tmp_path: Path) -> Iterator[Callable[[float], Sim]]:
    from google.oauth2.credentials import Credentials

    stack: list[tuple[FakeComputeAPI, ComputeClient, ComputeClient, Ledger]] = []

    def make(window: float) -> Sim:
        now = [T0]
        api = FakeComputeAPI(
            token="tok", clock=lambda: now[0], stop_delay_s=1.0, serial_needs_running=True
        ).start()
        creds = Credentials("tok")  # type: ignore[no-untyped-call]
        retry = ComputeRetry(attempts=2, sleep=lambda s: None)  # a 503 while STOPPING: no wait
        client = ComputeClient.create(creds, api_base=api.base_url, retry=retry)
        vm_client = ComputeClient.create(creds, api_base=api.base_url, retry=retry)
        ledger = open_ledger(tmp_path / f"ledger-{window:g}-{len(stack)}.sqlite", "sim")
        ledger.__enter__()
        stack.append((api, client, vm_client, ledger))
        poller = Poller(
            client, CursorStore(None), P, Z, ledger, Policy(), reap=True, clock=lambda: now[0]
        )
        return Sim(api, poller, vm_client, now, window)

    yield make
    for api, client, vm_client, ledger in stack:
        ledger.__exit__(None, None, None)
        client.close()
        vm_client.close()
        api.close()


def completions(rng: random.Random, n: int, linger: float | None) -> list[VM]:
    kinds = list(ENDINGS)
    at = [60 + rng.uniform(0, INTERVAL) + INTERVAL * rng.randrange(3) for _ in range(n)]
    return [
        VM(f"vm-{i:03d}", kinds[i % 3], at[i], linger, action=rng.choice(ACTIONS)) for i in range(n)
    ]


def failovers(vm: VM) -> int:
    return sum(1 for o in vm.outcomes if o.action == "failover")


@pytest.mark.parametrize("window", WINDOWS)
def test_completions_at_random_phases_never_fail_over_and_are_reaped(
    sim_factory: Callable[[float], Sim], window: float
) -> None:
    rng = random.Random(f"completions-{window}")
    vms = completions(rng, 51, None)  # 4 windows x 51 = 204 completions, the default linger
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
        if vm.action != "delete":  # the VM of an ended job is deleted (by the poller)
            assert last.reaped, (vm.name, last)
        assert sim.api.instance(vm.name).deleted
        assert vm.chain is not None and vm.chain.last_result is not None
        assert vm.chain.last_result.status("linger") == "ok"  # the real chain lingered
    # one requestId per (instance id, boot): every delete of one VM carries the same id
    ids: dict[str, set[str]] = {}
    for c in sim.api.calls_to("delete"):
        ids.setdefault(c.path.rsplit("/", 1)[-1], set()).add(c.query["requestId"])
    assert sorted(ids) == sorted(vm.name for vm in vms)
    for vm in vms:  # the agent's own delete carries its own id (one for all its retries)
        assert 1 <= len(ids[vm.name]) <= (2 if vm.action == "delete" else 1), vm.name


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
        vms.append(VM(f"vm-{i:03d}", kind, at, preempted_line=rng.random() < 0.5))
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
