"""IAM per permission: the fake answers 403 ``forbidden`` to a call the token's role lacks, and
the poller works under exactly the least-privilege role that docs/poller.md documents."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from gce_watchdog.cli import main
from gce_watchdog.testing.simcompute import PERMISSIONS, FakeComputeAPI, Fault
from gce_watchdog.testing.synth import Writer
from kit.paths import REPO
from kit.poll import outputs, poll_args

P, Z = "test-project", "us-central1-a"


def documented_role(*modes: str) -> set[str]:
    """The permissions docs/poller.md lists for these rows of its IAM table: a "the above +"
    row adds to the row above it, a "+" row is what that option adds to a mode."""
    text = (REPO / "docs" / "poller.md").read_text()
    table = text[text.index("IAM, per mode") :]
    perms: set[str] = set()
    rows: dict[str, set[str]] = {}
    for line in table.splitlines()[4:]:
        if not line.startswith("|"):
            break
        mode, granted = line.split("|")[1:3]
        names = set(re.findall(r"`(compute\.[a-zA-Z.]+)`", granted))
        perms = perms | names if "the above" in granted else names
        rows[mode.strip()] = set(perms)
    out: set[str] = set()
    for m in modes:
        out |= rows[m]
    assert out, f"no permissions found for {modes} in docs/poller.md"
    return out


READ = documented_role("poll by name")
REAP = documented_role("poll by name", "`--reap`", "evidence for an ended VM (rows 6/7)")


@pytest.mark.pure
def test_the_documented_roles_name_real_permissions() -> None:
    known = set(PERMISSIONS.values())
    assert known >= READ and known >= REAP
    assert "compute.instances.getSerialPortOutput" in READ
    assert "compute.projects.get" not in REAP and "compute.zones.get" not in REAP


@pytest.mark.process
def test_a_call_the_role_lacks_is_a_403_forbidden() -> None:
    with FakeComputeAPI(token=["ro", "all"], roles={"ro": READ}) as api:
        api.add_instance("vm-1", project=P, zone=Z)
        base = f"{api.base_url}/projects/{P}/zones/{Z}/instances/vm-1"

        def call(method: str, url: str, tok: str) -> requests.Response:
            return requests.request(
                method, url, headers={"Authorization": f"Bearer {tok}"}, timeout=5
            )

        assert call("GET", base, "ro").status_code == 200
        r = call("DELETE", base + "?requestId=6a1e0d54-3a1b-4c55-9e43-3c0c9d1a1f00", "ro")
        assert r.status_code == 403
        err = r.json()["error"]
        assert err["errors"][0]["reason"] == "forbidden"
        assert err["message"] == (
            f"Required 'compute.instances.delete' permission for "
            f"'projects/{P}/zones/{Z}/instances/vm-1'"
        )
        assert call("GET", f"{api.base_url}/projects/{P}", "ro").status_code == 403
        assert not api.instance("vm-1").deleted
        assert call("GET", f"{api.base_url}/projects/{P}", "all").status_code == 200


@pytest.mark.process
def test_a_scope_fault_is_applied() -> None:
    with FakeComputeAPI(token="t") as api:
        api.add_instance("vm-1", project=P, zone=Z)
        api.set_fault("scope", Fault.REFUSE, count=1)
        url = f"{api.base_url}/projects/{P}/zones/{Z}"
        hdr = {"Authorization": "Bearer t"}
        assert requests.get(url, headers=hdr, timeout=5).status_code == 403
        assert requests.get(url, headers=hdr, timeout=5).status_code == 200


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok", roles={"tok": REAP}) as a:
        a.add_instance("vm-1", project=P, zone=Z)
        a.add_instance("vm-2", project=P, zone=Z)
        yield a


@pytest.mark.process
def test_the_least_privilege_role_polls_decides_and_reaps(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = Writer(boot="aaaa0001")
    api.append_serial("vm-1", w.line("phase", {"ph": "workload"}))
    api.append_serial("vm-1", w.line("shutdown", {"reason": "ladder", "rung": "10/10"}, "bye"))
    healthy = Writer(boot="bbbb0002")
    healthy.ts_ms = int(time.time() * 1000)
    api.append_serial("vm-2", healthy.line("phase", {"ph": "workload"}))
    assert main(poll_args(api, tmp_path, "--once", "--reap", "vm-1", "vm-2")) == 0
    out = outputs(capsys)
    assert out["vm-1"]["verdict"] == "self_shutdown" and out["vm-1"]["reaped"]
    assert out["vm-2"]["verdict"] == "unknown"  # a first read: age unknown
    assert api.instance("vm-1").deleted
    assert all(c.status != 403 for c in api.calls)


@pytest.mark.process
def test_a_typo_under_the_least_privilege_role_stops_only_that_name(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 23: a never-seen name used to call projects.get, which the role lacks: AuthError
    (exit 77) stopped every name."""
    healthy = Writer(boot="bbbb0002")
    healthy.ts_ms = int(time.time() * 1000)
    api.append_serial("vm-2", healthy.line("phase", {"ph": "workload"}))
    assert main(poll_args(api, tmp_path, "--once", "--reap", "vm-9", "vm-2")) == 69
    out = outputs(capsys)
    assert out["vm-9"]["verdict"] is None
    assert "instance 'vm-9' not found" in str(out["vm-9"]["error"])
    assert out["vm-2"]["error"] is None and out["vm-2"]["verdict"] == "unknown"  # a first read
    assert api.calls_to("delete") == []


@pytest.mark.process
def test_the_least_privilege_fleet_role_lists_polls_and_reaps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    role = documented_role("fleet (`--label`)", "`--reap`", "evidence for an ended VM (rows 6/7)")
    with FakeComputeAPI(token="tok", roles={"tok": role}) as api:
        for name in ("vm-1", "vm-2"):
            api.add_instance(name, project=P, zone=Z, labels={"gce-watchdog": "on"})
        w = Writer(boot="aaaa0001")
        api.append_serial("vm-1", w.line("phase", {"ph": "workload"}))
        api.append_serial("vm-1", w.line("shutdown", {"reason": "ladder", "rung": "10/10"}, "x"))
        healthy = Writer(boot="bbbb0002")
        healthy.ts_ms = int(time.time() * 1000)
        api.append_serial("vm-2", healthy.line("phase", {"ph": "workload"}))
        argv = poll_args(api, tmp_path, "--once", "--reap")
        i = argv.index("--zone")
        argv = [*argv[:i], *argv[i + 2 :], "--label", "gce-watchdog=on"]
        assert main(argv) == 0
        out = outputs(capsys)
        assert out["vm-1"]["verdict"] == "self_shutdown" and out["vm-1"]["reaped"]
        assert out["vm-2"]["verdict"] == "unknown"  # a first read: its age is not known
        assert all(c.status != 403 for c in api.calls)


@pytest.mark.process
def test_the_least_privilege_pubsub_role_names_a_decision_by_its_id(tmp_path: Path) -> None:
    """A Pub/Sub worker looks a deciding instance id up (instances.aggregatedList, ``id = ID``)
    under exactly the `--pubsub` row's Compute permissions; without them it claims nothing."""
    from gce_watchdog.lib.compute import ComputeClient, ComputeRetry
    from gce_watchdog.poller.identity import ComputeIdentities
    from gce_watchdog.poller.ledgers import open_ledger
    from gce_watchdog.poller.pubsub import PubSubWorker
    from gce_watchdog.testing.synth import SYNTH_KEY
    from google.oauth2.credentials import Credentials
    from kit.identities import Batches
    from kit.pubsub_service import exported_entry, exported_text

    role = documented_role("`--pubsub`")
    assert role == {"compute.instances.list"}
    with FakeComputeAPI(token=["tok", "none"], roles={"tok": role, "none": set()}) as api:
        api.add_instance("vm-1", project=P, zone=Z, instance_id="8100000001")
        w = Writer(boot="aaaa0001", inst="8100000001")
        texts = [ln for ev, f in (("phase", {"ph": "workload"}), ("shutdown", {"reason": "x"}))
                 for ln in w.line(ev, f).decode().splitlines()]  # fmt: skip
        entries = [exported_entry(P, "8100000001", "vm-1", exported_text(t, "vm-1", False))
                   for t in texts]  # fmt: skip
        for tok, decided in (("none", 0), ("tok", 1)):
            client = ComputeClient.create(
                Credentials(tok), api.base_url, retry=ComputeRetry(1, sleep=lambda s: None)
            )
            outs: list[object] = []
            with open_ledger(tmp_path / f"{tok}.sqlite") as led:
                led.pins.place_pin("8100000001", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
                worker = PubSubWorker(Batches([entries]), f"projects/{P}/subscriptions/s", led,
                                      outs.append, identity=ComputeIdentities(client, [P]),
                                      log=lambda m: None)  # fmt: skip
                worker.step()
                assert len(led.decisions.all()) == decided and len(outs) == decided
                assert [d.instance for d in led.decisions.all()] == [f"{P}/{Z}/vm-1"] * decided
        statuses = [c.status for c in api.calls_to("list")]
        assert statuses == [403, 200]
