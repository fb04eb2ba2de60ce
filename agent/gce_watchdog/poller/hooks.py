"""``poll --on-failover CMD`` and ``--publish TOPIC``: deliver each announced decision.

``--on-failover``: run the dispatcher's command for each announced decision.

The command is an argv (``shlex.split`` of the option, never a shell), started with the decision's
versioned JSON (:func:`gce_watchdog.poller.decisions.decision_doc`) and a newline on stdin, and in
its environment ``GCE_WATCHDOG_TOKEN``, ``GCE_WATCHDOG_REQUEST_ID``, ``GCE_WATCHDOG_INSTANCE``
(project/zone/name) and ``GCE_WATCHDOG_JOB`` (empty when the instance has no job label).

- Exit 0 is the only success: only then does the poller mark the announcement done.
- Anything else (an exit status, a signal, a timeout, a command that cannot start) is retried
  with the package's back-off (``lib.retry.Backoff``) up to ``attempts`` times; then the
  decision's delivery is ``failed`` (its attempts and last error in the ledger), its lease ends,
  and the next poll (or announcement sweep) of any poller tries again.
  Delivery is at-least-once: the token is the dedup key.
- Each run is bounded by ``timeout_s``: its whole process group is killed (SIGKILL) then.
- The command's stdout and stderr go to an unlinked temporary file, never a pipe: a command that
  writes without end can neither block on a full pipe nor block the poller; the last 2 KiB of
  a failed run are logged.

``--publish``: one Pub/Sub message per announced decision (:class:`TopicPublisher`), with the
same contract: marked done only once the service accepted it, retried with the same back-off
(:func:`retried`), at-least-once (the ``request_id`` attribute is the dedup key).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gce_watchdog.lib.retry import Backoff, retry_call
from gce_watchdog.poller.decisions import doc_for
from gce_watchdog.poller.ledger import DecisionStore

TAIL_BYTES = 2048


@dataclass(frozen=True)
class Tried:
    """What one delivery step did: true once it succeeded; ``attempts`` made, and the last
    failed attempt's ``error`` (None if it succeeded)."""

    ok: bool
    attempts: int
    error: str | None = None

    def __bool__(self) -> bool:
        return self.ok


# A delivery step (``--publish``, ``--on-failover``): the decision's view in, what it did out
# (a plain bool counts as one attempt).
Step = Callable[[dict[str, Any]], "Tried | bool"]


def retried(
    once: Callable[[], str | None],
    what: str,
    attempts: int,
    backoff: Backoff,
    stop: threading.Event,
    log: Callable[[str], None],
    rng: Callable[[], float],
) -> Tried:
    """Run ``once`` (None: it succeeded, else what went wrong) until it succeeds (true) or
    ``attempts`` are spent (false), waiting the package's back-off between attempts; ``stop``
    cuts the wait short (and ends the attempts). The retry of every delivery step
    (``--on-failover``, ``--publish``), each failed attempt logged as ``WHAT: WHY (attempt n/N)``.
    """
    if attempts < 1:
        return Tried(False, 0)
    made: list[str | None] = []  # each attempt's error (None: it succeeded)

    def one(n: int) -> None:
        why = once()
        made.append(why)
        if why is not None:
            log(f"{what}: {why} (attempt {n}/{attempts})")
            raise _Failed(why)

    def pause(seconds: float) -> None:
        if stop.wait(seconds):
            raise _Stopped

    try:
        retry_call(
            one,
            lambda n, _e: backoff.wait(n, rng()) if n < attempts else None,
            retry_on=lambda e: isinstance(e, _Failed),
            sleep=pause,
        )
    except (_Failed, _Stopped):
        return Tried(False, len(made), made[-1] if made else None)
    return Tried(True, len(made))


class _Failed(Exception):
    """One delivery attempt failed (its reason is logged already)."""


class _Stopped(Exception):
    """The stop event cut a wait short: no more attempts."""


@dataclass
class FailoverHook:
    argv: Sequence[str]
    timeout_s: float = 60.0
    attempts: int = 3
    backoff: Backoff = field(default_factory=lambda: Backoff(initial=1.0, max_wait=30.0))
    stop: threading.Event = field(default_factory=threading.Event)  # cuts the back-off short
    log: Callable[[str], None] = lambda _msg: None
    rng: Callable[[], float] = random.random

    def __call__(self, doc: Mapping[str, Any]) -> Tried:
        """Run the command until it exits 0 (true) or the attempts are spent (false)."""
        data = (json.dumps(doc, sort_keys=True) + "\n").encode()
        env = dict(os.environ)
        env.update(
            GCE_WATCHDOG_TOKEN=str(doc["token"]),
            GCE_WATCHDOG_REQUEST_ID=str(doc["request_id"]),
            GCE_WATCHDOG_INSTANCE=f"{doc['project']}/{doc['zone']}/{doc['name']}",
            GCE_WATCHDOG_JOB=str(doc.get("job") or ""),
        )
        return retried(
            lambda: self._once(data, env), f"--on-failover for token {doc['token']}",
            self.attempts, self.backoff, self.stop, self.log, self.rng,
        )  # fmt: skip

    def _once(self, data: bytes, env: dict[str, str]) -> str | None:
        """None on exit 0, else what went wrong."""
        with tempfile.TemporaryFile() as out:
            try:
                proc = subprocess.Popen(  # an argv from the operator, no shell
                    list(self.argv),
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=out,
                    env=env,
                    start_new_session=True,  # its own process group: a timeout kills it whole
                    close_fds=True,
                )
            except OSError as e:
                return f"cannot start {self.argv[0]!r}: {e}"
            try:
                proc.communicate(data, timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                self._kill(proc)
                return f"timed out after {self.timeout_s:g}s (killed)"
            except BrokenPipeError:
                proc.wait(timeout=self.timeout_s)  # it exited without reading: its status says
            rc = proc.returncode
            if rc == 0:
                return None
            out.seek(max(0, out.seek(0, os.SEEK_END) - TAIL_BYTES))
            tail = out.read().decode("utf-8", "replace").strip()
            what = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
            return what + (f"; output ends: {tail!r}" if tail else "")

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait()


@dataclass
class Delivery:
    """An announced decision's deliveries (``--publish``, then ``--on-failover``), by token: its
    view read back from the ledger (:func:`gce_watchdog.poller.decisions.doc_for`), then each
    step in turn; True only once every step succeeded (then, and only then, the caller marks the
    announcement done). The attempts and the last error go to the decision's delivery state in
    the ledger (``record_delivery``): a failed one is ``failed`` until a later poll delivers it."""

    ledger: DecisionStore
    steps: Sequence[Step]
    log: Callable[[str], None] = lambda _msg: None

    def __call__(self, token: int) -> bool:
        doc = doc_for(self.ledger, token)
        if doc is None:  # (not in the ledger: nothing to deliver, nothing to record)
            self.log(f"the delivery of token {token} found no such decision in the ledger")
            return False
        attempts, error = 0, None
        for step in self.steps:
            got = step(doc)
            attempts += got.attempts if isinstance(got, Tried) else 1
            if not got:
                error = (got.error if isinstance(got, Tried) else None) or "the step failed"
                break
        self.ledger.record_delivery(token, attempts, error)
        if error is None:
            return True
        self.log(
            f"the delivery of token {token} failed after {attempts} attempt(s): {error}; it "
            "stays undelivered (failed) and the next poll retries it"
        )
        return False


@dataclass
class TopicPublisher:
    """``poll --publish projects/P/topics/T``: each announced decision as one Pub/Sub message,
    the view's JSON as data and attributes ``request_id``, ``token``, ``verdict`` (subscribers
    dedup on ``request_id``: delivery is at-least-once, like ``--on-failover``). True once the
    service accepted it (the publish future resolved within ``timeout_s``); a failed or timed-out
    publish is retried with the package's back-off up to ``attempts`` times, as the command of
    :class:`FailoverHook` is. The same step for every mode: a poller's round (instances, fleet,
    the worker's Compute API sweep) and a ``--pubsub`` worker's delivery after the ack."""

    publisher: Any  # a google.cloud.pubsub_v1.PublisherClient
    topic: str
    timeout_s: float = 60.0
    attempts: int = 3
    backoff: Backoff = field(default_factory=lambda: Backoff(initial=1.0, max_wait=30.0))
    stop: threading.Event = field(default_factory=threading.Event)  # cuts the back-off short
    log: Callable[[str], None] = lambda _msg: None
    rng: Callable[[], float] = random.random

    def __call__(self, doc: Mapping[str, Any]) -> Tried:
        data = json.dumps(doc, sort_keys=True).encode()
        attrs = {"request_id": str(doc["request_id"]), "token": str(doc["token"]),
                 "verdict": str(doc["verdict"])}  # fmt: skip
        return retried(
            lambda: self._once(data, attrs), f"--publish {self.topic} for token {doc['token']}",
            self.attempts, self.backoff, self.stop, self.log, self.rng,
        )  # fmt: skip

    def _once(self, data: bytes, attrs: dict[str, str]) -> str | None:
        """None once the service accepted the message, else what went wrong. A publish that
        timed out here may still be accepted later (the client keeps it): a second copy of
        the message, which the subscriber's dedup on ``request_id`` absorbs."""
        try:
            self.publisher.publish(self.topic, data, **attrs).result(timeout=self.timeout_s)
        except Exception as e:  # the client's errors (google.api_core), a timeout
            return f"{type(e).__name__}: {e}"
        return None
