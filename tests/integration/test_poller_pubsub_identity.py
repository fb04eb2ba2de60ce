"""Issue 25 item 2: a Pub/Sub worker names a decision by what the Compute API says the instance
id is, never by the LogEntry's labels. The attack: a real, signed line of VM A republished with
VM B's project, zone and name (whoever can publish to the topic, or replay an export, can write
any labels). The signature binds a v3 line to A's instance **id**, not to those names, so the
worker must take them from the API: the decision, the announcement and the decisions view name
A, never B, and the mismatch is an alarm. An id no configured project has is never announced;
an API that cannot answer delays the claim, it never lets the LogEntry's names through.

The worker runs against the fake Compute API (``instances.aggregatedList`` with ``id = ID``),
through the real emulator (kit/pubsub_service.py) and, for the rest, a subscriber that hands out
given batches (kit/identities.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gce_watchdog.lib.compute import ComputeClient, ComputeRetry
from gce_watchdog.poller.decisions import doc_for
from gce_watchdog.poller.identity import ComputeIdentities
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.poller.poller import PollOutcome
from gce_watchdog.poller.pubsub import IDENTITY_RETRY_S, PubSubWorker
from gce_watchdog.testing.simcompute import FakeComputeAPI, Fault
from gce_watchdog.testing.synth import SYNTH_KEY, Writer
from google.oauth2.credentials import Credentials
from kit.identities import Batches
from kit.paths import REPO
from kit.procs import running, terminate, wait_alive
from kit.pubsub_emulator import publish_all, topic_and_subscription
from kit.pubsub_service import ServiceLikeSubscriber, exported_entry, exported_text

pytestmark = pytest.mark.process

P, Z = "test-project", "us-central1-a"
# VM B: another team's VM, a real one, in a project the worker also watches
P_B, Z_B = "victim-project", "europe-west4-b"
A_ID, B_ID = "7100000001", "7100000002"
DEADLINE_S = 240.0  # a bound only: the tests wait for the ledger, not for time


def a_boot(boot: str = "a1a10001") -> list[str]:
    """A wedged boot of VM A, signed with its key and bound to its id (v3 ``inst=``)."""
    w = Writer(boot=boot, inst=A_ID)
    evs: list[tuple[str, dict[str, str]]] = [
        ("start", {"v": "1"}),
        ("phase", {"ph": "workload"}),
        ("shutdown", {"reason": "ladder", "rung": "10/10"}),
    ]
    return [ln for name, f in evs for ln in w.line(name, f).decode().splitlines()]


def relabelled(texts: list[str]) -> list[bytes]:
    """A's real lines, each in a LogEntry that names VM B (project, zone, name): only the
    instance id is A's (another id would not verify: the existing relabelled-id test)."""
    return [exported_entry(P_B, A_ID, "vm-b", exported_text(t, "vm-a", False), Z_B) for t in texts]


def honest(texts: list[str]) -> list[bytes]:
    return [exported_entry(P, A_ID, "vm-a", exported_text(t, "vm-a", False), Z) for t in texts]


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok") as a:
        a.add_instance("vm-a", project=P, zone=Z, instance_id=A_ID)
        a.add_instance("vm-b", project=P_B, zone=Z_B, instance_id=B_ID)
        yield a


def identities(
    api: FakeComputeAPI,
    projects: tuple[str, ...] = (P, P_B),
    clock: Callable[[], float] = time.monotonic,
) -> ComputeIdentities:
    waits: list[float] = []
    client = ComputeClient.create(
        Credentials("tok"),
        api.base_url,
        timeout=(2.0, 10.0),
        retry=ComputeRetry(2, sleep=waits.append),
    )
    return ComputeIdentities(client, projects, clock)


class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


def _never_b(outs: list[PollOutcome], logs: list[str]) -> None:
    for o in outs:
        doc = json.dumps(o.to_json())
        assert "vm-b" not in doc and P_B not in doc and Z_B not in doc, doc


def test_a_real_line_of_vm_a_relabelled_as_vm_b_is_announced_as_vm_a_on_the_emulator(
    pubsub_host: str, api: FakeComputeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_host)
    with topic_and_subscription(P, "serial", "watchdog", ack_deadline_s=10) as ts:
        publish_all(ts.publisher, ts.topic, relabelled(a_boot()))
        outs: list[PollOutcome] = []
        logs: list[str] = []
        with open_ledger(tmp_path / "ledger.sqlite", owner="w1") as led:
            led.pins.place_pin(A_ID, SYNTH_KEY.public, SYNTH_KEY.fingerprint)  # A's key, by its id
            ss = ServiceLikeSubscriber(ts.subscriber, 2, seed=3)
            w = PubSubWorker(ss, ts.subscription, led, outs.append, settle_s=600.0,
                             identity=identities(api), log=logs.append)  # fmt: skip
            deadline = time.monotonic() + DEADLINE_S
            while not (led.decisions.all() and not led.decisions.pending_announcements()):
                assert time.monotonic() < deadline, f"nothing decided: {w.stats}, {logs}"
                w.step(timeout=0.5)
            (d,) = led.decisions.all()
            view = doc_for(led.decisions, d.token)  # the decisions view (`gce-watchdog decisions`)
    assert (d.instance_id, d.verdict, d.instance) == (A_ID, "self_shutdown", f"{P}/{Z}/vm-a")
    assert view is not None and (view["project"], view["zone"], view["name"]) == (P, Z, "vm-a")
    (o,) = [o for o in outs if o.action == "failover"]
    assert (o.instance, o.instance_id, o.project, o.zone) == ("vm-a", A_ID, P, Z)
    _never_b(outs, logs)
    assert w.stats.relabelled == 1
    assert any("ALARM" in x and f"{P_B}/{Z_B}/vm-b" in x and f"{P}/{Z}/vm-a" in x for x in logs)
    lists = api.calls_to("list")
    assert lists and all(c.query.get("filter") == f"id = {A_ID}" for c in lists)


def test_an_honest_stream_is_named_as_before_no_alarm(api: FakeComputeAPI, tmp_path: Path) -> None:
    outs: list[PollOutcome] = []
    logs: list[str] = []
    with open_ledger(tmp_path / "l.sqlite") as led:
        led.pins.place_pin(A_ID, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        w = PubSubWorker(Batches([honest(a_boot())]), "s", led, outs.append,
                         identity=identities(api), log=logs.append)  # fmt: skip
        w.step()
        (d,) = led.decisions.all()
    assert d.instance == f"{P}/{Z}/vm-a" and [o.instance for o in outs] == ["vm-a"]
    assert w.stats.relabelled == 0 and logs == []


@pytest.mark.parametrize("why", ["deleted", "another project"])
def test_an_id_no_configured_project_has_is_never_announced(
    api: FakeComputeAPI, tmp_path: Path, why: str
) -> None:
    """VM A deleted before the worker looks, or in a project the worker is not configured for:
    nothing is claimed or announced (least of all under the LogEntry's names), an alarm, and
    the boot is left to the Compute API sweep (gapped): a redelivery changes nothing."""
    projects = (P, P_B)
    if why == "deleted":
        api.instance("vm-a").deleted = True
    else:
        projects = (P_B,)
    outs: list[PollOutcome] = []
    logs: list[str] = []
    entries = relabelled(a_boot())
    with open_ledger(tmp_path / "l.sqlite") as led:
        led.pins.place_pin(A_ID, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        subscriber = Batches([entries, entries])  # then a redelivery of all of it
        w = PubSubWorker(subscriber, "s", led, outs.append,
                         identity=identities(api, projects), log=logs.append)  # fmt: skip
        w.step()
        w.step()
        assert led.decisions.all() == [] and led.decisions.pending_announcements() == []
        assert led.assembly.boots() == [(A_ID, "a1a10001", "gapped")]
        assert len(subscriber.acked) == 2 * len(entries)  # stored, left: acked
    assert outs == []
    assert w.stats.unknown == 1 and w.stats.decisions == 0
    assert any("ALARM" in x and A_ID in x and "not announced" in x for x in logs), logs


@pytest.mark.parametrize("fault", [Fault.SERVER_ERROR, Fault.REFUSE])
def test_an_api_error_delays_the_claim_never_lets_the_logentry_names_through(
    api: FakeComputeAPI, tmp_path: Path, fault: Fault
) -> None:
    """The lookup fails (503 past the retries, or 403): nothing is claimed, the lines are acked
    (they are stored), and the boot is looked at again IDENTITY_RETRY_S later, by any worker
    (the hint is in the ledger): then it is decided under the API's names."""
    api.set_fault("list", fault)
    clock = Clock()
    outs: list[PollOutcome] = []
    logs: list[str] = []
    entries = relabelled(a_boot())
    with open_ledger(tmp_path / "l.sqlite") as led:
        led.pins.place_pin(A_ID, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        subscriber = Batches([entries])
        w = PubSubWorker(subscriber, "s", led, outs.append, clock=clock,
                         identity=identities(api, clock=clock), log=logs.append)  # fmt: skip
        w.step()
        assert led.decisions.all() == [] and outs == [] and w.stats.unidentified == 1
        assert len(subscriber.acked) == len(entries)
        assert led.assembly.boots() == [(A_ID, "a1a10001", "open")]
        clock.t += IDENTITY_RETRY_S - 1.5
        w.step()
        assert led.decisions.all() == [] and w.stats.unidentified == 1  # not due yet: not asked
        api.set_fault("list", None)
        clock.t += 2.0
        w.step()  # housekeeping: the hint is due
        (d,) = led.decisions.all()
    assert d.instance == f"{P}/{Z}/vm-a"
    assert [(o.instance, o.project, o.zone) for o in outs] == [("vm-a", P, Z)]
    _never_b(outs, logs)
    assert any("could not say" in x for x in logs) and w.stats.relabelled == 1


def test_a_worker_that_dies_during_the_lookup_leaves_the_boot_to_the_next(
    api: FakeComputeAPI, tmp_path: Path
) -> None:
    """Worker 1 looks (the boot's hint is set), its lookup fails and it is gone: worker 2 never
    receives those lines again (they were acked) and still decides it, from the hint."""
    api.set_fault("list", Fault.SERVER_ERROR)
    clock = Clock()
    outs: list[PollOutcome] = []
    url = tmp_path / "l.sqlite"
    with open_ledger(url, owner="w1") as led:
        led.pins.place_pin(A_ID, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        w1 = PubSubWorker(Batches([relabelled(a_boot())]), "s", led, outs.append, clock=clock,
                          identity=identities(api), log=lambda m: None)  # fmt: skip
        w1.step()
        assert led.decisions.all() == []
    api.set_fault("list", None)
    clock.t += IDENTITY_RETRY_S + 1
    with open_ledger(url, owner="w2") as led:
        w2 = PubSubWorker(Batches([]), "s", led, outs.append, clock=clock,
                          identity=identities(api), log=lambda m: None)  # fmt: skip
        w2.step()
        (d,) = led.decisions.all()
    assert (d.owner, d.instance) == ("w2", f"{P}/{Z}/vm-a")


def test_the_cli_worker_looks_ids_up_in_the_subscriptions_project(
    pubsub_host: str, api: FakeComputeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gce-watchdog poll --pubsub`` without --project: ids are looked up in the subscription's
    project (here A's); B's relabelling is an alarm on stderr, the printed line names A."""
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_host)
    with topic_and_subscription(P, "serial", "watchdog", ack_deadline_s=10) as ts:
        publish_all(ts.publisher, ts.topic, relabelled(a_boot()))
        ledger = tmp_path / "l.sqlite"
        with open_ledger(ledger) as led:
            led.pins.place_pin(A_ID, SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        (tmp_path / "tok").write_text("tok\n")
        env = {**os.environ, "PYTHONPATH": str(REPO / "agent"), "PUBSUB_EMULATOR_HOST": pubsub_host}
        argv = [sys.executable, "-m", "gce_watchdog", "poll", "--pubsub", ts.subscription,
                "--json", "--settle", "600s", "--api-base", api.base_url, "--access-token-file",
                str(tmp_path / "tok"), "--ledger", str(ledger)]  # fmt: skip
        with running(argv, env) as worker:
            wait_alive(worker, lambda: _announced(ledger), DEADLINE_S, "never announced")
            out, err = terminate(worker)
    assert worker.returncode == 0, err.decode()
    (line,) = [json.loads(x) for x in out.decode().splitlines()]
    assert (line["instance"], line["project"], line["zone"]) == ("vm-a", P, Z), line
    assert b"vm-b" not in out and P_B.encode() not in out
    assert b"ALARM" in err and f"{P_B}/{Z_B}/vm-b".encode() in err
    assert {c.path.split("/projects/")[1].split("/")[0] for c in api.calls_to("list")} == {P}


def _announced(path: Path) -> bool:
    with open_ledger(path) as led:
        return any(d.announced_at is not None for d in led.decisions.all())
