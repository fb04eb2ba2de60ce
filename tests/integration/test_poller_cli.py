"""``gce-watchdog parse`` and ``gce-watchdog poll`` end to end (fake Compute API over HTTP)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.testing.simcompute import FakeComputeAPI, Fault
from gce_watchdog.testing.synth import Writer, splice
from kit.paths import REPO
from kit.poll import outputs, poll_args

P, Z = "test-project", "us-central1-a"


def dump() -> tuple[bytes, Writer]:
    w = Writer(boot="aaaa0001")
    data = (
        b"[    0.000000] Linux version 5.10.0-26-cloud-amd64\r\n"
        + w.line("phase", {"ph": "workload"})
        + splice(w.line("tick", {"rung": "1/10", "md": "fail", "eg": "fail"}))
        + b"Nov 17 04:03:47 debian systemd[1]: Started ssh.service\r\n"
        + w.line("shutdown", {"reason": "ladder", "rung": "10/10"}, "10/10: shutting down")
    )
    return data, w


@pytest.mark.pure
def test_parse_text_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, _ = dump()
    f = tmp_path / "serial.log"
    f.write_bytes(data)
    assert main(["parse", str(f), "--now", "last"]) == 0
    out = capsys.readouterr().out
    assert "aaaa0001  seq 0..4  4 lines  lost 1" in out  # v3: seq 0 and 1 are the key
    assert "shutdown reason=ladder rung=10/10 | 10/10: shutting down" in out
    assert "rejected: 1 (checksum 1)" in out
    assert "boot aaaa0001: after seq 2 came 4 (1 lost)" in out
    assert "verdict: self_shutdown (FAILOVER)" in out


@pytest.mark.process
def test_parse_json_from_stdin_in_a_real_process() -> None:
    data, _ = dump()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gce_watchdog",
            "parse",
            "-",
            "--json",
            "--status",
            "RUNNING",
            "--now",
            "2025-11-30T05:00:00Z",
        ],
        input=data,
        capture_output=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [e["event"] for e in doc["events"]] == ["key", "key", "phase", "shutdown"]
    assert doc["rejected"] == 1 and doc["lost_lines"] == 1
    assert doc["verdict"]["kind"] == "self_shutdown" and doc["verdict"]["failover"] is True
    assert doc["bytes"] == len(data)


@pytest.mark.pure
def test_parse_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["parse", str(tmp_path / "missing.log")]) == 66
    assert "cannot read" in capsys.readouterr().err
    f = tmp_path / "x.log"
    f.write_bytes(b"")
    assert main(["parse", str(f), "--now", "yesterday"]) == 64
    assert main(["parse", str(f), "--drain-timeout", "soon"]) == 64
    assert main(["parse", str(f), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"]["kind"] == "unknown"


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok") as a:
        a.add_instance("vm-1", project=P, zone=Z)
        a.add_instance("vm-2", project=P, zone=Z)
        yield a


@pytest.mark.process
def test_poll_once_failover_exactly_once_and_reap(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = dump()
    api.append_serial("vm-1", data)
    healthy = Writer(boot="bbbb0002")
    healthy.ts_ms = int(time.time() * 1000)
    api.append_serial("vm-2", healthy.line("phase", {"ph": "workload"}))
    assert main(poll_args(api, tmp_path, "--once", "--reap", "vm-1", "vm-2")) == 0
    out = outputs(capsys)
    assert out["vm-1"]["verdict"] == "self_shutdown" and out["vm-1"]["action"] == "failover"
    # vm-2's only line came with this poller's first read, no record of it anywhere: its age is
    # not known, so not healthy yet (docs/poller.md, "Freshness")
    assert out["vm-1"]["reaped"] and out["vm-2"]["verdict"] == "unknown"
    assert out["vm-2"]["action"] == "none"
    # a second run (a new process would behave the same: everything is on disk)
    assert main(poll_args(api, tmp_path, "--once", "--reap", "vm-1")) == 0
    again = outputs(capsys)["vm-1"]
    assert again["action"] == "already_decided" and again["status"] == "MISSING"
    assert again["decision"]["token"] == out["vm-1"]["decision"]["token"]  # type: ignore[index]
    assert len(api.calls_to("delete")) == 1


@pytest.mark.process
def test_poll_exit_codes(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(poll_args(api, tmp_path, "--once", "Bad_Name")) == 64
    assert "not a valid instance name" in capsys.readouterr().err
    assert main(poll_args(api, tmp_path, "--interval", "0s", "vm-1")) == 64
    assert main(poll_args(api, tmp_path, "--once", "--api-attempts", "0", "vm-1")) == 64
    api.set_fault("serial", Fault.SERVER_ERROR, count=1)
    assert main(poll_args(api, tmp_path, "--once", "--api-attempts", "1", "vm-1")) == 69
    err = outputs(capsys)["vm-1"]["error"]
    assert "gave up after 1 attempts" in err and "HTTP 503" in err  # type: ignore[operator]
    (tmp_path / "token").write_text("wrong\n")
    assert main(poll_args(api, tmp_path, "--once", "vm-1")) == 77
    assert "credentials" in capsys.readouterr().err
    bad_ledger = [*poll_args(api, tmp_path, "--once", "vm-1"), "--ledger", "/proc/nope/l.db"]
    (tmp_path / "token").write_text("tok\n")
    assert main(bad_ledger) == 74
    assert "cannot open the ledger" in capsys.readouterr().err
    (tmp_path / "token").write_text("")
    assert main(poll_args(api, tmp_path, "--once", "vm-1")) == 77
    assert "is empty" in capsys.readouterr().err


@pytest.mark.process
def test_poll_interval_loop_is_bounded_by_max_polls(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(poll_args(api, tmp_path, "--interval", "10ms", "--max-polls", "3", "vm-1")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert len(api.calls_to("serial")) == 3


def _healthy(api: FakeComputeAPI, name: str) -> None:
    w = Writer(boot="cccc0003")
    w.ts_ms = int(time.time() * 1000)
    api.append_serial(name, w.line("phase", {"ph": "workload"}))


@pytest.mark.process
def test_log_changes_writes_first_sights_and_a_summary_per_round(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 38: the unit's journal got every instance every round (2.8 GB a day for 1,000 VMs);
    with --log changes an unchanged verdict is written once, and each round says what it saw."""
    _healthy(api, "vm-1")
    _healthy(api, "vm-2")
    argv = poll_args(api, tmp_path, "--log", "changes", "--interval", "10ms", "--max-polls", "3")
    assert main([*argv, "vm-1", "vm-2"]) == 0
    cap = capsys.readouterr()
    out = [json.loads(x) for x in cap.out.splitlines()]
    # each VM's only line came with this poller's first read and nothing newer follows: unknown
    # every round (issue 35, docs/poller.md "Freshness"), an unchanged verdict written once
    assert [(o["instance"], o["verdict"]) for o in out] == [
        ("vm-1", "unknown"),
        ("vm-2", "unknown"),
    ]
    rounds = [x for x in cap.err.splitlines() if x.startswith("gce-watchdog poll: round ")]
    assert len(rounds) == 3, cap.err
    assert rounds[0].endswith("; 2 outcome(s): unknown 2; 2 written, 0 unchanged"), rounds[0]
    assert rounds[2].endswith("; 2 outcome(s): unknown 2; 0 written, 2 unchanged"), rounds[2]
    # a change is written again: vm-2's poll fails (an error, every time), then comes back
    api.set_instance_fault("vm-2", Fault.SERVER_ERROR)
    argv = [*argv[:-2], "--max-polls", "2", "--api-attempts", "1"]
    assert main([*argv, "vm-1", "vm-2"]) == 69
    cap = capsys.readouterr()
    out = [json.loads(x) for x in cap.out.splitlines()]
    assert [o["instance"] for o in out] == ["vm-1", "vm-2", "vm-2"]  # a new process: first sight
    assert out[1]["error"] and out[2]["error"]


@pytest.mark.process
def test_text_output_is_quiet_by_default_and_json_alone_writes_every_round(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _healthy(api, "vm-1")
    argv = poll_args(api, tmp_path, "--interval", "10ms", "--max-polls", "3", "vm-1")
    text = [a for a in argv if a != "--json"]
    assert main(text) == 0
    cap = capsys.readouterr()
    assert len(cap.out.splitlines()) == 1 and " vm-1 id=" in cap.out
    assert cap.err.count("1 outcome(s): unknown 1;") == 3  # a first read alone: age unknown
    assert main([*text, "--log", "every"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert main(argv) == 0  # --json alone: every instance every round, as scripts expect
    cap = capsys.readouterr()
    assert len(cap.out.splitlines()) == 3 and "outcome(s)" not in cap.err


@pytest.mark.process
def test_a_typo_in_project_zone_or_name_is_a_config_error_never_a_verdict(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 15: a 404 for an instance never seen used to read as "VM gone": failover, exit 0."""
    data, _ = dump()
    api.append_serial("vm-1", data)
    args = poll_args(api, tmp_path, "--once", "--reap", "vm-1")
    i = args.index("--zone") + 1
    typo_zone = [*args[:i], "us-central1-q", *args[i + 1 :]]
    assert main(typo_zone) == 69
    err = capsys.readouterr()
    assert "zone 'us-central1-q' not found in project" in err.err and err.out == ""
    j = args.index("--project") + 1
    typo_project = [*args[:j], "test-projecd", *args[j + 1 :]]
    assert main(typo_project) == 69
    err = capsys.readouterr()
    assert "project 'test-projecd' not found" in err.err and err.out == ""
    assert main(poll_args(api, tmp_path, "--once", "--reap", "vm-9", "vm-2")) == 69
    out = outputs(capsys)
    assert out["vm-9"]["verdict"] is None and "instance 'vm-9' not found" in str(
        out["vm-9"]["error"]
    )
    assert out["vm-2"]["error"] is None  # the others are still decided
    assert api.calls_to("delete") == []  # nothing was failed over, nothing deleted
    with open_ledger(str(tmp_path / "ledger.sqlite")) as led:
        assert led.decisions.all() == []
    # A VM this poller has read, deleted since (by someone else): gone, a real verdict.
    assert main(poll_args(api, tmp_path, "--once", "vm-1")) == 0
    capsys.readouterr()
    api.instance("vm-1").deleted = True
    assert main(poll_args(api, tmp_path, "--once", "vm-1")) == 0
    gone = outputs(capsys)["vm-1"]
    assert gone["status"] == "MISSING" and gone["verdict"] == "self_shutdown"


@pytest.mark.process
def test_poll_reports_forged_lines_as_an_alarm_and_never_decides_on_them(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import secrets

    from gce_watchdog.wire import protocol

    w = Writer(boot="aaaa0001")
    w.ts_ms = int(time.time() * 1000)
    api.append_serial("vm-1", w.line("phase", {"ph": "workload"}))
    fake = protocol.make_event("shutdown", "aaaa0001", 2, w.ts_ms, {"reason": "ladder"})
    evil = protocol.LineKey(secrets.token_bytes(32))
    api.append_serial("vm-1", protocol.encode(fake, evil).encode() + b"\n")
    assert main(poll_args(api, tmp_path, "--once", "--reap", "vm-1")) == 0
    out = outputs(capsys)["vm-1"]
    assert out["verdict"] == "unknown" and out["action"] == "none"  # a first read: age unknown
    assert out["forged"] == 1 and out["forged_reasons"] == {"bad_sig": 1}
    assert api.calls_to("delete") == []


@pytest.mark.process
def test_parse_keeps_every_event_of_a_long_dump(tmp_path: Path) -> None:
    """The timeline compacts past 4096 events (its verdict inputs stay); parse lists them all."""
    w = Writer(boot="aaaa0001", step_ms=1000)
    data = b"".join(w.line("heartbeat", {"rung": "0/10", "ph": "workload"}) for _ in range(5000))
    f = tmp_path / "long.log"
    f.write_bytes(data)
    r = subprocess.run(
        [sys.executable, "-m", "gce_watchdog", "parse", str(f), "--json"],
        capture_output=True, cwd=REPO, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # the key announcements (seq 0, 1 and every multiple of 32) and 5000 heartbeats
    assert [e["event"] for e in doc["events"]].count("heartbeat") == 5000
    assert [e["seq"] for e in doc["events"]] == list(range(len(doc["events"])))
    assert len(doc["events"]) > 5000 + 5000 // 32


@pytest.mark.process
def test_invented_boots_give_no_second_decision(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 15: two invented boot ids gave three decisions and three failovers for one VM."""
    import secrets

    from gce_watchdog.wire import protocol

    data, w = dump()
    api.append_serial("vm-1", data)  # a real boot that shut itself down
    for boot in ("cccc0003", "dddd0004"):
        for seq, name in enumerate(("phase", "shutdown")):
            ev = protocol.make_event(name, boot, seq, w.ts_ms + 600_000, {"ph": "workload"})
            evil = protocol.LineKey(secrets.token_bytes(32))
            api.append_serial("vm-1", protocol.encode(ev, evil).encode() + b"\n")
    # GCE serves serial output only while the VM is RUNNING (docs/fakes.md): read it then.
    actions = []
    for i in range(4):
        if i == 1:
            api.set_status("vm-1", "TERMINATED")  # then it powers off; later rounds read nothing
        assert main(poll_args(api, tmp_path, "--once", "vm-1")) == 0
        out = outputs(capsys)["vm-1"]
        actions.append(out["action"])
        assert out["verdict"] == "self_shutdown" and out["boot"] == "aaaa0001"
        assert out["forged"] == 4
    assert actions == ["failover", "already_decided", "already_decided", "already_decided"]
    with open_ledger(str(tmp_path / "ledger.sqlite")) as led:
        assert [(d.boot, d.verdict) for d in led.decisions.all()] == [("aaaa0001", "self_shutdown")]


@pytest.mark.process
def test_label_without_project_is_a_usage_error(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # issue 26: it listed no project, polled nothing and exited 0 every round
    label_only = ["poll", "--label", "gce-watchdog=on", "--once", "--api-base", api.base_url]
    assert main(label_only) == 64
    assert "--label needs at least one --project" in capsys.readouterr().err
    sweep_only = ["poll", "--pubsub", "projects/p-1234/subscriptions/s", "--label", "a=b"]
    assert main(sweep_only) == 64
    assert "--label needs at least one --project" in capsys.readouterr().err
    assert api.calls == []


@pytest.mark.process
def test_a_pubsub_workers_lookup_project_is_checked(
    api: FakeComputeAPI, capsys: pytest.CaptureFixture[str]
) -> None:
    """--project with --pubsub names where deciding instance ids are looked up: checked like
    any project id (docs/poller.md, "Whose names")."""
    bad = ["poll", "--pubsub", "projects/p-1234/subscriptions/s", "--project", "Not_A_Project"]
    assert main(bad) == 64
    assert "project 'Not_A_Project' is not a valid project id" in capsys.readouterr().err
    assert api.calls == []


@pytest.mark.process
@pytest.mark.parametrize(
    "url",
    [
        "mysql://u:s3cret@db.example/ledger",
        "postgresql+psycopg://u:s3cret@db.example/ledger",
        "sqlite:///var/lib/ledger.sqlite",
    ],
)
def test_an_unknown_ledger_url_scheme_is_refused_never_a_local_file(
    url: str,
    api: FakeComputeAPI,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # issue 26: it became a SQLite file under ./mysql:/..., a private ledger per host
    monkeypatch.chdir(tmp_path)
    argv = [*poll_args(api, tmp_path, "--once", "vm-1"), "--ledger", url]
    before = sorted(tmp_path.iterdir())
    assert main(argv) == 64
    err = capsys.readouterr().err
    assert "--ledger: unknown URL scheme" in err and "postgresql://" in err
    assert "s3cret" not in err  # a password in the URL is never printed
    assert sorted(tmp_path.iterdir()) == before
    assert api.calls == []
    with pytest.raises(ValueError, match="unknown URL scheme"):
        open_ledger(url)
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.process
def test_a_cursor_dir_writable_by_group_or_others_is_refused(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.append_serial("vm-1", dump()[0])
    cursors = tmp_path / "cursors"
    cursors.mkdir()
    for mode, who in ((0o777, "group and others"), (0o1777, "group and others"), (0o770, "group")):
        cursors.chmod(mode)
        assert main(poll_args(api, tmp_path, "--once", "vm-1")) == 74
        err = capsys.readouterr().err
        assert f"cannot open the cursor directory: {cursors} is writable by {who}" in err
        assert api.calls_to("serial") == []
    cursors.chmod(0o755)
    assert main(poll_args(api, tmp_path, "--once", "vm-1")) == 0
    assert len(api.calls_to("serial")) == 1


@pytest.mark.process
def test_a_cursor_file_writable_by_others_is_not_read(
    api: FakeComputeAPI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = dump()
    api.append_serial("vm-1", data)
    assert main(poll_args(api, tmp_path, "--once", "vm-1")) == 0
    capsys.readouterr()
    (cursor,) = (tmp_path / "cursors").glob("*.json")
    cursor.chmod(0o666)  # anyone could have put an offset (or a timeline) of their own in it
    assert main(poll_args(api, tmp_path, "--once", "vm-1")) == 0
    err = capsys.readouterr().err
    assert f"cursor {P}/{Z}/vm-1 is writable by group and others (mode 0666): not trusted" in err
    first, second = api.calls_to("serial")
    assert first.query["start"] == second.query["start"] == "0"  # read again from the start
    assert cursor.stat().st_mode & 0o777 == 0o600  # rewritten by the poller, private


@pytest.mark.pure
def test_parse_refuses_what_is_not_a_file_or_a_pipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 25: `parse /dev/zero` never ended. A device or a directory is refused at once."""
    assert main(["parse", "/dev/zero"]) == 66
    assert "/dev/zero is not a regular file or a pipe" in capsys.readouterr().err
    assert main(["parse", str(tmp_path)]) == 66
    assert "is a directory" in capsys.readouterr().err
