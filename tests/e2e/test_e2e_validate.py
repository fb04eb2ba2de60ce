"""``gce-watchdog validate`` end to end against real booted VMs (issue 28 item 5, docs/e2e.md).

The fake Compute API's ``instances.insert`` boots the qemu guest with the insert body's metadata
(:class:`e2e.guests.QemuGuests`): the real start-up script installs the agent from the pinned
wheelhouse (on the done VM, the same wheelhouse is baked into the image), the agent follows
``gce-watchdog-fault`` from metadata (validate's drop-in enables it), ``setMetadata`` reaches the
guest's metadata server, its serial output is the fake's while the VM runs, its power-off is a
``guestTerminate``, and ``instances.delete`` kills qemu.
``validate`` runs in-process, as a user runs it, with only its pacing shortened.

Output: ``build/e2e/validate/`` (validate.json, the report, the consoles) and
``build/e2e/validate-<scenario>/`` per VM (serial.log, qemu.log, simgce's log).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest
from gce_watchdog.cli import main
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.validate.plan import LABEL
from kit.paths import REPO

from e2e import guests, vm

pytestmark = [pytest.mark.vm, pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1500)]

P, Z = "test-project", "us-central1-a"
RUN = "ve2e"
TOKEN = "e2e-validate-token"  # the fake Compute API's test token
# validate's pacing: a 2 s agent tick (as the other scenarios: the drop-in validate writes sets
# it; CONFIG, the environment's config.toml, gives the matching probe timeouts and the fake
# internet's 443 target), a poll every 2 s, operations read every 0.2 s.
PACING = ["--agent-interval", "2", "--poll-every", "2", "--op-poll", "0.2", "--deadline", "1200"]
# The environment's config.toml (the image's runner installs it; a GCE image has none): probe
# timeouts that fit validate's 2 s tick, the fake internet's 443 target (the default targets do
# not resolve here), a 6 s linger after the ladder's shutdown, no memory watch (a 1 GiB guest).
# validate's own drop-in (50-metadata.toml: the interval, faults from metadata) overrides it.
CONFIG = (
    """\
[agent]
probe_timeout = "1s"

"""
    + vm.FAKE_INTERNET_CONFIG
)
BOOT_TIMEOUT = 600.0  # one VM, boot to power-off (measured: see docs/e2e.md)
TIMINGS = (
    "fault_to_first_rung_s",
    "fault_to_top_rung_s",
    "fault_to_shutdown_line_s",
    "fault_to_left_running_s",
    "fault_to_decision_s",
)


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token=TOKEN, serial_needs_running=True) as a:
        a.add_zone(P, Z)
        yield a


def argv(api: FakeComputeAPI, *extra: str) -> list[str]:
    tok = vm.BUILD / "validate-token"
    tok.parent.mkdir(parents=True, exist_ok=True)
    tok.write_text(TOKEN + "\n")
    return ["validate", "--project", P, "--zone", Z, "--api-base", api.base_url,
            "--access-token-file", str(tok), *extra]  # fmt: skip


def test_validate_wedge_and_done_against_booted_vms(e2e: vm.Harness, api: FakeComputeAPI) -> None:
    out = vm.BUILD / "validate"
    shutil.rmtree(out, ignore_errors=True)
    sha = vm.sha256_of(e2e.www, "wheelhouse.tar")
    base = vm.VmSpec(name="validate", startup_script="", config=CONFIG, timeout=BOOT_TIMEOUT)
    t0 = time.monotonic()
    # The wedge VM installs the agent from validate's wheelhouse URL, as a user's VM does; the
    # done VM boots the image with the same wheelhouse baked in (docs/e2e.md, "Time").
    with guests.QemuGuests(e2e, api, base, prefix="validate", baked=frozenset({"done"})) as qemu:
        rc = main(
            argv(
                api,
                "--scenario", "wedge", "--scenario", "done", "--yes", "--run-id", RUN,
                "--out", str(out),
                # https as validate requires; the guest is served it over http (e2e/guests.py)
                "--wheel-url", f"https://{vm.WHEELS_NAME}/wheelhouse.tar", "--wheel-sha256", sha,
                "--startup-script", str(REPO / "startup" / "startup-script.sh"),
                *PACING,
            )
        )  # fmt: skip
    wall = time.monotonic() - t0
    boots = qemu.summary()
    print("\n".join(boots))
    doc = json.loads((out / "validate.json").read_text())
    by: dict[str, dict[str, Any]] = {s["scenario"]: s for s in doc["scenarios"]}
    e2e.timings["validate"] = {
        "wall_s": round(wall, 1),
        "wedge": by.get("wedge", {}).get("timings"),
    }
    fails = [(s["scenario"], [e for e in s["evidence"] if "FAIL" in e], s["notes"])
             for s in doc["scenarios"]]  # fmt: skip
    assert rc == 0, (fails, boots)
    assert doc["passed"] and doc["interrupted"] is None

    # Both VMs were booted, one after the other, from the insert bodies.
    assert [b.name for b in qemu.booted] == ["validate-wedge", "validate-done"], boots
    assert all(b.result is not None and b.error is None for b in qemu.booted), boots
    wedge_boot, done_boot = qemu.booted
    assert wedge_boot.metadata_changes >= 1, "validate's fault request reached the guest"
    assert done_boot.metadata_changes == 0

    wedge = by["wedge"]
    assert wedge["passed"], wedge["evidence"]
    assert wedge["failovers"] == 1 and wedge["verdict"] == "self_shutdown", wedge
    t = wedge["timings"]
    for k in TIMINGS:
        assert t[k] is not None and t[k] >= 0, (k, t)
    assert t["fault_to_first_rung_s"] < t["fault_to_top_rung_s"] <= t["fault_to_shutdown_line_s"]
    assert t["fault_to_decision_s"] <= t["fault_to_left_running_s"] + 0.5, t
    assert wedge["deleted"]
    # The serial log validate kept is what the real agent wrote: its fault and shutdown lines.
    console = (out / wedge["files"]["serial"]).read_bytes()
    assert b" fault " in console and b" op=inject" in console
    assert b" shutdown " in console and b"reason=ladder" in console

    done = by["done"]
    assert done["passed"], done["evidence"]
    assert done["failovers"] == 0 and done["verdict"] == "workload_ok", done
    assert done["reaped_by_poller"] and done["deleted"], done
    assert done["timings"]["fault_to_decision_s"] is None

    # Nothing left: no instance alive in the fake, and `validate --cleanup RUN` finds nothing.
    assert [i.name for i in api._instances.values() if not i.deleted] == []
    assert {i.labels[LABEL] for i in api._instances.values() if i.inserted} == {RUN}
    assert main(argv(api, "--cleanup", RUN)) == 0
    assert [i.name for i in api._instances.values() if not i.deleted] == []
