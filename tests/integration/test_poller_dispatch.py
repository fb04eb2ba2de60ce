"""Decisions delivered to a dispatcher exactly once (issue 26), on both ledger backends.

Two dispatchers written only from docs/poller.md ("Decisions as an interface"): one follows
``gce-watchdog decisions --follow --json`` and resumes after the last token it handled; one runs
as ``poll --on-failover`` and dedups on ``GCE_WATCHDOG_TOKEN``. The poller is killed with
SIGKILL at every step of a failover (before its ledger write, after it, during the hook, after
the hook before marking done); each job is re-launched exactly once by each dispatcher. Then the
hook's own contract (retries, timeout, a full stdout pipe), and the fleet-wide brake on a zone
outage of 50 VMs and on one real wedge.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.lib.retry import Backoff
from gce_watchdog.poller.hooks import FailoverHook
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.testing.simcompute import FakeComputeAPI, Fault
from gce_watchdog.testing.synth import Writer
from kit.paths import REPO
from kit.pipes import blocked_pipe
from kit.pubsub_emulator import topic_and_subscription
from kit.wait import wait_for

P, Z = "test-project", "us-central1-a"
DEADLINE_S = 60.0  # every wait for an event is bounded by this
ENV = {**os.environ, "PYTHONPATH": str(REPO / "agent")}

# The --on-failover dispatcher, from docs/poller.md: the decision on stdin, dedup on the token
# (delivery is at-least-once), exit 0 only once the re-launch is recorded durably.
HOOK = """
import fcntl, json, os, signal, sys
state = sys.argv[1]
doc = json.load(sys.stdin)
token = os.environ["GCE_WATCHDOG_TOKEN"]
assert doc["v"] == 2 and str(doc["token"]) == token
assert doc["request_id"] == os.environ["GCE_WATCHDOG_REQUEST_ID"]
with open(os.path.join(state, "calls"), "a") as f:
    f.write(token + "\\n")
# -- the test's crash injection (not part of a dispatcher): once per job, from a plan file --
plan = os.path.join(state, "plan", doc["job"])
try:
    mode = open(plan).read().strip()
    os.unlink(plan)
except FileNotFoundError:
    mode = ""
if mode == "hang":  # the test kills the poller while this runs
    open(os.path.join(state, "hanging"), "w").write(str(os.getpid()))
    signal.pause()
# -- the dispatcher --
with open(os.path.join(state, "relaunched"), "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    if token not in [line.split()[0] for line in f]:
        f.write(token + " " + doc["job"] + "\\n")
        f.flush()
        os.fsync(f.fileno())
if mode == "after":  # the job is re-launched; the poller dies before marking it done
    os.kill(os.getppid(), signal.SIGKILL)
"""

# The follower dispatcher, from docs/poller.md: resume after the last token handled.
FOLLOWER = """
import json, os, subprocess, sys
ledger, state = sys.argv[1], sys.argv[2]
log = os.path.join(state, "followed")
last = 0
if os.path.exists(log):
    for line in open(log):
        last = max(last, int(line.split()[0]))
cmd = [sys.executable, "-m", "gce_watchdog", "decisions", "--ledger", ledger,
       "--after", str(last), "--follow", "--json"]
with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as p:
    for line in p.stdout:
        d = json.loads(line)
        assert d["v"] == 2
        if d["token"] <= last:
            continue
        with open(log, "a") as f:
            f.write(f"{d['token']} {d['job']}\\n")
            f.flush()
            os.fsync(f.fileno())
        last = d["token"]
"""


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok", hang_s=120) as a:
        yield a


def until(pred: Callable[[], object], what: str) -> None:
    """Wait for an event (bounded); the predicate is the event."""
    assert wait_for(pred, DEADLINE_S, 0.02), f"timed out waiting for {what}"


def wedge(api: FakeComputeAPI, name: str, boot: str, labels: dict[str, str]) -> None:
    api.add_instance(name, project=P, zone=Z, labels=labels)
    w = Writer(boot=boot)
    api.append_serial(
        name,
        w.line("phase", {"ph": "workload"})
        + w.line("shutdown", {"reason": "ladder", "rung": "10/10"}, "10/10: shutting down"),
    )


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


class Rig:
    def __init__(self, api: FakeComputeAPI, tmp: Path, ledger: str) -> None:
        self.api, self.tmp, self.ledger = api, tmp, ledger
        self.state = tmp / "dispatcher"
        (self.state / "plan").mkdir(parents=True)
        (tmp / "hook.py").write_text(textwrap.dedent(HOOK))
        (tmp / "follower.py").write_text(textwrap.dedent(FOLLOWER))
        (tmp / "tok").write_text("tok\n")

    def argv(self, name: str, *extra: str) -> list[str]:
        hook = f"{sys.executable} {self.tmp / 'hook.py'} {self.state}"
        return [
            sys.executable, "-m", "gce_watchdog", "poll", "--project", P, "--zone", Z,
            "--api-base", self.api.base_url, "--access-token-file", str(self.tmp / "tok"),
            "--ledger", self.ledger, "--cursor-dir", str(self.tmp / "cursors"), "--json",
            "--once", "--reap", "--announce-lease", "1s", "--brake", "off",
            "--on-failover", hook, *extra, name,
        ]  # fmt: skip

    def start(self, name: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.argv(name), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV
        )

    def finish(self, name: str) -> None:
        """Pollers again (each --once) until nothing is left to announce: the lease lapses."""

        def done() -> bool:
            subprocess.run(self.argv(name), capture_output=True, env=ENV, timeout=DEADLINE_S)
            with open_ledger(self.ledger) as led:
                return not led.decisions.pending_announcements() and any(
                    d.instance.endswith("/" + name) for d in led.decisions.all()
                )

        until(done, f"{name} announced")

    def decided(self, name: str) -> bool:
        with open_ledger(self.ledger) as led:
            return any(d.instance.endswith("/" + name) for d in led.decisions.all())

    def follower(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(self.tmp / "follower.py"), self.ledger, str(self.state)],
            env=ENV, start_new_session=True,
        )  # fmt: skip


def kill(p: subprocess.Popen[bytes]) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=DEADLINE_S)


def killpg(p: subprocess.Popen[bytes]) -> None:
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=DEADLINE_S)


@pytest.mark.process
def test_each_job_is_relaunched_exactly_once_across_poller_crashes_at_every_step(
    api: FakeComputeAPI, tmp_path: Path, ledger_spec: str
) -> None:
    rig = Rig(api, tmp_path, ledger_spec)
    steps = ["before-write", "after-write", "during-hook", "after-hook"]
    for i, step in enumerate(steps):
        wedge(api, f"vm-{step}", f"{i:08x}", {"gce-watchdog-job": f"job-{step}", "team": "ml"})
    follower = rig.follower()
    try:
        # 1. before the ledger write: the poller hangs reading the console, and is killed
        api.set_fault("serial", Fault.HANG)
        p = rig.start("vm-before-write")
        until(lambda: api.arrived.get("serial"), "the serial read")
        kill(p)
        assert not rig.decided("vm-before-write")
        api.set_fault("serial", None)
        rig.finish("vm-before-write")

        # 2. after the ledger write, before the hook: the claim is durable, the DELETE hangs
        api.set_fault("delete", Fault.HANG)
        p = rig.start("vm-after-write")
        until(lambda: rig.decided("vm-after-write"), "the claim")
        kill(p)
        api.set_fault("delete", None)
        killpg(follower)  # the follower dies too, and resumes after its last token
        follower = rig.follower()
        rig.finish("vm-after-write")

        # 3. during the hook: killed while its command runs (the command is left hanging)
        (rig.state / "plan" / "job-during-hook").write_text("hang")
        p = rig.start("vm-during-hook")
        until(lambda: (rig.state / "hanging").exists(), "the hook to start")
        kill(p)
        os.kill(int((rig.state / "hanging").read_text()), signal.SIGKILL)
        rig.finish("vm-during-hook")

        # 4. after the hook exited 0, before the poller marked the announcement done
        (rig.state / "plan" / "job-after-hook").write_text("after")
        p = rig.start("vm-after-hook")
        assert p.wait(timeout=DEADLINE_S) == -signal.SIGKILL
        rig.finish("vm-after-hook")

        until(lambda: len(read_lines(rig.state / "followed")) >= len(steps), "the follower")
    finally:
        killpg(follower)
    jobs = sorted(f"job-{s}" for s in steps)
    relaunched = [x.split()[1] for x in read_lines(rig.state / "relaunched")]
    followed = [x.split()[1] for x in read_lines(rig.state / "followed")]
    assert sorted(relaunched) == jobs  # the hook dispatcher: each job once
    assert sorted(followed) == jobs  # the follower: each job once, across its own crash
    calls = Counter(read_lines(rig.state / "calls"))
    with open_ledger(ledger_spec) as led:
        decisions = led.decisions.all()
        assert led.decisions.pending_announcements() == []
    assert [d.token for d in decisions] == [1, 2, 3, 4]
    token_of = {d.instance.rsplit("/", 1)[1]: str(d.token) for d in decisions}
    assert calls[token_of["vm-after-hook"]] >= 2  # delivered again: at-least-once, deduped
    assert calls[token_of["vm-during-hook"]] >= 2


def hook_script(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "h.py"
    script.write_text(textwrap.dedent(body))
    return [sys.executable, str(script), str(tmp_path)]


DOC = {"v": 2, "token": 7, "request_id": "r-7", "project": P, "zone": Z, "name": "vm", "job": "j"}


@pytest.mark.process
def test_the_hook_is_retried_until_it_exits_zero(tmp_path: Path) -> None:
    argv = hook_script(tmp_path, """
        import json, os, sys
        n = os.path.join(sys.argv[1], "n")
        k = int(open(n).read()) if os.path.exists(n) else 0
        open(n, "w").write(str(k + 1))
        assert json.load(sys.stdin)["token"] == int(os.environ["GCE_WATCHDOG_TOKEN"]) == 7
        assert os.environ["GCE_WATCHDOG_JOB"] == "j"
        print("not yet" if k < 2 else "done")
        sys.exit(1 if k < 2 else 0)
    """)  # fmt: skip
    logs: list[str] = []
    hook = FailoverHook(argv, 30.0, attempts=3, backoff=Backoff(0.01, 2.0, 0.05), log=logs.append)
    assert hook(DOC)
    assert (tmp_path / "n").read_text() == "3"
    assert len(logs) == 2 and "exit status 1" in logs[0] and "not yet" in logs[0]
    (tmp_path / "n").write_text("-10")  # always failing now: False after the attempts
    assert not FailoverHook(argv, 30.0, attempts=2, backoff=Backoff(0.01, 2.0, 0.05))(DOC)


@pytest.mark.process
def test_a_stuck_hook_is_killed_at_its_timeout_with_its_children(tmp_path: Path) -> None:
    argv = hook_script(tmp_path, """
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(os.path.join(sys.argv[1], "child"), "w").write(str(child.pid))
        time.sleep(600)
    """)  # fmt: skip
    logs: list[str] = []
    assert not FailoverHook(argv, 1.0, attempts=1, log=logs.append)(DOC)
    assert "timed out after 1s" in logs[0]
    child = int((tmp_path / "child").read_text())
    until(lambda: not Path(f"/proc/{child}").exists() or _zombie(child), "the child killed")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.process
def test_a_hook_writing_without_end_never_blocks(tmp_path: Path) -> None:
    """Its output goes to a file, not a pipe: 16 MiB written, then exit 0."""
    argv = hook_script(tmp_path, """
        import sys
        for _ in range(256):
            sys.stdout.write("x" * 65536)
    """)  # fmt: skip
    assert FailoverHook(argv, 30.0, attempts=1)(DOC)


@pytest.mark.process
def test_a_full_stdout_pipe_never_blocks_an_announcement(
    api: FakeComputeAPI, tmp_path: Path
) -> None:
    ledger = str(tmp_path / "l.sqlite")
    rig = Rig(api, tmp_path, ledger)
    wedge(api, "vm-1", "0000000a", {"gce-watchdog-job": "job-1"})
    r, w = blocked_pipe()
    try:
        p = subprocess.run(rig.argv("vm-1"), stdout=w, stderr=subprocess.PIPE, env=ENV,
                           timeout=DEADLINE_S, check=False)  # fmt: skip
    finally:
        os.close(r)
        os.close(w)
    assert p.returncode == 0, p.stderr
    assert [x.split()[1] for x in read_lines(rig.state / "relaunched")] == ["job-1"]
    with open_ledger(ledger) as led:
        (d,) = led.decisions.all()
        assert d.announced_at is not None


# -- the fleet-wide brake ---------------------------------------------------------------------


def fleet(api: FakeComputeAPI, n_per_zone: int, zones: list[str]) -> dict[str, Writer]:
    names: dict[str, Writer] = {}
    for zone in zones:
        for i in range(n_per_zone):
            name = f"vm-{zone[-1]}-{i:02d}"
            api.add_instance(name, project=P, zone=zone, labels={"gce-watchdog": "on",
                             "gce-watchdog-job": f"job-{name}"})  # fmt: skip
            w = names[name] = Writer(boot=f"{len(names):08x}")
            api.append_serial(name, w.line("phase", {"ph": "workload"}))
    return names


def fleet_argv(api: FakeComputeAPI, tmp_path: Path) -> list[str]:
    (tmp_path / "tok").write_text("tok\n")
    return [
        "poll", "--label", "gce-watchdog=on", "--project", P, "--api-base", api.base_url,
        "--access-token-file", str(tmp_path / "tok"), "--ledger", str(tmp_path / "l.sqlite"),
        "--cursor-dir", str(tmp_path / "c"), "--json", "--once",
    ]  # fmt: skip


def outcomes(text: str) -> list[dict[str, object]]:
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


@pytest.mark.process
def test_the_brake_holds_a_zone_outage_of_50_vms_and_a_release_lets_them_through(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """100 VMs in two zones; one zone loses its network: every agent there climbs its ladder
    and powers its VM off (``self_shutdown``, each alone a failover). The default brake
    (10 %/10 min, at least 3) lets 10 through, holds 40 with an alarm, and lists them; one
    release command decides the rest, and the next round announces them."""
    writers = fleet(api, 50, ["us-central1-a", "us-central1-b"])
    assert main(fleet_argv(api, tmp_path)) == 0
    assert {o["action"] for o in outcomes(capsys.readouterr().out)} == {"none"}
    outage = [n for n in sorted(writers) if n.startswith("vm-b-")]
    for n in outage:
        w = writers[n]
        api.append_serial(n, w.line("shutdown", {"reason": "ladder", "rung": "10/10"}, "off"))
    main(fleet_argv(api, tmp_path))
    cap = capsys.readouterr()
    actions = Counter(str(o["action"]) for o in outcomes(cap.out))
    assert actions == {"none": 50, "failover": 10, "held": 40}
    assert cap.err.count("ALARM: the fleet-wide brake holds") == 40
    ledger = str(tmp_path / "l.sqlite")
    assert main(["decisions", "held", "--ledger", ledger, "--json"]) == 0
    held = outcomes(capsys.readouterr().out)
    assert len(held) == 40 and {h["zone"] for h in held} == {"us-central1-b"}
    main(fleet_argv(api, tmp_path))  # polled again: still held, nothing new decided
    assert Counter(str(o["action"]) for o in outcomes(capsys.readouterr().out))["held"] == 40
    assert main(["decisions", "release", "--all", "--ledger", ledger, "--json"]) == 0
    released = outcomes(capsys.readouterr().out)
    assert [r["token"] for r in released] == list(range(11, 51))
    main(fleet_argv(api, tmp_path))
    actions = Counter(str(o["action"]) for o in outcomes(capsys.readouterr().out))
    assert actions["failover"] == 40 and actions["held"] == 0
    with open_ledger(ledger) as led:
        assert (
            len(led.decisions.all()) == 50
            and led.decisions.pending_announcements() == []
            and led.decisions.holds() == []
        )


@pytest.mark.process
def test_one_real_wedge_in_a_healthy_fleet_goes_through_the_brake(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    writers = fleet(api, 50, ["us-central1-a", "us-central1-b"])
    main(fleet_argv(api, tmp_path))
    capsys.readouterr()
    wedged = sorted(writers)[7]
    w = writers[wedged]
    api.append_serial(wedged, w.line("shutdown", {"reason": "ladder", "rung": "10/10"}, "off"))
    main(fleet_argv(api, tmp_path))
    cap = capsys.readouterr()
    acted = {str(o["instance"]): o["action"] for o in outcomes(cap.out) if o["action"] != "none"}
    assert acted == {wedged: "failover"}
    assert "ALARM" not in cap.err


@pytest.mark.process
def test_a_dispatcher_follows_decisions_as_they_are_made(tmp_path: Path) -> None:
    """``decisions --follow`` prints a decision claimed while it waits (no restart)."""
    ledger = str(tmp_path / "l.sqlite")
    with open_ledger(ledger) as led:
        led.decisions.claim("1", "b", "self_shutdown", "r", f"{P}/{Z}/vm-1", 1.0)
    cmd = [sys.executable, "-m", "gce_watchdog", "decisions", "--ledger", ledger, "--follow",
           "--json"]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert p.stdout is not None
        first = json.loads(p.stdout.readline())
        assert (first["token"], first["name"], first["labels"], first["job"]) == (
            1,
            "vm-1",
            {},
            None,
        )
        with open_ledger(ledger) as led:
            led.decisions.claim("2", "b", "preempted", "r", f"{P}/{Z}/vm-2", 2.0, {"job": "j-2"})
        got: list[dict[str, object]] = []
        reader = threading.Thread(target=lambda: got.append(json.loads(p.stdout.readline())))  # type: ignore[union-attr]
        reader.start()
        reader.join(DEADLINE_S)
        assert got and (got[0]["token"], got[0]["job"]) == (2, "j-2")
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=DEADLINE_S)


@pytest.mark.process
def test_decisions_are_published_to_a_topic_with_the_request_id(
    api: FakeComputeAPI, tmp_path: Path, pubsub_host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--publish``: one message per announced decision on the real emulator, the view's JSON
    as data, ``request_id`` and ``token`` as attributes; a second poll publishes nothing more."""
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", pubsub_host)
    # the helper's ack deadline, 10 s, is the service's default this test had (none asked for)
    with topic_and_subscription(P, "decisions", "dispatcher") as ts:
        pub, sub, topic, subscription = ts.publisher, ts.subscriber, ts.topic, ts.subscription
        wedge(api, "vm-1", "0000000b", {"gce-watchdog-job": "job-1"})
        (tmp_path / "tok").write_text("tok\n")
        argv = ["poll", "--project", P, "--zone", Z, "--api-base", api.base_url,
                "--access-token-file", str(tmp_path / "tok"),
                "--ledger", str(tmp_path / "l.sqlite"), "--cursor-dir", str(tmp_path / "c"),
                "--json", "--once", "--publish", topic, "vm-1"]  # fmt: skip
        assert main(argv) == 0
        assert main(argv) == 0  # already decided and announced: nothing published
        pub.publish(topic, b"end", sentinel="1").result(timeout=DEADLINE_S)
        got = []  # what the pollers published before the sentinel (the emulator keeps order)
        deadline = time.monotonic() + DEADLINE_S
        while not any(m.message.attributes.get("sentinel") for m in got):
            assert time.monotonic() < deadline, "the sentinel never came"
            r = sub.pull(request={"subscription": subscription, "max_messages": 10}, timeout=10)
            got += list(r.received_messages)
        sub.acknowledge(request={"subscription": subscription, "ack_ids": [m.ack_id for m in got]})
        got = [m for m in got if not m.message.attributes.get("sentinel")]
    assert len(got) == 1
    msg = got[0].message
    doc = json.loads(msg.data)
    with open_ledger(str(tmp_path / "l.sqlite")) as led:
        (d,) = led.decisions.all()
        assert d.announced_at is not None
    assert dict(msg.attributes) == {"request_id": d.request_id, "token": "1",
                                    "verdict": "self_shutdown"}  # fmt: skip
    assert (doc["v"], doc["token"], doc["job"], doc["name"]) == (2, 1, "job-1", "vm-1")


@pytest.mark.pure
def test_decisions_never_creates_a_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo in --ledger must not follow a fresh, empty ledger forever."""
    missing = tmp_path / "typo.sqlite"
    assert main(["decisions", "--ledger", str(missing), "--follow"]) == 74
    assert not missing.exists() and "no ledger at" in capsys.readouterr().err
    assert main(["decisions", "--ledger", "mysql://h/db"]) == 64
    assert main(["decisions", "release", "--ledger", str(missing)]) == 64  # neither --all nor IDs
