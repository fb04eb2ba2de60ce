"""Qemu guests behind the fake Compute API: ``instances.insert`` boots a real VM (docs/e2e.md).

:class:`QemuGuests` is a :attr:`testing.simcompute.FakeComputeAPI.on_insert` hook for ``make e2e``
(the offline tests put ``testing/simguest.py`` there instead). For each inserted instance it boots
the e2e guest (:func:`e2e.vm.run`) with what GCE would give that VM:

- the insert body's metadata items as the instance attributes the fake metadata server serves
  (``startup-script`` among them, so the guest runs the start-up script the caller sent), the
  instance's name; one liberty: the fake internet has no TLS, so an agent source URL on
  ``https://wheels.test/`` is served to the guest as ``http://wheels.test/`` (same file, same
  sha256 checked by the start-up script);
- ``setMetadata`` while it runs: every look (``vm.SERIAL_POLL``) compares the fake's metadata
  with what the guest's metadata server serves and sends each change over simgce's control
  socket (``op=attribute``), which wakes the guest's ``wait_for_change`` long polls;
- its serial port: what qemu writes goes to the fake's port 1 of that instance while it is
  RUNNING (:class:`e2e.observe.SerialFeed`; nobody polls here: the caller, e.g. ``validate``,
  reads the API);
- when the guest powers itself off (qemu exits), what GCE records: the rest of the output, then
  ``compute.instances.guestTerminate`` and TERMINATED (``FakeComputeAPI.guest_shutdown``);
- when the instance is deleted (``instances.delete`` DONE) while qemu runs, qemu is killed.

The VMs boot one after another, in insert order, on one worker thread: two TCG guests on a
2-core machine would each run at half speed and the agent's probe timeouts would fire. An
instance deleted before its turn is never booted.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace

from gce_watchdog.testing.simcompute import FakeComputeAPI, FakeInstance
from kit.netns import SimHandle

from e2e import observe, vm

SCENARIO_LABEL = "gcewd-scenario"  # validate's label naming the scenario (validate/plan.py)
TLS_LESS = {f"https://{vm.WHEELS_NAME}/": f"http://{vm.WHEELS_NAME}/"}
SOURCE_KEYS = ("gce-watchdog-deb-url", "gce-watchdog-wheel-url")
WORKER_JOIN_S = 30.0  # close(): the running VM is stopped first, so this is qemu's kill + reap


def served(metadata: Mapping[str, str]) -> dict[str, str]:
    """The attributes the guest's metadata server serves for the fake instance's metadata."""
    out = dict(metadata)
    for key in SOURCE_KEYS:
        for https, http in TLS_LESS.items():
            if out.get(key, "").startswith(https):
                out[key] = http + out[key][len(https) :]
    return out


@dataclass
class Booted:
    """One instance's guest: what was booted and how it ended."""

    instance: str
    name: str  # the run's name (build/e2e/NAME)
    result: vm.VmResult | None = None
    skipped: str | None = None  # why it never booted
    error: str | None = None  # what the boot raised
    metadata_changes: int = 0  # setMetadata changes sent to the guest's metadata server


class QemuGuests:
    """The on_insert hook; use as a context manager around the caller's run."""

    def __init__(
        self,
        harness: vm.Harness,
        api: FakeComputeAPI,
        base: vm.VmSpec,
        prefix: str = "guest",
        baked: frozenset[str] = frozenset(),
    ) -> None:
        """``base``: the boot's settings (config.toml, timeout, ...); its startup script and
        attributes are replaced by the instance's metadata. ``baked``: the scenarios (the
        instance's SCENARIO_LABEL) booted from the image with the run's agent baked in
        (:meth:`vm.Harness.baked_image`): their start-up script skips the download and install."""
        self.harness = harness
        self.api = api
        self.base = base
        self.baked = baked
        self.prefix = prefix
        self.booted: list[Booted] = []
        self._queue: queue.Queue[FakeInstance | None] = queue.Queue()
        self._closing = threading.Event()
        self._current: threading.Event | None = None
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._work, name="qemu-guests", daemon=True)

    def __enter__(self) -> QemuGuests:
        self._worker.start()
        self.api.on_insert.append(self._queue.put)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the running VM (if any), boot no other, wait for the worker (bounded)."""
        with contextlib.suppress(ValueError):
            self.api.on_insert.remove(self._queue.put)
        self._closing.set()
        with self._lock:
            if self._current is not None:
                self._current.set()
        self._queue.put(None)
        self._worker.join(WORKER_JOIN_S)

    def _work(self) -> None:
        while True:
            inst = self._queue.get()
            if inst is None:
                return
            scenario = inst.labels.get(SCENARIO_LABEL) or inst.name
            b = Booted(inst.name, f"{self.prefix}-{scenario}")
            self.booted.append(b)
            if self._closing.is_set():
                b.skipped = "the harness was closing"
                continue
            if self._gone(inst):
                b.skipped = "deleted before its turn"
                continue
            try:
                self._boot(inst, b)
            except Exception as e:  # the caller sees a VM that never writes; the test, this error
                b.error = f"{type(e).__name__}: {e}"

    def _gone(self, inst: FakeInstance) -> bool:
        self.api.zone_operations()  # applies the operations that are DONE (a delete, metadata)
        return inst.deleted

    def _boot(self, inst: FakeInstance, b: Booted) -> None:
        attrs = served(inst.metadata)
        script = attrs.pop("startup-script", "")
        spec = replace(
            self.base,
            name=b.name,
            startup_script=script,
            attributes=attrs,
            instance_name=inst.name,
            instance_id=inst.id,
            project_id=inst.project,
            baked=(inst.labels.get(SCENARIO_LABEL) or "") in self.baked,
        )
        feed = observe.SerialFeed(self.api, inst.name)
        stop = threading.Event()
        sims: list[SimHandle] = []
        sent = dict(inst.metadata)  # what the guest's metadata server has (before translation)

        def sync() -> None:
            now = dict(inst.metadata)
            if now == sent or not sims:
                return
            for key in sorted(set(now) | set(sent)):
                if now.get(key) != sent.get(key):
                    value = now.get(key)
                    value = served({key: value})[key] if value is not None else None
                    reply = sims[0].command(op="attribute", key=key, value=value)
                    if not reply.get("ok"):
                        raise vm.E2EError(f"simgce refused attribute {key}: {reply}")
                    b.metadata_changes += 1
            sent.clear()
            sent.update(now)

        def watch(data: bytes) -> None:
            if self._gone(inst):
                stop.set()  # instances.delete: the VM goes away with its disk
                return
            if inst.status == "RUNNING":
                feed.feed(data)
            sync()

        with self._lock:
            self._current = stop
        try:
            res = self.harness.boot(spec, watch=watch, stop=stop, on_sim=sims.append)
        finally:
            with self._lock:
                self._current = None
        b.result = res
        if res.stopped or self._gone(inst):
            return
        if not res.timed_out and inst.status == "RUNNING":
            feed.feed(res.serial())  # written before the power-off; unread once TERMINATED
            self.api.guest_shutdown(inst.name)

    def summary(self) -> list[str]:
        out = []
        for b in self.booted:
            what = b.result.summary() if b.result else (b.error or f"skipped: {b.skipped}")
            out.append(f"{b.instance}: {what}; metadata changes sent: {b.metadata_changes}")
        return out
