"""Background watcher of the metadata server (never on the tick's path).

While the metadata server answers, :class:`MetadataWatcher`:

- caches the instance's identity (project, zone, name, id) in ``<state_dir>/instance.json``, so the
  action chain can call the Compute API on itself after the network has wedged (and after a
  restart of the agent);
- reads the disarm attribute (``watch.disarm_attribute``); a disarm stays valid for
  ``watch.disarm_hold`` after it was last confirmed, so it too always expires;
- decides whether the disarm and fault attributes may be obeyed at all (``daemon/mdtrust.py``:
  not when the VM's service account can write its own metadata, unless ``watch.trust_metadata``)
  once its identity is known and again every ``TRUST_RECHECK_S``, failing closed; an attribute
  it does not obey is said in the journal (and a fault request as ``fault op=refused
  why=untrusted``);
- long-polls ``instance/preempted`` and ``instance/maintenance-event`` with wait-for-change (ETag,
  ``timeout_sec``, a client timeout 10 s above the server's), and writes a ``preempted`` line the
  moment GCE announces a preemption (about 30 s before the VM is stopped), or a ``maintenance``
  line;
- when ``watch.faults_from_metadata`` is on (off by default), follows the fault attribute
  (``watch.fault_attribute``) and applies each new request once, by running ``gce-watchdog fault
  inject`` (the operator's command, so SSH and loopback stay open and the TTL reverts it) in a
  transient systemd unit, outside the agent's sandbox (``faults/request.py`` parses and decides).

Every request runs in the watcher's own threads with its own timeout; the daemon only reads
attributes, so the watcher can never delay a tick. Imports only the standard library.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from gce_watchdog.daemon import mdtrust
from gce_watchdog.faults.request import FaultRequest, decide, inject_argv, remember
from gce_watchdog.job.notice import Notice, maintenance_notice, preemption_notice
from gce_watchdog.lib.files import atomic_write, read_json
from gce_watchdog.lib.retry import Backoff
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter
from gce_watchdog.wire import vocab

INSTANCE_CACHE = "instance.json"
FAULT_REQUESTS = "fault-requests.json"  # ids of the metadata fault requests already applied
FAULT_APPLY_TIMEOUT_S = 60.0  # systemd-run returns once the unit started; `fault inject` in ms
FLAVOR = "Metadata-Flavor"
# The metadata server answers a wait-for-change request after at most timeout_sec; the client waits
# this much longer so that the server, not the client, ends an idle long poll (guest-agent: 60+10).
CLIENT_MARGIN_S = 10.0
# Back-off between failed requests: 1 s doubling to 60 s, with full jitter, reset on success.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
# A long poll that returns at once with an unchanged ETag (a server that ignores wait_for_change)
# must not turn into a busy loop: at least this long between two such requests.
MIN_POLL_GAP_S = 1.0
# The metadata trust check (daemon/mdtrust.py) runs again this often: a service account's
# scopes change only with the VM stopped, its IAM roles at any time.
TRUST_RECHECK_S = 600.0
SCOPES_PATH = "instance/service-accounts/default/scopes"
# Values must be safe to put in a Compute API URL path.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z")


@dataclass(frozen=True)
class InstanceInfo:
    """Who this VM is, as the Compute API names it."""

    project: str
    zone: str
    name: str
    id: str

    def to_json(self) -> dict[str, str]:
        return {"project": self.project, "zone": self.zone, "name": self.name, "id": self.id}

    @classmethod
    def from_json(cls, raw: object) -> InstanceInfo | None:
        """The info from a parsed cache file, or None when anything is missing or unsafe."""
        if not isinstance(raw, dict):
            return None
        vals = [raw.get(k) for k in ("project", "zone", "name", "id")]
        if not all(isinstance(v, str) and _NAME_RE.match(v) for v in vals):
            return None
        return cls(*(str(v) for v in vals))


def load_instance_cache(state_dir: str | Path) -> InstanceInfo | None:
    return InstanceInfo.from_json(read_json(Path(state_dir) / INSTANCE_CACHE))


def save_instance_cache(state_dir: str | Path, info: InstanceInfo) -> None:
    blob = (json.dumps(info.to_json(), sort_keys=True) + "\n").encode()
    atomic_write(Path(state_dir) / INSTANCE_CACHE, blob)


def metadata_root(cfg: cfgmod.Config) -> str:
    """The metadata root URL (``.../computeMetadata/v1/``): watch.metadata_root or metadata.url."""
    if cfg.watch.metadata_root:
        return cfg.watch.metadata_root.rstrip("/") + "/"
    url = cfg.metadata.url
    marker = "/computeMetadata/v1/"
    i = url.find(marker)
    if i >= 0:
        return url[: i + len(marker)]
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{marker}"


class MetadataError(Exception):
    """A request to the metadata server failed (connection, timeout, bad answer)."""


@dataclass(frozen=True)
class MdResponse:
    status: int
    body: str
    etag: str


class MetadataClient:
    """GET on the metadata server with the flavor header; one connection per request.

    Connections in flight are tracked so :meth:`abort` can cut a long poll short on stop.
    """

    def __init__(self, root: str) -> None:
        parts = urlsplit(root)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"metadata root must be an http:// URL, got {root!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.base_path = parts.path.rstrip("/") + "/"
        self._lock = threading.Lock()
        self._live: set[http.client.HTTPConnection] = set()
        self._aborted = False

    def get(self, path: str, params: dict[str, str] | None, timeout: float) -> MdResponse:
        url = self.base_path + path + (("?" + urlencode(params)) if params else "")
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        with self._lock:
            if self._aborted:
                raise MetadataError("watcher stopped")
            self._live.add(conn)
        try:
            conn.request("GET", url, headers={FLAVOR: "Google"})
            resp = conn.getresponse()
            body = resp.read(1 << 20).decode("utf-8", "replace")
            # Only the real metadata server (or a faithful fake) answers with the flavor header;
            # anything else (a proxy, a captive portal) must not be believed.
            if resp.getheader(FLAVOR) != "Google":
                raise MetadataError(f"HTTP {resp.status} without {FLAVOR}: Google")
            return MdResponse(resp.status, body, resp.getheader("ETag") or "")
        except (OSError, http.client.HTTPException) as e:
            raise MetadataError(f"{type(e).__name__}: {e}") from None
        finally:
            with self._lock:
                self._live.discard(conn)
            conn.close()

    def abort(self) -> None:
        """Make requests in flight fail now, and every later one at once."""
        with self._lock:
            self._aborted = True
            live = list(self._live)
        for conn in live:
            if conn.sock is not None:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)


# Waits while the metadata server is unreachable: 1 s doubling to 60 s, at least half of each.
BACKOFF = Backoff(BACKOFF_FIRST_S, 2.0, BACKOFF_MAX_S, jitter=0.5)


MonoClock = Callable[[], float]


def read_identity(client: MetadataClient, timeout: float) -> InstanceInfo:
    """The instance's identity from the metadata server: MetadataError when it cannot be read,
    ValueError (its values) when they are not what a Compute API URL can take."""
    got: dict[str, str] = {}
    for key, path in (
        ("id", "instance/id"),
        ("name", "instance/name"),
        ("zone", "instance/zone"),
        ("project", "project/project-id"),
    ):
        r = client.get(path, None, timeout)
        if r.status != 200:
            raise MetadataError(f"{path}: HTTP {r.status}")
        got[key] = r.body.strip()
    got["zone"] = got["zone"].rsplit("/", 1)[-1]  # projects/NUM/zones/ZONE -> ZONE
    info = InstanceInfo.from_json(got)
    if info is None:
        raise ValueError(str(got))
    return info


def metadata_trust(
    trust_local: bool, probe: TrustProbe, client: MetadataClient, timeout: float
) -> mdtrust.Trust:
    """One whole trust check, as ``check`` runs it: scopes, then (a write scope) the identity
    and testIamPermissions; what cannot be read counts as unknown (fail closed)."""
    if trust_local:
        return mdtrust.decide(True, None, None)
    scopes = probe.scopes()
    held = None
    if mdtrust.needs_permission_check(False, scopes):
        with contextlib.suppress(MetadataError, ValueError):
            held = probe.held(read_identity(client, timeout))
    return mdtrust.decide(False, scopes, held)


class TrustProbe:
    """The metadata trust check's edges: the service account's scopes from the metadata server,
    and ``instances.testIamPermissions`` on the VM itself through the Compute API as that
    account (``actions.api_base``; google-auth is imported only when a scope could write)."""

    def __init__(
        self,
        client: MetadataClient,
        api_base: str,
        timeout: float,
        compute: Callable[[], Any] | None = None,
    ) -> None:
        self.client = client
        self.api_base = api_base
        self.timeout = timeout
        # makes the Compute API client (a ``lib.compute.ComputeClient``); None: the VM's own
        # service account through the metadata server (``ComputeClient.on_vm``)
        self.compute = compute

    def scopes(self) -> list[str] | None:
        """The default service account's scopes; [] when the VM has none; None: unknown."""
        try:
            r = self.client.get(SCOPES_PATH, None, self.timeout)
        except MetadataError:
            return None
        if r.status == 404:
            return []
        if r.status != 200:
            return None
        return [x.strip() for x in r.body.splitlines() if x.strip()]

    def held(self, info: InstanceInfo) -> list[str] | None:
        """What ``testIamPermissions`` grants of ``[SET_METADATA]`` on this VM; None: unknown."""
        try:
            if self.compute is not None:
                client = self.compute()
            else:
                from gce_watchdog.lib.compute import ComputeClient

                client = ComputeClient.on_vm(self.api_base, self.timeout)
            try:
                held: list[str] = client.test_iam_permissions(
                    info.project, info.zone, info.name, [mdtrust.SET_METADATA]
                )
                return held
            finally:
                client.close()
        except Exception:  # an edge: every failure is "cannot tell" (fail closed)
            return None


class MetadataWatcher:
    """Threads that watch the metadata server; see the module docstring.

    ``clock`` (monotonic seconds) only ages the disarm confirmation; ``client`` is the HTTP edge.
    """

    def __init__(
        self,
        watch: cfgmod.WatchSection,
        root: str,
        state_dir: str,
        emitter: Emitter,
        clock: MonoClock = time.monotonic,
        client: MetadataClient | None = None,
        log: Callable[..., object] | None = None,
        apply_fault: FaultApplier | None = None,
        on_notice: Callable[[Notice], None] | None = None,
        wall: Callable[[], float] = time.time,
        trust_probe: TrustProbe | None = None,
        api_base: str = cfgmod.ActionsSection.api_base,
    ) -> None:
        self.watch = watch
        # None: a probe on this watcher's metadata client and the Compute API at ``api_base``
        self.trust_probe = trust_probe
        self.api_base = api_base
        self._trust = mdtrust.not_checked(watch.trust_metadata)
        self._trust_at: float | None = None  # clock() of the last finished check
        # set once a check has answered (or at once with trust_metadata): the fault watch waits
        # for it, so a request read at start-up is not refused only because nothing was checked
        self._trust_ready = threading.Event()
        if self._trust.trusted:
            self._trust_ready.set()
        self._ignored_said: dict[str, str] = {}  # attribute -> the reason last said for it
        self.on_notice = on_notice  # the job's notice (job/notice.py): written by the agent
        self.wall = wall
        self.state_dir = state_dir  # the instance identity cache (instance.json) lives here
        self.emitter = emitter
        self.clock = clock
        self.client = client or MetadataClient(root)
        self.log = log
        self.apply_fault = apply_fault or SystemdFaultApplier(None)
        self._lock = threading.Lock()
        self._fault_seen: str | None = None  # the last fault attribute value acted on
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._instance: InstanceInfo | None = None
        self._disarm_value = False
        self._disarm_confirmed: float | None = None
        self._preempted = False
        self._maintenance = "NONE"
        self.refreshes = 0  # successful identity/attribute refreshes (tests, `check`)

    @classmethod
    def from_config(cls, cfg: cfgmod.Config, emitter: Emitter, **kw: Any) -> MetadataWatcher:
        """A watcher for ``cfg.watch`` on the metadata server of ``cfg.metadata``."""
        kw.setdefault("api_base", cfg.actions.api_base)
        return cls(cfg.watch, metadata_root(cfg), cfg.agent.state_dir, emitter, **kw)

    # -- what the daemon reads (cheap, never blocks on the network) ------------------------------
    @property
    def instance(self) -> InstanceInfo | None:
        with self._lock:
            return self._instance

    @property
    def disarm_requested(self) -> bool:
        """True while the disarm attribute is set, was confirmed within ``disarm_hold``, and
        metadata may be obeyed (:attr:`trust`)."""
        with self._lock:
            if not self._disarm_value or self._disarm_confirmed is None:
                return False
            if not self._trust.trusted:
                return False
            return self.clock() - self._disarm_confirmed < self.watch.disarm_hold

    @property
    def trust(self) -> mdtrust.Trust:
        """Whether the disarm and fault attributes may be obeyed, and why (daemon/mdtrust.py)."""
        with self._lock:
            return self._trust

    @property
    def preempted(self) -> bool:
        with self._lock:
            return self._preempted

    @property
    def maintenance(self) -> str:
        with self._lock:
            return self._maintenance

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> MetadataWatcher:
        with self._lock:
            self._instance = load_instance_cache(self.state_dir)
        if not self.watch.enabled:
            return self
        targets: list[tuple[str, Callable[[], None]]] = [("mdwatch-info", self._info_loop)]
        targets.append(("mdwatch-preempt", lambda: self._watch("instance/preempted", self._on_pre)))
        targets.append(
            ("mdwatch-maint", lambda: self._watch("instance/maintenance-event", self._on_maint))
        )
        if self.watch.faults_from_metadata:
            targets.append(("mdwatch-fault", self._fault_loop))
        for name, fn in targets:
            t = threading.Thread(target=fn, name=name, daemon=True)
            self._threads.append(t)
            t.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self.client.abort()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]

    # -- identity and the disarm attribute -------------------------------------------------------
    def refresh_once(self) -> bool:
        """Read identity and the disarm attribute once; True when the identity was read."""
        try:
            info = read_identity(self.client, float(self.watch.request_timeout))
        except MetadataError as e:
            self._note("identity read failed", error=str(e))
            return False
        except ValueError as e:
            self._note("identity has unexpected values", values=str(e))
            return False
        with self._lock:
            changed = info != self._instance
            self._instance = info
        if changed:
            # The `start` line names the instance from the cache; on a first boot it has none
            # (inst=-), so the identity is said once here when it is first learnt (or changes).
            self.emitter.emit(
                vocab.INSTANCE,
                {"inst": info.id, "name": info.name, "zone": info.zone, "proj": info.project},
                f"this VM is {info.name} in {info.zone}",
            )
            try:
                save_instance_cache(self.state_dir, info)
            except OSError as e:
                self._note("cannot write the instance cache", error=str(e))
        if self._trust_at is None or self.clock() - self._trust_at >= TRUST_RECHECK_S:
            self.check_trust(info)
        self._read_disarm()
        self.refreshes += 1
        return True

    def check_trust(self, info: InstanceInfo) -> mdtrust.Trust:
        """Decide again whether metadata may be obeyed; say it in the journal when it changed."""
        local = self.watch.trust_metadata
        scopes: list[str] | None = None
        held: list[str] | None = None
        if not local:
            probe = self.trust_probe or TrustProbe(
                self.client, self.api_base, float(self.watch.request_timeout)
            )
            scopes = probe.scopes()
            if mdtrust.needs_permission_check(local, scopes):
                held = probe.held(info)
        trust = mdtrust.decide(local, scopes, held)
        with self._lock:
            before, self._trust = self._trust, trust
            self._trust_at = self.clock()
        self._trust_ready.set()
        first = before.why == mdtrust.NOT_CHECKED
        # said when metadata is not obeyed, and when that changes; a first check that trusts
        # (the usual case) is `check`'s to say, not a journal line at every start
        if (before.trusted, before.why) != (trust.trusted, trust.why) and not (
            first and trust.trusted
        ):
            verb = "obeyed" if trust.trusted else "ignored"
            self._note(
                f"metadata disarm and fault attributes {verb}: {trust.detail}", why=trust.why
            )
        return trust

    def _read_disarm(self) -> None:
        path = "instance/attributes/" + self.watch.disarm_attribute
        try:
            r = self.client.get(path, None, self.watch.request_timeout)
        except MetadataError as e:
            self._note("disarm attribute read failed", error=str(e))
            return  # unknown: keep the last answer, which ages out after disarm_hold
        if r.status == 404:
            value = False
        elif r.status == 200:
            value = parse_disarm_value(r.body)
        else:
            return
        with self._lock:
            self._disarm_value = value
            self._disarm_confirmed = self.clock()
            trust = self._trust
        self._say_ignored(self.watch.disarm_attribute, value and not trust.trusted, trust)

    def _say_ignored(self, attribute: str, ignored: bool, trust: mdtrust.Trust) -> None:
        """The journal says, once per attribute and reason, that a set attribute is ignored."""
        if not ignored:
            self._ignored_said.pop(attribute, None)
            return
        if self._ignored_said.get(attribute) == trust.why:
            return
        self._ignored_said[attribute] = trust.why
        self._note(
            f"metadata attribute {attribute} is set but ignored: {trust.detail} "
            "(docs/actions.md, 'Who may disarm through metadata')",
            why=trust.why,
        )

    def _info_loop(self) -> None:
        backoff = BACKOFF.counter()
        while not self._stop.is_set():
            if self.refresh_once():
                backoff.reset()
                wait = float(self.watch.refresh)
            else:
                wait = min(backoff.next(), self.watch.refresh)
            if self._stop.wait(wait):
                return

    # -- long polls ------------------------------------------------------------------------------
    def _watch(self, path: str, on_value: Callable[[str], None]) -> None:
        """Follow one key with wait-for-change; on_value gets the first and every new value."""
        w = self.watch
        etag = ""
        backoff = BACKOFF.counter()
        while not self._stop.is_set():
            params: dict[str, str] = {}
            timeout = float(w.request_timeout)
            if etag:
                params = {
                    "wait_for_change": "true",
                    "last_etag": etag,
                    "timeout_sec": str(int(w.poll_timeout)),
                }
                timeout = w.poll_timeout + CLIENT_MARGIN_S
            t0 = time.monotonic()
            try:
                r = self.client.get(path, params, timeout)
                if r.status != 200:
                    raise MetadataError(f"{path}: HTTP {r.status}")
            except MetadataError as e:
                if self._stop.is_set():
                    return
                self._note("long poll failed", path=path, error=str(e))
                etag = ""  # start over with a plain read: the value may have changed meanwhile
                if self._stop.wait(backoff.next()):
                    return
                continue
            backoff.reset()
            if not r.etag:
                # A server without ETags cannot long-poll: read it every `refresh` instead.
                on_value(r.body.strip())
                if self._stop.wait(w.refresh):
                    return
                continue
            if r.etag == etag:
                # The server's timeout_sec ended the poll with no change; never a busy loop.
                gap = MIN_POLL_GAP_S - (time.monotonic() - t0)
                if gap > 0 and self._stop.wait(gap):
                    return
                continue
            etag = r.etag
            on_value(r.body.strip())

    def _on_pre(self, value: str) -> None:
        now = value.upper() == "TRUE"
        with self._lock:
            was, self._preempted = self._preempted, now
            inst = self._instance
        if now and not was:
            self._notice(preemption_notice(self.wall()))
            self.emitter.emit(
                vocab.PREEMPTED,
                {"inst": inst.id if inst else "-", "src": "metadata"},
                "GCE is preempting this VM (spot reclaim, not a wedge)",
                sync=True,
            )

    def _on_maint(self, value: str) -> None:
        value = value or "NONE"
        with self._lock:
            was, self._maintenance = self._maintenance, value
        if value != was:
            self._notice(maintenance_notice(value, self.wall()))
            self.emitter.emit(
                vocab.MAINTENANCE,
                {"event": value, "was": was},
                f"host maintenance event: {value}",
                sync=True,
            )

    # -- faults requested through metadata --------------------------------------------------------
    def _fault_loop(self) -> None:
        """Follow the fault attribute: long-poll its value while it exists, and the attribute
        listing while it does not (a missing key cannot be long-polled); every change is read."""
        w = self.watch
        key = "instance/attributes/" + w.fault_attribute
        listing = "instance/attributes/"
        key_etag = ""
        backoff = BACKOFF.counter()
        while not self._trust_ready.wait(MIN_POLL_GAP_S):  # the first trust check (bounded:
            if self._stop.is_set():  # by stop)
                return
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                if key_etag:
                    r = self.client.get(key, self._wait_params(key_etag), w.poll_timeout + 10.0)
                else:
                    r = self.client.get(key, None, float(w.request_timeout))
                if r.status not in (200, 404):
                    raise MetadataError(f"{key}: HTTP {r.status}")
                if r.status == 404:
                    key_etag = ""
                    self.on_fault_value(None)
                    # Wait for the listing to change (the key added), or for the server's
                    # timeout; then read the key again either way (it may have been added
                    # between our two reads).
                    lr = self.client.get(listing, None, float(w.request_timeout))
                    if lr.status == 200 and lr.etag:
                        self.client.get(listing, self._wait_params(lr.etag), w.poll_timeout + 10.0)
                    elif self._stop.wait(w.refresh):
                        return
                    gap = MIN_POLL_GAP_S - (time.monotonic() - t0)
                    if gap > 0 and self._stop.wait(gap):
                        return
                    continue
            except MetadataError as e:
                if self._stop.is_set():
                    return
                self._note("fault attribute read failed", error=str(e))
                key_etag = ""
                if self._stop.wait(backoff.next()):
                    return
                continue
            backoff.reset()
            if not r.etag:
                self.on_fault_value(r.body)
                if self._stop.wait(w.refresh):
                    return
                continue
            if r.etag == key_etag:
                gap = MIN_POLL_GAP_S - (time.monotonic() - t0)
                if gap > 0 and self._stop.wait(gap):
                    return
                continue
            key_etag = r.etag
            self.on_fault_value(r.body)

    def _wait_params(self, etag: str) -> dict[str, str]:
        return {
            "wait_for_change": "true",
            "last_etag": etag,
            "timeout_sec": str(int(self.watch.poll_timeout)),
        }

    def on_fault_value(self, value: str | None) -> None:
        """Act on one value of the fault attribute (None: absent): apply a new request once."""
        if value == self._fault_seen:
            return
        self._fault_seen = value
        applied = load_applied(self.state_dir)
        trust = self.trust
        d = decide(value, self.watch.faults_from_metadata, applied, trust.trusted)
        if d.request is None:
            if d.why in ("absent", "applied-before"):
                return
            if d.why == "untrusted":
                self._say_ignored(self.watch.fault_attribute, True, trust)
                d = replace(d, why=f"untrusted: {trust.why}")
            else:
                self._note("fault request refused", why=d.why)
            self.emitter.emit(
                vocab.FAULT,
                {"op": "refused", "req": _request_id(value), "why": d.why.split(":")[0]},
                d.why[:100],
                sync=True,
            )
            return
        req = d.request
        # Recorded BEFORE it runs: a crash half-way never applies the same request twice.
        try:
            save_applied(self.state_dir, remember(applied, req.id))
        except OSError as e:
            self._note("cannot record the fault request; not applied", error=str(e))
            return
        err = self.apply_fault(req)
        if err:
            self._note("fault request failed", req=req.id, error=err)
            self.emitter.emit(
                vocab.FAULT,
                {"op": "refused", "req": req.id, "why": "apply_failed"},
                err[:100],
                sync=True,
            )

    def _notice(self, notice: Notice) -> None:
        """Hand the job its notice first: it has the least time of anyone to act on it."""
        if self.on_notice is None:
            return
        try:
            self.on_notice(notice)
        except OSError as e:  # best effort at the edge: the console line still goes out
            self._note("cannot write the job's notice", error=str(e))

    def _note(self, msg: str, **kw: Any) -> None:
        if self.log is not None:
            with contextlib.suppress(Exception):
                self.log(msg, **kw)


def parse_disarm_value(body: str) -> bool:
    """An attribute value that disarms: true/1/yes/on (any case); anything else does not."""
    return body.strip().lower() in ("true", "1", "yes", "on")


FaultApplier = Callable[[FaultRequest], str | None]
"""Applies a fault request; returns None when started, else what went wrong."""


def load_applied(state_dir: str | Path) -> list[str]:
    raw = read_json(Path(state_dir) / FAULT_REQUESTS)
    ids = raw.get("applied") if isinstance(raw, dict) else None
    return [x for x in ids if isinstance(x, str)] if isinstance(ids, list) else []


def save_applied(state_dir: str | Path, ids: Sequence[str]) -> None:
    blob = (json.dumps({"applied": list(ids)}) + "\n").encode()
    atomic_write(Path(state_dir) / FAULT_REQUESTS, blob)


def _request_id(value: str | None) -> str:
    """The request's id for a refusal line, only when it is a safe token (else ``-``)."""
    try:
        raw = json.loads(value or "")
    except ValueError:
        return "-"
    rid = raw.get("id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) and _NAME_RE.match(rid) and len(rid) <= 63 else "-"


class SystemdFaultApplier:
    """Runs ``gce-watchdog fault inject`` for a request.

    Under systemd it runs in a transient unit (``systemd-run``): the agent's own unit has no
    CAP_NET_ADMIN and no netlink, and the fault's reverter (a systemd timer) then lives outside the
    agent's cgroup, so it fires even if the agent dies or is restarted. Without systemd (a
    container, a test) the command runs directly.
    """

    def __init__(
        self,
        config: str | None,
        command: Sequence[str] = (sys.executable, "-m", "gce_watchdog"),
        run: Callable[[list[str]], tuple[int, str]] | None = None,
        systemd: Callable[[], bool] | None = None,
    ) -> None:
        self.config = config
        self.command = list(command)
        self.run = run or _run_bounded
        self.systemd = systemd or (lambda: os.path.isdir("/run/systemd/system"))

    def argv(self, req: FaultRequest) -> list[str]:
        inner = inject_argv(req, self.command, self.config)
        if not self.systemd():
            return inner
        return [
            "systemd-run",
            f"--unit=gcewd-fault-md-{req.id}",
            "--description=gce-watchdog: fault requested through metadata",
            "--collect",
            "--quiet",
            "--",
            *inner,
        ]

    def __call__(self, req: FaultRequest) -> str | None:
        rc, err = self.run(self.argv(req))
        return None if rc == 0 else f"rc={rc}: {err.strip()[:200]}"


def _run_bounded(argv: list[str]) -> tuple[int, str]:
    try:
        p = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=FAULT_APPLY_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)
    return p.returncode, p.stderr
