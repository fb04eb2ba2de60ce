"""Floods cost the attacker, not the verdict (issue 35, item 3), through the real CLI (``poll``
against the fake Compute API, ``parse`` on a dump): every line of a read is examined, a real
``shutdown`` or announcement inside 400 (and 10,000) forged lines is found, and unverifiable
lines never hold a verdict at ``unknown`` beyond the drain timeout."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.synth import SYNTH_KEY, Writer
from gce_watchdog.wire.line import MAX_VALUE
from gce_watchdog.wire.protocol import LineKey, announce_event, encode, make_event
from kit.poll import outputs, poll_args

pytestmark = pytest.mark.process

P, Z = "test-project", "us-central1-a"
EVIL = LineKey(bytes(range(100, 132)))  # the forger's key: intact lines, wrong signatures
MAX_POLLS = 80  # every loop is bounded


def forged(boot: str, seqs: range, event: str = "shutdown", pad: int = 0) -> bytes:
    """Intact lines of ``boot`` that do not verify under the pin (signed with another key);
    ``pad``: that many more fields at their maximum length (lines up to the 280 bytes)."""
    fields: dict[str, object] = {"reason": "ladder", "rung": "10/10"}
    for i in range(pad):  # fields at their maximum length (MAX_VALUE)
        fields[f"f{i}"] = "y" * MAX_VALUE
    return b"".join(
        encode(make_event(event, boot, s, 1_764_475_094_000, fields), EVIL).encode() + b"\n"
        for s in seqs
    )


def forged_announcements(boot: str, seqs: range) -> bytes:
    """Announcements of the *pinned* public key with wrong signatures (each costs a check)."""
    out = b""
    for s in seqs:
        ann = announce_event(boot, s, 1_764_475_094_000, SYNTH_KEY, "-")
        out += encode(ann, EVIL).encode() + b"\n"
    return out


def started(api: FakeComputeAPI, name: str) -> Writer:
    """A VM whose agent started (its key pinned from byte 0) and is in its workload."""
    api.add_instance(name, project=P, zone=Z)
    w = Writer(boot="aaaa0001", ts_ms=int(time.time() * 1000))
    api.append_serial(name, w.line("start", {"v": "1"}) + w.line("phase", {"ph": "workload"}))
    return w


def poll(api: FakeComputeAPI, tmp: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:  # type: ignore[type-arg]
    # one attempt: GCE answers 503 for the serial port of a VM that is off, by design
    assert main(poll_args(api, tmp, "--once", "--api-attempts", "1", *extra)) == 0
    return outputs(capsys)


def until_decided(
    api: FakeComputeAPI, tmp: Path, capsys: pytest.CaptureFixture[str], name: str, want: str
) -> list[dict]:  # type: ignore[type-arg]
    """Poll (bounded) until the verdict is ``want``; every outcome, in order."""
    outs = []
    for _ in range(MAX_POLLS):
        out = poll(api, tmp, capsys, name)[name]
        outs.append(out)
        if out["verdict"] == want:
            break
    return outs


@pytest.mark.parametrize(
    ("what", "n"),
    [("shutdown", 400), ("announcements", 400), ("shutdown", 10_000)],
)
def test_a_real_shutdown_inside_a_forged_flood_is_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str, n: int
) -> None:
    with FakeComputeAPI(token="tok") as api:
        w = started(api, "vm-1")
        assert poll(api, tmp_path, capsys, "vm-1")["vm-1"]["key_alarm"] == ""  # pinned
        # the forger claims the seqs below the agent's next ones: each is checked before it
        seqs = range(w.seq, w.seq + n)
        flood = forged(w.boot, seqs) if what == "shutdown" else forged_announcements(w.boot, seqs)
        w.seq += n
        api.append_serial("vm-1", flood + w.line("shutdown", {"reason": "ladder", "rung": "10/10"}))
        outs = [poll(api, tmp_path, capsys, "vm-1")["vm-1"]]  # read within the agent's linger
        api.guest_shutdown("vm-1")  # then the end-of-life chain powers off: no byte follows
        if outs[0]["verdict"] != "self_shutdown":
            outs += until_decided(api, tmp_path, capsys, "vm-1", "self_shutdown")
        last = outs[-1]
        assert last["verdict"] == "self_shutdown" and last["action"] == "failover", [
            (o["verdict"], o["reason"][:120], o["forged"]) for o in outs[:: max(1, len(outs) // 8)]
        ]
        assert last["forged"] >= n // 2  # shown as forged (the window may have lost the rest)
        assert [o for o in outs[:-1] if o["action"] != "none"] == []  # nothing acted on before
        if n <= 400:  # within one read's budget (docs/poller.md, "Per-read budget")
            assert len(outs) == 1, [o["verdict"] for o in outs]


def test_a_burst_of_unverifiable_lines_does_not_hide_a_later_wedge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """250 forged ticks with seqs far above the agent's (its liveness, if they were real), in
    one burst; the agent beats on, then wedges: it is failed over one drain timeout later."""
    drain = 1.5
    with FakeComputeAPI(token="tok") as api:
        w = started(api, "vm-1")
        args = ("--drain-timeout", f"{drain}s", "vm-1")
        assert poll(api, tmp_path, capsys, *args)["vm-1"]["verdict"] == "unknown"  # first read
        api.append_serial("vm-1", forged(w.boot, range(10**9, 10**9 + 250), "tick"))
        api.append_serial("vm-1", w.line("heartbeat", {"ph": "workload", "rung": "0/10"}))
        beat = poll(api, tmp_path, capsys, *args)["vm-1"]
        assert beat["verdict"] in ("healthy", "unknown") and beat["action"] == "none", beat
        last_line = time.time()  # the agent wedges: no line from here on
        outs = []
        for _ in range(MAX_POLLS):
            started_at = time.time()
            out = poll(api, tmp_path, capsys, *args)["vm-1"]
            outs.append(out)
            if started_at > last_line + drain:
                break
            time.sleep(0.2)
        # its newest line was received before last_line: silent past the drain timeout
        assert outs[-1]["verdict"] == "suspected_wedge", outs[-1]
        assert [o["action"] for o in outs].count("failover") == 1
        assert outs[-1]["forged"] >= 250  # every forged line was examined, and shown


def test_parse_finds_the_real_start_among_junk_lines_at_their_maximum_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = Writer(boot="aaaa0001")
    head = w.line("phase", {"ph": "bootstrap"})  # the pinned announcement, then a line
    junk = forged(w.boot, range(w.seq, w.seq + 500), "start", pad=3)
    assert max(len(x) for x in junk.splitlines()) >= 270  # at (or near) MAX_LINE
    w.seq += 500
    dump = tmp_path / "serial.log"
    dump.write_bytes(head + junk + w.line("start", {"v": "1"}))
    assert main(["parse", str(dump), "--json", "--now", "last"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [e["event"] for e in doc["events"]][-1] == "start", doc["verdict"]
    assert doc["forged"] == 500 and "unverified_flood" not in doc["verdict"]["reason"]
