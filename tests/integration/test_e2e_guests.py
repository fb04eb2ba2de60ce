"""e2e/guests.py's on_insert hook without qemu: a stand-in harness plays the boot (what
``vm.run`` calls back), so the hook's duties are checked in seconds: the insert body's metadata
served, setMetadata forwarded to the guest's metadata server, the serial output fed while
RUNNING, a power-off recorded as guestTerminate, a delete stopping the VM, one VM at a time."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.lib.compute import ComputeClient
from gce_watchdog.testing.simcompute import OP_GUEST_TERMINATE, FakeComputeAPI
from gce_watchdog.validate.gce import ValidateApi
from kit.paths import REPO

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from e2e import guests, vm

pytestmark = pytest.mark.process

P, Z = "test-project", "us-central1-a"
WAIT = 10.0


class StubSim:
    def __init__(self) -> None:
        self.commands: list[dict[str, Any]] = []

    def command(self, **cmd: Any) -> dict[str, Any]:
        self.commands.append(cmd)
        return {"ok": True}


class StubHarness:
    """Boots nothing: each boot writes ``lines``, waits for ``until`` (or ``stop``), ends."""

    def __init__(self) -> None:
        self.specs: list[vm.VmSpec] = []
        self.sims: list[StubSim] = []
        self.running = threading.Semaphore(1)  # fails a second boot while one runs
        self.release = threading.Event()
        self.poweroff = True

    def boot(
        self,
        spec: vm.VmSpec,
        watch: Callable[[bytes], None] | None = None,
        stop: threading.Event | None = None,
        on_sim: Callable[[Any], None] | None = None,
        **rest: Any,
    ) -> vm.VmResult:
        assert self.running.acquire(blocking=False), "two VMs at once"
        try:
            self.specs.append(spec)
            sim = StubSim()
            self.sims.append(sim)
            assert on_sim is not None and watch is not None and stop is not None
            on_sim(sim)
            data = b"boot line\n"
            stopped = False
            for _ in range(int(WAIT / 0.01)):  # bounded: the test releases or deletes
                watch(data)
                if stop.is_set():
                    stopped = True
                    break
                if self.release.is_set():
                    break
                stop.wait(0.01)
            nowhere = Path("/nonexistent")
            rc = -9 if stopped else 0
            return vm.VmResult(spec.name, nowhere, nowhere / "serial.log", rc, False, 0.1, {},
                               stopped=stopped)  # fmt: skip
        finally:
            self.running.release()


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok", serial_needs_running=True) as a:
        a.add_zone(P, Z)
        yield a


def body(name: str, scenario: str, **md: str) -> dict[str, object]:
    items = [{"key": k, "value": v} for k, v in md.items()]
    return {"name": name, "labels": {"gcewd-scenario": scenario}, "metadata": {"items": items}}


def client(api: FakeComputeAPI) -> ValidateApi:
    from google.oauth2.credentials import Credentials

    creds = Credentials("tok")  # type: ignore[no-untyped-call]
    return ValidateApi(ComputeClient.create(creds, api_base=api.base_url), op_poll_s=0.01)


def wait_for(pred: Callable[[], bool]) -> None:
    done = threading.Event()
    for _ in range(int(WAIT / 0.01)):
        if pred():
            return
        done.wait(0.01)
    raise AssertionError("not reached")


def test_insert_boots_with_the_metadata_forwards_changes_and_records_the_poweroff(
    api: FakeComputeAPI,
) -> None:
    h = StubHarness()
    base = vm.VmSpec(name="x", startup_script="", config="[agent]\n")
    v = client(api)
    with guests.QemuGuests(h, api, base, prefix="t") as q:  # type: ignore[arg-type]
        src = "https://wheels.test/wheelhouse.tar"
        v.insert(P, Z, body("vm-a", "wedge", **{"startup-script": "#!/bin/sh\n",
                                                "gce-watchdog-wheel-url": src}))  # fmt: skip
        wait_for(lambda: bool(h.sims))
        spec = h.specs[0]
        assert spec.name == "t-wedge" and spec.startup_script == "#!/bin/sh\n"
        assert spec.attributes["gce-watchdog-wheel-url"] == "http://wheels.test/wheelhouse.tar"
        assert spec.instance_name == "vm-a" and spec.instance_id == api.instance("vm-a").id
        assert spec.config == "[agent]\n"
        v.set_metadata(P, Z, "vm-a", "gce-watchdog-fault", '{"id":"f1"}')
        wait_for(lambda: bool(h.sims[0].commands))
        assert h.sims[0].commands == [
            {"op": "attribute", "key": "gce-watchdog-fault", "value": '{"id":"f1"}'}
        ]
        wait_for(lambda: v.client.serial_port_output(P, Z, "vm-a", 0).contents != b"")
        assert v.client.serial_port_output(P, Z, "vm-a", 0).contents == b"boot line\n"
        h.release.set()
        wait_for(lambda: q.booted[0].result is not None)
    inst = api.instance("vm-a")
    assert inst.status == "TERMINATED"
    assert [o.type for o in api.zone_operations("vm-a")][-1] == OP_GUEST_TERMINATE
    assert q.booted[0].metadata_changes == 1


def test_a_delete_stops_the_vm_and_the_next_boots_only_then(api: FakeComputeAPI) -> None:
    h = StubHarness()
    base = vm.VmSpec(name="x", startup_script="")
    v = client(api)
    with guests.QemuGuests(h, api, base, prefix="t") as q:  # type: ignore[arg-type]
        v.insert(P, Z, body("vm-a", "wedge"))
        v.insert(P, Z, body("vm-b", "done"))
        v.insert(P, Z, body("vm-c", "flap"))
        wait_for(lambda: len(h.specs) == 1)
        op = v.delete(P, Z, "vm-c")  # deleted before its turn: never booted
        assert op is not None
        v.wait(P, Z, op)
        op = v.delete(P, Z, "vm-a")
        assert op is not None
        v.wait(P, Z, op)
        wait_for(lambda: len(h.specs) == 2)
        assert q.booted[0].result is not None and q.booted[0].result.stopped
        assert h.specs[1].name == "t-done"
        h.release.set()
        wait_for(lambda: len(q.booted) == 3)
    assert q.booted[2].skipped == "deleted before its turn"
    types = [o.type for o in api.zone_operations("vm-a")]
    assert OP_GUEST_TERMINATE not in types, "a deleted VM did not power itself off"
