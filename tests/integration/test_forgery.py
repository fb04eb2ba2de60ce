"""Issue 15: verdicts that no local process can fool.

Every attack measured against protocol v1 is here, replayed against v3: forged lines (also
written by an unprivileged uid), seqs claimed in advance, lines replayed from an earlier boot,
invented boot ids and keys, a wild seq, CR-only endings, hostile lines of markers. Each must
leave the verdict of the real agent run unchanged, and every forgery must be counted.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
from gce_watchdog.poller.timeline import Timeline, parse_bytes
from gce_watchdog.poller.verdict import InstanceState, Policy, VerdictKind
from gce_watchdog.testing.synth import SYNTH_KEY, Writer
from gce_watchdog.wire import line as wire_line
from gce_watchdog.wire import protocol
from gce_watchdog.wire.protocol import Event, Forged, Forgery, KeyAnnounce, Rejected
from hypothesis import given
from hypothesis import strategies as st
from kit.nobody import Nobody
from kit.paths import REPO

RUN = InstanceState("RUNNING")
OFF = InstanceState("TERMINATED")
POL = Policy()


def forge(ev: Event, key: protocol.LineKey | None = None) -> bytes:
    """What a local process without the instance's key can write: a well-formed v3 line with
    a correct CRC and a signature under a key of its own."""
    return protocol.encode(ev, key or protocol.LineKey(secrets.token_bytes(32))).encode() + b"\n"


def forge_v1(ev: Event) -> bytes:
    """A protocol v1 line (CRC only): what anyone could write before v2."""
    body = wire_line._body(ev).replace(protocol.MARKER, protocol.LEGACY_MARKER, 1)
    return f"{body} #{zlib.crc32(body.encode()):08x}\n".encode()


def real_run_with_shutdown() -> tuple[list[bytes], Writer]:
    """A real agent run: start, workload, a ladder, the shutdown decision, the chain."""
    w = Writer(boot="aaaa0001")
    lines = [
        w.line("start", {"v": "0.2.0", "inst": "4000000000000000001", "pid": 812}),
        w.line("phase", {"ph": "workload"}),
        *(w.line("tick", {"rung": f"{r}/10", "md": "fail", "eg": "fail"}) for r in range(1, 11)),
        w.line("shutdown", {"reason": "ladder", "rung": "10/10", "action": "poweroff"}),
        w.line("action", {"step": "poweroff", "status": "start"}),
    ]
    return lines, w


def judge(data: bytes, status: InstanceState = OFF, now: float = 1e9) -> tuple[Timeline, object]:
    tl = parse_bytes(data, rx=now)
    return tl, tl.judge(status, now, POL)


# -- the wire: what a line without the key is ------------------------------------------------


@pytest.mark.pure
def test_a_line_signed_with_another_key_is_forged_never_an_event() -> None:
    ev = protocol.make_event("exit", "aaaa0001", 5, 0, {"rc": 0})
    res = protocol.decode_line(forge(ev), pin=SYNTH_KEY.public)
    assert isinstance(res, Forged) and res.reason == Forgery.BAD_SIG and res.event == ev
    assert isinstance(protocol.decode_line(forge(ev), None), Forged)  # no key: cannot verify
    assert protocol.decode_line(forge(ev, SYNTH_KEY), pin=SYNTH_KEY.public) == ev
    v1 = protocol.decode_line(forge_v1(ev), pin=SYNTH_KEY.public)
    assert isinstance(v1, Forged) and v1.reason == Forgery.LEGACY
    # damage is still damage, not forgery
    assert isinstance(protocol.decode_line(forge(ev)[:60], pin=SYNTH_KEY.public), Rejected)


@pytest.mark.pure
def test_the_key_is_pinned_once_and_a_second_key_is_a_conflict() -> None:
    w = Writer(boot="aaaa0001")
    data = w.line("start", {"v": "1"}) + w.line("heartbeat", {"rung": "0/10", "ph": "workload"})
    d = protocol.StreamDecoder()
    evs = d.feed(data)
    assert d.pin == SYNTH_KEY.public and d.pinned_here
    assert [e.event for e in evs] == ["key", "key", "start", "heartbeat"]
    assert evs[0].fields == (("kid", SYNTH_KEY.fingerprint), ("inst", "-"))  # never the key
    other = protocol.LineKey(secrets.token_bytes(32))
    d.feed(protocol.key_line("aaaa0001", 0, 0, other).encode() + b"\n")
    assert d.pin == SYNTH_KEY.public and d.unplaced == [other.fingerprint]
    assert d.stats.forged_reasons == {Forgery.UNPLACED: 1}


@pytest.mark.pure
def test_key_announcement_must_verify_under_the_key_it_announces() -> None:
    line = protocol.key_line("aaaa0001", 0, 0, SYNTH_KEY)
    body, _, _ = line.rpartition(" #")
    signed = f"{body} #{'A' * protocol.SIG_CHARS}"  # right CRC, wrong signature
    bad = f"{signed}{zlib.crc32(signed.encode()):08x}"
    ann = protocol.decode_line(bad)
    assert isinstance(ann, KeyAnnounce) and not ann.valid()
    good = protocol.decode_line(line)
    assert isinstance(good, KeyAnnounce) and good.valid()
    d = protocol.StreamDecoder()  # read from byte 0: the first line would be pinned...
    assert d.feed(bad.encode() + b"\n") == [] and d.pin is None  # ...were it signed
    assert d.stats.forged_reasons == {Forgery.UNPLACED: 1}


@pytest.mark.pure
def test_whole_line_dedup_reports_conflicts_and_a_wild_seq_spoils_nothing() -> None:
    w = Writer(boot="aaaa0001")
    a = w.line("start", {"v": "1"})
    d = protocol.StreamDecoder()
    assert len(d.feed(a + a)) == 3 and d.stats.duplicates == 3  # key, key, start; copies
    other = protocol.make_event("heartbeat", "aaaa0001", 2, 0, {"rung": "0/10"})
    got = d.feed(forge(other, SYNTH_KEY))  # same (boot, seq) as `start`, other content
    assert got == [other] and d.stats.conflicts == 1
    wild = protocol.make_event("tick", "aaaa0001", 10**9, 0, {"rung": "1/10"})
    d.feed(forge(wild, SYNTH_KEY))
    later = [w.line("tick", {"rung": f"{r}/10"}) for r in range(2, 6)]
    assert [e.seq for e in d.feed(b"".join(later))] == [3, 4, 5, 6]  # none taken for a copy
    assert d.stats.duplicates == 3


@pytest.mark.pure
def test_cr_only_endings_are_split() -> None:
    w = Writer(boot="aaaa0001", step_ms=1000)
    lines = [w.line("tick", {"rung": f"{i % 10}/10"}).rstrip(b"\n") for i in range(50)]
    data = b"progress 10%\r" + b"\r".join(lines) + b"\r"
    tl = parse_bytes(data)
    assert len([e for e in tl.events if e.event == "tick"]) == 50 and tl.rejected == 0


@pytest.mark.pure
def test_hostile_lines_decode_in_linear_time() -> None:
    # A 1 MiB line of markers took over a minute with v1's decoder (quadratic). The cap on
    # markers per line and the 280-byte window after each keep it linear: far under a second.
    hostile = b"GCEWD3 " * ((1 << 20) // 7)
    t0 = time.process_time()
    res = protocol.decode_line(hostile, pin=SYNTH_KEY.public)
    one = time.process_time() - t0
    assert isinstance(res, Rejected) and res.reason == protocol.Reject.MARKERS
    t0 = time.process_time()
    trailer = b" #" + b"A" * protocol.SIG_CHARS + b"0123abcd"
    line = (b"GCEWD3 x" + trailer * 3) * 3_500 + b"\n"  # ~1 MiB
    _, stats = protocol.decode_all(line)
    assert stats.rejected == 1
    assert one < 1.0 and time.process_time() - t0 < 1.0


@pytest.mark.pure
def test_exec_neutralizes_markers_in_what_it_passes_through() -> None:
    ev = protocol.make_event("exit", "aaaa0001", 5, 0, {"rc": 0})
    defused = protocol.neutralize(forge(ev, SYNTH_KEY))
    assert protocol.decode_line(defused, pin=SYNTH_KEY.public) is None


# -- verdicts: each attack of the issue against a real run ----------------------------------


@pytest.mark.pure
def test_forged_exit_rc0_after_a_real_shutdown_still_fails_over() -> None:
    lines, w = real_run_with_shutdown()
    fake = protocol.make_event("exit", w.boot, w.seq, w.ts_ms, {"rc": 0, "sig": "-"})
    fake_setup = protocol.make_event("setup_failed", w.boot, 3, w.ts_ms, {"step": "x"})
    tl, v = judge(b"".join(lines[:1]) + forge(fake_setup) + b"".join(lines[1:]) + forge(fake))
    assert v.kind is VerdictKind.SELF_SHUTDOWN and v.failover  # type: ignore[attr-defined]
    assert tl.forged == 2 and tl.forged_reasons == {Forgery.BAD_SIG: 2}


@pytest.mark.pure
def test_forged_shutdown_on_a_healthy_vm_is_no_failover() -> None:
    w = Writer(boot="aaaa0001")
    data = w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"})
    fake = protocol.make_event("shutdown", w.boot, w.seq, w.ts_ms, {"reason": "ladder"})
    tl, v = judge(data + forge(fake) + forge_v1(fake), RUN)
    assert v.kind is VerdictKind.HEALTHY and not v.failover  # type: ignore[attr-defined]
    assert tl.forged == 2


@pytest.mark.pure
def test_a_forged_heartbeat_from_the_future_does_not_hide_a_silent_vm() -> None:
    w = Writer(boot="aaaa0001")
    tl = Timeline()
    tl.feed(w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"}), 1000.0)
    future = protocol.make_event(
        "heartbeat", w.boot, w.seq, w.ts_ms + 10**9, {"rung": "0/10", "ph": "workload"}
    )
    tl.feed(forge(future), 1500.0)
    v = tl.judge(RUN, 1000.0 + 901, POL)
    assert v.kind is VerdictKind.SUSPECTED_WEDGE and tl.forged == 1


@pytest.mark.pure
def test_seqs_claimed_in_advance_do_not_hide_the_real_lines() -> None:
    lines, w = real_run_with_shutdown()
    claims = b"".join(
        forge(protocol.make_event("heartbeat", w.boot, s, w.ts_ms, {"rung": "0/10"}))
        for s in range(2, 62)
    )
    tl, v = judge(lines[0] + claims + b"".join(lines[1:]))
    assert v.kind is VerdictKind.SELF_SHUTDOWN  # type: ignore[attr-defined]
    assert tl.forged == 60 and tl.duplicates == 0
    assert [e.event for e in tl.events].count("tick") == 10


@pytest.mark.pure
def test_a_line_replayed_from_an_earlier_boot_does_not_switch_the_boot() -> None:
    old = Writer(boot="aaaa0001")
    old_lines = [old.line("phase", {"ph": "workload"}), old.line("exit", {"rc": 0, "sig": "-"})]
    # v3 orders boots by where they appear, not by the guest's clock; a reader that never saw
    # the earlier boot tells its replay from a reboot only by a signed time more than
    # REPLAY_BOUND_MS (a day) older than the current boot's: the earlier boot ran two days ago.
    new = Writer(boot="bbbb0002", ts_ms=old.ts_ms + 2 * 86_400_000)
    new_lines = [
        new.line("phase", {"ph": "workload"}),
        new.line("shutdown", {"reason": "ladder", "rung": "10/10"}),
    ]
    base = b"".join(old_lines + new_lines)
    _, want = judge(base)
    assert want.kind is VerdictKind.SELF_SHUTDOWN  # type: ignore[attr-defined]
    replayed = old_lines[1]  # the earlier boot's authentic `exit rc=0`, copied from a journal
    tl, v = judge(base + replayed)
    assert v == want and tl.latest_boot == "bbbb0002"
    # ...also when the reader never saw the earlier boot's lines before the replay
    tl, v = judge(b"".join(new_lines) + old_lines[0] + replayed)
    assert v == want and tl.latest_boot == "bbbb0002"


@pytest.mark.pure
def test_a_new_boot_whose_clock_is_an_hour_behind_is_current() -> None:
    """Issue 25: boots were ordered by their earliest signed time, so a reboot with a clock an
    hour behind was never current and a healthy (or shut down) new boot was a wedge."""
    old = Writer(boot="aaaa0001")
    old_lines = [old.line("phase", {"ph": "workload"}), old.line("heartbeat", {"rung": "0/10"})]
    new = Writer(boot="bbbb0002", ts_ms=old.ts_ms - 3_600_000)
    shutdown = new.line("shutdown", {"reason": "ladder", "rung": "10/10"})
    tl, v = judge(b"".join(old_lines) + new.line("phase", {"ph": "workload"}) + shutdown)
    assert tl.latest_boot == "bbbb0002" and v.kind is VerdictKind.SELF_SHUTDOWN  # type: ignore[attr-defined]
    healthy = Writer(boot="cccc0003", ts_ms=old.ts_ms - 3_600_000)
    data = b"".join(old_lines) + healthy.line("phase", {"ph": "workload"})
    tl = parse_bytes(data, rx=1000.0)
    v = tl.judge(RUN, 1000.0 + 60, POL)  # a minute after its last line: healthy
    assert tl.latest_boot == "cccc0003" and v.kind is VerdictKind.HEALTHY and not v.failover


@pytest.mark.pure
def test_invented_boot_ids_create_no_boot_and_a_second_key_is_an_alarm() -> None:
    lines, _ = real_run_with_shutdown()
    data = b"".join(lines)
    inventions = b""
    for boot in ("cccc0003", "dddd0004"):
        fake = protocol.make_event("phase", boot, 1, 2 * 10**12, {"ph": "workload"})
        inventions += forge(fake)
    tl, v = judge(data + inventions, RUN)
    assert list(tl.boots) == ["aaaa0001"] and tl.forged == 2
    assert v.kind is VerdictKind.SELF_SHUTDOWN and v.boot == "aaaa0001"  # type: ignore[attr-defined]
    # An invented boot with a key of its own: announced, but not the pinned key.
    evil = protocol.LineKey(secrets.token_bytes(32))
    own = protocol.key_line("eeee0005", 0, 2 * 10**12, evil).encode() + b"\n"
    own += forge(protocol.make_event("exit", "eeee0005", 2, 2 * 10**12, {"rc": 0}), evil)
    tl, v = judge(data + own, RUN)
    assert tl.unplaced == [evil.fingerprint] and list(tl.boots) == ["aaaa0001"]
    # an alarm, but the pinned key still decides: one printed line cannot silence the poller
    assert "ALARM" in v.reason  # type: ignore[attr-defined]
    assert v.kind is VerdictKind.SELF_SHUTDOWN  # type: ignore[attr-defined]


@pytest.mark.pure
def test_the_pin_survives_a_poller_restart() -> None:
    lines, w = real_run_with_shutdown()
    tl = Timeline()
    tl.feed(b"".join(lines[:3]), 10.0)
    again = Timeline.from_json(tl.to_json())
    assert again.pin == SYNTH_KEY.public
    fake = protocol.make_event("exit", w.boot, 50, w.ts_ms, {"rc": 0})
    again.feed(forge(fake) + b"".join(lines[3:]), 20.0)
    assert again.judge(OFF, 30.0, POL).kind is VerdictKind.SELF_SHUTDOWN
    assert again.forged == 1


# -- the property --------------------------------------------------------------------------

_real_lines, _ = real_run_with_shutdown()
_REAL = _real_lines
_BOOTS = ["aaaa0001", "bbbb0002", "cccc0003"]
_NAMES = ["exit", "setup_failed", "shutdown", "phase", "heartbeat", "start", "preempted", "key"]


@st.composite
def unauthenticated(draw: st.DrawFn) -> bytes:
    name = draw(st.sampled_from(_NAMES))
    boot = draw(st.sampled_from(_BOOTS))
    seq = draw(st.integers(0, 10**9))
    ts = draw(st.integers(0, 4 * 10**12))
    if name == "key":
        own = protocol.LineKey(draw(st.binary(min_size=32, max_size=32)))
        return protocol.key_line(boot, seq, ts, own).encode()
    fields = {"rc": draw(st.sampled_from(["0", "1", "-"])), "ph": "done", "reason": "ladder"}
    ev = protocol.make_event(name, boot, seq, ts, fields)
    kind = draw(st.sampled_from(["sig", "v2", "v1", "raw"]))
    if kind == "sig":
        return forge(ev, protocol.LineKey(draw(st.binary(min_size=32, max_size=32))))
    if kind == "v2":  # a v2 line under a key read back from the console: never decides
        return protocol.encode_v2(ev, draw(st.binary(min_size=32, max_size=32))).encode()
    if kind == "v1":
        return forge_v1(ev)
    return wire_line._body(ev).encode() + b" #" + draw(st.binary(max_size=30)) + b"\n"


@pytest.mark.pure
@given(
    st.lists(st.tuples(st.integers(0, len(_REAL)), unauthenticated()), max_size=12),
    st.sampled_from([RUN, OFF, InstanceState(None)]),
    st.floats(0, 5000),
)
def test_no_unauthenticated_lines_anywhere_change_the_verdict(
    inserts: list[tuple[int, bytes]], status: InstanceState, dt: float
) -> None:
    rx = 1_000_000.0
    want = parse_bytes(b"".join(_REAL), rx=rx).judge(status, rx + dt, POL)
    lines = list(_REAL)
    for at, junk in sorted(inserts, key=lambda t: -t[0]):
        lines.insert(at, junk if junk.endswith(b"\n") else junk + b"\n")
    tl = parse_bytes(b"".join(lines), rx=rx)
    got = tl.judge(status, rx + dt, POL)
    if tl.pin != SYNTH_KEY.public:
        # An intact line before the instance's very first line: the threat model rules this
        # out (the first line of the first boot is written by root before any workload runs,
        # docs/serial-protocol.md), and if it happens anyway it cannot pass unnoticed: the
        # real key is not placed (or another one is), an alarm on every verdict.
        assert any(at == 0 for at, _ in inserts)
        assert got.reason.startswith("ALARM"), got.reason
        return
    if tl.unplaced:  # another key was announced: the same verdict, with an alarm
        assert got.reason.startswith("ALARM")
        got = replace(got, reason=want.reason)
    assert replace(got, evidence=()) == replace(want, evidence=())


# -- an unprivileged process on the VM -----------------------------------------------------

FORGER = r"""
import base64, os, sys, secrets, zlib
console, boot_id_path = sys.argv[1], sys.argv[2]
try:
    open(sys.argv[3], "rb").read()
    print("READ THE KEY")
except PermissionError:
    print("key: permission denied")
boot = open(boot_id_path).read().strip().replace("-", "")[:8]
def line(body):  # a v3 line with a valid CRC and a signature of nobody's making
    b = body.encode() + b" #" + base64.urlsafe_b64encode(secrets.token_bytes(64))[:86]
    return b + b"%08x" % (zlib.crc32(b) & 0xFFFFFFFF) + bytes([10])
out = b""
for seq in range(3, 40):  # claim what comes next, and decide
    for name, f in (("exit", "rc=0 sig=-"), ("heartbeat", "rung=0/10")):
        out += line(f"GCEWD3 {boot} {seq} 2096-10-02T07:06:40.000Z {name} {f}")
pk = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
out += line(f"GCEWD3 {boot} 0 1970-01-01T00:00:00.000Z key pk={pk} inst=-")
with open(console, "ab") as c:
    c.write(out)
print("wrote", len(out))
"""


@pytest.mark.process
def test_forged_lines_written_by_nobody_change_nothing(nobody: Nobody, nobody_dir: Path) -> None:
    # nobody_dir: a 0755 dir nobody can reach; nobody's interpreter imports the agent from the
    # world-readable copy (kit/nobody.py), as a checkout under a 0700 dir (`mktemp -d`, as CI
    # clones) is not readable by it, and the attack must still run there
    tmp_path = nobody_dir
    state, run = tmp_path / "state", tmp_path / "run"
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("5f1e2d3c-0000-4000-8000-000000000001\n")
    cfg = tmp_path / "config.toml"
    console = tmp_path / "console.log"
    console.touch()
    console.chmod(0o666)  # like the runner's pipe: the workload's output reaches the console
    cfg.write_text(
        f'[agent]\nstate_dir = "{state}"\nrun_dir = "{run}"\nboot_id_path = "{boot_id}"\n'
        f'[serial]\ndevice = "{console}"\nfallback_file = "{tmp_path}/fallback.log"\n'
    )
    gw = [sys.executable, "-m", "gce_watchdog"]
    env_ok = subprocess.run([*gw, "phase", "workload", "--config", str(cfg)], cwd=REPO, check=False)
    assert env_ok.returncode == 0
    key = state / "signing.key"
    assert key.stat().st_mode & 0o777 == 0o600
    # the workload, as nobody: forge what it can, then try our own CLI
    f = nobody.run(["-c", FORGER, str(console), str(boot_id), str(key)], cwd=tmp_path, timeout=120)
    assert f.returncode == 0, f.stderr
    assert "key: permission denied" in f.stdout and "wrote" in f.stdout
    own = nobody.run(
        ["-c", "from gce_watchdog.vm.state import load_line_key as k; "
         f"k({str(state)!r}, {str(run)!r})"], cwd=tmp_path, timeout=120)  # fmt: skip
    assert own.returncode != 0 and "KeyUnavailable" in own.stderr, own.stderr
    # root's real lines after the forgeries
    for argv in (["setup-failed", "--step", "train", "--reason", "broken"],):
        assert subprocess.run([*gw, *argv, "--config", str(cfg)], cwd=REPO).returncode == 0
    tl = parse_bytes(console.read_bytes(), rx=100.0)
    v = tl.judge(RUN, 100.0, POL)
    assert v.kind is VerdictKind.SETUP_FAILED, v.reason
    assert tl.forged == 75 and len(tl.unplaced) == 1  # 74 forged lines and one forged key
    assert v.reason.startswith("ALARM")
    assert [e.event for e in tl.events] == ["key", "key", "phase", "setup_failed"]


@pytest.mark.pure
def test_upgrade_pollers_first_v2_lines_then_the_v3_agent() -> None:
    """docs/serial-protocol.md, "Upgrade from v2": a v3 reader keeps verifying a v2 instance's
    lines under the v2 key it held before the upgrade (the cursor's), takes no new v2 key from
    the console, and once the instance speaks v3 and is pinned its v2 lines never decide."""
    v2_key = bytes(range(100, 132))
    v2 = [
        protocol.key_line_v2("aaaa0001", 0, 0, v2_key),
        protocol.encode_v2(
            protocol.make_event("phase", "aaaa0001", 1, 0, {"ph": "workload"}), v2_key
        ),
        protocol.encode_v2(
            protocol.make_event("shutdown", "aaaa0001", 2, 0, {"reason": "ladder"}), v2_key
        ),
    ]
    data = "".join(x + "\n" for x in v2).encode()
    held = Timeline(v2_key, from_start=False)  # a cursor of before the upgrade: its v2 key
    held.feed(data, 10.0)
    assert [e.event for e in held.events] == ["key", "phase", "shutdown"] and held.forged == 0
    assert held.judge(OFF, 20.0, POL).kind is VerdictKind.SELF_SHUTDOWN
    fresh = parse_bytes(data, rx=10.0)  # no v2 key held: v2 is never pinned from the console
    assert fresh.events == [] and fresh.forged_reasons == {Forgery.V2: 3}
    assert not fresh.judge(OFF, 20.0, POL).failover  # an alarm, not a decision (no pin)
    # the agent is upgraded in place: v3 lines after v2 ones cannot be placed (no_pin) until an
    # operator pins by hand; with the hand pin, the v3 key decides and v2 lines are forged
    w = Writer(boot="bbbb0002", ts_ms=10**12)
    v3 = w.line("phase", {"ph": "workload"}) + w.line("exit", {"rc": 0, "sig": "-"})
    late = parse_bytes(data + v3, rx=10.0)
    assert late.pin is None and "no_pin" in late.key_alarm
    hand = parse_bytes(data + v3, rx=10.0, pin_fp=SYNTH_KEY.fingerprint)
    assert hand.pin == SYNTH_KEY.public and hand.pinned_here
    assert [e.event for e in hand.events] == ["key", "key", "phase", "exit"]
    replay = protocol.encode_v2(
        protocol.make_event("exit", "bbbb0002", 9, 10**12, {"rc": 1}), v2_key
    )
    hand.feed(replay.encode() + b"\n", 11.0)
    assert hand.forged_reasons.get(Forgery.V2, 0) == 4  # the v2 key read back speaks for nobody
    assert hand.judge(OFF, 20.0, POL).kind is VerdictKind.WORKLOAD_OK
