"""Exactly one decision and one announcement per VM, whatever the pollers do: separate cursor
dirs, a poller killed between its claim and its announcement, eight poller processes racing over
100 wedged VMs. Run on both ledger backends (SQLite file, real PostgreSQL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.testing.simcompute import FakeComputeAPI, Fault
from gce_watchdog.testing.synth import Writer
from kit.paths import REPO
from kit.pipes import blocked_pipe

pytestmark = pytest.mark.process

P, Z = "test-project", "us-central1-a"
DEADLINE_S = 60.0  # every wait for an event is bounded by this


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok", hang_s=120) as a:
        yield a


def wedge(api: FakeComputeAPI, names: list[str]) -> None:
    """Each VM's agent climbed its ladder and wrote its shutdown line (a real boot each)."""
    for i, name in enumerate(names):
        api.add_instance(name, project=P, zone=Z)
        w = Writer(boot=f"{i:08x}")
        api.append_serial(
            name,
            w.line("phase", {"ph": "workload"})
            + w.line("shutdown", {"reason": "ladder", "rung": "10/10"}, "10/10: shutting down"),
        )


def poll_argv(
    api: FakeComputeAPI, tmp_path: Path, ledger: str, cursors: str, *extra: str
) -> list[str]:
    tok = tmp_path / "token"
    if not tok.exists():
        tok.write_text("tok\n")
    return [
        "poll", "--project", P, "--zone", Z, "--api-base", api.base_url,
        "--access-token-file", str(tok), "--ledger", ledger,
        "--cursor-dir", str(tmp_path / cursors), "--json",
        "--brake", "off",  # exactly-once over whole wedged fleets: the brake has its own tests
        *extra,
    ]  # fmt: skip


def lines(text: str) -> list[dict[str, object]]:
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


def test_separate_cursor_dirs_never_give_a_second_decision(
    api: FakeComputeAPI, tmp_path: Path, ledger_spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 15: 15 failovers for 10 VMs over 10 rounds, each round a poller with its own cursor
    dir. Reaped VMs are gone (404) to a fresh cursor, which knows neither their id nor their boot:
    the ledger, not the cursor, says they were decided."""
    names = [f"vm-{i}" for i in range(10)]
    wedge(api, names)
    announced: list[str] = []
    for rnd in range(10):
        main(poll_argv(api, tmp_path, ledger_spec, f"cursors-{rnd}", "--once", "--reap", *names))
        out = lines(capsys.readouterr().out)
        assert len(out) == len(names)
        announced += [str(o["instance"]) for o in out if o["action"] == "failover"]
        if rnd > 0:
            assert {o["action"] for o in out} == {"already_decided"}
    assert sorted(announced) == sorted(names)  # one announcement per VM, in the first round
    with open_ledger(ledger_spec) as led:
        decisions = led.decisions.all()
        assert led.decisions.pending_announcements() == []
    assert len(decisions) == len(names)
    assert [d.token for d in decisions] == list(range(1, len(names) + 1))
    deletes = api.calls_to("delete")
    per_vm = {c.path.rsplit("/", 1)[1]: set() for c in deletes}  # type: dict[str, set[str]]
    for c in deletes:
        per_vm[c.path.rsplit("/", 1)[1]].add(c.query["requestId"])
    assert sorted(per_vm) == sorted(names)
    assert all(len(r) == 1 for r in per_vm.values())
    assert len(api.operations) == len(names)  # each VM deleted once


def test_a_poller_killed_between_claim_and_announce_is_announced_by_the_next_once(
    api: FakeComputeAPI, tmp_path: Path, ledger_spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 15: the first poller claims, then hangs in its DELETE and is killed (SIGKILL) before
    it prints ``action=failover``. The decision stays pending; the next poller announces it once
    its claimer's lease lapsed, and no poller announces it again."""
    wedge(api, ["vm-1"])
    api.set_fault("delete", Fault.HANG)
    argv = poll_argv(api, tmp_path, ledger_spec, "cursors-a", "--once", "--reap",
                     "--announce-lease", "1s", "vm-1")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
    first = subprocess.Popen(
        [sys.executable, "-m", "gce_watchdog", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + DEADLINE_S
        with open_ledger(ledger_spec) as led:
            while not (pending := led.decisions.pending_announcements()):  # the claim is the event
                assert first.poll() is None, first.communicate()
                assert time.monotonic() < deadline, "the first poller never claimed"
                time.sleep(0.05)
        assert len(pending) == 1  # claimed, not announced; its DELETE hangs
        first.send_signal(signal.SIGKILL)
        out, _ = first.communicate(timeout=DEADLINE_S)
        assert b"failover" not in out  # it died before announcing
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    api.set_fault("delete", None)
    actions: list[str] = []
    deadline = time.monotonic() + DEADLINE_S
    while "failover" not in actions:  # until the lease lapses and the next poller takes it over
        assert time.monotonic() < deadline, f"never announced: {actions}"
        main(poll_argv(api, tmp_path, ledger_spec, "cursors-b", "--once", "--reap", "vm-1"))
        actions += [str(o["action"]) for o in lines(capsys.readouterr().out)]
    for _ in range(3):
        main(poll_argv(api, tmp_path, ledger_spec, "cursors-c", "--once", "--reap", "vm-1"))
        actions += [str(o["action"]) for o in lines(capsys.readouterr().out)]
    assert actions.count("failover") == 1
    assert set(actions) <= {"already_decided", "failover"}
    with open_ledger(ledger_spec) as led:
        (d,) = led.decisions.all()
        assert d.announced_at is not None and d.announced_by != d.owner
        assert led.decisions.pending_announcements() == []
    assert {c.query["requestId"] for c in api.calls_to("delete")} == {d.request_id}


RACERS = 8
FLEET = 100


def test_eight_pollers_with_separate_cursors_race_over_100_wedged_vms(
    api: FakeComputeAPI, tmp_path: Path, ledger_spec: str
) -> None:
    """Issue 19: exactly 100 decisions, 100 announcements and 100 deletes, one requestId each."""
    names = [f"vm-{i:03d}" for i in range(FLEET)]
    wedge(api, names)
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
    procs = []
    try:
        for r in range(RACERS):
            argv = poll_argv(api, tmp_path, ledger_spec, f"cursors-{r}", "--max-polls", "2",
                             "--interval", "0.2s", "--reap", *names)  # fmt: skip
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "gce_watchdog", *argv],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                )
            )
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err.decode()
    results = [o for out, _ in outs for o in lines(out.decode())]
    assert len(results) == RACERS * 2 * FLEET
    announced = Counter(str(o["instance"]) for o in results if o["action"] == "failover")
    assert sorted(announced) == names and set(announced.values()) == {1}
    assert {str(o["action"]) for o in results} == {"failover", "already_decided"}, [
        o["error"] for o in results if o["error"]
    ][:3]
    with open_ledger(ledger_spec) as led:
        decisions = led.decisions.all()
        assert led.decisions.pending_announcements() == []
    assert len(decisions) == FLEET
    assert sorted(d.token for d in decisions) == list(range(1, FLEET + 1))
    rids: dict[str, set[str]] = {}
    for c in api.calls_to("delete"):
        rids.setdefault(c.path.rsplit("/", 1)[1], set()).add(c.query["requestId"])
    assert sorted(rids) == names and all(len(r) == 1 for r in rids.values())
    by_vm = {d.instance.rsplit("/", 1)[1]: d.request_id for d in decisions}
    assert {vm: next(iter(r)) for vm, r in rids.items()} == by_vm
    assert len(api.operations) == FLEET and all(api.instance(n).deleted for n in names)


def test_a_poller_killed_after_its_reap_before_announcing_is_announced_once(
    api: FakeComputeAPI, tmp_path: Path, ledger_spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The claimer deletes the VM, then blocks writing its announcement (stdout full) and is
    killed. The VM is gone: later pollers see a 404 and the decision, never the VM again. The
    decision is still announced, once, when the lease lapses (each round takes over lapsed
    announcements), by whichever poller comes next."""
    wedge(api, ["vm-1"])
    argv = poll_argv(api, tmp_path, ledger_spec, "cursors-a", "--once", "--reap",
                     "--announce-lease", "1s", "vm-1")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
    r, w = blocked_pipe()
    first = subprocess.Popen([sys.executable, "-m", "gce_watchdog", *argv], stdout=w,
                             stderr=subprocess.PIPE, env=env)  # fmt: skip
    os.close(w)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not api.instance("vm-1").deleted:  # reaped: now it blocks on its announcement
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first poller never reaped"
            time.sleep(0.05)
        with open_ledger(ledger_spec) as led:
            while (
                d := led.decisions.get(
                    led.decisions.all()[0].instance_id, led.decisions.all()[0].boot
                )
            ) and not d.reaped_at:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert [p.token for p in led.decisions.pending_announcements()] == [d.token]
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=DEADLINE_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        os.close(r)
    actions: list[str] = []
    deadline = time.monotonic() + DEADLINE_S
    while "failover" not in actions:  # other pollers, other cursor dirs, one run each
        assert time.monotonic() < deadline, f"never announced: {actions}"
        main(poll_argv(api, tmp_path, ledger_spec, f"c-{len(actions)}", "--once", "vm-1"))
        actions += [str(o["action"]) for o in lines(capsys.readouterr().out)]
    for i in range(3):
        main(poll_argv(api, tmp_path, ledger_spec, f"d-{i}", "--once", "vm-1"))
        actions += [str(o["action"]) for o in lines(capsys.readouterr().out)]
    assert actions.count("failover") == 1
    with open_ledger(ledger_spec) as led:
        (d,) = led.decisions.all()
        assert led.decisions.pending_announcements() == [] and d.announced_by != d.owner
    assert len(api.operations) == 1  # deleted once
