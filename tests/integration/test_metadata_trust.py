"""Operators cannot misfire (issue 35 item 6): a local process that can write the VM's metadata
must not be able to disarm the watchdog or cut its network through the metadata attributes.

The attack: the VM's service account has a scope that can write metadata (cloud-platform) and
IAM grants it ``compute.instances.setMetadata`` on itself, so any process on the VM can set
``gce-watchdog-disarm`` or ``gce-watchdog-fault``. The fake metadata server presents the
account's scopes, the fake Compute API answers ``instances.testIamPermissions`` from its roles;
the watcher and ``gce-watchdog check`` run with their real edges (``check`` as a process, its
token from the fake metadata server through google-auth).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.daemon import mdtrust
from gce_watchdog.daemon.metawatch import (
    TRUST_RECHECK_S,
    MetadataClient,
    MetadataWatcher,
    TrustProbe,
    metadata_root,
)
from gce_watchdog.faults.request import FaultRequest
from gce_watchdog.lib.compute import ComputeClient, ComputeRetry
from gce_watchdog.testing import simgce
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.simgce import FakeMetadataServer, SimGCE, SimInstance
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from google.oauth2.credentials import Credentials
from kit.agent import agent_config, agent_process, stop_agent
from kit.cli import agent_env, gcewd
from kit.clocks import ManualClock
from kit.events import sink_events
from kit.wait import wait_for

pytestmark = pytest.mark.process

CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
SET_MD = "compute.instances.setMetadata"
# the roles of the VM's service account (the fake metadata server's token)
EDITOR = [SET_MD, "compute.instances.get", "compute.instances.stop", "compute.instances.delete"]
CUSTOM = ["compute.instances.get", "compute.instances.stop", "compute.instances.delete"]
FAULT = '{"id": "wedge-1", "cut": "metadata+egress443", "ttl": "15m"}'


@pytest.fixture
def md() -> Iterator[FakeMetadataServer]:
    info = SimInstance(project="sim-project", zone="europe-west4-b", name="vm-7", id="77")
    info.scopes = [CLOUD_PLATFORM]  # the attack's precondition: a scope that can write metadata
    with FakeMetadataServer(info=info) as srv:
        yield srv


def compute_api(role: list[str]) -> FakeComputeAPI:
    api = FakeComputeAPI(token=simgce.TOKEN, roles={simgce.TOKEN: role})
    api.add_instance("vm-7", project="sim-project", zone="europe-west4-b", instance_id="77")
    return api


class Applier:
    def __init__(self) -> None:
        self.applied: list[FaultRequest] = []

    def __call__(self, req: FaultRequest) -> str | None:
        self.applied.append(req)
        return None


def watcher(
    tmp: Path, md: FakeMetadataServer, api_base: str, clock: ManualClock, **watch: object
) -> tuple[MetadataWatcher, MemorySink, list[str], Applier]:
    w: dict[str, object] = {"request_timeout": "2s", "faults_from_metadata": True, **watch}
    cfg = cfgmod.from_dict(
        {"agent": {"state_dir": str(tmp)}, "metadata": {"url": md.url}, "watch": w}
    )
    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(tmp, "0badc0de"), "0badc0de", key=SYNTH_KEY)
    notes: list[str] = []
    client = MetadataClient(metadata_root(cfg))

    def compute() -> ComputeClient:  # the Compute API as the VM's account (its token)
        creds: Any = Credentials(simgce.TOKEN)  # type: ignore[no-untyped-call]
        return ComputeClient.create(creds, api_base, timeout=2.0, retry=ComputeRetry(1))

    probe = TrustProbe(client, api_base, 2.0, compute=compute)
    applier = Applier()
    mw = MetadataWatcher.from_config(
        cfg, em, clock=clock, client=client, trust_probe=probe, apply_fault=applier,
        log=lambda msg, **kw: notes.append(f"{msg} {kw}"),
    )  # fmt: skip
    return mw, sink, notes, applier


def test_a_local_process_that_can_write_metadata_cannot_disarm_or_cut_the_network(
    tmp_path: Path, md: FakeMetadataServer
) -> None:
    clock = ManualClock()
    with compute_api(EDITOR) as api:
        w, sink, notes, applier = watcher(tmp_path, md, api.base_url, clock)
        assert not w.trust.trusted  # nothing checked yet: fail closed
        # the attack: the workload sets both attributes through the account's token
        md.set_attribute("gce-watchdog-disarm", "true")
        assert w.refresh_once()
        assert (w.trust.trusted, w.trust.why) == (False, mdtrust.CAN_WRITE)
        assert not w.disarm_requested  # the watchdog stays armed
        assert any("ignored" in n and "can_write_metadata" in n for n in notes)
        assert sum("gce-watchdog-disarm is set but ignored" in n for n in notes) == 1
        assert w.refresh_once() and sum("is set but ignored" in n for n in notes) == 1  # once
        w.on_fault_value(FAULT)
        assert applier.applied == []  # nothing was cut
        faults = [e for e in sink_events(sink) if e.event == "fault"]
        assert [(e.get("op"), e.get("why")) for e in faults] == [("refused", "untrusted")]
        [ask] = api.calls_to("test_iam")
        assert ask.method == "POST" and ask.bearer == simgce.TOKEN and ask.status == 200
        # IAM changes: the account loses setMetadata; the next check (TRUST_RECHECK_S) obeys
        api.roles[simgce.TOKEN] = frozenset(CUSTOM)
        clock.advance(TRUST_RECHECK_S - 1)
        assert w.refresh_once() and not w.disarm_requested  # not due yet: no new request
        assert len(api.calls_to("test_iam")) == 1
        clock.advance(1)
        assert w.refresh_once()
        assert (w.trust.trusted, w.trust.why) == (True, mdtrust.NO_PERMISSION)
        assert w.disarm_requested
        assert any("attributes obeyed" in n for n in notes)


def test_what_cannot_be_told_is_not_trusted_and_trust_metadata_overrides(
    tmp_path: Path, md: FakeMetadataServer
) -> None:
    with socket.socket() as s:  # a Compute API that refuses connections: cannot tell
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/compute/v1"
    md.set_attribute("gce-watchdog-disarm", "true")
    w, _, _, _ = watcher(tmp_path / "a", md, dead, ManualClock())
    assert w.refresh_once()
    assert (w.trust.trusted, w.trust.why) == (False, mdtrust.PERMISSION_UNKNOWN)
    assert not w.disarm_requested
    w2, _, _, applier = watcher(tmp_path / "b", md, dead, ManualClock(), trust_metadata=True)
    assert w2.trust.trusted  # the operator's local word, before any check
    assert w2.refresh_once() and w2.disarm_requested
    w2.on_fault_value(FAULT)
    assert [r.id for r in applier.applied] == ["wedge-1"]
    # a VM without a service account, or with read-only scopes: obeyed
    md.set_scopes(None)
    w3, _, _, _ = watcher(tmp_path / "c", md, dead, ManualClock())
    assert w3.refresh_once() and w3.trust.why == mdtrust.NO_SERVICE_ACCOUNT and w3.disarm_requested
    md.set_scopes(list(simgce.READONLY_SCOPES))
    w4, _, _, _ = watcher(tmp_path / "d", md, dead, ManualClock())
    assert w4.refresh_once() and w4.trust.why == mdtrust.NO_WRITE_SCOPE and w4.disarm_requested


def test_check_says_why_the_attributes_are_ignored(tmp_path: Path) -> None:
    """``gce-watchdog check`` as a process: the real token path (google-auth against the fake
    metadata server) and testIamPermissions against the fake Compute API."""
    (tmp_path / "boot_id").write_text("0" * 32 + "\n")
    with SimGCE() as sim, compute_api(EDITOR) as api:
        assert sim.tcp is not None
        sim.metadata.set_scopes([CLOUD_PLATFORM])
        sim.metadata.info.name, sim.metadata.info.zone = "vm-7", "europe-west4-b"
        sim.metadata.info.project, sim.metadata.info.id = "sim-project", "77"
        cfg = tmp_path / "config.toml"
        base = (
            f'[agent]\nprobe_timeout = "300ms"\nstate_dir = "{tmp_path}/state"\n'
            f'run_dir = "{tmp_path}/run"\nboot_id_path = "{tmp_path}/boot_id"\n'
            f'[metadata]\nurl = "{sim.metadata.url}"\n'
            f'[egress]\ntargets = ["127.0.0.1:{sim.tcp.port}"]\ndns_timeout = "200ms"\n'
            f'[actions]\napi_base = "{api.base_url}"\n'
        )
        host = f"127.0.0.1:{sim.metadata.port}"
        env = agent_env(GCE_METADATA_HOST=host, GCE_METADATA_IP=host)

        def check(extra: str = "") -> tuple[dict[str, Any], str]:
            cfg.write_text(base + extra)
            js = gcewd("check", "--json", "--config", str(cfg), env=env)
            text = gcewd("check", "--config", str(cfg), env=env)
            assert js.returncode == 0, js.stderr
            doc: dict[str, Any] = json.loads(js.stdout)["metadata_trust"]
            return doc, text.stdout

        doc, text = check()
        assert (doc["trusted"], doc["why"]) == (False, "can_write_metadata")
        assert "metadata disarm/fault attributes: IGNORED (can_write_metadata)" in text
        api.roles[simgce.TOKEN] = frozenset(CUSTOM)
        doc, text = check()
        assert (doc["trusted"], doc["why"]) == (True, "no_permission")
        assert "attributes: obeyed (no_permission)" in text
        doc, _ = check("[watch]\ntrust_metadata = true\n")
        assert (doc["trusted"], doc["why"]) == (True, "trust_metadata")


def test_the_agent_stays_armed_and_its_journal_says_why(tmp_path: Path) -> None:
    """The real agent (``gce-watchdog run``): the disarm attribute set by a process that can
    write metadata is not obeyed (no ``disarm`` line on the console), and the journal (stderr
    outside systemd) says why; with ``trust_metadata = true`` the same attribute disarms."""
    with SimGCE() as sim, compute_api(EDITOR) as api:
        sim.metadata.set_scopes([CLOUD_PLATFORM])
        sim.metadata.info.name, sim.metadata.info.zone = "vm-7", "europe-west4-b"
        sim.metadata.info.project, sim.metadata.info.id = "sim-project", "77"
        sim.metadata.set_attribute("gce-watchdog-disarm", "true")
        host = f"127.0.0.1:{sim.metadata.port}"
        env = agent_env(GCE_METADATA_HOST=host, GCE_METADATA_IP=host)
        for trust in (False, True):
            run = tmp_path / f"trust-{trust}"
            run.mkdir()
            watch = {"refresh": 10, "request_timeout": 5, "trust_metadata": trust}
            cfg = agent_config(run, sim, actions={"linger": 0, "api_base": api.base_url},
                               watch=watch)  # fmt: skip
            err = run / "stderr"
            with err.open("w") as f, agent_process(cfg, stderr=f, env=env) as p:
                serial = run / "ttyS0"
                if trust:
                    said = wait_for(lambda: b" disarm " in serial.read_bytes(), timeout=30)
                    assert said, serial.read_bytes()[-2000:]
                else:
                    said = wait_for(lambda: "is set but ignored" in err.read_text(), timeout=30)
                    assert said, err.read_text()[-2000:]
                    assert "can_write_metadata" in err.read_text()
                    assert wait_for(lambda: serial.read_bytes().count(b" heartbeat ") >= 2)
                    assert b" disarm " not in serial.read_bytes()  # armed all along
                assert stop_agent(p) == 0
