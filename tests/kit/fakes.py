"""Hand-written fakes for the agent's edges (no mock.patch anywhere)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from gce_watchdog.daemon.ladder import LadderState, ProbeVerdict
from gce_watchdog.daemon.service import ChainMark, LadderStore
from gce_watchdog.daemon.tick import ProbeResult, TickResult


class FakeClock:
    """Monotonic and wall time that only move when the code under test waits (a
    ``gce_watchdog.lib.clock.Clock``)."""

    def __init__(self, start: float = 1000.0, wall0: float = 1_796_000_000.0) -> None:
        self.t = start
        self.wall0 = wall0 - start
        self.waits: list[float] = []
        self.on_advance: list[Callable[[float], None]] = []

    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.t + self.wall0

    def advance(self, seconds: float) -> None:
        self.t += seconds
        for cb in self.on_advance:
            cb(self.t)

    def sleep(self, seconds: float) -> None:
        self.advance(max(seconds, 0.0))

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        self.waits.append(seconds)
        if stop.is_set():
            return True
        self.advance(max(seconds, 0.0))
        return stop.is_set()


@dataclass
class FakeNotifier:
    watchdog_interval: float = 0.0
    messages: list[tuple[str, ...]] = field(default_factory=list)

    def notify(self, *assignments: str) -> bool:
        self.messages.append(assignments)
        return True


def result(md: str, eg: str, reason: str = "", dns: str = "ok") -> TickResult:
    """A tick result from verdict names ("ok", "fail", "unknown")."""

    def pr(v: str) -> ProbeResult:
        verdict = ProbeVerdict(v)
        fallback = "timeout" if v == "fail" else "x"
        why = "ok" if verdict is ProbeVerdict.OK else (reason or fallback)
        return ProbeResult(verdict, why, 5)

    return TickResult(pr(md), pr(eg), dns)


class ScriptedProber:
    """Returns scripted tick results in order (the last one repeats); can advance a clock to
    model probe latency."""

    def __init__(
        self,
        script: list[TickResult],
        clock: FakeClock | None = None,
        latency: float = 0.0,
        obey_budget: bool = False,
    ) -> None:
        self.script = list(script)
        self.obey_budget = obey_budget
        self.calls = 0
        self.clock = clock
        self.latency = latency
        self.budgets: list[float] = []  # the budget each call was given

    def __call__(self, budget: float = math.inf) -> TickResult:
        """The next scripted result; the clock advances by the latency (with ``obey_budget``, by
        the tick's budget when that is shorter: a real probe gives up at its budget)."""
        r = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        self.budgets.append(budget)
        if self.clock is not None and self.latency:
            self.clock.advance(min(self.latency, budget) if self.obey_budget else self.latency)
        return r


class MemoryLadderStore(LadderStore):
    """The daemon's ``LadderStore`` (daemon/service.py) kept in memory: ``save`` then
    ``load_full`` give back what was saved, for a boot, with no file and no fsync. For tests
    about the loop and the chain, not about the state file (those use the real store): a real
    save is an atomic write with two fsyncs, which a loaded disk makes cost tens of ms each."""

    def __init__(self, boot_id: str = "b1") -> None:
        super().__init__("/nonexistent/ladder.json", boot_id)
        self.saved: tuple[LadderState, ChainMark | None] | None = None
        self.saves = 0

    def load_full(self, threshold: int) -> tuple[LadderState, ChainMark | None]:
        if self.saved is None:
            return LadderState(), None
        st, mark = self.saved  # as the real load: clamped to the threshold, a decision at it
        return LadderState(
            threshold if st.fired else min(st.rung, threshold), st.fired, st.warned
        ), mark

    def save(self, st: LadderState, mark: ChainMark | None = None) -> bool:
        self.saved, self.saves = (st, mark), self.saves + 1
        return True
