"""GET /healthz for Cloud Run services (issue 26; lib/health.py), on loopback.

The server on a clock the test moves (the pure answer: tests/unit/test_health.py), then a real
``poll --pubsub`` worker on the Pub/Sub emulator serving /healthz on ``$PORT``: 200 while it
pulls, 503 while its loop is stuck (an ``--on-failover`` command that does not return until the
test lets it), 200 again after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.lib.health import HealthServer, Liveness
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.synth import SYNTH_KEY, Writer
from kit.paths import REPO
from kit.ports import free_port
from kit.pubsub_emulator import topic_and_subscription
from kit.pubsub_service import exported_entry, exported_text
from kit.wait import wait_for

DEADLINE_S = 90.0


def get(port: int, path: str = "/healthz") -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        return e.code, json.loads(body) if body.startswith(b"{") else {}


@pytest.mark.process
def test_the_server_answers_from_the_liveness_and_only_on_its_paths() -> None:
    now = [1000.0]
    live = Liveness(30.0, clock=lambda: now[0])
    with HealthServer(live, "127.0.0.1", 0) as srv:
        assert get(srv.port) == (200, {"status": "ok", "last_progress_s": 0.0, "stall_s": 30.0})
        assert get(srv.port, "/")[0] == 200
        now[0] += 31
        code, body = get(srv.port)
        assert code == 503 and body["status"] == "stalled"
        live.beat()
        assert get(srv.port, "/healthz?probe=1")[0] == 200
        assert get(srv.port, "/metrics")[0] == 404


# -- a real worker -------------------------------------------------------------------------------

# Blocks (a stuck dispatcher) until the test creates the release file; bounded anyway.
HOOK = """
import os, sys, time
state = sys.argv[1]
open(os.path.join(state, "started"), "w").close()
end = time.monotonic() + 120
while not os.path.exists(os.path.join(state, "release")) and time.monotonic() < end:
    time.sleep(0.05)
"""


@pytest.fixture
def topic(pubsub_host: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_host)
    with topic_and_subscription("test-project", "serial-h", "watchdog-h", ack_deadline_s=60) as ts:
        yield ts.topic, ts.subscription


@pytest.mark.process
def test_a_pubsub_worker_serves_healthz_on_port_and_says_when_its_loop_is_stuck(
    topic: tuple[str, str], pubsub_host: str, tmp_path: Path
) -> None:
    from google.cloud import pubsub_v1

    t, s = topic
    w = Writer(boot="feed0001")
    texts = [
        ln
        for ev, f in (("phase", {"ph": "workload"}), ("shutdown", {"reason": "ladder"}))
        for ln in w.line(ev, f).decode().splitlines()
    ]
    ledger = tmp_path / "l.sqlite"
    with open_ledger(ledger) as led:
        led.pins.place_pin("6100", SYNTH_KEY.public, SYNTH_KEY.fingerprint)
    # who 6100 is: the worker asks the Compute API by id (never the LogEntry's names)
    api = FakeComputeAPI(token="unused").start()
    api.add_instance("vm-h", project="test-project", instance_id="6100")
    state = tmp_path / "hook"
    state.mkdir()
    (tmp_path / "hook.py").write_text(HOOK)
    (tmp_path / "tok").write_text("unused\n")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent"), "PUBSUB_EMULATOR_HOST": pubsub_host,
           "PORT": str(port)}  # fmt: skip
    argv = [sys.executable, "-m", "gce_watchdog", "poll", "--pubsub", s, "--ledger", str(ledger),
            "--json", "--settle", "1s", "--access-token-file", str(tmp_path / "tok"),
            "--api-base", api.base_url, "--health-address", "127.0.0.1", "--health-stall", "3s",
            "--on-failover", f"{sys.executable} {tmp_path / 'hook.py'} {state}"]  # fmt: skip
    worker = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    seen: list[int] = []

    def health_is(code: int) -> bool:
        assert worker.poll() is None, worker.communicate()
        try:
            got = get(port)[0]
        except OSError:  # not listening yet
            return False
        seen.append(got)
        return got == code

    try:
        assert wait_for(lambda: health_is(200), DEADLINE_S), "never healthy"
        for _ in range(5):  # pulling (nothing to pull) is progress
            assert wait_for(lambda: health_is(200), DEADLINE_S), f"not healthy: {seen[-5:]}"
        pub = pubsub_v1.PublisherClient()
        for x in texts:
            entry = exported_entry("test-project", "6100", "vm-h", exported_text(x, "vm-h", False))
            pub.publish(t, entry).result(timeout=30)
        assert wait_for(lambda: (state / "started").exists(), DEADLINE_S), "hook never ran"
        assert wait_for(lambda: health_is(503), DEADLINE_S), f"never stalled: {seen[-5:]}"
        (state / "release").touch()
        assert wait_for(lambda: health_is(200), DEADLINE_S), "did not recover"
        with open_ledger(ledger) as led:
            assert wait_for(
                lambda: not led.decisions.pending_announcements() and led.decisions.all(),
                DEADLINE_S,
            )
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
        api.close()
    assert worker.returncode == 0, err.decode()
    assert f"health: GET /healthz on 127.0.0.1:{port}".encode() in err


@pytest.mark.process
def test_a_bad_health_port_or_stall_is_a_usage_error(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent"), "PORT": "70000"}
    argv = [sys.executable, "-m", "gce_watchdog", "poll", "--pubsub",
            "projects/test-project/subscriptions/serial", "--ledger", str(tmp_path / "l.sqlite"),
            "--health-stall", "0s"]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert r.returncode == 64, r.stderr
    assert "--health-port 70000: want 1..65535" in r.stderr  # $PORT is its default
    assert "--health-stall must be > 0" in r.stderr
    assert not (tmp_path / "l.sqlite").exists()
