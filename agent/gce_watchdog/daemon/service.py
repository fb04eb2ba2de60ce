"""The agent daemon: ticks on the monotonic clock, feeds the ladder, performs its actions.

The real edges are wired in :mod:`gce_watchdog.daemon.app` (the composition root);
:class:`Agent` only sees the small interfaces in :class:`Deps`, so tests swap every edge
for a hand-written fake and drive it with a fake clock.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gce_watchdog import __version__
from gce_watchdog.daemon import ladder
from gce_watchdog.daemon.actions import ChainStopped, step_after
from gce_watchdog.daemon.ladder import LadderState, Observation
from gce_watchdog.daemon.metawatch import load_instance_cache
from gce_watchdog.daemon.tick import TickReport, TickResult, tick_lines
from gce_watchdog.lib.cli import EX_OK
from gce_watchdog.lib.clock import Clock
from gce_watchdog.lib.files import read_json, write_json
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter
from gce_watchdog.wire import vocab


class Notify(Protocol):
    watchdog_interval: float

    def notify(self, *assignments: str) -> bool: ...


class Service(Protocol):
    """Something that runs beside the ladder (memory monitor, metadata watcher)."""

    def start(self) -> Any: ...

    def stop(self, timeout: float = ...) -> Any: ...


# A chain that ran through with the VM still up is tried again (from the power-off) this often.
CHAIN_RETRY_S = 60.0
# How long the `stop` line waits for the `signal` line's thread (a sync line waits for the
# port's drain, serial.sync_timeout, 5 s by default; systemd's stop timeout is 20 s).
SIGNAL_LINE_WAIT_S = 2.0
# How long the loop's end waits for dry-run rehearsals still running beside it (their linger
# ends at once on the stop event; the dry-run steps after it are lines only).
REHEARSAL_JOIN_S = 5.0
# How long the loop waits, at most, for a dry-run rehearsal it just started to write its decision
# line (`dry_run_shutdown`) before it goes on (issue 38: beside the loop, the line came 30-40 ms
# after the deciding tick on a loaded machine). A sync line waits for the port's drain; a console
# that hangs must not stop the ladder for long.
REHEARSAL_ANNOUNCE_S = 1.0


@dataclass(frozen=True)
class ChainMark:
    """How far the shutdown chain of this boot got: persisted before each step.

    ``step``: the step being taken (``shutdown``, ``linger``, ``delete``, ``stop``, ``poweroff``,
    ``force``, ``kernel``), or ``end`` when the chain ran through and the VM is still up.
    ``since``: wall time of the decision (a resumed linger only waits what is left of it).
    """

    step: str
    since: float


def _finite(v: object) -> float | None:
    if isinstance(v, int | float) and not isinstance(v, bool):
        try:
            f = float(v)
        except OverflowError:
            return None
        return f if math.isfinite(f) else None
    return None


class LadderStore:
    """The rung persisted per boot, so a restarted agent continues its ladder (and its chain)."""

    def __init__(self, path: str | Path, boot_id: str) -> None:
        self.path = Path(path)
        self.boot_id = boot_id

    def load(self, threshold: int) -> LadderState:
        return self.load_full(threshold)[0]

    def load_full(self, threshold: int) -> tuple[LadderState, ChainMark | None]:
        """The state and the chain's mark. Any content at all (garbage, wrong types) gives a
        usable answer, never an exception: a file nobody can parse starts the ladder at 0."""
        raw = read_json(self.path)
        if not isinstance(raw, dict) or raw.get("boot_id") != self.boot_id:
            return LadderState(), None
        rung_f = _finite(raw.get("rung", 0))
        if rung_f is None or rung_f != int(rung_f):
            return LadderState(), None
        chain = raw.get("chain")
        mark: ChainMark | None = None
        if isinstance(chain, dict) and isinstance(chain.get("step"), str):
            mark = ChainMark(str(chain["step"])[:16], _finite(chain.get("since")) or 0.0)
        fired = raw.get("fired") is True or mark is not None
        if fired and mark is None:  # decided, step unknown (an older file): from the start
            mark = ChainMark("shutdown", 0.0)
        # A lowered threshold since the last run: clamp, the ladder refuses rungs above it.
        rung = max(0, min(int(rung_f), threshold))
        if fired:
            rung = threshold
        return LadderState(rung=rung, fired=fired, warned=raw.get("warned") is True), mark

    def save(self, st: LadderState, mark: ChainMark | None = None) -> bool:
        chain = None if mark is None else {"step": mark.step, "since": mark.since}
        try:
            write_json(
                self.path,
                {
                    "boot_id": self.boot_id,
                    "rung": st.rung,
                    "fired": st.fired,
                    "warned": st.warned,
                    "chain": chain,
                },
            )
            return True
        except (OSError, ValueError):
            return False  # best effort: the ladder goes on in memory


class ShutdownHook(Protocol):
    """The action chain (``ActionChain.execute``): see there for the keyword arguments."""

    def __call__(
        self,
        reason: str,
        rung: int,
        threshold: int,
        *,
        resume_at: str | None = None,
        linger_left: float | None = None,
        progress: Callable[[str], object] | None = None,
    ) -> None: ...


class EndHook(Protocol):
    """The job's end of life (``endoflife.EndWatch``): ``poll`` runs its chain when one is due."""

    running: bool

    def poll(self) -> bool: ...

    @property
    def step(self) -> str:
        """The step its running chain is at ("-": none)."""
        ...

    @property
    def lingers(self) -> bool:
        """Whether its chain lingers (a stop before the linger's end stops it)."""
        ...


@dataclass
class Deps:
    emitter: Emitter
    # One tick's probes, given the tick's budget in seconds (at most agent.probe_timeout)
    prober: Callable[[float], TickResult]
    clock: Clock
    notifier: Notify
    store: LadderStore
    on_shutdown: ShutdownHook
    armed: Callable[[], tuple[bool, str]] = lambda: (True, "")
    uptime: Callable[[], float] = lambda: math.inf
    phase: Callable[[], str] = lambda: "unknown"
    instance_id: Callable[[], str] = lambda: "-"
    instance_name: Callable[[], str] = lambda: "-"
    tick_hooks: list[Callable[[TickReport], None]] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)
    end_of_life: EndHook | None = None


# A late tick's probes keep at least this share of agent.probe_timeout: a stalled machine must not
# turn its next probes into instant failures (a false rung), docs/agent.md "Schedule".
MIN_BUDGET_SHARE = 0.5


def probe_budget(slot: float, start: float, timeout: float) -> float:
    """The probe budget of a tick that starts at ``start`` in the slot starting at ``slot``: the
    probes end by ``slot + timeout``, but never get less than MIN_BUDGET_SHARE of the timeout.
    Pure."""
    late = start - slot
    if late <= 0:
        return timeout
    return max(timeout - late, timeout * MIN_BUDGET_SHARE)


class Agent:
    """The tick loop. ``agent``: its own section; ``linger``: ``actions.linger`` (what is left
    of it when a restart resumes the chain there); ``cfg_digest``: the config's digest, for the
    ``start`` line."""

    def __init__(
        self, agent: cfgmod.AgentSection, deps: Deps, *, linger: float, cfg_digest: str
    ) -> None:
        self.settings = agent
        self.linger = linger
        self.cfg_digest = cfg_digest
        self.d = deps
        self.threshold = agent.threshold
        self.state = LadderState()
        self.ticks = 0
        self.healthy_streak = 0
        self.overruns = 0
        self._budget = float(agent.probe_timeout)  # the next tick's probe budget (run() sets it)
        self.tick_errors = 0
        self.stalls = 0  # gaps of more than two intervals between tick starts
        self.skipped = 0  # slots that got no tick (within those gaps)
        self.mark: ChainMark | None = None  # the shutdown chain's progress (None: not decided)
        self.chain_running = False
        self._chain_ended: float | None = None  # monotonic time the last chain returned
        self.notes: list[tuple[str, str]] = []  # (what, text): `warn` lines after `start`
        # Dry runs' chains, each on its own thread beside the ticks (rehearse): by number, the
        # step each is at (the latest one is `rehearsing`)
        self._rehearsals: list[threading.Thread] = []
        self._rehearsal_steps: dict[int, str] = {}
        self._rehearsal_n = 0
        self._signal_line: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg: cfgmod.Config, deps: Deps) -> Agent:
        """An agent for ``cfg`` (the convenience for callers that hold a whole config)."""
        return cls(cfg.agent, deps, linger=cfg.actions.linger, cfg_digest=cfgmod.digest(cfg))

    # -- one tick -------------------------------------------------------------------------------
    def tick_once(self) -> TickReport:
        d = self.d
        self.end_of_life()
        t0 = d.clock.monotonic()
        res = d.prober(self._budget)
        armed, why = d.armed()
        # A dry run decides like an armed agent but latches nothing: to the ladder it is
        # "disarmed" (one decision per outage, reset by a recovery), and the chain is rehearsed.
        rehearsing = self.settings.action == "dry-run" and armed
        actions = self._step(res, armed and self.settings.action != "dry-run")
        decided = any(isinstance(a, ladder.Shutdown) for a in actions)
        said = tick_lines(
            res,
            self.state,
            actions,
            self.threshold,
            streak=self.healthy_streak,
            heartbeat_every=self.settings.heartbeat_every,
            ticks=self.ticks,
            dropped=d.emitter.sink.dropped,
            why=why,
            rehearsing=rehearsing,
            phase=d.phase,
        )
        self.healthy_streak = said.streak
        for line in said.lines:
            d.emitter.emit(line.event, line.fields, line.text, sync=line.sync)
        d.notifier.notify("WATCHDOG=1", f"STATUS={said.status}")
        if rehearsing and any(isinstance(a, ladder.WouldShutdown) for a in actions):
            self.rehearse()
        for line in said.would:
            d.emitter.emit(line.event, line.fields, line.text, sync=line.sync)
        resume = None if decided else self.chain_due()
        if decided or resume is not None:
            self.run_chain(resume)
        return self._report(res, actions, d.clock.monotonic() - t0, armed)

    def _step(self, res: TickResult, armed: bool) -> tuple[ladder.Action, ...]:
        """One ladder step on this tick's verdicts; a decision is persisted before the chain
        runs, so a restart resumes it and never forgets it."""
        d = self.d
        obs = Observation(
            metadata=res.metadata.verdict,
            egress=res.egress.verdict,
            in_grace=d.uptime() < self.settings.boot_grace,
            armed=armed,
        )
        prev = self.state
        self.state, actions = ladder.step(prev, obs, self.threshold)
        self.ticks += 1
        decided = any(isinstance(a, ladder.Shutdown) for a in actions)
        if decided:
            self.mark = ChainMark("shutdown", d.clock.wall())
        if self.state != prev or decided:
            d.store.save(self.state, self.mark)
        return actions

    def _report(
        self, res: TickResult, actions: tuple[ladder.Action, ...], duration: float, armed: bool
    ) -> TickReport:
        """The tick's report, handed to every tick hook (an exporter never breaks the ladder)."""
        report = TickReport(
            self.ticks,
            res,
            self.state,
            actions,
            duration,
            overruns=self.overruns,
            skipped=self.skipped,
            stalls=self.stalls,
            armed=armed,
        )
        for hook in self.d.tick_hooks:
            with contextlib.suppress(Exception):
                hook(report)
        return report

    # -- the job's end of life ------------------------------------------------------------------
    def end_of_life(self) -> None:
        """A job's ending handed over by ``gce-watchdog end``: its chain runs here, on the loop's
        thread (docs/actions.md). Not once the ladder decided: that chain ends the VM already."""
        hook = self.d.end_of_life
        if hook is None or self.state.fired or self.chain_running:
            return
        try:
            hook.poll()
        except ChainStopped:
            pass  # stopped in the linger: a restarted agent resumes it there
        except Exception as e:
            self._report_error("chain", e, "end-of-life chain failed")

    # -- the shutdown chain ---------------------------------------------------------------------
    def chain_due(self) -> str | None:
        """Where a decided chain must (re)start now, or None (not decided, running, or it ran
        through less than CHAIN_RETRY_S ago)."""
        if not self.state.fired or self.chain_running:
            return None
        m = self.mark
        if m is None:
            return "shutdown"
        ended = self._chain_ended
        if (
            m.step == "end"
            and ended is not None
            and self.d.clock.monotonic() - ended < CHAIN_RETRY_S
        ):
            return None
        return m.step

    @property
    def rehearsing(self) -> str | None:
        """The step the latest running rehearsal (a dry run's chain) is at; None: none runs."""
        steps = self._rehearsal_steps.copy()  # (one C call: safe against the threads' writes)
        return steps[max(steps)] if steps else None

    def rehearse(self) -> None:
        """A dry-run decision: the configured chain runs in dry-run mode (its decision line is
        ``dry_run_shutdown``, its steps ``status=dry_run``), nothing is persisted or latched, and
        the agent goes on watching: a recovery is reported and a later outage decides again.

        The rehearsal runs on a thread of its own, beside the ticks (issue 38): its linger never
        stops the ladder, so a long dry-run soak measures every tick. A later decision while one
        still lingers (a recovery and a new outage within the linger) is rehearsed too, beside
        it. The loop's end waits for them (bounded, :data:`REHEARSAL_JOIN_S`)."""
        self._rehearsals = [t for t in self._rehearsals if t.is_alive()]
        self._rehearsal_n += 1
        n = self._rehearsal_n
        self._rehearsal_steps[n] = "shutdown"  # before the thread: a stop now sees it
        announced = threading.Event()
        t = threading.Thread(
            target=self._rehearse, args=(n, announced), name=f"rehearsal-{n}", daemon=True
        )
        self._rehearsals.append(t)
        t.start()
        # The decision line right after the deciding tick: the loop yields (blocked, the GIL
        # released) until the rehearsal has written it, i.e. moved past its "shutdown" step or
        # ended; bounded (REHEARSAL_ANNOUNCE_S). Then the linger goes on beside the ticks.
        announced.wait(REHEARSAL_ANNOUNCE_S)

    def _rehearse(self, n: int, announced: threading.Event) -> None:
        def progress(step: str) -> None:
            self._rehearsal_steps[n] = step
            if step != "shutdown":  # the chain's first step (its decision line) is done
                announced.set()

        try:
            self.d.on_shutdown(
                "ladder",
                self.state.rung,
                self.threshold,
                resume_at=None,
                linger_left=None,
                progress=progress,
            )
        except ChainStopped:
            pass  # a stop during the rehearsed linger: the loop stops
        except Exception as e:
            self._report_error("chain", e, "dry-run chain failed")
        finally:
            self._rehearsal_steps.pop(n, None)
            announced.set()

    def _join_rehearsals(self, stop: threading.Event) -> None:
        """The loop ends: a rehearsal still lingering is stopped (``stop`` ends its linger) and
        waited for, bounded, so that the ``stop`` line comes after its lines."""
        alive = [t for t in self._rehearsals if t.is_alive()]
        if not alive:
            return
        stop.set()  # (ended by max_ticks: the loop is over, its rehearsals end with it)
        for t in alive:
            t.join(REHEARSAL_JOIN_S / len(alive))

    def run_chain(self, resume_at: str | None) -> None:
        """Run (or resume) the chain; whatever it raises, the next attempt goes on further."""
        d = self.d
        if self.mark is None:
            self.mark = ChainMark("shutdown", d.clock.wall())
        since = self.mark.since
        linger_left = None
        if resume_at == "linger":
            full = self.linger
            spent = d.clock.wall() - since
            linger_left = full if spent < 0 else max(0.0, full - spent)

        def progress(step: str) -> None:
            self.mark = ChainMark(step, since)
            d.store.save(self.state, self.mark)

        self.chain_running = True
        try:
            d.on_shutdown(
                "ladder",
                self.state.rung,
                self.threshold,
                resume_at=None if resume_at == "shutdown" else resume_at,
                linger_left=linger_left,
                progress=progress,
            )
            progress("end")
        except ChainStopped:
            pass  # stopped in the linger: its mark stays there, a restart resumes it
        except Exception as e:
            nxt = step_after(self.mark.step)
            self._report_error("chain", e, f"shutdown chain failed at {self.mark.step}")
            with contextlib.suppress(Exception):
                progress(nxt)
        finally:
            self.chain_running = False
            self._chain_ended = d.clock.monotonic()

    def _wait_until(self, due: float, stop: threading.Event, ping_every: float) -> None:
        """Wait for the next slot (or ``stop``), pinging systemd every ``ping_every`` s."""
        d = self.d
        while not stop.is_set():
            left = due - d.clock.monotonic()
            if left <= 0:
                break
            chunk = min(left, ping_every) if ping_every else left
            if d.clock.wait(stop, chunk):
                break
            if ping_every and due - d.clock.monotonic() > 0:
                d.notifier.notify("WATCHDOG=1")

    def _check_gap(self, gap: float, interval: float) -> None:
        """A gap of more than two intervals between two tick starts (the process was stopped,
        the machine stalled, a tick hung): a ``stall`` line with the slots that got no tick."""
        if gap <= 2 * interval:
            return
        skipped = max(0, math.floor(gap / interval) - 1)
        self.stalls += 1
        self.skipped += skipped
        with contextlib.suppress(Exception):
            self.d.emitter.emit(
                vocab.STALL,
                {"gap": f"{int(gap * 1000)}ms", "skipped": skipped},
                f"{gap:.1f}s between two ticks (interval {interval:g}s): {skipped} skipped",
            )

    def _report_error(self, where: str, e: BaseException, what: str = "") -> None:
        """An unexpected exception: an ``error`` line (best effort), and the agent goes on."""
        text = f"{what or where + ' raised'}: {type(e).__name__}: {e}"
        with contextlib.suppress(Exception):
            self.d.emitter.emit(
                vocab.ERROR, {"where": where, "err": type(e).__name__}, text
            )  # the serial line cuts it; the journal gets it whole

    def request_stop(self, stop: threading.Event, reason: str, signame: str) -> None:
        """A signal asked the agent to stop (called from the signal handler).

        Before the shutdown chain's linger ends (a rehearsed one included) the agent stops: the
        linger ends at once and nothing after it is done (a restarted agent resumes a real chain
        at the linger). Past the linger the chain goes on (it acts; systemd stopping units during
        the power-off it started sends SIGTERM too) and the loop stops after it, if the VM is
        still up then. Either way a ``signal`` line says so, written from a thread because the
        handler may have interrupted the emitter itself.
        """
        stop.reason = reason  # type: ignore[attr-defined]
        stop.set()
        hook = self.d.end_of_life
        eol = hook is not None and hook.running
        if not (self.chain_running or eol or self.rehearsing):
            return
        if eol and hook is not None:
            step, lingers = hook.step, hook.lingers
        elif self.rehearsing:
            step, lingers = self.rehearsing, self.linger > 0
        else:
            step = self.mark.step if self.mark is not None else "-"
            lingers = self.linger > 0
        if step == "linger" or (step == "shutdown" and lingers):
            what = "dry-run linger" if self.rehearsing else "linger"
            then = "" if self.rehearsing else "; a restart resumes the chain"
            text = f"{signame} during the {what}: the agent stops{then}"
        else:
            text = f"{signame} during the shutdown chain: the chain goes on"

        def say() -> None:
            with contextlib.suppress(Exception):
                self.d.emitter.emit(vocab.SIGNAL, {"sig": signame, "step": step}, text, sync=True)

        self._signal_line = threading.Thread(target=say, name="signal-line", daemon=True)
        self._signal_line.start()

    # -- the loop -------------------------------------------------------------------------------
    def run(self, stop: threading.Event, max_ticks: int | None = None) -> int:
        d = self.d
        self.state, self.mark = d.store.load_full(self.threshold)
        d.emitter.emit(
            vocab.START,
            {
                "v": __version__,
                "inst": d.instance_id(),
                "name": d.instance_name(),
                "bootid": d.store.boot_id,  # the full kernel boot id (the header carries 8 hex)
                "cfg": self.cfg_digest,
                "pid": os.getpid(),
                "rung": vocab.encode_rung(self.state.rung, self.threshold),
            },
            f"gce-watchdog {__version__} started, every {self.settings.interval:g}s",
            sync=True,
        )
        for what, text in self.notes:
            with contextlib.suppress(Exception):
                d.emitter.emit(vocab.WARN, {"what": what}, text, sync=True)  # whole to the journal
        for svc in d.services:
            with contextlib.suppress(Exception):
                svc.start()
        d.notifier.notify("READY=1", f"STATUS=starting, rung {self.state.rung}/{self.threshold}")
        resume = self.chain_due()
        if resume is not None:  # restarted in the middle of a decided chain: go on with it
            self.run_chain(resume)
        interval = self.settings.interval
        # Ping systemd at least twice per WatchdogSec even when the tick interval is longer.
        ping_every = d.notifier.watchdog_interval / 2 if d.notifier.watchdog_interval else 0.0
        timeout = float(self.settings.probe_timeout)
        t0 = d.clock.monotonic()
        k = 0
        slot = t0  # where the coming tick's slot starts on the grid
        last_start: float | None = None
        reason = "sigterm"
        try:
            while not stop.is_set():
                start = d.clock.monotonic()
                if last_start is not None:
                    self._check_gap(start - last_start, interval)
                last_start = start
                self._budget = probe_budget(slot, start, timeout)
                before = self.ticks
                try:
                    self.tick_once()
                except Exception as e:  # no state file, no edge may end the watch
                    self.tick_errors += 1
                    self.ticks = max(self.ticks, before + 1)
                    self._report_error("tick", e)
                    with contextlib.suppress(Exception):
                        d.notifier.notify("WATCHDOG=1", "STATUS=tick failed")
                if max_ticks is not None and self.ticks >= max_ticks:
                    reason = "max_ticks"
                    break
                # Next slot on the grid t0 + k*interval: a tick that was quicker than the
                # interval does not shift the schedule. A tick that overran into the next slot is
                # followed by that slot's tick at once, its probes ending by the slot's start +
                # the timeout (probe_budget): late ticks do not push the grid, so the N-th failing
                # tick ends within N x interval + one timeout of the fault even when every tick
                # overruns by a few ms (a loaded machine at timeout/interval 0.99). A tick that
                # missed a whole slot restarts the grid at once: no slot is ever skipped (an
                # overrun is counted and exported).
                k += 1
                now = d.clock.monotonic()
                due = t0 + k * interval
                slot = due
                if now >= due:
                    self.overruns += 1
                    if now >= due + interval:
                        t0, k, slot = now, 0, now
                    continue
                self._wait_until(due, stop, ping_every)
            else:
                reason = getattr(stop, "reason", "sigterm")
        finally:
            self._join_rehearsals(stop)
            for svc in d.services:
                with contextlib.suppress(Exception):
                    svc.stop(2.0)
            d.notifier.notify("STOPPING=1")
            if self._signal_line is not None:  # the `signal` line before the `stop` line
                self._signal_line.join(SIGNAL_LINE_WAIT_S)
            d.emitter.emit(
                vocab.STOP,
                {
                    "reason": reason,
                    "ticks": self.ticks,
                    "rung": vocab.encode_rung(self.state.rung, self.threshold),
                },
                "gce-watchdog stopped",
                sync=True,
            )
        return EX_OK


# -- real wiring ---------------------------------------------------------------------------------


def read_uptime(path: str = "/proc/uptime") -> float:
    try:
        return float(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return math.inf  # unknown uptime: no grace (never delay a real outage's ladder)


class AgentLock:
    """One ladder per VM: an exclusive flock in the run directory."""

    def __init__(self, run_dir: str) -> None:
        self.path = Path(run_dir) / "agent.lock"
        self.fd = -1

    def acquire(self) -> str | None:
        """None on success, else a message naming the holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a link planted at agent.lock is refused, never truncated through.
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        self.fd = os.open(self.path, flags, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            self.fd = -1
            return f"another gce-watchdog agent (pid {holder}) holds {self.path}"
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        return None


def _instance_id(state_dir: str, known: Any, attr: str = "id") -> str:
    """The instance's id (or name) for the `start` line: the watcher's, else its cache, else
    "-"."""
    info = known or load_instance_cache(state_dir)
    return str(getattr(info, attr)) if info is not None else "-"
