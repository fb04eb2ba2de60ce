"""The one Compute API client, for the poller and the agent's action chain.

:class:`ComputeClient` wraps a google-auth ``AuthorizedSession`` with explicit timeouts: the
poller's on application default credentials (:meth:`ComputeClient.create`) with a retry policy
for rate limits and transient errors, the action chain's on the VM's own service account through
the metadata server (:meth:`ComputeClient.on_vm`), one attempt per call (the chain retries under
its own deadline). :meth:`ComputeClient.send` is the one transport call both use; :meth:`call`
maps a response to a JSON object or a typed error (:class:`ComputeAPIError`). google-auth and
requests are imported on first use: they are heavy, and the daemon only needs them on its way
down.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gce_watchdog.lib.httpdate import parse_retry_after
from gce_watchdog.lib.retry import Backoff, retry_call

if TYPE_CHECKING:  # pragma: no cover
    import requests

DEFAULT_API_BASE = "https://compute.googleapis.com/compute/v1"
SCOPES = ("https://www.googleapis.com/auth/compute",)
# Connect: a TCP+TLS handshake to googleapis.com takes well under a second; 10 s rides out a
# congested link without hanging a poll of many instances.
CONNECT_TIMEOUT_S = 10.0
# Read: a 1 MiB serial response is usually served in < 2 s; 30 s is the tail we tolerate.
READ_TIMEOUT_S = 30.0
# Rate-limit reasons GCE puts in error.errors[].reason (with 403 or 429).
RATE_LIMIT_REASONS = frozenset({"rateLimitExceeded", "userRateLimitExceeded"})
# Worth another try: a server error that may pass. 501 (not implemented) never will.
TRANSIENT_SERVER_STATUS = frozenset({500, 502, 503, 504})
# GCE's rate quotas are per minute and "refilled at the start of the next interval" (Compute
# Engine docs, "API rate limits"): without a Retry-After, a rate-limited call waits for it.
QUOTA_INTERVAL_S = 60.0
_NAME_RE = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_PROJECT_RE = re.compile(r"[a-z][-a-z0-9:.]{4,61}[a-z0-9]\Z")


@dataclass(frozen=True)
class ErrorClass:
    """What a Compute API error means for a retry: ``transient`` (worth another try), and
    ``wait_at_least`` (seconds before it: the Retry-After, or the start of the next quota
    interval for a rate limit without one; None: the caller's own back-off alone)."""

    transient: bool
    wait_at_least: float | None = None
    rate_limited: bool = False


def classify(
    status: int, reason: str = "", retry_after: float | None = None, now: float = 0.0
) -> ErrorClass:
    """The one classifier of Compute API errors, for the poller and the agent's action chain.

    ``status`` 0 is no response at all (a timeout, a refused connection): transient. A rate
    limit, 429 or 403 with reason ``rateLimitExceeded``/``userRateLimitExceeded`` (GCE answers
    403, Compute Engine docs, "API rate limits"), is transient and waits ``retry_after``, else
    until the start of the next minute of the wall clock ``now``. 500/502/503/504 are transient
    (and honour a Retry-After); 501 and every other status are final.
    """
    if status == 429 or (status == 403 and reason in RATE_LIMIT_REASONS):
        wait = retry_after if retry_after is not None else until_next_interval(now)
        return ErrorClass(True, wait, rate_limited=True)
    if status == 0 or status in TRANSIENT_SERVER_STATUS:
        return ErrorClass(True, retry_after)
    return ErrorClass(False)


def until_next_interval(now: float, interval: float = QUOTA_INTERVAL_S) -> float:
    """Seconds from the wall time ``now`` to the start of the next quota interval, in
    (0, interval]: a call made right at a boundary waits for the next one (its quota is spent)."""
    if not math.isfinite(now):
        return interval
    return interval - (now % interval)


class ComputeAPIError(Exception):
    """A Compute API call failed; ``status`` is the HTTP status (0: no response)."""

    def __init__(
        self, message: str, status: int = 0, reason: str = "", retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.retry_after = retry_after  # the response's Retry-After, in seconds, if it had one

    def classify(self, now: float) -> ErrorClass:
        """This error through :func:`classify` (``now``: wall time, for a rate limit)."""
        return classify(self.status, self.reason, self.retry_after, now)

    @property
    def transient(self) -> bool:
        return self.classify(0.0).transient


class AuthError(ComputeAPIError):
    """No usable credentials, or the API rejected them (401/403): not retried."""


class NotFoundError(ComputeAPIError):
    """404: the instance (or project/zone) does not exist."""


class GaveUpError(ComputeAPIError):
    """The retry policy's attempts ran out; the message names the last error."""


@dataclass(frozen=True)
class ComputeRetry:
    """Retry transient API errors: ``attempts`` tries, jittered exponential waits, then give up.

    The least wait before the next try is :func:`classify`'s: a response's ``Retry-After``, or
    for a rate limit without one the start of the next minute; capped at ``max_wait_s`` (one poll
    interval: a poller that sleeps longer misses its own schedule). ``sleep`` and ``wall`` are
    injectable so tests never wait.
    """

    attempts: int = 5
    initial_s: float = 1.0  # first wait ~1 s, doubling: most transient errors pass in seconds
    max_wait_s: float = 30.0  # a single wait never exceeds one poll interval
    sleep: Callable[[float], None] = time.sleep
    wall: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be >= 1")

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        # full jitter: any wait up to the exponential step
        backoff = Backoff(self.initial_s, 2.0, self.max_wait_s, jitter=1.0)

        def next_wait(n: int, e: BaseException) -> float | None:
            if n >= self.attempts:
                return None
            w = backoff.wait(n, random.random())  # noqa: S311 - jitter, not cryptography
            after = (
                e.classify(self.wall()).wait_at_least if isinstance(e, ComputeAPIError) else None
            )
            return w if after is None else min(self.max_wait_s, max(w, after))

        try:
            return retry_call(
                lambda _n: fn(),
                next_wait,
                retry_on=lambda e: isinstance(e, ComputeAPIError) and e.transient,
                sleep=self.sleep,
            )
        except ComputeAPIError as last:
            if not last.transient:
                raise
            raise GaveUpError(
                f"{what}: gave up after {self.attempts} attempts, last error: {last}",
                last.status,
                last.reason,
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
class InstanceStatus:
    """What the API says about an instance (the poller's view; the VM's own identity is
    ``gce_watchdog.daemon.metawatch.InstanceInfo``)."""

    name: str
    id: str
    status: str
    spot: bool
    termination_action: str = ""
    # The instance's labels (Instance.labels, a map of strings), sorted: hashable, for the
    # decisions the poller records (docs/poller.md, "Decisions as an interface").
    labels: tuple[tuple[str, str], ...] = ()
    # Instance.lastStartTimestamp (epoch seconds): when the VM was last started, so when the
    # boot that runs (or that ended last) began; None when not given or not readable.
    last_start: float | None = None
    # What it cost (poller/cost.py): the machine type's name (Instance.machineType's last part),
    # the GPUs attached (Instance.guestAccelerators' acceleratorCount summed; 0: none listed),
    # and lastStopTimestamp as Unix seconds (None: absent or unreadable).
    machine_type: str = ""
    accelerators: int = 0
    last_stop: float | None = None


def _stamp(body: dict[str, Any], key: str) -> float | None:
    """An RFC 3339 timestamp field of an instance resource in epoch seconds, or None (absent,
    unreadable, or without a zone offset)."""
    raw = body.get(key)
    if not isinstance(raw, str) or not raw:
        return None
    try:
        t = dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t.timestamp() if t.tzinfo is not None else None


def last_start_of(body: dict[str, Any]) -> float | None:
    """``Instance.lastStartTimestamp`` (RFC 3339) in epoch seconds, or None."""
    return _stamp(body, "lastStartTimestamp")


def instance_cost_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The :class:`InstanceStatus` fields what-it-cost reads from an instance resource (besides
    ``last_start``, :func:`last_start_of`)."""
    total = 0
    for a in body.get("guestAccelerators") or []:
        n = a.get("acceleratorCount") if isinstance(a, dict) else None
        total += n if isinstance(n, int) and n > 0 else 0
    return {
        "machine_type": str(body.get("machineType") or "").rstrip("/").rsplit("/", 1)[-1],
        "accelerators": total,
        "last_stop": _stamp(body, "lastStopTimestamp"),
    }


def instance_labels(body: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """``Instance.labels`` of an instance resource, sorted; () when absent or not a map."""
    raw = body.get("labels")
    if not isinstance(raw, dict):
        return ()
    return tuple(sorted((str(k), str(v)) for k, v in raw.items()))


def validate_target(project: str, zone: str, names: list[str]) -> list[str]:
    """Every problem with the project, zone and instance names, for one clear error message."""
    errs = []
    if not _PROJECT_RE.match(project):
        errs.append(f"project {project!r} is not a valid project id")
    if not re.match(r"[a-z]+-[a-z]+\d+-[a-z]\Z", zone):
        errs.append(f"zone {zone!r} is not a zone name like us-central1-a")
    errs += [f"instance {n!r} is not a valid instance name" for n in names if not _NAME_RE.match(n)]
    return errs


_ENV_CACHED: dict[type, type] = {}


def env_cached_session_class(base: type) -> type:
    """``base`` (a ``requests.Session`` subclass: google-auth's ``AuthorizedSession``) with the
    environment's proxy and CA-bundle settings read once per origin instead of on every request.

    requests, with ``trust_env`` (the default), scans the whole environment on every request
    for ``*_proxy`` variables and matches ``no_proxy`` against the URL's host
    (``Session.merge_environment_settings``): at one serial read per VM per round that was about
    a fifth of the poller's CPU. The result depends only on the environment, which a poller does
    not change, and on the URL's scheme and host, so it is computed at an origin's first request
    and reused; the rest is requests' own merge. Behaviour is requests' (the same proxies, the
    same ``REQUESTS_CA_BUNDLE``/``CURL_CA_BUNDLE``), netrc and redirects untouched.
    """
    if base in _ENV_CACHED:
        return _ENV_CACHED[base]
    from urllib.parse import urlsplit

    from requests import sessions
    from requests.utils import get_environ_proxies

    merge: Any = sessions.merge_setting  # untyped in requests

    class EnvCachedSession(base):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._env_lock = threading.Lock()
            self._env_proxies: dict[tuple[str, str, str | None], dict[str, str]] = {}
            self._env_ca: str | None = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get(
                "CURL_CA_BUNDLE"
            )

        def merge_environment_settings(
            self,
            url: str,
            proxies: dict[str, str] | None,
            stream: bool | None,
            verify: Any,
            cert: Any,
        ) -> dict[str, Any]:
            # requests.Session.merge_environment_settings (2.x), its environment look-ups cached
            if self.trust_env:
                no_proxy = proxies.get("no_proxy") if proxies is not None else None
                parts = urlsplit(url)
                key = (parts.scheme, parts.netloc, no_proxy)
                with self._env_lock:
                    env_proxies = self._env_proxies.get(key)
                    if env_proxies is None:
                        env_proxies = self._env_proxies[key] = dict(
                            get_environ_proxies(url, no_proxy=no_proxy)
                        )
                if proxies is not None:
                    for k, v in env_proxies.items():
                        proxies.setdefault(k, v)
                if verify is True or verify is None:
                    verify = self._env_ca or verify
            return {
                "proxies": merge(proxies, self.proxies),
                "stream": merge(stream, self.stream),
                "verify": merge(verify, self.verify),
                "cert": merge(cert, self.cert),
            }

    EnvCachedSession.__name__ = EnvCachedSession.__qualname__ = f"EnvCached{base.__name__}"
    _ENV_CACHED[base] = EnvCachedSession
    return EnvCachedSession


class ComputeClient:
    """The Compute API calls the poller needs, through one authorized session."""

    def __init__(
        self,
        session: HTTPSession,
        api_base: str = DEFAULT_API_BASE,
        timeout: float | tuple[float, float] = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
        retry: ComputeRetry | None = None,
        max_allowed_time: float | None = None,
    ) -> None:
        self.session = session
        self.api_base = api_base.rstrip("/")
        self.timeout = timeout
        self.retry = retry or ComputeRetry()
        # google-auth's bound on the whole call, token refresh included (its default is 120 s)
        self.max_allowed_time = max_allowed_time

    @classmethod
    def create(
        cls,
        credentials: Any = None,
        api_base: str = DEFAULT_API_BASE,
        timeout: float | tuple[float, float] = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
        retry: ComputeRetry | None = None,
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
        session = env_cached_session_class(AuthorizedSession)(credentials)
        return cls(session, api_base, timeout, retry)

    @classmethod
    def on_vm(cls, api_base: str, timeout: float) -> ComputeClient:
        """A client acting as this VM's service account (token from the metadata server that
        google-auth is pointed at: ``GCE_METADATA_HOST``/``GCE_METADATA_IP``), one attempt per
        call, ``timeout`` bounding each request and its token refresh."""
        import google.auth.compute_engine
        import google.auth.transport.requests

        gce: Any = google.auth.compute_engine
        transport: Any = google.auth.transport.requests
        session = transport.AuthorizedSession(gce.Credentials())
        return cls(session, api_base, timeout, ComputeRetry(attempts=1), max_allowed_time=timeout)

    def close(self) -> None:
        self.session.close()

    def instance_url(self, project: str, zone: str, name: str, suffix: str = "") -> str:
        return f"{self.api_base}/projects/{project}/zones/{zone}/instances/{name}{suffix}"

    _url = instance_url

    def send(
        self, method: str, url: str, params: dict[str, str], body: object = None
    ) -> requests.Response:
        """One request, bounded; transport and token errors are raised as they come. ``body``:
        sent as JSON when not None."""
        kw: dict[str, Any] = {"params": params, "timeout": self.timeout}
        if body is not None:
            kw["json"] = body
        if self.max_allowed_time is not None:
            kw["max_allowed_time"] = self.max_allowed_time
        return self.session.request(method, url, **kw)

    def _once(
        self, method: str, url: str, params: dict[str, str], body: object = None
    ) -> dict[str, Any]:
        import google.auth.exceptions
        import requests

        try:
            r = self.send(method, url, params, body)
        except google.auth.exceptions.RefreshError as e:
            raise AuthError(f"credentials could not be refreshed: {e}", 401) from None
        except google.auth.exceptions.TransportError as e:
            raise ComputeAPIError(f"{method} {url}: token endpoint unreachable: {e}") from None
        except requests.Timeout:
            c, rd = self.timeout if isinstance(self.timeout, tuple) else (self.timeout,) * 2
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
        after = parse_retry_after(r.headers.get("Retry-After"), time.time())
        raise ComputeAPIError(text, r.status_code, reason, after)

    def _call(
        self, method: str, url: str, params: dict[str, str], body: object = None
    ) -> dict[str, Any]:
        result: dict[str, Any] = self.retry.call(
            f"{method} {url}", lambda: self._once(method, url, params, body)
        )
        return result

    def test_iam_permissions(
        self, project: str, zone: str, name: str, permissions: list[str]
    ) -> list[str]:
        """``instances.testIamPermissions``: the subset of ``permissions`` the caller holds on
        the instance (discovery document: POST .../instances/{resource}/testIamPermissions,
        ``TestPermissionsRequest`` {"permissions": [...]} in, ``TestPermissionsResponse`` out;
        an empty subset may come back as ``{}``)."""
        body = self._call(
            "POST",
            self._url(project, zone, name, "/testIamPermissions"),
            {},
            {"permissions": list(permissions)},
        )
        held = body.get("permissions") or []
        if not isinstance(held, list):
            raise ComputeAPIError("malformed TestPermissionsResponse", 200)
        return [str(p) for p in held if str(p) in permissions]

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

    def get_instance(self, project: str, zone: str, name: str) -> InstanceStatus | None:
        """The instance, or None when it does not exist (deleted, e.g. a reaped Spot VM)."""
        try:
            body = self._call("GET", self._url(project, zone, name), {})
        except NotFoundError:
            return None
        sched = body.get("scheduling") or {}
        spot = sched.get("provisioningModel") == "SPOT" or bool(sched.get("preemptible"))
        return InstanceStatus(
            name=str(body.get("name", name)),
            id=str(body.get("id", "")),
            status=str(body.get("status", "")),
            spot=spot,
            termination_action=str(sched.get("instanceTerminationAction", "")),
            labels=instance_labels(body),
            last_start=last_start_of(body),
            **instance_cost_fields(body),
        )

    def scope_exists(self, project: str, zone: str | None = None) -> bool:
        """Whether the project (and the zone in it) exists: False on 404, raises otherwise."""
        url = f"{self.api_base}/projects/{project}" + (f"/zones/{zone}" if zone else "")
        try:
            self._call("GET", url, {})
        except NotFoundError:
            return False
        return True

    def delete_instance(
        self, project: str, zone: str, name: str, request_id: str
    ) -> dict[str, Any]:
        """Delete with a requestId: retries (ours or another poller's) are one request to GCE."""
        return self._call("DELETE", self._url(project, zone, name), {"requestId": request_id})

    def stop_instance(self, project: str, zone: str, name: str, request_id: str) -> dict[str, Any]:
        return self._call(
            "POST", self._url(project, zone, name, "/stop"), {"requestId": request_id}
        )

    def aggregated_instances(
        self, project: str, filter: str = "", page_token: str = "", max_results: int = 500
    ) -> dict[str, Any]:
        """One page of ``instances.aggregatedList`` (``items`` keyed ``zones/ZONE``).

        Only parameters the discovery document declares are sent: ``returnPartialSuccess`` is
        not declared for this method in revision 20261106 (it was in 20241001), and a service
        that validates parameters would refuse it. Unreachable zones still come back in
        ``unreachables`` (``InstanceAggregatedList``).
        """
        params = {"maxResults": str(max_results)}
        if filter:
            params["filter"] = filter
        if page_token:
            params["pageToken"] = page_token
        return self._call("GET", f"{self.api_base}/projects/{project}/aggregated/instances", params)

    def zone_operations(
        self, project: str, zone: str, filter: str = "", max_results: int = 500
    ) -> list[dict[str, Any]]:
        """``zoneOperations.list`` with ``filter`` (e.g. ``targetLink = "..."``), every page."""
        url = f"{self.api_base}/projects/{project}/zones/{zone}/operations"
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            params = {"maxResults": str(max_results)}
            if filter:
                params["filter"] = filter
            if token:
                params["pageToken"] = token
            body = self._call("GET", url, params)
            items += [i for i in body.get("items") or [] if isinstance(i, dict)]
            token = str(body.get("nextPageToken") or "")
            if not token:
                return items

    def get_operation(self, project: str, zone: str, name: str) -> dict[str, Any]:
        """``zoneOperations.get``: the operation as it is now (PENDING, RUNNING or DONE)."""
        url = f"{self.api_base}/projects/{project}/zones/{zone}/operations/{name}"
        return self._call("GET", url, {})


# GCE label syntax (Compute Engine docs, "Labels": keys start with a lower-case letter).
_LABEL_RE = re.compile(r"[a-z][-_a-z0-9]{0,62}\Z")
_VALUE_RE = re.compile(r"[-_a-z0-9]{0,63}\Z")


def parse_label(spec: str) -> tuple[str, str | None]:
    """``KEY=VALUE`` or ``KEY`` (any value) as GCE label syntax allows; ValueError otherwise."""
    key, sep, value = spec.partition("=")
    if not _LABEL_RE.match(key):
        raise ValueError(f"label key {key!r}: lower-case letters, digits, - and _, 1-63")
    if sep and not _VALUE_RE.match(value):
        raise ValueError(f"label value {value!r}: lower-case letters, digits, - and _, 0-63")
    return key, (value if sep else None)


def label_filter(key: str, value: str | None) -> str:
    """The aggregatedList filter (AIP-160) for instances carrying the label."""
    return f"labels.{key}:*" if value is None else f'labels.{key} = "{value}"'
