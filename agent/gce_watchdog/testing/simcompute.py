"""A fake Compute Engine API: a real HTTP server on 127.0.0.1, pinned to Google's own references.

Used by the poller's tests, the e2e test, the benchmarks and the action-chain tests. It serves the
``compute/v1`` methods in :data:`METHODS`, under ``/compute/v1`` like the real service. Each
method's HTTP verb, path and declared parameters are copied from the Compute Engine v1 discovery
document (revision 20261106, in google-api-python-client 2.202.0); a test
(``tests/test_simcompute_discovery.py``) reads the vendored document
(``tests/data/discovery/compute.v1.subset.json``) and fails when this table, the status enums or
the fields and types of any response disagree with it. ``docs/fakes.md`` lists every behaviour
with its reference.

- **Parameters.** A query parameter the method does not declare (nor the document's standard
  parameters, ``alt``, ``fields``, ...) is refused with 400, as Google's API front end refuses a
  parameter it "cannot bind" (so a client sending ``returnPartialSuccess``, undeclared in this
  revision, fails here as it would on GCE).
- **Serial output** (``instances.getSerialPortOutput``): only the most recent ``window`` bytes
  (1 MiB by default) are kept; an older ``start`` is moved to the oldest byte held and returned
  as ``start``; a negative ``start`` means "the most recent ``-start`` bytes"; ``next`` is the
  offset for the next call; int64s are JSON strings. Where the reference is silent the fake
  chooses: a ``start`` beyond the end returns no contents with ``start = next = end``.
  By default (``serial_needs_running=True``, the faithful mode) a VM that is not RUNNING is
  refused with 503 ``backendError``: GCE serves serial output "only while the VM instance is
  running" (Compute Engine docs, "Viewing serial port output"), and 503 ``TIMEOUT,
  backendError`` is the error Google's own serial poller met on a STOPPING VM
  (compute-image-tools PR #456). What GCE answers for a TERMINATED one is not documented; the
  fake gives the same 503, and the poller must not depend on the code.
- **Operations** (``Operation``: PENDING, RUNNING, DONE, with ``error``): ``delete``, ``stop`` and
  ``setMetadata`` return an Operation that is PENDING for ``op_pending_s``, RUNNING for
  ``stop_delay_s``, then DONE, on the injected ``clock`` (tests advance it; nothing sleeps). While
  a stop or delete runs the VM is STOPPING ("currently stopping (either being deleted or
  killed)", ``Instance.status.enumDescriptions``), then TERMINATED, or gone (404) for a delete.
  ``fail_next_operation`` makes the next one end DONE with ``error`` and ``httpErrorStatusCode``
  and change nothing. ``zoneOperations.get`` and ``zoneOperations.list`` (``filter`` on
  ``operationType``, ``targetId``, ``targetLink``, ``status``, joined by AND) read them back.
- **System events** recorded as zone operations, with the operation types Google's tools read:
  ``preempt`` records ``compute.instances.preempted`` (Google's sample "List preemption history
  of an instance" filters zone operations on ``operationType="compute.instances.preempted"``),
  ``guest_shutdown`` records ``compute.instances.guestTerminate`` and ``host_error``
  ``compute.instances.hostError`` (GoogleCloudPlatform/gcpdiag ``runbook/gce/vm_termination.py``
  and its test, which tells a guest-OS-issued shutdown by that type). ``host_maintenance``
  follows ``Scheduling.onHostMaintenance`` (discovery document: ``MIGRATE`` "automatically
  migrate instances out of the way of maintenance events", the default; ``TERMINATE``
  "terminate and (optionally) restart the instance", what GPU VMs get): ``TERMINATE`` records
  ``compute.instances.terminateOnHostMaintenance`` and stops the VM, ``MIGRATE`` records
  ``compute.instances.migrateOnHostMaintenance`` and the VM stays RUNNING (the operation types
  of gcpdiag ``gcpdiag/runbook/gce/constants.py`` and of GoogleCloudPlatform/ml-auto-solutions'
  interruption DAG). ``restart`` is the automatic restart after a stop by Compute Engine
  (``Scheduling.automaticRestart``: "automatically restarted if it is terminated by Compute
  Engine (not terminated by a user)", true by default, never for preemptible VMs); when it
  comes is not documented ("may be restarted outside the window of maintenance events"), so
  the test says; whether GCE records an operation for it and whether the serial port keeps its
  bytes are not documented either: the fake records none and keeps them.
- ``instances.simulateMaintenanceEvent`` (discovery document: POST
  ``.../instances/{instance}/simulateMaintenanceEvent``, an Operation; Compute Engine docs
  "Simulate a host maintenance event": an instance that does not live-migrate "is either
  terminated or restarted, depending on the configured host maintenance policy"): the caller's
  operation ``simulateMaintenanceEvent`` (DONE), then the maintenance event above. The guest's
  ``maintenance-event`` value (``FakeInstance.maintenance_event``) says
  TERMINATE_ON_HOST_MAINTENANCE for ``maintenance_notice_s`` before the stop (the stop's
  operation is PENDING meanwhile); how much notice a simulated event gives is not documented
  (the fake's choice, 0 by default). A VM that is not RUNNING: 400 (not documented either).
- **requestId** ("a valid UUID with the exception that zero UUID is not supported",
  ``instances.delete.parameters.requestId``): the zero UUID and a non-UUID are 400; a repeated id
  returns the first request's operation and does not act twice; ids are kept per instance and
  method, so one id sent for two instances is two requests.
- ``instances.aggregatedList``: ``items`` keyed ``zones/ZONE``, each with ``instances`` or, for a
  zone with none that match, a ``warning`` ``NO_RESULTS_ON_PAGE``; ``nextPageToken`` while more
  remain (``maxResults`` 0..500, default 500). The filter understands the forms the poller
  sends: ``labels.KEY = "VALUE"`` and ``labels.KEY:*`` (fleet discovery), ``id = N`` (the
  Pub/Sub worker's lookup by id; AIP-160 with a number, the ``filter`` parameter's description
  in the discovery document); any other filter is a 400.

Every request needs ``Authorization: Bearer <token>`` with an accepted token (401 otherwise).
IAM per permission: ``roles`` maps a token to the permission set its principal's role grants (a
role is a set of permissions, Compute Engine docs "IAM roles and permissions"); a call whose
permission (``PERMISSIONS``, from the "IAM Permissions" section of each method's API reference
page) the set lacks is a 403 ``forbidden``, "Required 'compute.instances.get' permission for
'projects/P/zones/Z/instances/N'". A token not in ``roles`` has every permission.
``instances.testIamPermissions`` (discovery document: POST
``projects/{project}/zones/{zone}/instances/{resource}/testIamPermissions``, body
``TestPermissionsRequest`` ``{"permissions": [...]}``, answer ``TestPermissionsResponse``, "A
subset of ``TestPermissionsRequest.permissions`` that the caller is allowed") answers from the
same ``roles``: how a VM's service account asks whether it can write its own metadata.
Tests can make an endpoint hang (sleep past the client's timeout), refuse (403) or rate-limit
for the next N calls: ``RATE_LIMIT`` answers as GCE does, 403 with reason ``rateLimitExceeded``
in the error body (Compute Engine docs, "API rate limits": "a 403 error with the reason
rateLimitExceeded"); ``TOO_MANY_REQUESTS`` is a 429 with the same reason, what Google front ends
answer for other APIs (a client must take both).

Usage::

    with FakeComputeAPI(token="t", serial_needs_running=True) as api:
        api.add_instance("vm-1", spot=True)
        api.append_serial("vm-1", b"hello\\n")
        client = ComputeClient.create(credentials, api_base=api.base_url)  # lib.compute
"""

from __future__ import annotations

import datetime as dt
import enum
import itertools
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

DEFAULT_WINDOW = 1024 * 1024  # the API keeps "the most recent 1 MB" of serial output
DEFAULT_HANG_S = 30.0  # longer than any client read timeout a test would use
MAX_RESULTS = 500  # the API's default and maximum page size for list calls
ZERO_UUID = "00000000-0000-0000-0000-000000000000"
USER_EMAIL = "poller@test-project.iam.gserviceaccount.com"  # Operation.user of our own calls
API = "https://www.googleapis.com/compute/v1"

# Instance.status.enum and Operation.status.enum of revision 20261106 (the test compares).
INSTANCE_STATUSES = (
    "DEPROVISIONING",
    "PENDING",
    "PENDING_STOP",
    "PROVISIONING",
    "REPAIRING",
    "RUNNING",
    "STAGING",
    "STOPPED",
    "STOPPING",
    "SUSPENDED",
    "SUSPENDING",
    "TERMINATED",
)
OPERATION_STATUSES = ("DONE", "PENDING", "RUNNING")
# Instance.properties of the document: the fields an instances.insert body may carry (any other
# is refused, as Google's API front end refuses an unknown field of a JSON payload).
INSTANCE_FIELDS = frozenset(
    {
        "advancedMachineFeatures",
        "canIpForward",
        "confidentialInstanceConfig",
        "cpuPlatform",
        "creationTimestamp",
        "deletionProtection",
        "description",
        "disks",
        "displayDevice",
        "fingerprint",
        "guestAccelerators",
        "hostname",
        "id",
        "instanceEncryptionKey",
        "keyRevocationActionType",
        "kind",
        "labelFingerprint",
        "labels",
        "lastStartTimestamp",
        "lastStopTimestamp",
        "lastSuspendedTimestamp",
        "localSsdEncryptionMode",
        "machineType",
        "metadata",
        "minCpuPlatform",
        "name",
        "networkInterfaces",
        "networkPerformanceConfig",
        "params",
        "privateIpv6GoogleAccess",
        "reservationAffinity",
        "resourcePolicies",
        "resourceStatus",
        "satisfiesPzi",
        "satisfiesPzs",
        "scheduling",
        "selfLink",
        "serviceAccounts",
        "shieldedInstanceConfig",
        "shieldedInstanceIntegrityPolicy",
        "sourceMachineImage",
        "sourceMachineImageEncryptionKey",
        "startRestricted",
        "status",
        "statusMessage",
        "tags",
        "workloadIdentityConfig",
        "zone",
    }
)
# Instance.name.pattern (RFC 1035, 1-63 characters).
INSTANCE_NAME_RE = re.compile(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?\Z")
# The document's top-level "parameters": accepted by every method.
STANDARD_PARAMETERS = frozenset(
    {
        "$.xgafv",
        "access_token",
        "alt",
        "callback",
        "fields",
        "key",
        "oauth_token",
        "prettyPrint",
        "quotaUser",
        "uploadType",
        "upload_protocol",
        "userIp",
    }
)
# Operation types of system events (see the module docstring for the references).
OP_PREEMPTED = "compute.instances.preempted"
OP_GUEST_TERMINATE = "compute.instances.guestTerminate"
OP_HOST_ERROR = "compute.instances.hostError"
OP_TERMINATE_ON_MAINTENANCE = "compute.instances.terminateOnHostMaintenance"
OP_MIGRATE_ON_MAINTENANCE = "compute.instances.migrateOnHostMaintenance"
# Scheduling.onHostMaintenance.enum (the discovery document; the contract test compares them)
ON_HOST_MAINTENANCE = ("MIGRATE", "TERMINATE")
# The maintenance-event value of a stop that is coming (Compute Engine docs, "Get notice of host
# maintenance": NONE, MIGRATE_ON_HOST_MAINTENANCE or TERMINATE_ON_HOST_MAINTENANCE)
MAINTENANCE_TERMINATE = "TERMINATE_ON_HOST_MAINTENANCE"
# The system events after which Scheduling.automaticRestart brings the VM back ("terminated by
# Compute Engine (not terminated by a user)"): not a preemption (preemptible VMs "cannot be
# automatically restarted"), not a guest's own power-off.
_RESTARTABLE = frozenset({OP_HOST_ERROR, OP_TERMINATE_ON_MAINTENANCE})


@dataclass(frozen=True)
class Method:
    """One served method, as the discovery document declares it."""

    endpoint: str  # the fake's short name (faults, calls)
    http: str
    path: str  # relative to /compute/v1/, with {param} placeholders
    parameters: frozenset[str]


def _m(endpoint: str, http: str, path: str, params: str) -> Method:
    return Method(endpoint, http, path, frozenset(params.split()))


_I = "projects/{project}/zones/{zone}/instances/{instance}"
_Z = "projects/{project}/zones/{zone}"
_LIST = "filter maxResults orderBy pageToken project"
METHODS: dict[str, Method] = {
    "compute.instances.get": _m("get", "GET", _I, "instance project zone"),
    "compute.instances.getSerialPortOutput": _m(
        "serial", "GET", _I + "/serialPort", "instance port project start zone"
    ),
    "compute.instances.delete": _m(
        "delete", "DELETE", _I, "instance noGracefulShutdown project requestId zone"
    ),
    "compute.instances.stop": _m(
        "stop",
        "POST",
        _I + "/stop",
        "discardLocalSsd instance noGracefulShutdown project requestId zone",
    ),
    "compute.instances.setMetadata": _m(
        "set_metadata", "POST", _I + "/setMetadata", "instance project requestId zone"
    ),
    "compute.instances.simulateMaintenanceEvent": _m(
        "simulate_maintenance",
        "POST",
        _I + "/simulateMaintenanceEvent",
        "instance project requestId withExtendedNotifications zone",
    ),
    # POST .../instances/{resource}/testIamPermissions, TestPermissionsRequest
    # {"permissions": [...]} in, TestPermissionsResponse (the subset the caller holds) out
    # (compute.v1 discovery document, instances.testIamPermissions; the VM's metadata trust
    # check, daemon/mdtrust.py, asks it about compute.instances.setMetadata on itself)
    "compute.instances.testIamPermissions": _m(
        "test_iam",
        "POST",
        "projects/{project}/zones/{zone}/instances/{resource}/testIamPermissions",
        "project resource zone",
    ),
    "compute.instances.list": _m("zone_list", "GET", _Z + "/instances", _LIST + " zone"),
    "compute.instances.insert": _m(
        "insert",
        "POST",
        _Z + "/instances",
        "project requestId sourceInstanceTemplate sourceMachineImage zone",
    ),
    "compute.instances.aggregatedList": _m(
        "list",
        "GET",
        "projects/{project}/aggregated/instances",
        _LIST + " includeAllScopes serviceProjectNumber",
    ),
    "compute.zoneOperations.get": _m(
        "operation", "GET", _Z + "/operations/{operation}", "operation project zone"
    ),
    "compute.zoneOperations.list": _m("operations", "GET", _Z + "/operations", _LIST + " zone"),
    "compute.projects.get": _m("scope", "GET", "projects/{project}", "project"),
    "compute.zones.get": _m("scope", "GET", _Z, "project zone"),
}
# The IAM permission each method checks: the "IAM Permissions" section of each method's page in
# the Compute Engine API reference (compute/docs/reference/rest/v1/instances/getSerialPortOutput:
# "compute.instances.getSerialPortOutput"; instances/aggregatedList and instances/list:
# "compute.instances.list"; instances/insert: "compute.instances.create"; zoneOperations/get and
# list, projects/get, zones/get: the permission of the same name). Roles and permissions:
# Compute Engine docs, "IAM roles and permissions" (compute/docs/access/iam).
PERMISSIONS: dict[str, str] = {mid: mid for mid in METHODS} | {
    "compute.instances.aggregatedList": "compute.instances.list",
    "compute.instances.insert": "compute.instances.create",
    # testIamPermissions checks none: any caller may ask what it holds (its reference page,
    # "IAM Permissions": none required); the answer is the subset its role grants
    "compute.instances.testIamPermissions": "",
}
_ROUTES = [
    (
        mid,
        m,
        re.compile("^/compute/v1/" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", m.path) + "$"),
    )
    for mid, m in METHODS.items()
]
ENDPOINTS = tuple(sorted({m.endpoint for m in METHODS.values()}))

_LABEL_EQ_RE = re.compile(r'^labels\.(?P<key>[a-z][-_a-z0-9]*)\s*=\s*"(?P<value>[-_a-z0-9]*)"$')
_LABEL_HAS_RE = re.compile(r"^labels\.(?P<key>[a-z][-_a-z0-9]*):\*$")
# AIP-160 on a number field ("The value must be a string, a number, or a boolean", the filter
# parameter's description): the Pub/Sub worker's lookup of one instance by its id.
_ID_EQ_RE = re.compile(r"^id\s*=\s*(?P<id>[1-9][0-9]{0,19})$")
_OP_TERM_RE = re.compile(
    r"^\(?\s*(?P<field>operationType|targetId|targetLink|status)\s*=\s*"
    r'(?:"(?P<q>[^"]*)"|(?P<bare>[^\s()"]+))\s*\)?$'
)


class Fault(enum.Enum):
    """What an endpoint does instead of answering normally."""

    HANG = "hang"  # sleep hang_s before answering (the client's read timeout fires first)
    REFUSE = "refuse"  # 403 forbidden
    # Compute Engine docs, "API rate limits": "a 403 error with the reason rateLimitExceeded"
    RATE_LIMIT = "rate_limit"  # 403 with reason rateLimitExceeded, as GCE answers
    TOO_MANY_REQUESTS = "too_many_requests"  # 429 with reason rateLimitExceeded
    SERVER_ERROR = "server_error"  # 503 backendError


@dataclass(frozen=True)
class Call:
    """One request as the server saw it."""

    method: str
    endpoint: str  # one of ENDPOINTS, or unknown
    path: str
    query: dict[str, str]
    authorized: bool
    status: int
    client: str = ""  # the peer's address (the e2e guest's poller: 169.254.10.2)
    # the bearer token it sent, kept out of repr (an assertion message must not print it)
    bearer: str | None = field(default=None, repr=False)


@dataclass
class FakeInstance:
    name: str
    project: str
    zone: str
    id: str
    status: str = "RUNNING"
    spot: bool = False
    termination_action: str = "STOP"
    deleted: bool = False
    total: int = 0  # bytes ever written to serial port 1
    retained: bytearray = field(default_factory=bytearray)
    labels: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    fingerprint: str = "AAAAAAAAAAA="
    machine_type: str = ""  # set by instances.insert (its machineType, as sent)
    on_host_maintenance: str = "MIGRATE"  # Scheduling.onHostMaintenance (default MIGRATE)
    automatic_restart: bool = True  # Scheduling.automaticRestart (never for a Spot VM)
    # The value the metadata server gives the guest at instance/maintenance-event ("NONE", or
    # "TERMINATE_ON_HOST_MAINTENANCE" once a maintenance event that stops it was announced)
    maintenance_event: str = "NONE"
    inserted: dict[str, Any] = field(default_factory=dict)  # the insert body, as sent
    # Instance.lastStartTimestamp (the fake's clock): set when the VM starts RUNNING (added
    # running, a status set to RUNNING from another, a restart); None: never started
    last_start: float | None = None


@dataclass
class FakeOperation:
    """A zone operation; its status follows the clock: PENDING, RUNNING, then DONE."""

    id: str
    name: str
    type: str
    inst: FakeInstance
    insert_s: float
    pending_s: float
    running_s: float
    user: str
    error: tuple[int, str, str] | None = None  # (HTTP status, error code, message)
    effect: str = ""  # what DONE does to the instance: terminate | delete | metadata | ""
    meta: dict[str, str] = field(default_factory=dict)
    applied: str = "PENDING"  # the last status whose effect was applied

    def status(self, now: float) -> str:
        if now < self.insert_s + self.pending_s:
            return "PENDING"
        if now < self.insert_s + self.pending_s + self.running_s:
            return "RUNNING"
        return "DONE"


@dataclass
class _FaultPlan:
    fault: Fault
    remaining: int  # calls left to affect; -1 = every call until cleared


def _rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="milliseconds")


class FakeComputeAPI:
    """A threaded HTTP server pretending to be ``compute.googleapis.com``; a context manager.

    ``clock`` (seconds, default wall time) drives operations and is the time in ``insertTime``;
    ``stop_delay_s`` how long a stop, a delete or a system event keeps the VM STOPPING;
    ``op_pending_s`` how long an operation stays PENDING; ``serial_needs_running`` the faithful
    serial rule (on by default, as GCE; ``False`` only for a test about the reader's own window
    arithmetic that has no VM life cycle, see docs/fakes.md).
    """

    def __init__(
        self,
        token: str | list[str] = "test-token",  # noqa: S107 (a fake server's test token)
        window: int = DEFAULT_WINDOW,
        hang_s: float = DEFAULT_HANG_S,
        host: str = "127.0.0.1",
        *,
        clock: Callable[[], float] = time.time,
        stop_delay_s: float = 0.0,
        op_pending_s: float = 0.0,
        serial_needs_running: bool = True,
        roles: dict[str, Iterable[str]] | None = None,
        maintenance_notice_s: float = 0.0,
    ) -> None:
        self.tokens = {token} if isinstance(token, str) else set(token)
        # token -> the permissions its principal's role grants (a role is a permission set,
        # Compute Engine docs "IAM roles and permissions"); a token not named here has them all
        self.roles: dict[str, frozenset[str]] = {t: frozenset(p) for t, p in (roles or {}).items()}
        self.window = window
        self.hang_s = hang_s
        self.retry_after: str | None = "1"  # the Retry-After header of a RATE_LIMIT fault
        self.host = host
        self.clock = clock
        self.stop_delay_s = stop_delay_s
        self.op_pending_s = op_pending_s
        self.serial_needs_running = serial_needs_running
        # simulateMaintenanceEvent on a TERMINATE VM: how long the guest sees the notice before
        # the stop (GCE documents no notice for a simulated event; the fake's choice)
        self.maintenance_notice_s = maintenance_notice_s
        self.calls: list[Call] = []
        # requests per endpoint as they arrive, before any fault (a hung call is in ``calls``
        # only once it is answered): a test waits on this to act while a call hangs
        self.arrived: dict[str, int] = {}
        # (project, zone, instance name, method id, requestId) -> operation
        self.operations: dict[tuple[str, str, str, str, str], FakeOperation] = {}
        self._ops: list[FakeOperation] = []
        self._op_errors: list[tuple[int, str, str]] = []
        self._instances: dict[tuple[str, str, str], FakeInstance] = {}
        self._zones: set[tuple[str, str]] = set()  # projects and zones that exist (add_zone)
        self._faults: dict[str, _FaultPlan] = {}
        # per-instance and per-project faults (a slow VM; a project out of quota)
        self._instance_faults: dict[str, _FaultPlan] = {}
        self._project_faults: dict[str, _FaultPlan] = {}
        self.zones: set[tuple[str, str]] = set()  # (project, zone) pairs a list reports
        # (project, zone) -> how aggregatedList says it could not reach the zone
        self._unreachable: dict[tuple[str, str], str] = {}
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._ids = itertools.count(4_000_000_000_000_000_001)
        self._op_ids = itertools.count(7_000_000_000_000_000_001)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._more: list[tuple[ThreadingHTTPServer, threading.Thread]] = []  # serve_socket
        # Called (outside the lock, on the request's thread) with each instance that
        # instances.insert created: tests start a simulated guest there, e2e a qemu VM.
        self.on_insert: list[Callable[[FakeInstance], None]] = []
        # Called (outside the lock, before the answer is sent) with the instance and the
        # ``contents`` of each serialPort read answered 200: a test acts between two reads.
        self.on_serial: list[Callable[[FakeInstance, str], None]] = []

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> FakeComputeAPI:
        handler = _make_handler(self)
        self._server = ThreadingHTTPServer((self.host, 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def serve_socket(self, sock: socket.socket) -> None:
        """Serve on a second, already listening socket as well (e.g. one made in another network
        namespace, so the e2e guest reaches this fake); closed with the fake."""
        srv = ThreadingHTTPServer(sock.getsockname()[:2], _make_handler(self), False)
        srv.socket.close()
        srv.socket = sock
        srv.server_address = sock.getsockname()
        srv.daemon_threads = True
        t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        t.start()
        self._more.append((srv, t))

    def close(self) -> None:
        self._closing.set()  # wakes any hanging handler
        for srv, t in self._more:
            srv.shutdown()
            srv.server_close()
            t.join(timeout=5)
        self._more.clear()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> FakeComputeAPI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def port(self) -> int:
        assert self._server is not None, "server not started"
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        """What a client uses in place of https://compute.googleapis.com/compute/v1."""
        return f"http://{self.host}:{self.port}/compute/v1"

    # -- test controls ----------------------------------------------------------------------

    def add_instance(
        self,
        name: str,
        project: str = "test-project",
        zone: str = "us-central1-a",
        status: str = "RUNNING",
        spot: bool = False,
        termination_action: str = "STOP",
        instance_id: str | None = None,
        labels: dict[str, str] | None = None,
        on_host_maintenance: str = "MIGRATE",
        automatic_restart: bool | None = None,
    ) -> FakeInstance:
        """``automatic_restart`` None: the document's default, true except for a Spot VM."""
        if status not in INSTANCE_STATUSES:
            raise ValueError(f"status {status!r} is not in Instance.status.enum")
        if on_host_maintenance not in ON_HOST_MAINTENANCE:
            raise ValueError(f"{on_host_maintenance!r} is not in Scheduling.onHostMaintenance")
        if spot and automatic_restart:
            raise ValueError("a preemptible VM cannot be automatically restarted")
        inst = FakeInstance(
            name=name,
            project=project,
            zone=zone,
            id=instance_id or str(next(self._ids)),
            status=status,
            spot=spot,
            termination_action=termination_action,
            labels=dict(labels or {}),
            on_host_maintenance=on_host_maintenance,
            automatic_restart=not spot if automatic_restart is None else automatic_restart,
            last_start=self.clock() if status == "RUNNING" else None,
        )
        with self._lock:
            self._instances[(project, zone, name)] = inst
            self.zones.add((project, zone))
        return inst

    def instance(self, name: str) -> FakeInstance:
        """The instance with this name (in any project/zone); KeyError if none."""
        with self._lock:
            self._advance()
            for (_, _, n), inst in self._instances.items():
                if n == name:
                    return inst
        raise KeyError(name)

    def append_serial(self, name: str, data: bytes) -> None:
        """Write bytes to the instance's serial port 1, dropping what falls out of the window."""
        inst = self.instance(name)
        with self._lock:
            inst.total += len(data)
            inst.retained += data
            excess = len(inst.retained) - self.window
            if excess > 0:
                del inst.retained[:excess]

    def reset_serial(self, name: str) -> None:
        """Empty the port as if the instance were recreated (offsets restart at 0)."""
        inst = self.instance(name)
        with self._lock:
            inst.total = 0
            inst.retained = bytearray()

    def set_status(self, name: str, status: str) -> None:
        if status not in INSTANCE_STATUSES:
            raise ValueError(f"status {status!r} is not in Instance.status.enum")
        inst = self.instance(name)
        with self._lock:
            if status == "RUNNING" and inst.status != "RUNNING":
                inst.last_start = self.clock()  # a start: lastStartTimestamp moves
            inst.status = status

    def preempt(self, name: str) -> FakeOperation:
        """GCE takes a Spot VM back: a ``compute.instances.preempted`` operation; the VM goes
        STOPPING, then TERMINATED (deleted with termination action DELETE)."""
        inst = self.instance(name)
        effect = "delete" if inst.termination_action == "DELETE" else "terminate"
        return self._system_event(inst, OP_PREEMPTED, effect)

    def guest_shutdown(self, name: str) -> FakeOperation:
        """The guest powered itself off: ``compute.instances.guestTerminate``; STOPPING, then
        TERMINATED, whatever the termination action (a guest shutdown does not delete)."""
        return self._system_event(self.instance(name), OP_GUEST_TERMINATE, "terminate")

    def host_error(self, name: str) -> FakeOperation:
        """The host failed: ``compute.instances.hostError``; the VM is TERMINATED."""
        return self._system_event(self.instance(name), OP_HOST_ERROR, "terminate")

    def host_maintenance(self, name: str) -> FakeOperation:
        """A host maintenance event (what ``instances.simulateMaintenanceEvent`` triggers): with
        ``onHostMaintenance`` TERMINATE, ``compute.instances.terminateOnHostMaintenance`` and
        the VM goes STOPPING, then TERMINATED; with MIGRATE, a live migration
        (``compute.instances.migrateOnHostMaintenance``), the VM stays RUNNING."""
        inst = self.instance(name)
        with self._lock:
            return self._maintenance_locked(inst, 0.0)

    def _maintenance_locked(self, inst: FakeInstance, notice_s: float) -> FakeOperation:
        """The maintenance event's operation; a stop waits ``notice_s`` (PENDING) while the
        guest's ``maintenance-event`` says TERMINATE_ON_HOST_MAINTENANCE."""
        if inst.on_host_maintenance == "TERMINATE":
            inst.maintenance_event = MAINTENANCE_TERMINATE
            return self._new_op(inst, OP_TERMINATE_ON_MAINTENANCE, "terminate", "system",
                                self.stop_delay_s, notice_s=notice_s)  # fmt: skip
        return self._new_op(inst, OP_MIGRATE_ON_MAINTENANCE, "", "system", self.stop_delay_s)

    def restart(self, name: str) -> None:
        """GCE's automatic restart of a VM that Compute Engine stopped (host error, host
        maintenance): RUNNING again. ValueError where GCE would not restart it: automatic
        restart off (a Spot VM), not TERMINATED, or its last stop not one of Compute Engine's."""
        inst = self.instance(name)
        with self._lock:
            last = [o for o in self._ops if o.inst is inst and o.effect in ("terminate", "delete")]
            if not inst.automatic_restart or inst.deleted or inst.status != "TERMINATED":
                raise ValueError(f"{name}: not a VM GCE restarts (status {inst.status})")
            if not last or last[-1].type not in _RESTARTABLE:
                raise ValueError(f"{name}: not stopped by Compute Engine")
            inst.status = "RUNNING"
            inst.last_start = self.clock()
            inst.maintenance_event = "NONE"

    def fail_next_operation(
        self, http_status: int = 403, code: str = "PERMISSION_DENIED", message: str = "denied"
    ) -> None:
        """The next delete/stop/setMetadata operation ends DONE with this ``error``."""
        with self._lock:
            self._op_errors.append((http_status, code, message))

    def zone_operations(self, name: str | None = None) -> list[FakeOperation]:
        with self._lock:
            self._advance()
            return [o for o in self._ops if name is None or o.inst.name == name]

    def set_fault(self, endpoint: str, fault: Fault | None, count: int = -1) -> None:
        """Make the next ``count`` calls to ``endpoint`` (or all, -1) fail; None clears it."""
        if endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {endpoint!r}; one of {ENDPOINTS}")
        with self._lock:
            if fault is None:
                self._faults.pop(endpoint, None)
            else:
                self._faults[endpoint] = _FaultPlan(fault, count)

    def set_instance_fault(self, name: str, fault: Fault | None, count: int = -1) -> None:
        """Every call about instance ``name`` (get, serial, delete, stop) fails this way."""
        with self._lock:
            if fault is None:
                self._instance_faults.pop(name, None)
            else:
                self._instance_faults[name] = _FaultPlan(fault, count)

    def set_project_fault(self, project: str, fault: Fault | None, count: int = -1) -> None:
        """Every call in ``project`` fails this way (e.g. its rate quota is spent)."""
        with self._lock:
            if fault is None:
                self._project_faults.pop(project, None)
            else:
                self._project_faults[project] = _FaultPlan(fault, count)

    def calls_to(self, endpoint: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.endpoint == endpoint]

    def set_unreachable(self, project: str, zone: str, via: str | None = "warning") -> None:
        """aggregatedList cannot reach ``zone``: its instances are left out of the list, and the
        zone is reported by ``via``: ``"warning"`` (its scoped list carries only the warning
        ``UNREACHABLE``, "A given scope cannot be reached", ``InstancesScopedList.warning.code``)
        or ``"unreachables"`` (``zones/ZONE`` in ``InstanceAggregatedList.unreachables``,
        "Unreachable resources"). Which one GCE uses for a zone outage is not documented, so a
        client must take both. ``None`` makes the zone reachable again."""
        if via not in (None, "warning", "unreachables"):
            raise ValueError(f"via must be 'warning', 'unreachables' or None, not {via!r}")
        with self._lock:
            if via is None:
                self._unreachable.pop((project, zone), None)
            else:
                self._unreachable[(project, zone)] = via

    def add_zone(self, project: str, zone: str) -> None:
        """Make a project and zone exist without any instance in them."""
        with self._lock:
            self._zones.add((project, zone))

    # -- operations -------------------------------------------------------------------------

    def _new_op(
        self,
        inst: FakeInstance,
        kind: str,
        effect: str,
        user: str,
        running_s: float,
        meta: dict[str, str] | None = None,
        notice_s: float = 0.0,
    ) -> FakeOperation:
        n = next(self._op_ids)
        prefix = "systemevent" if user == "system" else "operation"
        now = self.clock()
        op = FakeOperation(
            id=str(n),
            name=f"{prefix}-{int(now * 1000)}-{n:x}",
            type=kind,
            inst=inst,
            insert_s=now,
            pending_s=self.op_pending_s + notice_s,
            running_s=running_s,
            user=user,
            effect=effect,
            meta=dict(meta or {}),
        )
        if user != "system" and self._op_errors:
            op.error = self._op_errors.pop(0)
        self._ops.append(op)
        self._advance()
        return op

    def _system_event(self, inst: FakeInstance, kind: str, effect: str) -> FakeOperation:
        with self._lock:
            return self._new_op(inst, kind, effect, "system", self.stop_delay_s)

    def _advance(self) -> None:
        """Apply the effects of operations whose status moved on (caller holds the lock)."""
        now = self.clock()
        for op in self._ops:
            st = op.status(now)
            if st == op.applied or op.error is not None:
                op.applied = st
                continue
            inst = op.inst
            stopping = st in ("RUNNING", "DONE") and op.effect in ("terminate", "delete")
            if stopping and not inst.deleted and inst.status not in ("TERMINATED", "STOPPED"):
                inst.status = "STOPPING"
            if st == "DONE":
                if op.effect == "terminate" and not inst.deleted:
                    inst.status = "TERMINATED"
                elif op.effect == "delete":
                    inst.deleted = True
                    inst.status = "TERMINATED"
                elif op.effect == "start" and not inst.deleted:
                    inst.status = "RUNNING"
                    inst.last_start = now
                elif op.effect == "metadata":
                    inst.metadata = dict(op.meta)
                    inst.fingerprint = uuid.uuid4().hex[:11] + "="
            op.applied = st

    # -- request handling (called from server threads) --------------------------------------

    def _take_fault(self, endpoint: str, project: str = "", name: str = "") -> Fault | None:
        with self._lock:
            for table, key in (
                (self._faults, endpoint),
                (self._project_faults, project),
                (self._instance_faults, name),
            ):
                plan = table.get(key) if key else None
                if plan is None:
                    continue
                if plan.remaining > 0:
                    plan.remaining -= 1
                    if plan.remaining == 0:
                        del table[key]
                return plan.fault
            return None

    def _route(self, method: str, path: str) -> tuple[str, Method, dict[str, str]] | None:
        for mid, m, rx in _ROUTES:
            if m.http != method:
                continue
            hit = rx.match(path)
            if hit:
                return mid, m, hit.groupdict()
        return None

    def _handle(
        self, method: str, raw_path: str, auth: str | None, body: bytes = b"", client: str = ""
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        parts = urlsplit(raw_path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        route = self._route(method, parts.path)
        endpoint = route[1].endpoint if route else "unknown"
        with self._lock:
            self.arrived[endpoint] = self.arrived.get(endpoint, 0) + 1
        token = auth[len("Bearer ") :] if auth and auth.startswith("Bearer ") else None
        authorized = token in self.tokens
        status, out, headers = self._dispatch(method, route, query, authorized, body, token)
        with self._lock:
            self.calls.append(
                Call(method, endpoint, parts.path, query, authorized, status, client, token)
            )
        return status, out, headers

    def _dispatch(
        self,
        method: str,
        route: tuple[str, Method, dict[str, str]] | None,
        query: dict[str, str],
        authorized: bool,
        body: bytes,
        token: str | None = None,
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        if not authorized:
            return (
                401,
                _error(401, "Request is missing required authentication credential.", "required"),
                {"WWW-Authenticate": 'Bearer realm="https://accounts.google.com/"'},
            )
        if route is None:
            return 404, _error(404, "The requested URL was not found.", "notFound"), {}
        mid, m, groups = route
        unknown = sorted(set(query) - m.parameters - STANDARD_PARAMETERS)
        if unknown:
            name = unknown[0]
            msg = (
                f'Invalid JSON payload received. Unknown name "{name}": Cannot bind query '
                f"parameter. Field '{name}' could not be found in request message."
            )
            return 400, _error(400, msg, "invalid"), {}
        granted = self.roles.get(token or "")
        if granted is not None and PERMISSIONS[mid] and PERMISSIONS[mid] not in granted:
            # GCE's answer to a call the caller's role does not allow: 403, reason "forbidden",
            # "Required '<permission>' permission for '<resource>'" (Compute Engine API
            # reference, "IAM Permissions" of each method; Cloud APIs error model, 403
            # PERMISSION_DENIED)
            resource = "projects/" + "/".join(
                f"{k}s/{groups[k]}" if k != "project" else groups[k]
                for k in ("project", "zone", "instance")
                if k in groups
            )
            msg = f"Required '{PERMISSIONS[mid]}' permission for '{resource}'"
            return 403, _error(403, msg, "forbidden"), {}
        faulted = self._faulted(m, groups)
        if faulted is not None:
            return faulted
        if m.endpoint == "scope":
            return self._scope(groups.get("project", ""), groups.get("zone"))
        project = groups["project"]
        if m.endpoint == "list":
            return self._list(project, query)
        zone = groups["zone"]
        if m.endpoint == "insert":
            return self._insert(mid, project, zone, query, body)
        if m.endpoint == "test_iam":
            return self._test_iam(project, zone, groups["resource"], body, granted)
        with self._lock:
            self._advance()
            if m.endpoint == "zone_list":
                return self._zone_list(project, zone, query)
            if m.endpoint in ("operation", "operations"):
                return self._operations(project, zone, groups.get("operation"), query)
            name = groups["instance"]
            inst = self._instances.get((project, zone, name))
            rid = query.get("requestId", "")
            if rid:
                parsed = _request_uuid(rid)
                if parsed is None:
                    return 400, _bad_request_id(rid), {}
                done = self.operations.get((project, zone, name, mid, str(parsed)))
                if done is not None:
                    return 200, self._op_json(done), {}
            if inst is None or inst.deleted:
                what = f"projects/{project}/zones/{zone}/instances/{name}"
                return 404, _error(404, f"The resource '{what}' was not found", "notFound"), {}
            if m.endpoint == "get":
                return 200, _instance_json(inst), {}
            if m.endpoint == "simulate_maintenance":
                return self._simulate_maintenance(inst, mid, query, rid)
            if m.endpoint != "serial":
                op = self._mutate(inst, m.endpoint, body)
                if isinstance(op, tuple):
                    return op
                if rid:
                    self.operations[(project, zone, name, mid, str(uuid.UUID(rid)))] = op
                return 200, self._op_json(op), {}
            answer = self._serial(inst, query)
        if answer[0] == 200:
            for see in list(self.on_serial):
                see(inst, str(answer[1]["contents"]))  # without the lock: hooks call back
        return answer

    def _faulted(
        self, m: Method, groups: dict[str, str]
    ) -> tuple[int, dict[str, Any], dict[str, str]] | None:
        """The answer of the fault queued for this call (:meth:`_take_fault`), or None: no
        fault, or a hang that has waited its time (the call then goes on)."""
        target = groups.get("instance") or groups.get("resource") or ""
        fault = self._take_fault(m.endpoint, groups["project"], target)
        if fault is Fault.HANG:
            self._closing.wait(self.hang_s)
        elif fault is Fault.REFUSE:
            return 403, _error(403, "Required permission denied.", "forbidden"), {}
        elif fault in (Fault.RATE_LIMIT, Fault.TOO_MANY_REQUESTS):
            code = 403 if fault is Fault.RATE_LIMIT else 429
            return (
                code,
                _error(
                    code,
                    "Rate Limit Exceeded",
                    "rateLimitExceeded",
                    domain="usageLimits",
                ),
                {"Retry-After": self.retry_after} if self.retry_after is not None else {},
            )
        elif fault is Fault.SERVER_ERROR:
            return 503, _error(503, "Backend Error", "backendError"), {}
        return None

    def _test_iam(
        self, project: str, zone: str, resource: str, body: bytes, granted: frozenset[str] | None
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """instances.testIamPermissions: the requested permissions the caller's role grants
        (all of them for a token without a role), on an instance that exists (by name or id).
        An empty subset is ``{}`` (proto3 JSON leaves an empty repeated field out); a wildcard
        is a 400 (TestPermissionsRequest.permissions: "wildcards ... are not allowed")."""
        try:
            doc = json.loads(body or b"{}")
            asked = [str(p) for p in doc.get("permissions") or []]
        except (ValueError, TypeError, AttributeError):
            return 400, _error(400, "Invalid JSON payload received.", "invalid"), {}
        if any("*" in p for p in asked):
            return 400, _error(400, "Permissions with wildcards are not allowed.", "invalid"), {}
        with self._lock:
            found = [
                i
                for (p, z, n), i in self._instances.items()
                if p == project and z == zone and resource in (n, i.id) and not i.deleted
            ]
        if not found:
            what = f"projects/{project}/zones/{zone}/instances/{resource}"
            return 404, _error(404, f"The resource '{what}' was not found", "notFound"), {}
        held = [p for p in asked if granted is None or p in granted]
        return 200, ({"permissions": held} if held else {}), {}

    def _simulate_maintenance(
        self, inst: FakeInstance, mid: str, query: dict[str, str], rid: str
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """instances.simulateMaintenanceEvent (caller holds the lock): the caller's operation
        (``simulateMaintenanceEvent``, DONE) and the event itself as ``host_maintenance`` does
        it, the stop after ``maintenance_notice_s``. Only a RUNNING VM: a 400 otherwise (what
        GCE answers is not documented; the fake's choice)."""
        if inst.status != "RUNNING":
            msg = f"The instance is not running (status {inst.status})."
            return 400, _error(400, msg, "invalid"), {}
        op = self._new_op(inst, "simulateMaintenanceEvent", "", "user", 0.0)
        if rid:
            key = (inst.project, inst.zone, inst.name, mid, str(uuid.UUID(rid)))
            self.operations[key] = op
        if op.error is None:
            self._maintenance_locked(inst, self.maintenance_notice_s)
        return 200, self._op_json(op), {}

    def _mutate(
        self, inst: FakeInstance, endpoint: str, body: bytes
    ) -> FakeOperation | tuple[int, dict[str, Any], dict[str, str]]:
        if endpoint == "set_metadata":
            try:
                doc = json.loads(body or b"{}")
                items = {str(i["key"]): str(i.get("value", "")) for i in doc.get("items") or []}
                fp = str(doc.get("fingerprint", ""))
            except (ValueError, TypeError, KeyError, AttributeError):
                return 400, _error(400, "Invalid JSON payload received.", "invalid"), {}
            if fp != inst.fingerprint:  # Metadata.fingerprint: optimistic locking
                msg = "Supplied fingerprint does not match current metadata fingerprint."
                return 412, _error(412, msg, "conditionNotMet"), {}
            # The items go in before the operation can be DONE (with no delay it is DONE at
            # once, and its effect is applied when it becomes DONE, never later).
            return self._new_op(inst, "setMetadata", "metadata", "user", 0.0, meta=items)
        running = self.stop_delay_s if inst.status not in ("TERMINATED", "STOPPED") else 0.0
        effect = "delete" if endpoint == "delete" else "terminate"
        return self._new_op(inst, endpoint, effect, "user", running)

    def _insert(
        self, mid: str, project: str, zone: str, query: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """instances.insert: PROVISIONING, then RUNNING when its operation is DONE."""
        try:
            doc = json.loads(body or b"null")
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            return 400, _error(400, "Invalid JSON payload received.", "invalid"), {}
        unknown = sorted(set(doc) - INSTANCE_FIELDS)
        if unknown:
            msg = f'Invalid JSON payload received. Unknown name "{unknown[0]}": Cannot find field.'
            return 400, _error(400, msg, "invalid"), {}
        name = doc.get("name")
        if not isinstance(name, str) or not INSTANCE_NAME_RE.match(name):
            msg = f"Invalid value for field 'resource.name': '{name}'. Must be a match of regex"
            return 400, _error(400, msg, "invalid"), {}
        rid = query.get("requestId", "")
        with self._lock:
            self._advance()
            made = self._insert_locked(mid, project, zone, name, rid, doc)
        if len(made) == 3:
            return made
        op_json, new = made
        if new is not None:  # (None: a repeated requestId, nothing was created)
            for hook in list(self.on_insert):
                hook(new)  # without the lock: hooks call back into the fake
        return 200, op_json, {}

    def _insert_locked(
        self, mid: str, project: str, zone: str, name: str, rid: str, doc: dict[str, Any]
    ) -> tuple[dict[str, Any], FakeInstance | None] | tuple[int, dict[str, Any], dict[str, str]]:
        """(the operation, the new instance or None for a repeated requestId), or an error."""
        if rid:
            parsed = _request_uuid(rid)
            if parsed is None:
                return 400, _bad_request_id(rid), {}
            rid = str(parsed)
            done = self.operations.get((project, zone, name, mid, rid))
            if done is not None:
                return self._op_json(done), None  # the same request again: nothing new
        old = self._instances.get((project, zone, name))
        if old is not None and not old.deleted:
            what = f"projects/{project}/zones/{zone}/instances/{name}"
            return 409, _error(409, f"The resource '{what}' already exists", "alreadyExists"), {}
        md = doc.get("metadata") or {}
        sched = doc.get("scheduling") or {}
        labels = doc.get("labels") or {}
        try:
            items = {str(i["key"]): str(i.get("value", "")) for i in md.get("items") or []}
            labels = {str(k): str(v) for k, v in labels.items()}
        except (TypeError, KeyError, AttributeError):
            return 400, _error(400, "Invalid JSON payload received.", "invalid"), {}
        inst = FakeInstance(
            name=name,
            project=project,
            zone=zone,
            id=str(next(self._ids)),
            status="PROVISIONING",
            spot=isinstance(sched, dict) and sched.get("provisioningModel") == "SPOT",
            termination_action=str(
                (sched.get("instanceTerminationAction") if isinstance(sched, dict) else "")
                or "STOP"
            ),
            labels=labels,
            metadata=items,
            machine_type=str(doc.get("machineType", "")),
            inserted=doc,
        )
        if isinstance(sched, dict):  # Scheduling: defaults MIGRATE, restart unless Spot
            inst.on_host_maintenance = str(sched.get("onHostMaintenance") or "MIGRATE")
            inst.automatic_restart = bool(sched.get("automaticRestart", not inst.spot))
        self._instances[(project, zone, name)] = inst
        self.zones.add((project, zone))
        op = self._new_op(inst, "insert", "start", "user", 0.0)
        if rid:
            self.operations[(project, zone, name, mid, rid)] = op
        return self._op_json(op), inst

    def _op_json(self, op: FakeOperation) -> dict[str, Any]:
        inst = op.inst
        base = f"projects/{inst.project}/zones/{inst.zone}"
        st = op.status(self.clock())
        out: dict[str, Any] = {
            "kind": "compute#operation",
            "id": op.id,
            "name": op.name,
            "operationType": op.type,
            "status": st,
            "progress": {"PENDING": 0, "RUNNING": 50, "DONE": 100}[st],
            "targetId": inst.id,
            "targetLink": f"{API}/{base}/instances/{inst.name}",
            "zone": f"{API}/{base}",
            "selfLink": f"{API}/{base}/operations/{op.name}",
            "insertTime": _rfc3339(op.insert_s),
            "user": op.user if op.user == "system" else USER_EMAIL,
        }
        if st != "PENDING":
            out["startTime"] = _rfc3339(op.insert_s + op.pending_s)
        if st == "DONE":
            out["endTime"] = _rfc3339(op.insert_s + op.pending_s + op.running_s)
            if op.error is not None:
                status, code, message = op.error
                out["error"] = {"errors": [{"code": code, "message": message}]}
                out["httpErrorStatusCode"] = status
                out["httpErrorMessage"] = code.replace("_", " ")
        return out

    def _operations(
        self, project: str, zone: str, name: str | None, query: dict[str, str]
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        here = [o for o in self._ops if o.inst.project == project and o.inst.zone == zone]
        base = f"projects/{project}/zones/{zone}"
        if name is not None:
            for o in here:
                if o.name == name:
                    return 200, self._op_json(o), {}
            what = f"{base}/operations/{name}"
            return 404, _error(404, f"The resource '{what}' was not found", "notFound"), {}
        flt = query.get("filter", "").strip()
        terms: list[tuple[str, str]] = []
        for raw in re.split(r"\s+AND\s+", flt) if flt else []:
            t = _OP_TERM_RE.match(raw.strip())
            if t is None:
                return 400, _error(400, f"Invalid value for field 'filter': '{flt}'", "invalid"), {}
            terms.append((t["field"], t["q"] if t["q"] is not None else t["bare"]))
        page, token, err = _page(query)
        if err is not None:
            return err
        rows = [self._op_json(o) for o in here]
        rows = [r for r in rows if all(str(r.get(f)) == v for f, v in terms)]
        body: dict[str, Any] = {
            "kind": "compute#operationList",
            "id": f"{base}/operations",
            "items": rows[token : token + page],
            "selfLink": f"{API}/{base}/operations",
        }
        if token + page < len(rows):
            body["nextPageToken"] = format(token + page, "x")
        return 200, body, {}

    def _scope(self, project: str, zone: str | None) -> tuple[int, dict[str, Any], dict[str, str]]:
        """projects.get / zones.get: 404 with the API's wording for what does not exist."""
        with self._lock:
            zones = {(p, z) for p, z, _ in self._instances} | self._zones
        if project not in {p for p, _ in zones}:
            what = f"projects/{project}"
            return 404, _error(404, f"The resource '{what}' was not found", "notFound"), {}
        if zone is None:
            return 200, {"kind": "compute#project", "name": project}, {}
        if (project, zone) not in zones:
            what = f"projects/{project}/zones/{zone}"
            return 404, _error(404, f"The resource '{what}' was not found", "notFound"), {}
        return 200, {"kind": "compute#zone", "name": zone, "status": "UP"}, {}

    def _zone_list(
        self, project: str, zone: str, query: dict[str, str]
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        if query.get("filter"):
            return 400, _error(400, "the fake's instances.list takes no filter", "invalid"), {}
        page, token, err = _page(query)
        if err is not None:
            return err
        rows = sorted(
            (i for (p, z, _), i in self._instances.items() if (p, z) == (project, zone)),
            key=lambda i: i.name,
        )
        rows = [i for i in rows if not i.deleted]
        base = f"projects/{project}/zones/{zone}"
        body: dict[str, Any] = {
            "kind": "compute#instanceList",
            "id": f"{base}/instances",
            "items": [_instance_json(i) for i in rows[token : token + page]],
            "selfLink": f"{API}/{base}/instances",
        }
        if token + page < len(rows):
            body["nextPageToken"] = format(token + page, "x")
        return 200, body, {}

    def _list(
        self, project: str, query: dict[str, str]
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        flt = query.get("filter", "").strip()
        match: Any = None
        if flt:
            eq, has = _LABEL_EQ_RE.match(flt), _LABEL_HAS_RE.match(flt)
            by_id = _ID_EQ_RE.match(flt)
            if by_id:
                match = lambda i: i.id == by_id["id"]  # noqa: E731
            elif eq:
                match = lambda i: i.labels.get(eq["key"]) == eq["value"]  # noqa: E731
            elif has:
                match = lambda i: has["key"] in i.labels  # noqa: E731
            else:
                return 400, _error(400, f"Invalid value for field 'filter': '{flt}'", "invalid"), {}
        size, offset, err = _page(query)
        if err is not None:
            return err
        with self._lock:
            self._advance()
            if not any(p == project for p, _ in self.zones):
                what = f"projects/{project}"
                return 404, _error(404, f"The resource '{what}' was not found", "notFound"), {}
            matching = sorted(
                (i for (p, _, _), i in self._instances.items() if p == project and not i.deleted),
                key=lambda i: (i.zone, i.name),
            )
            matching = [i for i in matching if match is None or match(i)]
            lost = {z: v for (p, z), v in self._unreachable.items() if p == project}
            matching = [i for i in matching if i.zone not in lost]
            page = [_instance_json(i) for i in matching[offset : offset + size]]
            zones = sorted({z for p, z in self.zones if p == project} | set(lost))
        items: dict[str, Any] = {}
        unreachables: list[str] = []
        for z in zones:
            here = [i for i in page if i["zone"].endswith(f"/zones/{z}")]
            if lost.get(z) == "unreachables":
                unreachables.append(f"zones/{z}")
            if lost.get(z) == "warning":
                items[f"zones/{z}"] = {
                    "warning": {
                        "code": "UNREACHABLE",
                        "message": f"Scope 'zones/{z}' is unreachable.",  # wording: ours
                        "data": [{"key": "scope", "value": f"zones/{z}"}],
                    }
                }
            elif here:
                items[f"zones/{z}"] = {"instances": here}
            else:
                items[f"zones/{z}"] = {
                    "warning": {
                        "code": "NO_RESULTS_ON_PAGE",
                        "message": "There are no results for scope 'zones/" + z + "' on this page.",
                        "data": [{"key": "scope", "value": f"zones/{z}"}],
                    }
                }
        body: dict[str, Any] = {
            "kind": "compute#instanceAggregatedList",
            "id": f"projects/{project}/aggregated/instances",
            "items": items,
            "selfLink": f"{API}/projects/{project}/aggregated/instances",
        }
        if unreachables:
            body["unreachables"] = unreachables
        if offset + size < len(matching):
            body["nextPageToken"] = format(offset + size, "x")
        return 200, body, {}

    def _serial(
        self, inst: FakeInstance, query: dict[str, str]
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        try:
            port = int(query.get("port", "1"))
            start = int(query.get("start", "0"))
        except ValueError:
            return 400, _error(400, "Invalid value for 'port' or 'start'", "invalid"), {}
        if not 1 <= port <= 4:
            return 400, _error(400, f"Invalid value for field 'port': '{port}'", "invalid"), {}
        if self.serial_needs_running and inst.status != "RUNNING":
            # "only while the VM instance is running"; 503 TIMEOUT backendError on STOPPING
            # (compute-image-tools PR #456); the same for any other status (not documented).
            return 503, _error(503, "TIMEOUT", "backendError"), {}
        total = inst.total if port == 1 else 0
        data = bytes(inst.retained) if port == 1 else b""
        oldest = total - len(data)
        if start < 0:
            s = max(total + start, oldest)
        elif start > total:
            s = total
        else:
            s = max(start, oldest)
        contents = data[s - oldest :]
        base = f"projects/{inst.project}/zones/{inst.zone}/instances/{inst.name}"
        return (
            200,
            {
                "kind": "compute#serialPortOutput",
                "contents": contents.decode("utf-8", errors="replace"),
                "start": str(s),
                "next": str(total),
                "selfLink": f"{API}/{base}/serialPort",
            },
            {},
        )


def _page(
    query: dict[str, str],
) -> tuple[int, int, tuple[int, dict[str, Any], dict[str, str]] | None]:
    """(page size, offset, error): ``maxResults`` 0..500 (0 and absent: 500), ``pageToken``."""
    try:
        size = int(query.get("maxResults", str(MAX_RESULTS)))
        offset = int(query.get("pageToken") or "0", 16) if query.get("pageToken") else 0
    except ValueError:
        bad = "Invalid value for 'maxResults' or 'pageToken'"
        return 0, 0, (400, _error(400, bad, "invalid"), {})
    if not 0 <= size <= MAX_RESULTS:
        bad = f"Invalid value for field 'maxResults': '{size}'"
        return 0, 0, (400, _error(400, bad, "invalid"), {})
    return size or MAX_RESULTS, offset, None


def _request_uuid(rid: str) -> uuid.UUID | None:
    """A requestId as GCE takes it: "a valid UUID with the exception that zero UUID is not
    supported" (instances.delete.parameters.requestId); None when it is not one."""
    try:
        parsed = uuid.UUID(rid)
    except ValueError:
        return None
    return None if parsed.int == 0 else parsed


def _bad_request_id(rid: str) -> dict[str, Any]:
    return _error(400, f"Invalid value for field 'requestId': '{rid}'", "invalid")


def _error(code: int, message: str, reason: str, domain: str = "global") -> dict[str, Any]:
    return {
        "error": {
            "code": code,
            "message": message,
            "errors": [{"message": message, "domain": domain, "reason": reason}],
        }
    }


def _instance_json(inst: FakeInstance) -> dict[str, Any]:
    base = f"projects/{inst.project}/zones/{inst.zone}"
    out: dict[str, Any] = {
        "kind": "compute#instance",
        "id": inst.id,
        "name": inst.name,
        "status": inst.status,
        # Instance.labels, served by instances.get and aggregatedList alike (compute v1
        # reference, https://cloud.google.com/compute/docs/reference/rest/v1/instances).
        "labels": dict(inst.labels),
        "zone": f"{API}/{base}",
        "selfLink": f"{API}/{base}/instances/{inst.name}",
        "scheduling": {
            "provisioningModel": "SPOT" if inst.spot else "STANDARD",
            "preemptible": inst.spot,
            "instanceTerminationAction": inst.termination_action,
            "onHostMaintenance": inst.on_host_maintenance,
            "automaticRestart": inst.automatic_restart,
        },
        "metadata": {
            "kind": "compute#metadata",
            "fingerprint": inst.fingerprint,
            "items": [{"key": k, "value": v} for k, v in sorted(inst.metadata.items())],
        },
    }
    if inst.last_start is not None:
        out["lastStartTimestamp"] = _rfc3339(inst.last_start)
    if inst.labels:
        out["labels"] = dict(inst.labels)
    if inst.machine_type:
        out["machineType"] = f"{API}/{base}/machineTypes/{inst.machine_type.rsplit('/', 1)[-1]}"
    return out


def _make_handler(api: FakeComputeAPI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Headers and body go out in two writes: without NODELAY, Nagle + delayed ACK
            # add ~40 ms to every keep-alive response.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            status, out, headers = api._handle(
                method, self.path, self.headers.get("Authorization"), body, self.client_address[0]
            )
            blob = json.dumps(out).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(blob)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(blob)
            except OSError:
                pass  # the client gave up (hang fault): nothing to answer

        def do_GET(self) -> None:
            self._serve("GET")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:
            pass  # tests read api.calls instead

    return Handler
