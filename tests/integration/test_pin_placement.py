"""Issue 35, item 4: a key is pinned only from a placeable announcement.

The reader pins (trust on first use) only the agent's announcement at the start of its boot,
read from byte 0 with nothing missing before it. A self-signed announcement a local process
printed before the agent's first line is not pinned: the start of the boot is contested (two
keys claim seq 0/1), nobody's key decides, and the instance gets the ``no_pin`` alarm the docs
promise (docs/serial-protocol.md, "Pins"). An announcement printed after the agent's start
changes nothing (the pin stays, an ``unplaced_key`` alarm).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.poller.timeline import Timeline, parse_bytes
from gce_watchdog.poller.verdict import InstanceState, Policy, VerdictKind
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.simgce import SimGCE
from gce_watchdog.testing.synth import SYNTH_KEY, Writer
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire import protocol
from hypothesis import given
from hypothesis import strategies as st
from kit.agent import agent_config, agent_process, stop_agent
from kit.events import read_events
from kit.nobody import Nobody
from kit.paths import REPO
from kit.poll import P, Z, outputs, parse_json, poll_args
from kit.wait import wait_for

OFF = InstanceState("TERMINATED")
POL = Policy()
BOOT = "aaaa0001"


def real_run() -> bytes:
    """The agent's lines of a boot that ended by the ladder's power-off."""
    w = Writer(boot=BOOT)
    return (
        w.line("start", {"v": "0.2.0", "pid": 812})
        + w.line("phase", {"ph": "workload"})
        + w.line("shutdown", {"reason": "ladder", "rung": "10/10", "action": "poweroff"})
    )


def evil_announcement(seq: int = 0, boot: str = BOOT, key: protocol.LineKey | None = None) -> bytes:
    """What any local process can print: an announcement signed by a key of its own."""
    own = key or protocol.LineKey(secrets.token_bytes(32))
    return protocol.key_line(boot, seq, 0, own).encode() + b"\n"


@pytest.mark.pure
def test_an_announcement_printed_before_the_agents_first_line_is_not_pinned() -> None:
    evil = protocol.LineKey(secrets.token_bytes(32))
    tl = parse_bytes(evil_announcement(0, key=evil) + real_run(), rx=100.0)
    assert tl.pin is None and not tl.pinned_here
    assert "no_pin" in tl.key_alarm
    assert set(tl.unplaced) == {evil.fingerprint, SYNTH_KEY.fingerprint}
    assert tl.events == [] and tl.boots == {}  # the withdrawn key's announcement decides nothing
    v = tl.judge(OFF, 100.0, POL)
    assert not v.failover and v.reason.startswith("ALARM"), v.reason


@pytest.mark.pure
def test_two_copies_and_another_boot_id_are_no_better() -> None:
    evil = protocol.LineKey(secrets.token_bytes(32))
    head = evil_announcement(0, "deadbeef", evil) + evil_announcement(1, "deadbeef", evil)
    tl = parse_bytes(head + real_run(), rx=100.0)
    assert tl.pin is None and "no_pin" in tl.key_alarm
    assert not tl.judge(OFF, 100.0, POL).failover


@pytest.mark.pure
def test_a_reader_that_read_only_the_forgers_line_stores_no_pin() -> None:
    """The race: a poll between the forger's line and the agent's first line."""
    evil = evil_announcement(0)
    tl = Timeline(instance_id="4000000000000000001")
    tl.feed(evil, 10.0)
    assert not tl.pinned_here  # not stored: the boot's start is not settled
    tl = Timeline.from_json(tl.to_json())  # a poller restart keeps it unsettled
    assert not tl.pinned_here
    tl.feed(real_run(), 20.0)
    assert tl.pin is None and "no_pin" in tl.key_alarm and tl.events == []


@pytest.mark.pure
def test_a_start_read_in_two_polls_is_stored_once_the_first_event_verifies() -> None:
    data = real_run()
    copies = b"".join(x + b"\n" for x in data.split(b"\n")[:2])
    tl = Timeline()
    assert tl.feed(copies, 10.0) and tl.pin == SYNTH_KEY.public and not tl.pinned_here
    tl = Timeline.from_json(tl.to_json())  # the cursor between the two polls
    tl.feed(data[len(copies) :], 20.0)
    assert tl.pinned_here and tl.pin == SYNTH_KEY.public and tl.key_alarm == ""
    assert tl.judge(OFF, 20.0, POL).kind is VerdictKind.SELF_SHUTDOWN


@pytest.mark.pure
def test_the_agents_start_is_pinned_and_a_later_announcement_changes_nothing() -> None:
    evil = protocol.LineKey(secrets.token_bytes(32))
    tl = parse_bytes(real_run() + evil_announcement(0, key=evil), rx=100.0)
    assert tl.pin == SYNTH_KEY.public and tl.pinned_here
    assert tl.unplaced == [evil.fingerprint] and "unplaced_key" in tl.key_alarm
    assert tl.judge(OFF, 100.0, POL).kind is VerdictKind.SELF_SHUTDOWN


@pytest.mark.pure
def test_a_hand_pin_is_never_withdrawn_by_a_later_announcement() -> None:
    tl = Timeline(pin_fp=SYNTH_KEY.fingerprint)
    copies = b"".join(x + b"\n" for x in real_run().split(b"\n")[:2])  # the agent's two copies
    tl.feed(copies + evil_announcement(0), 10.0)  # then another key, before any other line
    assert tl.pin == SYNTH_KEY.public and tl.pinned_here  # the operator's key: stored at once
    assert "no_pin" not in tl.key_alarm


@pytest.mark.pure
@given(
    st.lists(
        st.tuples(
            st.integers(0, 1),
            st.sampled_from([BOOT, "deadbeef"]),
            st.binary(min_size=32, max_size=32),
        ),
        min_size=1,
        max_size=4,
    ),
    st.integers(1, 4),
)
def test_no_announcement_before_the_agents_start_is_ever_pinned(
    forged: list[tuple[int, str, bytes]], chunks: int
) -> None:
    head = b"".join(
        evil_announcement(seq, boot, protocol.LineKey(seed)) for seq, boot, seed in forged
    )
    data = head + real_run()
    step = -(-len(data) // chunks)
    tl = Timeline()
    for i in range(0, len(data), step):  # any number of reads
        tl.feed(data[i : i + step], 100.0)
        assert tl.pin != SYNTH_KEY.public or not tl.pinned_here or i + step < len(head)
    tl.finish(100.0)
    assert tl.pin is None and "no_pin" in tl.key_alarm
    assert not tl.judge(OFF, 100.0, POL).failover


@pytest.mark.process
def test_parse_takes_back_the_announcements_of_a_start_contested_in_a_later_chunk() -> None:
    """``parse`` reads 64 KiB at a time and lists every event: the forger's announcement, read
    a chunk before the agent's start withdraws it, is not listed either."""
    noise = b"[    1.000000] kernel: a line of someone else's\r\n" * 3000  # ~150 KiB
    data = evil_announcement(0) + noise + real_run()
    doc = parse_json(data, "--status", "TERMINATED")
    assert doc["events"] == [] and doc["key_id"] is None
    assert "no_pin" in doc["verdict"]["reason"] and doc["verdict"]["failover"] is False


# -- the real CLI, the attacker an unprivileged process ---------------------------------------

ANNOUNCER = r"""
import sys
from gce_watchdog.wire import protocol
console, boot_id_path = sys.argv[1], sys.argv[2]
boot = open(boot_id_path).read().strip().replace("-", "")[:8]
own = protocol.LineKey(bytes(range(32)))
with open(console, "a") as c:
    c.write(protocol.key_line(boot, 0, 0, own) + "\n" + protocol.key_line(boot, 1, 0, own) + "\n")
print(own.fingerprint)
"""


@pytest.mark.process
def test_poll_and_parse_give_no_pin_for_an_announcement_printed_by_nobody_first(
    nobody: Nobody, nobody_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = nobody_dir
    boot_id = d / "boot_id"
    boot_id.write_text("5f1e2d3c-0000-4000-8000-000000000001\n")
    console = d / "console.log"
    console.touch()
    console.chmod(0o666)  # the workload's output reaches the console
    cfg = d / "config.toml"
    cfg.write_text(
        f'[agent]\nstate_dir = "{d}/state"\nrun_dir = "{d}/run"\nboot_id_path = "{boot_id}"\n'
        f'[serial]\ndevice = "{console}"\nfallback_file = "{d}/fallback.log"\n'
    )
    # the workload, as nobody, before the instance's first line of ours
    f = nobody.run(["-c", ANNOUNCER, str(console), str(boot_id)], cwd=d, timeout=120)
    assert f.returncode == 0, f.stderr
    evil_fp = f.stdout.strip()
    gw = [sys.executable, "-m", "gce_watchdog"]
    for argv in (["phase", "workload"], ["setup-failed", "--step", "train", "--reason", "x"]):
        assert subprocess.run([*gw, *argv, "--config", str(cfg)], cwd=REPO).returncode == 0
    data = console.read_bytes()
    out = parse_json(data, "--status", "TERMINATED")
    why = out["verdict"]["reason"]
    assert "no_pin" in why and evil_fp in why and out["key_id"] is None, why
    assert out["verdict"]["failover"] is False and out["events"] == []
    with FakeComputeAPI(token="tok") as api:
        iid = api.add_instance("vm-1", project=P, zone=Z).id
        api.append_serial("vm-1", data)
        assert main(poll_args(api, d, "--once", "vm-1")) == 0
        got = outputs(capsys)["vm-1"]
        assert "no_pin" in str(got["key_alarm"]), got
        assert got["action"] == "none" and got["verdict"] != "setup_failed", got
        # the VM powers off: still nothing can be placed, no failover
        api.set_status("vm-1", "TERMINATED")
        assert main(poll_args(api, d, "--once", "vm-1")) == 0
        again = outputs(capsys)["vm-1"]
        assert again["action"] == "none" and "no_pin" in str(again["key_alarm"]), again
    with open_ledger(str(d / "ledger.sqlite")) as ledger:
        assert ledger.pins.get_pin(iid) is None  # nothing stored for any reader to trust


# -- the agent's side: a run dir that cannot hold the counter ---------------------------------


def _unusable_run_dir(tmp: Path, kind: str) -> Path:
    """A run dir path no counter file can be made in, whatever the uid: a FIFO, or a regular
    file, where the directory should be (root ignores a directory's mode bits)."""
    p = tmp / "run"
    if kind == "fifo":
        os.mkfifo(p)
    else:
        p.write_text("not a directory\n")
    return p


@pytest.mark.pure
@pytest.mark.parametrize("kind", ["fifo", "file"])
def test_an_unusable_run_dir_still_announces_at_seq_0_and_1(tmp_path: Path, kind: str) -> None:
    run = _unusable_run_dir(tmp_path, kind)
    seq = SeqAllocator(run, BOOT, floor=lambda: 7_000_000_123)
    sink = MemorySink()
    em = Emitter(sink, seq, BOOT, wall=lambda: 1.8e9, key=SYNTH_KEY)
    em.emit("start", {"v": "1"})
    em.emit("phase", {"ph": "workload"})
    assert seq.fallbacks == 4
    got = [protocol.decode_line(ln) for ln in sink.lines]
    assert [(g.event.event, g.event.seq) for g in got[:2]] == [("key", 0), ("key", 1)]  # type: ignore[union-attr]
    tl = parse_bytes("".join(x + "\n" for x in sink.lines).encode(), rx=1.8e9)
    assert tl.pin == SYNTH_KEY.public and tl.pinned_here and tl.key_alarm == ""
    assert [(e.event, e.seq) for e in tl.events] == [
        ("key", 0), ("key", 1), ("start", 7_000_000_123), ("phase", 7_000_000_124),
    ]  # fmt: skip


@pytest.mark.process
def test_the_agent_with_an_unusable_run_dir_is_pinned_by_poll(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _unusable_run_dir(tmp_path, "fifo")
    with SimGCE() as sim:
        cfg = agent_config(tmp_path, sim, agent={"run_dir": str(run)})
        serial = tmp_path / "ttyS0"
        with agent_process(cfg) as p:
            assert wait_for(lambda: any(e.event == "heartbeat" for e in read_events(serial)))
            assert stop_agent(p) == 0
    data = serial.read_bytes()
    first = protocol.decode_line(data.split(b"\n", 1)[0])
    assert isinstance(first, protocol.KeyAnnounce) and first.event.seq == 0
    with FakeComputeAPI(token="tok") as api:
        iid = api.add_instance("vm-1", project=P, zone=Z).id
        api.append_serial("vm-1", data)
        assert main(poll_args(api, tmp_path, "--once", "vm-1")) == 0
        got = outputs(capsys)["vm-1"]
        assert got["key_alarm"] == "" and got["forged"] == 0, got
    with open_ledger(str(tmp_path / "ledger.sqlite")) as ledger:
        pin = ledger.pins.get_pin(iid)
    assert pin is not None and pin.public is not None and pin.source == "placed"
