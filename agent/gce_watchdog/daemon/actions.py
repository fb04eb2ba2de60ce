"""The shutdown action chain, run once when the ladder reaches its threshold.

Steps, each announced on the serial console before it is taken and its outcome written after it
(every line synchronous, i.e. drained before the step starts):

1. ``shutdown`` line: reason, rung, action and the planned chain.
2. ``linger``: keep the VM up (and RUNNING, so the poller can still read serial output through the
   Compute API) for ``actions.linger``, repeating the verdict line every ``actions.repeat_every``
   and pinging the systemd watchdog. A recovery during the linger does NOT cancel the decision
   (docs/actions.md: the poller may already have failed the job over).
3. ``delete`` / ``stop`` (when ``agent.action`` says so): the Compute API on this very instance,
   with a ``requestId`` that stays the same across retries, under a hard deadline.
4. ``poweroff``: ``actions.poweroff_cmd``; still up after ``poweroff_wait``: ``force``
   (``actions.force_cmd``); still up after ``force_wait``: ``kernel`` (reboot(2), then sysrq).

``agent.action = "dry-run"`` runs the chain but replaces steps 3-4 with ``status=dry_run`` lines.

The job's own ending (``gce-watchdog end``: job done, job failed, ``setup_failed``) runs the same
chain through :meth:`ActionChain.end_of_life`: its first line is ``end`` (never ``shutdown``: the
job's terminal line, already drained, decides the verdict), then the same linger, API step and
power-off escalation (docs/actions.md, "The one end-of-life path").
Every edge (commands, clock, Compute API, kernel) is injectable; nothing here runs at import.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from gce_watchdog.daemon.metawatch import InstanceInfo, load_instance_cache
from gce_watchdog.lib.clock import Clock, RealClock
from gce_watchdog.lib.httpdate import parse_retry_after
from gce_watchdog.lib.proc import DETAIL_MAX, RunResult, run_command
from gce_watchdog.lib.retry import Backoff, retry_call
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter
from gce_watchdog.wire import vocab

if TYPE_CHECKING:
    from gce_watchdog.lib.compute import ComputeClient

# Waits between API attempts: 1 s doubling, capped at 4 s, with jitter (the step has 30 s in all).
API_WAIT_FIRST_S = 1.0
API_WAIT_MAX_S = 4.0
# How long the kernel step lets sync(2) run before powering off anyway (a wedged disk must not
# keep a wedged VM alive).
SYNC_BOUND_S = 5.0
# reboot(2) magic numbers (linux/reboot.h).
LINUX_REBOOT_MAGIC1 = 0xFEE1DEAD
LINUX_REBOOT_MAGIC2 = 672274793
LINUX_REBOOT_CMD_POWER_OFF = 0x4321FEDC


# -- edges -------------------------------------------------------------------------------------


Runner = Callable[[Sequence[str], float], RunResult]


class ChainStopped(Exception):
    """The agent was asked to stop (SIGTERM, SIGINT) before or during the linger: the chain ends
    there, nothing after the linger is done, and the chain's mark stays at ``linger`` (a
    restarted agent resumes it with what is left of it). Past the linger the chain goes on."""


class _Retryable(Exception):
    """A Compute API attempt that may be tried again (``result`` is its answer)."""

    def __init__(self, result: ApiResult) -> None:
        super().__init__(result.detail)
        self.result = result


@dataclass(frozen=True)
class ApiResult:
    """One Compute API attempt. ``retryable``: a timeout, a connection error, or an answer
    :func:`gce_watchdog.lib.compute.classify` calls transient (a rate limit, 500/502/503/504);
    ``wait_at_least``: its least wait before the next try (None: the back-off alone)."""

    ok: bool
    http: int | None = None
    detail: str = ""
    retryable: bool = False
    timeout: bool = False
    wait_at_least: float | None = None


class ComputeApi(Protocol):
    def act(self, op: str, inst: InstanceInfo, request_id: str) -> ApiResult:
        """One attempt of ``instances.<op>`` (delete or stop) on ``inst``; never raises."""
        ...


class GoogleComputeApi:
    """The chain's edge on the one Compute API client (``gce_watchdog.lib.compute``), acting as the
    VM's own service account. Every request carries an explicit ``timeout`` and
    ``max_allowed_time`` (google-auth's default is 120 s); every failure becomes a result."""

    def __init__(
        self,
        base_url: str,
        timeout: float,
        client: ComputeClient | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._client = client  # None: made on first use (google-auth is imported then)
        self.wall = wall  # wall time: a rate limit without Retry-After waits for the next minute

    def _get_client(self) -> ComputeClient:
        if self._client is None:
            # Imported with google-auth, at the first call: a daemon that never acts through the
            # API does not load the client (docs/performance.md, "The RSS target").
            from gce_watchdog.lib.compute import ComputeClient

            self._client = ComputeClient.on_vm(self.base_url, self.timeout)
        return self._client

    def url(self, op: str, inst: InstanceInfo) -> tuple[str, str]:
        path = f"{self.base_url}/projects/{inst.project}/zones/{inst.zone}/instances/{inst.name}"
        return ("DELETE", path) if op == "delete" else ("POST", path + "/stop")

    def act(self, op: str, inst: InstanceInfo, request_id: str) -> ApiResult:
        method, url = self.url(op, inst)
        try:
            r = self._get_client().send(method, url, {"requestId": request_id})
        except Exception as e:  # an edge: every failure becomes a result
            return _api_exception(e)
        if 200 <= r.status_code < 300:
            try:
                name = str(r.json().get("name", "-"))
            except ValueError:
                name = "-"
            return ApiResult(True, r.status_code, name)
        from gce_watchdog.lib.compute import classify  # loaded by the client already

        message, reason = _api_error(r)
        now = self.wall()
        after = parse_retry_after(r.headers.get("Retry-After"), now)
        c = classify(r.status_code, reason, after, now)
        return ApiResult(
            False, r.status_code, message, retryable=c.transient, wait_at_least=c.wait_at_least
        )


def _api_exception(e: Exception) -> ApiResult:
    """Map a transport/auth exception to a result (imported lazily: google-auth is heavy)."""
    import google.auth.exceptions
    import requests

    text = f"{type(e).__name__}: {e}"[:DETAIL_MAX]
    if isinstance(e, requests.exceptions.Timeout):
        return ApiResult(False, None, text, retryable=True, timeout=True)
    if isinstance(e, requests.exceptions.ConnectionError | google.auth.exceptions.TransportError):
        return ApiResult(False, None, text, retryable=True)
    if isinstance(e, google.auth.exceptions.RefreshError):
        # Token fetch failed (metadata server unreachable or refusing): worth another try.
        return ApiResult(False, None, "token: " + text, retryable=True)
    return ApiResult(False, None, text, retryable=False)


def _api_error(r: Any) -> tuple[str, str]:
    """The error's message (for the console) and its first ``errors[].reason``."""
    msg, reason = "", ""
    try:
        err = r.json().get("error", {})
        msg = str(err.get("message") or "")
        errs = err.get("errors")
        if isinstance(errs, list) and errs and isinstance(errs[0], dict):
            reason = str(errs[0].get("reason") or "")
    except (ValueError, AttributeError):
        pass
    return (msg or r.reason or f"HTTP {r.status_code}")[:DETAIL_MAX], reason


class Kernel(Protocol):
    def poweroff(self, method: str) -> str:
        """Power off now by ``method`` (reboot | sysrq). Returns only on failure: the error."""
        ...


@dataclass
class RealKernel:
    """The kernel's own power-off, for when PID 1 cannot do it any more."""

    sysrq_path: str = "/proc/sysrq-trigger"

    def poweroff(self, method: str) -> str:
        _bounded_sync(SYNC_BOUND_S)
        if method == "reboot":
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            rc = libc.reboot(ctypes.c_int(LINUX_REBOOT_CMD_POWER_OFF))
            if rc == 0:
                return "reboot(2) returned 0 but the system is still up"
            return f"reboot(2): {os.strerror(ctypes.get_errno())}"
        if method == "sysrq":
            try:
                with open(self.sysrq_path, "w") as f:
                    f.write("o")
            except OSError as e:
                return f"{self.sysrq_path}: {e.strerror or e}"
            return "sysrq o written but the system is still up"
        return f"unknown method {method!r}"


def _bounded_sync(bound: float) -> None:
    t = threading.Thread(target=os.sync, name="sync", daemon=True)
    t.start()
    t.join(bound)


# -- retry policy as a value ------------------------------------------------------------------


@dataclass(frozen=True)
class ChainRetry:
    """Stop after ``attempts`` or when the next wait would cross ``deadline``; jittered waits.
    ``attempt_time``: one attempt's own bound (``actions.api_timeout``)."""

    attempts: int
    deadline: float
    first_wait: float = API_WAIT_FIRST_S
    max_wait: float = API_WAIT_MAX_S
    attempt_time: float = 0.0

    def next_wait(
        self, attempt: int, jitter: float, elapsed: float, at_least: float | None = None
    ) -> float | None:
        """The wait before attempt ``attempt`` (2, 3, ...), ``elapsed`` seconds into the step;
        None: stop (even the back-off would cross the deadline).

        ``at_least`` is the last answer's least wait (its Retry-After, or the next quota
        interval for a rate limit): honoured, but shortened to the last start that leaves a
        whole attempt before the deadline (one late try beats none; the deadline always holds).
        """
        wait = self.wait_before(attempt, jitter)
        if elapsed + wait >= self.deadline:
            return None
        if at_least is None or not at_least > wait:  # also a NaN: the back-off alone
            return wait
        latest = self.deadline - self.attempt_time - elapsed
        longer = max(wait, min(at_least, latest))
        return longer if elapsed + longer < self.deadline else wait

    def wait_before(self, attempt: int, jitter: float) -> float:
        """Wait before attempt number ``attempt`` (2, 3, ...); ``jitter`` in [0, 1)."""
        # the wait after failed attempt n-1: at least half of the step, ``jitter`` of the rest
        backoff = Backoff(self.first_wait, 2.0, self.max_wait, jitter=0.5)
        return backoff.wait(attempt - 1, 1.0 - jitter)


# -- the chain ----------------------------------------------------------------------------------


@dataclass
class StepOutcome:
    step: str
    status: str  # ok | fail | timeout | stuck | skip | dry_run
    detail: str = ""


@dataclass
class ChainResult:
    reason: str
    plan: list[str]
    steps: list[StepOutcome] = field(default_factory=list)

    def status(self, step: str) -> str | None:
        """The last status written for ``step`` (None if the step never ran)."""
        found = [s.status for s in self.steps if s.step == step]
        return found[-1] if found else None


class ActionChain:
    """Runs the shutdown chain for a config; constructors only store values."""

    def __init__(
        self,
        actions: cfgmod.ActionsSection,
        action: str,
        state_dir: str,
        emitter: Emitter,
        keepalive: Callable[[], object],
        runner: Runner = run_command,
        clock: Clock | None = None,
        api: ComputeApi | None = None,
        kernel: Kernel | None = None,
        instance: Callable[[], InstanceInfo | None] | None = None,
        jitter: Callable[[], float] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.actions = actions
        # The agent's stop event: set, it ends the linger (ChainStopped). None: nothing stops it
        # (`gce-watchdog end` running the chain itself ignores SIGTERM).
        self.stop = stop
        self._action = action  # agent.action: what the chain ends with
        self.emitter = emitter
        self.keepalive = keepalive
        self.runner = runner
        self.clock: Clock = clock or RealClock()
        self.api: ComputeApi = api or GoogleComputeApi(actions.api_base, actions.api_timeout)
        self.kernel: Kernel = kernel or RealKernel(actions.sysrq_path)
        self.instance = instance or (lambda: load_instance_cache(state_dir))
        if jitter is None:
            import random

            jitter = random.random
        self.jitter = jitter
        self.last_result: ChainResult | None = None
        self._event = ""  # "": the ladder's chain; vocab.END: a job's end of life

    @classmethod
    def from_config(
        cls, cfg: cfgmod.Config, emitter: Emitter, keepalive: Callable[[], object], **kw: Any
    ) -> ActionChain:
        """A chain for ``cfg.actions`` ending with ``agent.action``."""
        return cls(cfg.actions, cfg.agent.action, cfg.agent.state_dir, emitter, keepalive, **kw)

    # -- plan ----------------------------------------------------------------------------------
    @property
    def action(self) -> str:
        return self._action

    @property
    def dry_run(self) -> bool:
        return self.action == "dry-run"

    @property
    def verdict_event(self) -> str:
        """The decision's line: ``dry_run_shutdown`` in a dry run, so that no reader takes a
        rehearsal for a shutdown (no poller fails over on it)."""
        if self._event:
            return self._event
        return vocab.DRY_RUN_SHUTDOWN if self.dry_run else vocab.SHUTDOWN

    # -- the job's end of life -------------------------------------------------------------------
    def for_end(self, linger: float | None = None) -> ActionChain:
        """The same chain for a job's end of life: its line is ``end``, its action
        :func:`end_action` of ``agent.action``, its linger ``linger`` (None: ``actions.linger``).
        A copy: the ladder's chain is left as it is."""
        c = copy.copy(self)
        c._event = vocab.END
        c._action = end_action(self._action)
        if linger is not None:
            c.actions = replace(self.actions, linger=cfgmod.Duration(linger))
        return c

    def end_of_life(
        self,
        reason: str,
        *,
        linger: float | None = None,
        resume_at: str | None = None,
        linger_left: float | None = None,
        progress: Callable[[str], object] | None = None,
    ) -> None:
        """The job ended (``reason``: done, failed, setup_failed) and its terminal line is already
        written and drained: announce ``end``, linger, act, power off with escalation. Returns
        only if the machine is still up at its end (the outcome is in :attr:`last_result`)."""
        chain = self.for_end(linger)
        try:
            chain.execute(
                reason,
                0,
                0,
                resume_at=resume_at,
                linger_left=linger_left,
                progress=progress,
            )
        finally:
            self.last_result = chain.last_result

    def api_op(self) -> str | None:
        """The Compute API self-action of this chain (None: none)."""
        if self.action in ("delete", "stop"):
            return self.action
        if self.dry_run and self.actions.dry_run_op in ("delete", "stop"):
            return self.actions.dry_run_op
        return None

    def plan(self) -> list[str]:
        """Step names in order (the ``chain=`` field of the ``shutdown`` line)."""
        a = self.actions
        steps = ["linger"] if a.linger > 0 else []
        op = self.api_op()
        if op:
            steps.append(op)
        steps += ["poweroff", "force"]
        if a.kernel:
            steps.append("kernel")
        return steps

    # -- run -----------------------------------------------------------------------------------
    def execute(
        self,
        reason: str,
        rung: int,
        threshold: int,
        *,
        resume_at: str | None = None,
        linger_left: float | None = None,
        progress: Callable[[str], object] | None = None,
    ) -> None:
        """Run the whole chain; returns only if the machine is still up at its end.

        ``resume_at``: a step name (or ``"end"``, a chain that already ran through) to continue a
        chain an earlier run of the agent started; steps before it are not taken again (the
        ``shutdown`` line is written again, saying so). ``linger_left``: what is left of a resumed
        linger. ``progress(step)`` is called before each step, so the caller can persist how far
        the chain got. An exception in any step is written to the console and the chain goes on
        with the next step: once decided, the chain always reaches the power-off steps. The
        outcome of every step is kept in :attr:`last_result`.
        """
        plan = self.plan()
        res = ChainResult(reason, plan)
        self.last_result = res
        # An end of life has no rung: the ladder did not decide it.
        r = "" if self._event else vocab.encode_rung(rung, threshold)
        first = _order(resume_at)
        todo = [s for s in plan if _order(s) >= first]

        def run(step: str, fn: Callable[[], None]) -> None:
            if progress is not None:
                try:
                    progress(step)
                except Exception as e:  # persisting progress is best effort
                    self._error(res, step, e, "cannot record the chain's progress")
            try:
                fn()
            except ChainStopped:
                raise
            except Exception as e:
                self._error(res, step, e)

        self._ping()
        run("shutdown", lambda: self._announce(reason, r, plan, resume_at))
        a = self.actions
        for step in todo:
            if step == "linger":
                left = a.linger if linger_left is None else linger_left
                run(step, partial(self._linger, res, reason, r, left))
            elif step in ("delete", "stop"):
                run(step, partial(self._api_step, res, step))
            elif self.dry_run:
                run(step, partial(self._dry_run_step, res, step))
            elif step == "poweroff":
                run(step, partial(self._command_step, res, step, a.poweroff_cmd, a.poweroff_wait))
            elif step == "force":
                run(step, partial(self._command_step, res, step, a.force_cmd, a.force_wait))
            elif step == "kernel":
                run(step, partial(self._kernel_step, res))

    def _announce(self, reason: str, r: str, plan: list[str], resume_at: str | None) -> None:
        fields: dict[str, object] = {
            "reason": reason,
            "rung": r,
            "action": self.action,
            "chain": "+".join(plan),
        }
        if not r:
            del fields["rung"]
        text = _verdict_text(reason, r)
        if resume_at is not None:  # no `chain` on a resumed line: room for the text
            del fields["chain"]
            fields["resume"] = "poweroff" if resume_at == "end" else resume_at
            what = "end-of-life" if self._event else "shutdown"
            text = (
                f"{what} chain ended with the VM still up: powering off again"
                if resume_at == "end"
                else f"resuming the {what} chain at {resume_at} (agent restarted)"
            )
        self.emitter.emit(self.verdict_event, fields, text, sync=True)

    def _error(self, res: ChainResult, step: str, e: BaseException, what: str = "") -> None:
        """An exception in a step: say so on the console (best effort) and go on."""
        text = f"{what or 'step raised'}: {type(e).__name__}: {e}"[:DETAIL_MAX] + ", going on"
        res.steps.append(StepOutcome(step, "error", text))
        with contextlib.suppress(Exception):
            self.emitter.emit(
                vocab.ACTION,
                {"step": step, "status": "error", "err": type(e).__name__},
                text,
                sync=True,
            )

    # -- steps ---------------------------------------------------------------------------------
    def _line(
        self, res: ChainResult, step: str, status: str, fields: Mapping[str, object], text: str = ""
    ) -> None:
        # A very long instance name is shortened by make_event, never refused.
        self.emitter.emit(vocab.ACTION, {"step": step, "status": status, **fields}, text, sync=True)
        if status != "start":
            res.steps.append(StepOutcome(step, status, text))

    def _ping(self) -> None:
        with contextlib.suppress(Exception):  # best effort at the edge: never stop the chain
            self.keepalive()

    def _wait_pinging(
        self,
        seconds: float,
        done: threading.Event | None = None,
        each: Callable[[float], object] | None = None,
        start: float | None = None,
    ) -> None:
        """Wait ``seconds`` from ``start`` (default: now), or until ``done`` is set, pinging
        systemd before every slice of at most ``repeat_every``; ``each(left)`` after a slice that
        leaves time. Bounded: one pass per slice, whatever the clock does (the one wait of the
        linger, the API step's deadline and the power-off waits)."""
        end = (self.clock.monotonic() if start is None else start) + seconds
        step = self.actions.repeat_every
        for _ in range(int(seconds / step) + 2):
            self._ping()
            left = end - self.clock.monotonic()
            if left <= 0:
                return
            if done is not None:
                if self.clock.wait(done, min(step, left)):
                    return
            else:
                self.clock.sleep(min(step, left))
            if each is not None:
                left = end - self.clock.monotonic()
                if left <= 0:
                    return
                each(left)

    def _linger(self, res: ChainResult, reason: str, r: str, linger: float) -> None:
        t0 = self.clock.monotonic()
        self._line(
            res,
            "linger",
            "start",
            {"ms": int(linger * 1000)},
            f"keeping the VM up {linger:g}s so the poller reads the verdict",
        )
        rep = 0

        def repeat(left: float) -> None:
            nonlocal rep
            rep += 1
            fields: dict[str, object] = {
                "reason": reason,
                "rung": r,
                "action": self.action,
                "rep": rep,
                "left": f"{int(left * 1000)}ms",
            }
            if not r:
                del fields["rung"]
            self.emitter.emit(
                self.verdict_event, fields, _verdict_text(reason, r) + f", {left:.0f}s to go"
            )

        # A dry run says its decision once: the repeats are for a poller that must read a real
        # verdict before the VM goes (a rehearsal's line is never a failover).
        each = None if self.dry_run else repeat
        self._wait_pinging(linger, done=self.stop, each=each, start=t0)
        if self.stop is not None and self.stop.is_set():
            raise ChainStopped("stopped during the linger")
        ms = int((self.clock.monotonic() - t0) * 1000)
        self._line(res, "linger", "ok", {"ms": ms, "reps": rep})

    def _api_step(self, res: ChainResult, op: str) -> None:
        inst = self.instance()
        if inst is None:
            self._line(
                res,
                op,
                "skip",
                {"why": "no_instance"},
                "instance identity unknown (metadata never read): cannot call the API",
            )
            return
        fields = {"inst": inst.name, "zone": inst.zone}
        if self.dry_run:
            self._line(
                res, op, "dry_run", fields, f"dry-run: would call instances.{op} on {inst.name}"
            )
            return
        rid = str(uuid.uuid4())  # one id for every retry: GCE acts at most once per requestId
        self._line(res, op, "start", {**fields, "rid": rid}, f"instances.{op} on {inst.name}")
        a = self.actions
        policy = ChainRetry(a.api_attempts, a.api_deadline, attempt_time=a.api_timeout)
        t0 = self.clock.monotonic()
        done = threading.Event()
        box: list[tuple[ApiResult, int]] = []

        def work() -> None:
            box.append(self._api_attempts(op, inst, rid, policy, t0))
            done.set()

        threading.Thread(target=work, name="compute-api", daemon=True).start()
        # The hard bound: whatever google-auth does inside (its token fetch retries on its own),
        # the chain moves on at the deadline; the abandoned thread is a daemon thread.
        self._wait_pinging(a.api_deadline, done=done, start=t0)
        ms = int((self.clock.monotonic() - t0) * 1000)
        if not box:
            self._line(
                res,
                op,
                "timeout",
                {"ms": ms, "rid": rid},
                f"instances.{op}: no answer within {a.api_deadline:g}s, moving on",
            )
            return
        result, tries = box[0]
        extra: dict[str, object] = {"http": result.http or "-", "tries": tries, "ms": ms}
        if result.ok:
            self._line(res, op, "ok", {**extra, "opn": result.detail or "-"}, f"{op} accepted")
        elif result.timeout or result.retryable:
            self._line(
                res,
                op,
                "timeout" if result.timeout else "fail",
                extra,
                f"gave up after {tries} attempts, last error: {result.detail}",
            )
        else:
            self._line(res, op, "fail", extra, f"instances.{op} refused: {result.detail}".strip())

    def _api_attempts(
        self, op: str, inst: InstanceInfo, rid: str, policy: ChainRetry, t0: float
    ) -> tuple[ApiResult, int]:
        """Try until success, a final answer, ``attempts`` or the deadline (runs in a thread)."""
        tries = 0

        def one(attempt: int) -> ApiResult:
            nonlocal tries
            tries = attempt
            try:
                result = self.api.act(op, inst, rid)
            except Exception as e:
                result = ApiResult(False, None, f"{type(e).__name__}: {e}"[:DETAIL_MAX])
            if result.ok or not result.retryable:
                return result
            raise _Retryable(result)

        def next_wait(attempt: int, e: BaseException) -> float | None:
            if attempt >= policy.attempts or not isinstance(e, _Retryable):
                return None
            elapsed = self.clock.monotonic() - t0
            return policy.next_wait(attempt + 1, self.jitter(), elapsed, e.result.wait_at_least)

        if policy.attempts < 1:
            return ApiResult(False, None, "not attempted", retryable=True), 0
        try:
            return retry_call(one, next_wait, sleep=self.clock.sleep), tries
        except _Retryable as e:
            return e.result, tries

    def _command_step(self, res: ChainResult, step: str, argv: list[str], wait: float) -> None:
        """Run one power-off command; if it was accepted, wait (bounded) for the power to go."""
        self._ping()
        self._line(res, step, "start", {"argv": ",".join(argv)}, " ".join(argv))
        out = self.runner(argv, self.actions.command_timeout)
        self._ping()
        if not out.ok:
            self._line(
                res,
                step,
                "fail",
                {"rc": "-" if out.rc is None else out.rc},
                out.detail or f"{argv[0]} failed",
            )
            return
        self._line(res, step, "ok", {"rc": 0}, f"accepted; waiting up to {wait:g}s")
        self._wait_pinging(wait)
        self._line(
            res,
            step,
            "stuck",
            {"ms": int(wait * 1000)},
            f"still running {wait:g}s after {step} was accepted",
        )

    def _kernel_step(self, res: ChainResult) -> None:
        for how in self.actions.kernel:
            self._line(res, "kernel", "start", {"how": how}, f"kernel power-off by {how}")
            self._ping()
            try:
                err = self.kernel.poweroff(how)
            except Exception as e:  # the next method is still worth a try
                self._error(res, "kernel", e)
                continue
            if not err:
                self._line(res, "kernel", "ok", {"how": how})
                return
            self._line(res, "kernel", "fail", {"how": how}, err)

    def _dry_run_step(self, res: ChainResult, step: str) -> None:
        a = self.actions
        if step == "kernel":
            how = "+".join(a.kernel)
            self._line(res, "kernel", "dry_run", {"how": how}, f"dry-run: would power off by {how}")
            return
        argv = a.poweroff_cmd if step == "poweroff" else a.force_cmd
        text = "dry-run: would run " + " ".join(argv)
        self._line(res, step, "dry_run", {"argv": ",".join(argv)}, text)


# Every step in its fixed order; a resumed chain skips the steps before its mark. "end": the chain
# ran through with the VM still up, so a new attempt starts again at the power-off.
STEP_ORDER = ("shutdown", "linger", "delete", "stop", "poweroff", "force", "kernel")


def _order(step: str | None) -> int:
    if step is None:
        return 0
    if step == "end":
        return STEP_ORDER.index("poweroff")
    return STEP_ORDER.index(step) if step in STEP_ORDER else 0


def step_after(step: str) -> str:
    """The step to resume at when ``step`` could not finish (the next one; then the power-off)."""
    i = _order(step)
    if step not in STEP_ORDER or i + 1 >= len(STEP_ORDER):
        return "end"
    return STEP_ORDER[i + 1]


def end_action(action: str) -> str:
    """What a job's end of life does for ``agent.action``: the same (poweroff, stop, delete),
    except a dry run, which rehearses the ladder only: a job's ending is asked for (the
    done/failure action), so it powers off for real, as the start-up script always did."""
    return "poweroff" if action == "dry-run" else action


_END_TEXT = {
    "done": "job done",
    "failed": "job failed",
    "setup_failed": "setup failed",
}


def _verdict_text(reason: str, r: str) -> str:
    if not r:  # an end of life
        return f"{_END_TEXT.get(reason, reason)}: ending the VM after the linger"
    if reason == "ladder":
        return f"shutting down: BOTH reachability probes FAILED ({r})"
    return f"shutting down: {reason} ({r})"


__all__ = [
    "ActionChain",
    "ApiResult",
    "ChainResult",
    "ChainRetry",
    "GoogleComputeApi",
    "RealKernel",
    "RunResult",
    "end_action",
    "run_command",
]
