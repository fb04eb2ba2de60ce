"""The poller's container image, built and run for real (issue 26 item 5): the repository's
Dockerfile built by podman (someone else's builder, runc its runtime) from the hash-pinned locks,
offline, on a Debian 12 base (tests/kit/podman.py says why and how), then run in the two Cloud
Run forms docs/poller.md names:

- a **job**: ``--once`` rounds, each a new replica with a fresh disk, against the fake Compute
  API and a real PostgreSQL ledger on loopback: the wedged VM is failed over once, and the next
  replica finds it already decided;
- a **service**: the Pub/Sub worker on the real emulator, GET /healthz on ``$PORT``, a decision
  from the stream, and SIGTERM (what Cloud Run sends, with 10 s before SIGKILL) ending it with 0.

Also: ``--version``, the unprivileged user, and the refusal (64) without a shared ledger."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog import __version__
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.synth import SYNTH_KEY, Writer
from kit.podman import Podman, build, debian_tree, unavailable
from kit.ports import free_port
from kit.pubsub_emulator import topic_and_subscription
from kit.pubsub_service import exported_entry, exported_text
from kit.wait import wait_for

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1200)]

TAG = "localhost/gce-watchdog-poller:test"
LABEL = {"gce-watchdog": "on"}
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def pm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    why = unavailable()
    if why:
        pytest.skip(f"container: {why}")
    p = Podman(tmp_path_factory.mktemp("podman"))
    try:
        p.import_tree(debian_tree(), "localhost/gcewd-base:bookworm")
        build(p, "localhost/gcewd-base:bookworm", TAG)
        yield p
    finally:
        p.close()


def secret(tmp_path: Path, value: str = "tok") -> Path:
    """A token file the image's user (uid 10001) can read through a bind mount."""
    tok = tmp_path / "token"
    tok.write_text(value + "\n")
    tok.chmod(0o644)
    return tok


def test_version_user_and_entry_point(pm: Podman) -> None:
    r = pm.run("run", "--rm", "--network=none", TAG, "--version")
    assert (r.returncode, r.stdout) == (0, f"gce-watchdog {__version__}\n"), r.stderr
    who = pm.run("run", "--rm", "--network=none", "--entrypoint", "id", TAG, "-u")
    assert who.stdout.strip() == "10001", who.stderr
    inspect = pm.run("image", "inspect", "--format", "{{json .Config.Entrypoint}}", TAG)
    assert json.loads(inspect.stdout) == ["gce-watchdog", "poll", "--json"]


def test_without_a_postgresql_ledger_the_image_refuses_to_start(pm: Podman) -> None:
    r = pm.run("run", "--rm", "--network=none", TAG, "--label", "gce-watchdog=on",
               "--project", "test-project", "--once")  # fmt: skip
    assert r.returncode == 64, r.stderr
    assert "GCE_WATCHDOG_SHARED_LEDGER=required" in r.stderr


def test_as_a_cloud_run_job_each_replica_a_fresh_disk_one_failover(
    pm: Podman, pg_database: str, tmp_path: Path
) -> None:
    tok = secret(tmp_path)
    with FakeComputeAPI(token="tok") as api:
        api.add_instance("a-healthy", zone="us-central1-a", labels=LABEL)
        api.add_instance("b-wedged", zone="us-central1-b", labels=LABEL)
        w = Writer(boot="aaaa0001")
        w.ts_ms = int(time.time() * 1000)
        api.append_serial("a-healthy", w.line("phase", {"ph": "workload"}))
        w = Writer(boot="bbbb0002")
        lines = w.line("phase", {"ph": "workload"})  # the first line of a boot carries its key
        lines += w.line("shutdown", {"reason": "ladder", "rung": "10/10"}, "10/10")
        api.append_serial("b-wedged", lines)
        runs = []
        for _ in range(2):  # two executions of the job: nothing of the first one's disk is left
            r = pm.run("run", "--rm", "--network=host", "-v", f"{tok}:/run/secrets/token:ro",
                       TAG, "--label", "gce-watchdog=on", "--project", "test-project", "--once",
                       "--api-base", api.base_url, "--access-token-file", "/run/secrets/token",
                       "--ledger", pg_database)  # fmt: skip
            assert r.returncode == 0, r.stderr
            runs.append({d["instance"]: d for d in map(json.loads, r.stdout.splitlines())})
        seen = {c.path for c in api.calls if c.authorized}
    assert any("b-wedged/serialPort" in p for p in seen)
    assert runs[0]["b-wedged"]["action"] == "failover", runs[0]
    assert runs[0]["a-healthy"]["action"] == "none"
    assert runs[1]["b-wedged"]["action"] == "already_decided", runs[1]
    with open_ledger(pg_database) as led:
        assert [d.instance for d in led.decisions.all()] == ["test-project/us-central1-b/b-wedged"]


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def test_as_a_cloud_run_service_healthz_on_port_and_sigterm(
    pm: Podman, pg_database: str, pubsub_host: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_host)
    n = f"{os.getpid()}-{time.monotonic_ns():x}"
    with topic_and_subscription("test-project", "serial-c", "watchdog-c", ack_deadline_s=60) as ts:
        with open_ledger(pg_database) as led:
            led.pins.place_pin("6200", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
        tok, port, name = secret(tmp_path), free_port(), f"gcewd-svc-{n}"
        api = FakeComputeAPI(token="tok").start()
        api.add_instance("vm-c", project="test-project", instance_id="6200")
        svc = pm.popen("run", "--rm", "--name", name, "--network=host",
                       "-e", f"PORT={port}", "-e", f"PUBSUB_EMULATOR_HOST={pubsub_host}",
                       "-v", f"{tok}:/run/secrets/token:ro", TAG, "--pubsub", ts.subscription,
                       "--ledger", pg_database, "--settle", "1s", "--api-base", api.base_url,
                       "--access-token-file", "/run/secrets/token")  # fmt: skip
        try:
            assert wait_for(lambda: svc.poll() is None and _health(port) == 200, DEADLINE_S), (
                svc.poll(),
                svc.stderr.read() if svc.poll() is not None and svc.stderr else b"",
            )
            w = Writer(boot="cafe0001")
            for ev, f in (("phase", {"ph": "workload"}), ("shutdown", {"reason": "ladder"})):
                for x in w.line(ev, f).decode().splitlines():
                    text = exported_text(x, "vm-c", False)
                    entry = exported_entry("test-project", "6200", "vm-c", text)
                    ts.publisher.publish(ts.topic, entry).result(timeout=30)
            with open_ledger(pg_database) as led:
                assert wait_for(
                    lambda: led.decisions.all() and not led.decisions.pending_announcements(),
                    DEADLINE_S,
                )
                assert [d.instance for d in led.decisions.all()] == [
                    "test-project/us-central1-a/vm-c"
                ]
            stop = pm.run("stop", "--time", "10", name, timeout=60)  # SIGTERM, SIGKILL after 10 s
            assert stop.returncode == 0, stop.stderr
            out, err = svc.communicate(timeout=60)
        finally:
            if svc.poll() is None:
                pm.run("rm", "--force", name, timeout=60)
                svc.communicate(timeout=60)
            api.close()
    assert svc.returncode == 0, err.decode()[-2000:]
    assert f"health: GET /healthz on 0.0.0.0:{port}".encode() in err
    assert b"tok\n" not in out + err
