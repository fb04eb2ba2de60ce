"""Reading serial port 1 through the Compute API, incrementally and resumably.

:class:`ComputeClient` wraps a google-auth ``AuthorizedSession`` (application default
credentials unless credentials are injected) with explicit (connect, read) timeouts and an
explicit retry policy for rate limits and transient errors. :class:`SerialReader` keeps one
:class:`Cursor` per instance (the API's ``next`` offset, the unterminated last line, the
timeline) in a JSON file so a restarted poller resumes where it stopped.

Reader semantics (``docs/poller.md`` has the long form):

- Each read asks for ``start = cursor.offset``; the new offset is the response's ``next``. In
  steady state every byte is fetched exactly once.
- A console line split across two reads: the bytes after the last newline are held in the
  cursor (``pending``, persisted) and prefixed to the next read, so the line is decoded once,
  whole. We hold the bytes rather than re-reading from the line's start because re-reading
  would fetch the same bytes again on every poll of a VM that writes no newline.
- ``start`` beyond the requested offset: the API dropped those bytes (1 MiB window). They are
  counted as a byte gap; the held partial line is decoded alone (its rest is gone, so a line of
  ours in it is rejected, not misread).
- ``next`` below the requested offset: the port's buffer restarted (a recreated instance). The
  reader starts again from 0 and counts a reset. A different instance id under the same name
  also starts a fresh cursor.
"""

from __future__ import annotations

import base64
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gce_watchdog.lib.files import atomic_write
from gce_watchdog.lib.retry import Backoff, tenacity_wait
from gce_watchdog.poller.timeline import Timeline

if TYPE_CHECKING:  # pragma: no cover
    import requests

DEFAULT_API_BASE = "https://compute.googleapis.com/compute/v1"
SCOPES = ("https://www.googleapis.com/auth/compute",)
# Connect: a TCP+TLS handshake to googleapis.com takes well under a second; 10 s rides out a
# congested link without hanging a poll of many instances.
CONNECT_TIMEOUT_S = 10.0
# Read: a 1 MiB serial response is usually served in < 2 s; 30 s is the tail we tolerate.
READ_TIMEOUT_S = 30.0
# StreamDecoder.MAX_PENDING: a console line longer than this is not ours; keep only its tail.
MAX_PENDING = 64 * 1024
# Rate-limit reasons GCE puts in error.errors[].reason (with 403 or 429).
RATE_LIMIT_REASONS = frozenset({"rateLimitExceeded", "userRateLimitExceeded"})
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
_NAME_RE = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_PROJECT_RE = re.compile(r"[a-z][-a-z0-9:.]{4,61}[a-z0-9]\Z")


class ComputeAPIError(Exception):
    """A Compute API call failed; ``status`` is the HTTP status (0: no response)."""

    def __init__(
        self, message: str, status: int = 0, reason: str = "", retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.retry_after = retry_after  # the response's Retry-After, in seconds, if it had one

    @property
    def transient(self) -> bool:
        return (
            self.status == 0
            or self.status in TRANSIENT_STATUS
            or (self.status == 403 and self.reason in RATE_LIMIT_REASONS)
        )


class AuthError(ComputeAPIError):
    """No usable credentials, or the API rejected them (401/403): not retried."""


class NotFoundError(ComputeAPIError):
    """404: the instance (or project/zone) does not exist."""


class GaveUpError(ComputeAPIError):
    """The retry policy's attempts ran out; the message names the last error."""


@dataclass(frozen=True)
class RetryPolicy:
    """Retry transient API errors: ``attempts`` tries, jittered exponential waits, then give up.

    A response's ``Retry-After`` is honoured as the least wait before the next try, capped at
    ``max_wait_s`` (one poll interval: a poller that sleeps longer misses its own schedule).
    ``sleep`` is injectable so tests never wait.
    """

    attempts: int = 5
    initial_s: float = 1.0  # first wait ~1 s: GCE's rate limits are per 100-second windows
    max_wait_s: float = 30.0  # a single wait never exceeds one poll interval
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be >= 1")

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        import tenacity

        # full jitter: any wait up to the exponential step
        backoff = tenacity_wait(Backoff(self.initial_s, 2.0, self.max_wait_s, jitter=1.0))

        def wait(rs: tenacity.RetryCallState) -> float:
            w = float(backoff(rs))
            e = rs.outcome.exception() if rs.outcome is not None else None
            after = e.retry_after if isinstance(e, ComputeAPIError) else None
            return w if after is None else min(self.max_wait_s, max(w, after))

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=wait,
            retry=tenacity.retry_if_exception(
                lambda e: isinstance(e, ComputeAPIError) and e.transient
            ),
            sleep=self.sleep,
            reraise=False,
        )
        try:
            return retrying(fn)
        except tenacity.RetryError as e:
            last = e.last_attempt.exception()
            status = last.status if isinstance(last, ComputeAPIError) else 0
            reason = last.reason if isinstance(last, ComputeAPIError) else ""
            raise GaveUpError(
                f"{what}: gave up after {self.attempts} attempts, last error: {last}",
                status,
                reason,
            ) from last


class HTTPSession(Protocol):
    """The part of requests.Session / AuthorizedSession the client uses."""

    def request(self, method: str, url: str, **kwargs: Any) -> requests.Response: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SerialChunk:
    contents: bytes
    start: int
    next: int


@dataclass(frozen=True)
class InstanceInfo:
    name: str
    id: str
    status: str
    spot: bool
    termination_action: str = ""


def validate_target(project: str, zone: str, names: list[str]) -> list[str]:
    """Every problem with the project, zone and instance names, for one clear error message."""
    errs = []
    if not _PROJECT_RE.match(project):
        errs.append(f"project {project!r} is not a valid project id")
    if not re.match(r"[a-z]+-[a-z]+\d+-[a-z]\Z", zone):
        errs.append(f"zone {zone!r} is not a zone name like us-central1-a")
    errs += [f"instance {n!r} is not a valid instance name" for n in names if not _NAME_RE.match(n)]
    return errs


class ComputeClient:
    """The Compute API calls the poller needs, through one authorized session."""

    def __init__(
        self,
        session: HTTPSession,
        api_base: str = DEFAULT_API_BASE,
        timeout: tuple[float, float] = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
        retry: RetryPolicy | None = None,
    ) -> None:
        self.session = session
        self.api_base = api_base.rstrip("/")
        self.timeout = timeout
        self.retry = retry or RetryPolicy()

    @classmethod
    def create(
        cls,
        credentials: Any = None,
        api_base: str = DEFAULT_API_BASE,
        timeout: tuple[float, float] = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
        retry: RetryPolicy | None = None,
    ) -> ComputeClient:
        """A client on an ``AuthorizedSession``; ``credentials`` None = application defaults.

        Tests pass ``google.oauth2.credentials.Credentials("token")`` to talk to the fake API.
        """
        import google.auth
        import google.auth.exceptions
        from google.auth.transport.requests import AuthorizedSession

        if credentials is None:
            try:
                credentials, _ = google.auth.default(scopes=list(SCOPES))
            except google.auth.exceptions.DefaultCredentialsError as e:
                raise AuthError(
                    "no Google credentials: run `gcloud auth application-default login`, set "
                    f"GOOGLE_APPLICATION_CREDENTIALS, or run on GCE with a service account ({e})"
                ) from None
        session = AuthorizedSession(credentials)  # type: ignore[no-untyped-call]
        return cls(session, api_base, timeout, retry)

    def close(self) -> None:
        self.session.close()

    def _url(self, project: str, zone: str, name: str, suffix: str = "") -> str:
        return f"{self.api_base}/projects/{project}/zones/{zone}/instances/{name}{suffix}"

    def _once(self, method: str, url: str, params: dict[str, str]) -> dict[str, Any]:
        import google.auth.exceptions
        import requests

        try:
            r = self.session.request(method, url, params=params, timeout=self.timeout)
        except google.auth.exceptions.RefreshError as e:
            raise AuthError(f"credentials could not be refreshed: {e}", 401) from None
        except google.auth.exceptions.TransportError as e:
            raise ComputeAPIError(f"{method} {url}: token endpoint unreachable: {e}") from None
        except requests.Timeout:
            c, rd = self.timeout
            raise ComputeAPIError(
                f"{method} {url}: timed out (connect {c:g}s, read {rd:g}s)"
            ) from None
        except requests.RequestException as e:
            raise ComputeAPIError(f"{method} {url}: {type(e).__name__}: {e}") from None
        try:
            body = r.json()
        except ValueError:
            body = None
        if r.status_code == 200 and isinstance(body, dict):
            return body
        err = body.get("error", {}) if isinstance(body, dict) else {}
        errs = err.get("errors") if isinstance(err, dict) else None
        reason = ""
        if isinstance(errs, list) and errs and isinstance(errs[0], dict):
            reason = str(errs[0].get("reason", ""))
        message = str(err.get("message", "")) if isinstance(err, dict) else ""
        text = f"{method} {url}: HTTP {r.status_code}" + (f" {reason}" if reason else "")
        text += f": {message or r.reason or 'no error message'}"
        if r.status_code == 200:
            raise ComputeAPIError(f"{method} {url}: response is not a JSON object", 200)
        if r.status_code == 404:
            raise NotFoundError(text, 404, reason)
        if r.status_code == 401 or (r.status_code == 403 and reason not in RATE_LIMIT_REASONS):
            raise AuthError(text, r.status_code, reason)
        from gce_watchdog.lib.httpdate import parse_retry_after

        after = parse_retry_after(r.headers.get("Retry-After"), time.time())
        raise ComputeAPIError(text, r.status_code, reason, after)

    def _call(self, method: str, url: str, params: dict[str, str]) -> dict[str, Any]:
        result: dict[str, Any] = self.retry.call(
            f"{method} {url}", lambda: self._once(method, url, params)
        )
        return result

    def serial_port_output(
        self, project: str, zone: str, name: str, start: int, port: int = 1
    ) -> SerialChunk:
        body = self._call(
            "GET",
            self._url(project, zone, name, "/serialPort"),
            {"port": str(port), "start": str(start)},
        )
        try:
            contents = str(body.get("contents", "")).encode("utf-8", errors="replace")
            return SerialChunk(contents, int(body["start"]), int(body["next"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ComputeAPIError(f"malformed serialPortOutput response: {e!r}", 200) from None

    def get_instance(self, project: str, zone: str, name: str) -> InstanceInfo | None:
        """The instance, or None when it does not exist (deleted, e.g. a reaped Spot VM)."""
        try:
            body = self._call("GET", self._url(project, zone, name), {})
        except NotFoundError:
            return None
        sched = body.get("scheduling") or {}
        spot = sched.get("provisioningModel") == "SPOT" or bool(sched.get("preemptible"))
        return InstanceInfo(
            name=str(body.get("name", name)),
            id=str(body.get("id", "")),
            status=str(body.get("status", "")),
            spot=spot,
            termination_action=str(sched.get("instanceTerminationAction", "")),
        )

    def delete_instance(
        self, project: str, zone: str, name: str, request_id: str
    ) -> dict[str, Any]:
        """Delete with a requestId: retries (ours or another poller's) are one request to GCE."""
        return self._call("DELETE", self._url(project, zone, name), {"requestId": request_id})

    def stop_instance(self, project: str, zone: str, name: str, request_id: str) -> dict[str, Any]:
        return self._call(
            "POST", self._url(project, zone, name, "/stop"), {"requestId": request_id}
        )


# -- cursors and the incremental reader --------------------------------------------------------


@dataclass
class Cursor:
    """Everything needed to resume reading one instance."""

    name: str
    instance_id: str = ""
    offset: int = 0  # the next byte to ask for: the API's `next` from the last read
    pending: bytes = b""  # bytes after the last newline, joined to the next read
    fetched_bytes: int = 0  # contents bytes received, over the cursor's life
    new_bytes: int = 0  # bytes the offset advanced by (new output), over the cursor's life;
    # fetched_bytes == new_bytes - lost bytes when nothing is ever read twice
    reads: int = 0
    timeline: Timeline = field(default_factory=Timeline)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": 1,
            "name": self.name,
            "instance_id": self.instance_id,
            "offset": self.offset,
            "pending": base64.b64encode(self.pending).decode(),
            "fetched_bytes": self.fetched_bytes,
            "new_bytes": self.new_bytes,
            "reads": self.reads,
            "timeline": self.timeline.to_json(),
        }

    @classmethod
    def from_json(cls, obj: Any) -> Cursor:
        """Raises ValueError (or KeyError/TypeError) when the document is not a cursor."""
        if not isinstance(obj, dict) or obj.get("version") != 1:
            raise ValueError("not a version 1 cursor")
        return cls(
            name=str(obj["name"]),
            instance_id=str(obj["instance_id"]),
            offset=int(obj["offset"]),
            pending=base64.b64decode(obj["pending"]),
            fetched_bytes=int(obj["fetched_bytes"]),
            new_bytes=int(obj["new_bytes"]),
            reads=int(obj["reads"]),
            timeline=Timeline.from_json(obj["timeline"]),
        )


class CursorStore:
    """One JSON file per instance in a directory (``None``: keep cursors in memory only)."""

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = Path(directory) if directory else None
        self._mem: dict[str, Cursor] = {}
        self.corrupt: list[str] = []  # names whose file could not be used (started fresh)

    def _path(self, project: str, zone: str, name: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{project}.{zone}.{name}.json"

    def load(self, project: str, zone: str, name: str) -> Cursor:
        key = f"{project}/{zone}/{name}"
        if key in self._mem:
            return self._mem[key]
        cur = Cursor(name)
        if self.directory is not None:
            p = self._path(project, zone, name)
            try:
                cur = Cursor.from_json(json.loads(p.read_bytes()))
            except FileNotFoundError:
                pass
            except (OSError, ValueError, KeyError, TypeError):
                self.corrupt.append(key)  # reported; reading restarts from the oldest bytes
        self._mem[key] = cur
        return cur

    def save(self, project: str, zone: str, cur: Cursor) -> None:
        key = f"{project}/{zone}/{cur.name}"
        self._mem[key] = cur
        if self.directory is not None:
            blob = json.dumps(cur.to_json(), sort_keys=True).encode()
            atomic_write(self._path(project, zone, cur.name), blob, mode=0o600)


@dataclass(frozen=True)
class ReadResult:
    """What one incremental read brought."""

    fetched: int  # contents bytes received
    new: int  # bytes written to the port since the previous read (`next` - requested offset)
    lost: int  # of those, bytes the API no longer held (byte gap)
    reset: bool  # the port's buffer restarted; read again from 0
    new_events: int


class SerialReader:
    """Incremental reads of serial port 1 for many instances, resuming from stored cursors."""

    def __init__(self, client: ComputeClient, store: CursorStore) -> None:
        self.client = client
        self.store = store

    def read(self, project: str, zone: str, name: str, instance_id: str = "") -> ReadResult:
        cur = self.store.load(project, zone, name)
        if instance_id and cur.instance_id and cur.instance_id != instance_id:
            cur = Cursor(name)  # a new instance under the same name: its own port, its own log
        if instance_id:
            cur.instance_id = instance_id
        fetched = lost = new_events = new = 0
        reset = False
        # At most two reads: the second only after a buffer reset (the port restarted at 0).
        for _ in range(2):
            requested = cur.offset
            chunk = self.client.serial_port_output(project, zone, name, requested)
            fetched += len(chunk.contents)
            cur.reads += 1
            if chunk.next < requested:
                reset = True
                cur.timeline.resets += 1
                new_events += len(cur.timeline.feed(cur.pending + b"\n")) if cur.pending else 0
                cur.pending = b""
                cur.offset = 0
                continue
            if chunk.start > requested:
                lost += chunk.start - requested
                cur.timeline.note_byte_gap(requested, chunk.start)
                if cur.pending:  # its continuation is gone: decode what we have, alone
                    new_events += len(cur.timeline.feed(cur.pending + b"\n"))
                    cur.pending = b""
            data = cur.pending + chunk.contents
            cut = data.rfind(b"\n") + 1
            if cut:
                new_events += len(cur.timeline.feed(data[:cut]))
            cur.pending = data[cut:][-MAX_PENDING:]
            new = chunk.next - requested
            cur.new_bytes += new
            cur.fetched_bytes += len(chunk.contents)
            cur.offset = chunk.next
            break
        self.store.save(project, zone, cur)
        return ReadResult(fetched, new, lost, reset, new_events)

    def cursor(self, project: str, zone: str, name: str) -> Cursor:
        return self.store.load(project, zone, name)


def jitter(seconds: float, fraction: float = 0.1) -> float:
    """``seconds`` +- ``fraction``: many pollers started together spread their calls."""
    return seconds * (1 + random.uniform(-fraction, fraction))  # noqa: S311 (not crypto)
