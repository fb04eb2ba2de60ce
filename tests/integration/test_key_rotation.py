"""Issue 25 item 4: ``gce-watchdog key --rotate``. The VM's side (a real state dir, the real
command, a running writer that follows the key file) and the readers' (the ledger's pin moves,
SQLite and PostgreSQL; the poll path's SerialReader; the Pub/Sub worker's classification).
docs/serial-protocol.md, "Key rotation"."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from gce_watchdog.lib.compute import SerialChunk
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.poller.pin_store import PIN_REKEY
from gce_watchdog.poller.pubsub import PubSubWorker, SerialLine
from gce_watchdog.poller.reader import CursorStore, SerialReader
from gce_watchdog.poller.timeline import Timeline
from gce_watchdog.poller.verdict import InstanceState, Policy, VerdictKind
from gce_watchdog.vm.console import Emitter, MemorySink, SerialPort, follower
from gce_watchdog.vm.state import (
    KEY_FILE,
    RotateRefused,
    SeqAllocator,
    load_line_key,
    rotate_line_key,
)
from gce_watchdog.wire import protocol
from gce_watchdog.wire.protocol import Forgery, LineKey, Retired, pk_fingerprint
from kit.identities import TableIdentities
from kit.paths import REPO

INST = "5151515151515151515"
BOOT = "c0ffee00"
RUN = InstanceState("RUNNING")
POL = Policy()
EVIL = LineKey(b"\x09" * 32)


def _config(tmp: Path) -> Path:
    (tmp / "console.log").touch()
    (tmp / "boot_id").write_text(BOOT + "-0000-0000-0000-000000000000\n")
    cfg = tmp / "config.toml"
    cfg.write_text(
        f'[agent]\nstate_dir = "{tmp}/state"\nrun_dir = "{tmp}/run"\n'
        f'boot_id_path = "{tmp}/boot_id"\n'
        f'[serial]\ndevice = "{tmp}/console.log"\nfallback_file = "{tmp}/fallback.log"\n'
        "sync_timeout = 2\n"
    )
    return cfg


def _cli(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gce_watchdog", *args, "--config", str(cfg)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _agent(tmp: Path) -> tuple[Emitter, SerialPort]:
    """A running writer (the agent) on the same console, started before the rotation."""
    ks = load_line_key(tmp / "state", tmp / "run")
    key = LineKey(ks.seed, ks.ephemeral)
    port = SerialPort(str(tmp / "console.log")).open()
    em = Emitter(
        port,
        SeqAllocator(tmp / "run", BOOT),
        BOOT,
        key=key,
        inst=INST,
        follow=follower(str(tmp / "state"), key),
    )
    return em, port


@pytest.mark.process
def test_key_rotate_announces_switches_and_the_running_agent_follows(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    first = _cli(cfg, "key", "--fingerprint")
    assert first.returncode == 0, first.stderr
    fp0 = first.stdout.strip()
    em, port = _agent(tmp_path)
    try:
        assert em.write("start", {"v": "1", "inst": INST, "rung": "0/10"})
        for i in range(3):
            assert em.write("heartbeat", {"rung": "0/10", "ph": "workload", "ticks": i})
        refused = _cli(cfg, "key", "--rotate")  # no instance id yet: nothing changes
        assert refused.returncode == 69 and "instance id" in refused.stderr
        assert _cli(cfg, "key").stdout.strip() == fp0
        (tmp_path / "state" / "instance.json").write_text(json.dumps({"id": INST}))
        rot = _cli(cfg, "key", "--rotate")
        assert rot.returncode == 0, rot.stderr
        fp1 = rot.stdout.strip()
        assert fp1 != fp0 and _cli(cfg, "key").stdout.strip() == fp1
        mode = (tmp_path / "state" / KEY_FILE).stat().st_mode
        assert stat.S_IMODE(mode) == 0o600
        assert not [p for p in (tmp_path / "state").iterdir() if p.name.endswith(".tmp")]
        for i in range(3):  # the agent's next lines: the new key, with no signal, no restart
            assert em.write("heartbeat", {"rung": "0/10", "ph": "workload", "ticks": 10 + i})
        assert em.key is not None and em.key.fingerprint == fp1
    finally:
        port.close()
    phase = _cli(cfg, "phase", "workload")  # another writer process: the new key too
    assert phase.returncode == 0, phase.stderr
    data = (tmp_path / "console.log").read_bytes()
    assert b" rekey pk=" in data and data.count(b" rekey ") == 1
    tl = Timeline(instance_id=INST)
    events = tl.feed(data, 100.0)
    assert tl.forged == 0 and tl.key_alarm == "", tl.forged_samples
    assert tl.pin is not None and pk_fingerprint(tl.pin) == fp1
    assert [(pk_fingerprint(o), pk_fingerprint(n)) for o, n, _, _ in tl.rekeys] == [(fp0, fp1)]
    names = [e.event for e in events]
    assert names.count("heartbeat") == 6 and "phase" in names
    assert tl.judge(RUN, 101.0, POL).kind is VerdictKind.HEALTHY


@pytest.mark.pure
def test_a_rekey_line_the_console_did_not_take_keeps_the_old_key(tmp_path: Path) -> None:
    state, run = tmp_path / "state", tmp_path / "run"
    ks = load_line_key(state, run)
    seq = SeqAllocator(run, BOOT)

    def lost(take: object, old: bytes, new: bytes) -> bool:
        return False

    with pytest.raises(RotateRefused):
        rotate_line_key(state, seq, lost)
    assert load_line_key(state, run).seed == ks.seed
    assert sorted(p.name for p in state.iterdir()) == [KEY_FILE]


@pytest.mark.pure
def test_an_ephemeral_key_is_not_rotated(tmp_path: Path) -> None:
    state, run = tmp_path / "state", tmp_path / "run"
    state.mkdir()
    (state / KEY_FILE).mkdir()  # the state dir cannot hold a key: ephemeral, in the run dir
    ks = load_line_key(state, run)
    assert ks.ephemeral

    def never(take: object, old: bytes, new: bytes) -> bool:
        raise AssertionError("no rekey line for an ephemeral key")

    with pytest.raises(RotateRefused):
        rotate_line_key(state, SeqAllocator(run, BOOT), never)


@pytest.mark.pure
def test_no_writer_signs_with_the_old_key_after_the_rekey_seq(tmp_path: Path) -> None:
    """The rekey line's seq and the rename are one step under the counter's lock: a writer
    whose seq comes after the rekey line's checks the key file after taking it."""
    state, run = tmp_path / "state", tmp_path / "run"
    ks = load_line_key(state, run)
    old = LineKey(ks.seed)
    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(run, BOOT), BOOT, key=old, inst=INST,
                 follow=follower(str(state), old))  # fmt: skip
    em.emit("start", {"v": "1"})
    seqs: list[int] = []

    def announce(take: object, o: bytes, n: bytes) -> bool:
        assert callable(take)
        k = take()
        seqs.append(k)
        sink.submit(protocol.rekey_line(BOOT, k, 0, LineKey(o), LineKey(n).public, INST))
        return True

    _, new_seed = rotate_line_key(state, SeqAllocator(run, BOOT), announce)
    em.emit("heartbeat", {"rung": "0/10"})
    new = LineKey(new_seed)
    after = [ln for ln in sink.lines if int(ln.split(" ")[2]) > seqs[0]]
    assert after and all(protocol.decode_line(ln, pin=new.public) is not None for ln in after)
    assert all(
        not isinstance(protocol.decode_line(ln, pin=old.public), protocol.Event) for ln in after
    )


# -- readers: the ledger's pin moves --------------------------------------------------------


@dataclass
class FakeCompute:
    """getSerialPortOutput over a growing console (start/next as the API's: docs for
    instances.getSerialPortOutput, https://cloud.google.com/compute/docs/reference/rest/v1/
    instances/getSerialPortOutput)."""

    data: bytes = b""

    def serial_port_output(
        self, project: str, zone: str, name: str, start: int, port: int = 1
    ) -> SerialChunk:
        return SerialChunk(self.data[start:], start, len(self.data))


class Console:
    def __init__(self, key: LineKey) -> None:
        self.key, self.seq, self.lines = key, 0, []

    def take(self) -> int:
        n, self.seq = self.seq, self.seq + 1
        return n

    def emit(self, event: str, **fields: object) -> None:
        n = self.take()
        while protocol.needs_announcement(n):
            self.lines.append(protocol.key_line(BOOT, n, 1000 * n, self.key, INST))
            n = self.take()
        self.lines.append(protocol.encode(protocol.make_event(event, BOOT, n, 1000 * n, fields),
                                          self.key))  # fmt: skip

    def rotate(self, new: LineKey, signer: LineKey | None = None) -> int:
        n = self.take()
        self.lines.append(protocol.rekey_line(BOOT, n, 1000 * n, signer or self.key, new.public,
                                              INST))  # fmt: skip
        if signer is None:
            self.key = new
        return n

    def bytes(self) -> bytes:
        return "".join(x + "\n" for x in self.lines).encode()


@pytest.mark.process
@pytest.mark.parametrize("ledger_spec", ["sqlite", "postgres"], indirect=True)
def test_a_rotation_moves_the_ledger_pin_and_every_reader_follows(
    ledger_spec: str, tmp_path: Path
) -> None:
    old, new, newer = LineKey(b"\x01" * 32), LineKey(b"\x02" * 32), LineKey(b"\x03" * 32)
    vm = Console(old)
    api = FakeCompute()
    with open_ledger(ledger_spec, owner="poller-a") as led:
        reader = SerialReader(api, CursorStore(tmp_path / "a"), lambda: 10.0, pins=led.pins)
        vm.emit("start", v="1")
        vm.emit("heartbeat", rung="0/10")
        api.data = vm.bytes()
        reader.read("p", "z", "vm", INST)
        pin = led.pins.get_pin(INST)
        assert pin is not None and pin.public == old.public and pin.source == "placed"
        # a forged rekey: nothing moves
        vm.rotate(EVIL, signer=EVIL)
        vm.emit("heartbeat", rung="0/10")
        api.data = vm.bytes()
        reader.read("p", "z", "vm", INST)
        assert led.pins.get_pin(INST).public == old.public  # type: ignore[union-attr]
        # the real rotation
        n = vm.rotate(new)
        vm.emit("heartbeat", rung="0/10")
        api.data = vm.bytes()
        reader.read("p", "z", "vm", INST)
        pin = led.pins.get_pin(INST)
        assert pin is not None and pin.public == new.public and pin.source == PIN_REKEY
        assert pin.fingerprint == new.fingerprint and pin.pinned_by == "poller-a"
        assert pin.retired == (Retired(old.public, BOOT, n),)
        # a stale mover (another reader that decoded the same rotation) changes nothing
        again = led.pins.rekey_pin(INST, old.public, EVIL.public, EVIL.fingerprint, BOOT, n)
        assert again is not None and again.public == new.public
        # a chain: a second rotation
        m = vm.rotate(newer)
        vm.emit("heartbeat", rung="0/10")
        api.data = vm.bytes()
        reader.read("p", "z", "vm", INST)
        pin = led.pins.get_pin(INST)
        assert pin is not None and pin.public == newer.public
        assert pin.retired == (Retired(old.public, BOOT, n), Retired(new.public, BOOT, m))
        tl = reader.cursor("p", "z", "vm").timeline
        assert tl.forged_reasons == {Forgery.BAD_REKEY: 1}
        assert tl.judge(RUN, 11.0, POL).kind is VerdictKind.HEALTHY
    # another host, a fresh cursor dir, after the rotations: the ledger's pin, no key alarm
    with open_ledger(ledger_spec, owner="poller-b") as led:
        fresh = SerialReader(api, CursorStore(tmp_path / "b"), lambda: 20.0, pins=led.pins)
        fresh.read("p", "z", "vm", INST)
        tl = fresh.cursor("p", "z", "vm").timeline
        assert tl.pin == newer.public and tl.key_alarm == ""
        assert tl.judge(RUN, 21.0, POL).kind is VerdictKind.UNKNOWN  # a first read: age unknown
        # an operator's hand pin replaces the rotation record too
        led.pins.hand_pin(INST, "f" * 32)
        pin = led.pins.get_pin(INST)
        assert pin is not None and pin.retired == () and pin.source == "hand"


@pytest.mark.process
@pytest.mark.parametrize("ledger_spec", ["sqlite", "postgres"], indirect=True)
def test_pubsub_workers_move_the_pin_through_a_verified_rekey_only(ledger_spec: str) -> None:
    old, new = LineKey(b"\x01" * 32), LineKey(b"\x02" * 32)
    vm = Console(old)
    vm.emit("start", v="1")
    with open_ledger(ledger_spec, owner="w") as led:
        led.pins.place_pin(INST, old.public, old.fingerprint, now=1.0)
        ids = TableIdentities.of([INST], "p", "z")
        a = PubSubWorker(None, "sub", led, lambda o: None, identity=ids)
        b = PubSubWorker(None, "sub", led, lambda o: None, identity=ids)

        def feed(w: PubSubWorker, text: str, inst: str = INST, now: float = 5.0) -> list[str]:
            lines: list[object] = []
            raw: list[object] = []
            key = w._pinned([inst], {}).get(inst)
            w._classify(SerialLine("p", "z", inst, "vm", text), key, now, None, lines, raw)  # type: ignore[arg-type]
            return [s.event.event for s in lines]  # type: ignore[attr-defined]

        for ln in vm.lines:
            feed(a, ln)
            feed(b, ln)  # b caches the old pin
        # forged: signed by the attacker
        forged = protocol.rekey_line(BOOT, 40, 0, EVIL, EVIL.public, INST)
        assert feed(a, forged) == [] and a.stats.forged == 1
        assert led.pins.get_pin(INST).public == old.public  # type: ignore[union-attr]
        # a real rekey of this instance relabelled as another's (the same key elsewhere)
        assert feed(a, protocol.rekey_line(BOOT, 41, 0, old, new.public, INST), inst="99") == []
        assert led.pins.get_pin("99") is None
        n = vm.rotate(new)
        vm.emit("heartbeat", rung="0/10")
        assert feed(a, vm.lines[-2], now=6.0) == ["rekey"]
        pin = led.pins.get_pin(INST)
        assert pin is not None and pin.public == new.public and pin.source == PIN_REKEY
        assert pin.retired == (Retired(old.public, BOOT, n),) and a.stats.rekeys == 1
        assert feed(a, vm.lines[-1], now=6.0) == ["heartbeat"]
        # b still caches the old pin: the new key's line makes it look again, and it verifies
        assert feed(b, vm.lines[-1], now=7.0) == ["heartbeat"] and b.stats.forged == 0
        # a copy of the rekey line (a redelivery) moves nothing and is stored as seen
        assert feed(b, vm.lines[-2], now=7.0) == ["rekey"] and b.stats.rekeys == 0
        # a late line of the old key, numbered before the rotation: still the boot's
        late = protocol.encode(protocol.Event("heartbeat", BOOT, n - 1, 0, ()), old)
        assert feed(b, late, now=8.0) == ["heartbeat"]
        # the old key after its rotation: retired, neither stored nor forged
        after = protocol.encode(protocol.Event("shutdown", BOOT, n + 5, 0, ()), old)
        assert feed(b, after, now=9.0) == [] and b.stats.retired == 1 and b.stats.forged == 0


@pytest.mark.process
def test_the_private_keys_stay_0600_and_out_of_the_console(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "instance.json").write_text(json.dumps({"id": INST}))
    assert _cli(cfg, "key").returncode == 0
    old = (tmp_path / "state" / KEY_FILE).read_bytes()
    assert _cli(cfg, "key", "--rotate").returncode == 0
    new = (tmp_path / "state" / KEY_FILE).read_bytes()
    data = (tmp_path / "console.log").read_bytes()
    for seed in (old, new):
        assert protocol.b64(seed).encode() not in data and seed.hex().encode() not in data
    assert os.stat(tmp_path / "state" / KEY_FILE).st_mode & 0o077 == 0
