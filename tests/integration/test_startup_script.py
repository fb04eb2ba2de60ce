"""The real start-up script, end to end, against a temporary root and local servers
(testing.simgce's metadata and file servers): phases, setup_failed, the pre-agent emitter."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from gce_watchdog.poller.timeline import parse_bytes
from gce_watchdog.testing.simgce import FakeMetadataServer, StaticFileServer
from gce_watchdog.vm.bootcount import BootCount
from gce_watchdog.vm.console import Emitter, MemorySink, boot_count
from gce_watchdog.vm.state import (
    SeqAllocator,
    load_line_key,
    read_boot_id,
    read_phase,
    short_boot,
)
from gce_watchdog.wire import protocol
from kit.paths import REPO

pytestmark = pytest.mark.process

SCRIPT = REPO / "startup" / "startup-script.sh"
BAKE = REPO / "startup" / "bake-image.sh"
BOOT_ID = "5f1e2d3c-0000-4000-8000-0123456789ab"
PY = sys.executable
# What the recorder saw of an end of life: the agent's chain (poweroff_cmd, then force_cmd: the
# recorder never powers off, so the chain escalates), or the script's own (no agent).
AGENT_END = ["poweroff", "force"]
SCRIPT_END = ["poweroff", "poweroff", "--force", "--force"]


def test_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (make apt-test installs it)")
    p = subprocess.run(
        ["shellcheck", "--shell=bash", str(SCRIPT), str(BAKE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr


@dataclass
class Vm:
    """A temporary root the script runs against, with its env and a metadata server."""

    root: Path
    mds: FakeMetadataServer
    env: dict[str, str]

    @property
    def serial(self) -> Path:
        return self.root / "serial.log"

    @property
    def state(self) -> Path:
        return self.root / "var/lib/gce-watchdog"

    @property
    def actions(self) -> list[str]:
        p = self.root / "actions.log"
        return p.read_text().split() if p.exists() else []

    @property
    def run_dir(self) -> Path:
        return self.root / "run/gce-watchdog"

    def events(self) -> list[protocol.Event]:
        """Our events on the console, as a poller that pinned the instance's key reads them
        (the key announcement itself is left out)."""
        if not self.serial.exists():
            return []
        key = protocol.LineKey((self.state / "signing.key").read_bytes())
        events, stats = protocol.decode_all(self.serial.read_bytes(), pin=key.public)
        assert stats.rejected == 0, "every line the script writes must decode"
        assert stats.forged == 0, "every line the script writes must authenticate"
        return [e for e in events if e.event != protocol.KEY_EVENT]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SCRIPT), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def bake(self) -> None:
        """The agent 'baked into the image': this checkout's agent behind PREFIX/bin."""
        prefix = self.root / "opt/gce-watchdog"
        (prefix / "bin").mkdir(parents=True)
        shim = prefix / "bin/gce-watchdog"
        shim.write_text(f'#!/bin/sh\nexec "{PY}" -m gce_watchdog "$@"\n')
        shim.chmod(0o755)
        # The shim's interpreter inside the image tree (`install --root` checks the agent runs).
        (self.root / "bin").mkdir(exist_ok=True)
        shutil.copy("/bin/sh", self.root / "bin/sh")
        (prefix / ".baked").write_text("gce-watchdog test\n")


@pytest.fixture
def vm(tmp_path: Path) -> Iterator[Vm]:
    root = tmp_path / "root"
    root.mkdir()
    boot = root / "boot_id"
    boot.write_text(BOOT_ID + "\n")
    state = root / "var/lib/gce-watchdog"
    cfg = root / "etc/gce-watchdog/config.toml"
    cfg.parent.mkdir(parents=True)
    (root / "serial.log").touch()  # the "serial device" (a missing one is unusable)
    recorder = root / "action-cmd"
    recorder.write_text(f'#!/bin/sh\necho "$@" >> "{root}/actions.log"\n')
    recorder.chmod(0o755)
    # The agent's end-of-life chain records its power-off commands too, never powers off
    # (kernel = []: no reboot(2) of the test machine), and lingers briefly.
    cfg.write_text(
        f'[agent]\nstate_dir = "{state}"\nrun_dir = "{root}/run/gce-watchdog"\n'
        f'boot_id_path = "{boot}"\n'
        f'[serial]\ndevice = "{root}/serial.log"\nfallback_file = "{root}/fallback.log"\n'
        f'[actions]\nlinger = "0.2s"\nrepeat_every = "0.1s"\npoweroff_wait = "0.1s"\n'
        f'force_wait = "0.1s"\nkernel = []\npoweroff_cmd = ["{recorder}", "poweroff"]\n'
        f'force_cmd = ["{recorder}", "force"]\n'
    )
    mds = FakeMetadataServer().start()
    # the script's mktemp scratch under the test's folder: a failed bootstrap step ends the
    # script before its `rm -rf`, and that must not pile up in the machine's /tmp
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "TMPDIR": str(scratch),
        "GCEWD_ROOT": str(root),
        "GCEWD_SERIAL": str(root / "serial.log"),
        "GCEWD_SERIAL_FALLBACK": str(root / "fallback.log"),
        "GCEWD_BOOT_ID_PATH": str(boot),
        "GCEWD_METADATA_URL": f"{mds.base}/computeMetadata/v1",
        "GCEWD_DNS_NAME": "localhost",
        "GCEWD_SYSTEMD_RUN_DIR": str(root / "run/systemd/system"),  # absent: no systemd
        "GCEWD_ACTION_CMD": str(recorder),
        "GCEWD_METADATA_DEADLINE": "3",
        # the script's own end of life (no agent): no linger or waits, sysrq into a file
        "GCEWD_DEFAULT_LINGER": "0",
        "GCEWD_POWEROFF_WAIT": "0",
        "GCEWD_FORCE_WAIT": "0",
        "GCEWD_SYSRQ": str(root / "sysrq"),
    }
    try:
        yield Vm(root, mds, env)
    finally:
        mds.stop()


def _phases(events: list[protocol.Event]) -> list[str]:
    return [e.get("ph") or "" for e in events if e.event == "phase"]


def _assert_consecutive(events: list[protocol.Event]) -> None:
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # no line lost or duplicated


def test_success_path_bootstrap_workload_done(vm: Vm) -> None:
    vm.bake()
    marker = vm.root / "bootstrap-ran"
    bdir = vm.root / "etc/gce-watchdog/bootstrap.d"
    bdir.mkdir(parents=True)
    (bdir / "10-first").write_text(f"#!/bin/sh\necho first >> {marker}\n")
    (bdir / "10-first").chmod(0o755)
    (bdir / "20-notes.txt~").write_text("an editor backup: skipped\n")
    steps = [[PY, "-c", f"open({str(marker)!r}, 'a').write('second\\n')"]]
    args_out = vm.root / "workload-args.json"
    dump = f"import json, sys; json.dump(sys.argv[1:], open({str(args_out)!r}, 'w'))"
    workload = [PY, "-c", dump, "two words", "$(touch pwned)", "*"]
    vm.mds.set_attribute("gce-watchdog-bootstrap", json.dumps(steps))
    vm.mds.set_attribute("gce-watchdog-workload", json.dumps(workload))

    p = vm.run()
    assert p.returncode == 0, p.stderr
    evs = vm.events()
    assert _phases(evs) == ["bootstrap", "workload", "done"]
    assert [e.event for e in evs if e.event in ("setup_failed",)] == []
    names = [e.event for e in evs]
    assert names.index("exit") == names.index("phase", names.index("exit") - 1) + 1
    ex = next(e for e in evs if e.event == "exit")
    assert (ex.get("rc"), ex.get("sig")) == ("0", "-")
    st = {e.get("step"): e.get("st") for e in evs if e.event == "bootstrap_step"}
    assert st == {"dns": "ok", "install": "ok", "unit": "skip",
                  "bootstrap:10-first": "ok", "bootstrap:md000": "ok"}  # fmt: skip
    assert marker.read_text() == "first\nsecond\n"  # directory steps first, then metadata
    # The argv reached the workload untouched: no shell ever saw it.
    assert json.loads(args_out.read_text()) == ["two words", "$(touch pwned)", "*"]
    assert not (vm.root / "pwned").exists() and not Path("pwned").exists()
    _assert_consecutive(evs)
    assert {e.boot for e in evs} == {short_boot(read_boot_id(vm.env["GCEWD_BOOT_ID_PATH"]))}
    assert read_phase(vm.state) == "done"
    assert vm.actions == []  # no failure action on success
    assert list(Path(vm.env["TMPDIR"]).iterdir()) == []  # its scratch removed after a success

    # Safe to run again (the next boot, or an operator by hand): same outcome, numbering goes on.
    p = vm.run()
    assert p.returncode == 0, p.stderr
    evs2 = vm.events()
    assert _phases(evs2) == ["bootstrap", "workload", "done"] * 2
    _assert_consecutive(evs2)


def test_failing_bootstrap_step_is_setup_failed_with_that_step(vm: Vm) -> None:
    vm.bake()
    steps = [[PY, "-c", "pass"], [PY, "-c", "raise SystemExit(3)"], [PY, "-c", "pass"]]
    vm.mds.set_attribute("gce-watchdog-bootstrap", json.dumps(steps))
    vm.mds.set_attribute("gce-watchdog-workload", json.dumps([PY, "-c", "pass"]))
    p = vm.run()
    assert p.returncode == 3
    evs = vm.events()
    (sf,) = [e for e in evs if e.event == "setup_failed"]
    assert (sf.get("step"), sf.get("rc"), sf.get("cause")) == ("bootstrap:md001", "3", "job")
    assert "exited with 3" in sf.text
    # nothing after the terminal line but its end of life: no workload, no third step
    after = evs[evs.index(sf) + 1 :]
    assert after[0].event == "end" and after[0].get("reason") == "setup_failed"
    assert {e.event for e in after} == {"end", "action"}
    assert _phases(evs) == ["bootstrap"]
    assert read_phase(vm.state) == "setup_failed"
    # the default failure action (poweroff), after the line, through the agent's chain
    assert vm.actions == AGENT_END
    assert list(Path(vm.env["TMPDIR"]).iterdir()) == []  # its scratch removed after a failure too


def test_failure_action_from_metadata_and_env(vm: Vm) -> None:
    vm.bake()
    vm.mds.set_attribute("gce-watchdog-bootstrap", json.dumps([["/bin/false"]]))
    vm.mds.set_attribute("gce-watchdog-failure-action", "reboot")
    assert vm.run().returncode == 1
    assert vm.actions == ["reboot"]
    vm.env["GCEWD_FAILURE_ACTION"] = "none"
    assert vm.run().returncode == 1
    assert vm.actions == ["reboot"]  # none: the VM stays up for inspection


def test_dns_that_never_resolves_fails_the_dns_step(vm: Vm) -> None:
    vm.bake()
    vm.env["GCEWD_DNS_NAME"] = "gcewd-no-such-host.invalid"
    vm.env["GCEWD_DNS_DEADLINE"] = "2"
    t0 = time.monotonic()
    p = vm.run()
    took = time.monotonic() - t0
    assert p.returncode == 75, p.stderr
    (sf,) = [e for e in vm.events() if e.event == "setup_failed"]
    assert (sf.get("step"), sf.get("rc"), sf.get("cause")) == ("dns", "75", "infra")
    assert took < 15  # bounded by the DNS deadline, not a fixed number of tries
    assert vm.actions == AGENT_END


def test_workload_must_be_an_argv_not_a_shell_string(vm: Vm) -> None:
    vm.bake()
    vm.mds.set_attribute("gce-watchdog-workload", "python3 train.py --epochs 3")
    p = vm.run()
    assert p.returncode == 64
    (sf,) = [e for e in vm.events() if e.event == "setup_failed"]
    # the signed trailer (protocol v3) leaves ~30 bytes of text on this line: the start of why
    assert sf.get("step") == "workload" and sf.text.startswith("gce-watchdog-workload: not val")


def test_failed_workload_is_an_exit_line_not_setup_failed(vm: Vm) -> None:
    vm.bake()
    vm.mds.set_attribute("gce-watchdog-workload", json.dumps([PY, "-c", "raise SystemExit(7)"]))
    p = vm.run()
    assert p.returncode == 7
    evs = vm.events()
    assert not [e for e in evs if e.event == "setup_failed"]
    ex = next(e for e in evs if e.event == "exit")
    assert ex.get("rc") == "7"
    assert _phases(evs) == ["bootstrap", "workload", "done"]
    assert vm.actions == []


def test_exec_that_never_starts_the_workload_is_setup_failed_not_done(vm: Vm) -> None:
    vm.bake()
    marker = vm.root / "ran"
    vm.mds.set_attribute(
        "gce-watchdog-workload", json.dumps([PY, "-c", f"open({str(marker)!r}, 'w')"])
    )
    cfg = vm.root / "etc/gce-watchdog/config.toml"
    cfg.write_text(cfg.read_text() + "\n[agent]\nthreshold = 0\n")  # exec refuses: exit 78
    p = vm.run()
    assert p.returncode == 78, p.stderr
    assert not marker.exists()  # the job never ran
    evs = vm.events()
    sf = [e for e in evs if e.event == "setup_failed"]
    assert len(sf) == 1 and sf[0].get("step") == "workload" and sf[0].get("rc") == "78"
    assert "done" not in _phases(evs) and not [e for e in evs if e.event == "exit"]


def test_no_workload_attribute_stops_after_bootstrap(vm: Vm) -> None:
    vm.bake()
    p = vm.run()
    assert p.returncode == 0, p.stderr
    evs = vm.events()
    assert _phases(evs) == ["bootstrap"]
    assert evs[-1].event == "bootstrap_step" and evs[-1].get("step") == "workload"
    assert evs[-1].get("st") == "skip"


def test_metadata_server_unreachable_is_setup_failed_metadata(vm: Vm) -> None:
    vm.bake()
    vm.mds.stop()
    p = vm.run()
    assert p.returncode == 75
    (sf,) = [e for e in vm.events() if e.event == "setup_failed"]
    assert (sf.get("step"), sf.get("cause")) == ("metadata", "infra")


def test_bootstrap_step_that_gives_up_with_75_is_infra(vm: Vm) -> None:
    # A step's `gce-watchdog fetch` that gave up at its deadline exits 75 (EX_TEMPFAIL).
    vm.bake()
    vm.mds.set_attribute("gce-watchdog-bootstrap", json.dumps([[PY, "-c", "raise SystemExit(75)"]]))
    p = vm.run()
    assert p.returncode == 75
    (sf,) = [e for e in vm.events() if e.event == "setup_failed"]
    assert (sf.get("step"), sf.get("rc"), sf.get("cause")) == ("bootstrap:md000", "75", "infra")


@pytest.mark.parametrize(("rc", "cause"), [(6, "infra"), (7, "infra"), (28, "infra"), (22, "job")])
def test_bootstrap_step_with_curls_network_codes_is_infra(vm: Vm, rc: int, cause: str) -> None:
    """Issue 36.4: a raw curl that cannot resolve (6), connect (7) or finish (28) after the
    network checks is infra, like the same download through `gce-watchdog fetch` (75); an HTTP
    error (22, `curl -f`) is the job's."""
    vm.bake()
    vm.mds.set_attribute(
        "gce-watchdog-bootstrap", json.dumps([[PY, "-c", f"raise SystemExit({rc})"]])
    )
    p = vm.run()
    assert p.returncode == rc
    (sf,) = [e for e in vm.events() if e.event == "setup_failed"]
    assert (sf.get("step"), sf.get("rc"), sf.get("cause")) == ("bootstrap:md000", str(rc), cause)


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_a_real_curl_refused_on_loopback_is_infra(vm: Vm) -> None:
    # a port bound and held but not listening: a connect is refused (curl exits 7, "failed to
    # connect"), and no other process can take the port meanwhile
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        argv = [shutil.which("curl"), "-sS", "-o", "/dev/null", f"http://127.0.0.1:{port}/x"]
        vm.bake()
        vm.mds.set_attribute("gce-watchdog-bootstrap", json.dumps([argv]))
        p = vm.run()
    assert p.returncode == 7, p.stderr
    (sf,) = [e for e in vm.events() if e.event == "setup_failed"]
    assert (sf.get("rc"), sf.get("cause")) == ("7", "infra")


# ---------------------------------------------------------------------------------------------
# The pre-agent emitter: the one other encoder of protocol v3 (its own Ed25519, RFC 8032).


def test_script_emitter_decodes_and_shares_the_seq_file_with_the_agent(vm: Vm) -> None:
    full = read_boot_id(vm.env["GCEWD_BOOT_ID_PATH"])
    boot = short_boot(full)
    sink = MemorySink()
    # the agent first: it counts the boot (the first: 1), creates the key and announces it as
    # the boot's seq 0 and 1
    count = boot_count(str(vm.state), str(vm.run_dir), full)
    assert count == BootCount("1")
    ks = load_line_key(vm.state, vm.run_dir)
    assert ks.path == vm.state / "signing.key" and not ks.ephemeral and not ks.problems
    assert (ks.path.stat().st_mode & 0o777) == 0o600
    key = protocol.LineKey(ks.seed)
    agent = Emitter(sink, SeqAllocator(vm.run_dir, boot), boot, key=key, count=count, boot_id=full)
    agent.emit("heartbeat", {"rung": "0/10"})
    (vm.run_dir / f"bc.{boot}").unlink()  # the script reads boot.count itself: the same 1
    p = vm.run("emit", "fetch", "out=retry", "att=1", "host=pypi.org", "--", "DNS not ready")
    assert p.returncode == 0, p.stderr
    agent.emit("heartbeat", {"rung": "0/10"})
    assert (vm.run_dir / f"seq.{boot}").read_text() == f"{5:020d}\n"
    (ev,) = vm.events()  # the script signed with the agent's key: it authenticates
    assert (ev.event, ev.boot, ev.seq) == ("fetch", boot, 3)
    assert ev.fields == (("out", "retry"), ("att", "1"), ("host", "pypi.org"), ("bc", "1"))
    assert ev.text == "DNS not ready"
    got = [protocol.decode_line(ln, pin=key.public) for ln in sink.lines]
    assert [type(r).__name__ for r in got] == ["KeyAnnounce", "KeyAnnounce", "Event", "Event"]
    seqs = [r.event.seq if isinstance(r, protocol.KeyAnnounce) else r.seq for r in got]  # type: ignore[union-attr]
    assert seqs == [0, 1, 2, 4]
    # the script's Ed25519 (pure Python, RFC 8032) and libsodium's give the same bytes: an
    # event line, and its announcement as the agent writes it at that seq
    script_lines = vm.serial.read_bytes().splitlines()
    assert protocol.encode(ev, key).encode() in script_lines
    assert (vm.state / "boot.count").read_text() == f"1 {full}\n"


def test_script_announcement_is_the_agents_byte_for_byte(vm: Vm) -> None:
    """The script's announcements (bc, bid) and lines are the library's bytes for the same
    seq, timestamp and key, and a second boot counts 2 on every line of it."""
    for n, boot_id in ((1, BOOT_ID), (2, "6a1e2d3c-0000-4000-8000-0123456789ab")):
        Path(vm.env["GCEWD_BOOT_ID_PATH"]).write_text(boot_id + "\n")
        full = read_boot_id(vm.env["GCEWD_BOOT_ID_PATH"])
        vm.serial.write_bytes(b"")
        assert vm.run("emit", "phase", "ph=bootstrap").returncode == 0
        key = protocol.LineKey((vm.state / "signing.key").read_bytes())
        lines = vm.serial.read_bytes().splitlines()
        assert len(lines) == 3
        for seq, raw in enumerate(lines[:2]):
            ts = protocol.parse_ts(raw.decode().split()[3])
            assert ts is not None
            want = protocol.key_line(short_boot(full), seq, ts, key, "-", str(n), full)
            assert raw == want.encode()
            assert f" bc={n} bid={full} ".encode() in raw
        (ev,) = vm.events()
        assert ev.get("bc") == str(n)
        want_ev = protocol.make_event(
            "phase", ev.boot, 2, ev.ts_ms, {"ph": "bootstrap"}, "", (("bc", str(n)),)
        )
        assert lines[2] == protocol.encode(want_ev, key).encode()


def test_script_emitter_with_a_lost_counter_writes_bc_dash_and_warns(vm: Vm) -> None:
    vm.state.mkdir(parents=True)
    (vm.state / "signing.key").write_bytes(b"k" * 32)
    (vm.state / "signing.key").chmod(0o600)
    for ph in ("bootstrap", "workload"):
        assert vm.run("emit", "phase", f"ph={ph}").returncode == 0
    evs = vm.events()
    assert [e.event for e in evs] == ["phase", "warn", "phase", "warn"]
    assert {e.get("bc") for e in evs} == {"-"}
    assert evs[1].get("what") == "bootcount" and "position only" in evs[1].text
    assert not (vm.state / "boot.count").exists()  # never restarted at 1


def test_script_emitter_creates_the_key_and_announces_it_first(vm: Vm) -> None:
    assert vm.run("emit", "phase", "ph=bootstrap").returncode == 0
    key = vm.state / "signing.key"
    st = key.stat()
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid() and st.st_size == 32
    lines = vm.serial.read_bytes().splitlines()
    first, second = (protocol.decode_line(ln) for ln in lines[:2])
    public = protocol.LineKey(key.read_bytes()).public
    assert isinstance(first, protocol.KeyAnnounce) and first.key == public and first.valid()
    assert isinstance(second, protocol.KeyAnnounce) and second.key == public and second.valid()
    assert (first.event.seq, second.event.seq) == (0, 1) and not first.ephemeral
    assert first.event.get("kid") == protocol.pk_fingerprint(public)
    assert [e.event for e in vm.events()] == ["phase"]
    # the next line of the boot does not announce again
    assert vm.run("emit", "phase", "ph=workload").returncode == 0
    assert len(vm.serial.read_bytes().splitlines()) == 4


def test_script_emitter_with_an_unusable_run_dir_still_announces_at_seq_0_and_1(vm: Vm) -> None:
    """Issue 35.4: a run dir that cannot hold the counter (a FIFO where the dir should be)."""
    vm.run_dir.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(vm.run_dir)
    for ph in ("bootstrap", "workload"):
        p = vm.run("emit", "phase", f"ph={ph}")
        assert p.returncode == 0 and "seq file unusable" in p.stderr, p.stderr
    data = vm.serial.read_bytes()
    first, second = (protocol.decode_line(ln) for ln in data.splitlines()[:2])
    assert isinstance(first, protocol.KeyAnnounce) and isinstance(second, protocol.KeyAnnounce)
    assert (first.event.seq, second.event.seq) == (0, 1)
    phases = vm.events()
    assert [e.get("ph") for e in phases] == ["bootstrap", "workload"]
    assert 1 < phases[0].seq < phases[1].seq  # from CLOCK_BOOTTIME, increasing
    tl = parse_bytes(data, rx=1.0)
    assert tl.pinned_here and tl.key_alarm == ""


@pytest.mark.parametrize(
    "fields, text",
    [
        (["reason=pip failed: exit 1 | see #log"], "a | b # c \u00e9\t end"),
        (["step=" + "s" * 80, "reason=" + "r" * 200], "t" * 300),
        (["rc=-"], ""),
    ],
)
def test_script_emitter_sanitizes_like_the_agent(vm: Vm, fields: list[str], text: str) -> None:
    args = ["emit", "setup_failed", *fields] + (["--", text] if text else [])
    assert vm.run(*args).returncode == 0
    raw = vm.serial.read_bytes()
    assert all(len(ln) <= protocol.MAX_LINE for ln in raw.splitlines())
    (ev,) = vm.events()
    assert ev.event == "setup_failed"
    for k, v in ev.fields:
        assert protocol.sanitize_value(v) == v  # already in the value alphabet
    if text:
        assert ev.text and set(ev.text) <= set(protocol.sanitize_text(text) + ".")
    assert read_phase(vm.state) == "setup_failed"


# ---------------------------------------------------------------------------------------------
# Installing from a wheelhouse URL (no baked agent): download, unpack, venv, pip --no-index.


def _dep_wheel(dest: Path) -> Path:
    """A tiny real dependency wheel (gcewd_dep 1.0), to be pinned by hash in requirements.lock."""
    files = {
        "gcewd_dep.py": "VALUE = 1\n",
        "gcewd_dep-1.0.dist-info/METADATA": (
            "Metadata-Version: 2.1\nName: gcewd-dep\nVersion: 1.0\n"
        ),
        "gcewd_dep-1.0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    return _zip_wheel(dest / "gcewd_dep-1.0-py3-none-any.whl", "gcewd_dep-1.0", files)


def _zip_wheel(whl: Path, distinfo: str, files: dict[str, str]) -> Path:
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{distinfo}.dist-info/RECORD,,")
    files[f"{distinfo}.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(whl, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return whl


def _wheelhouse(tmp_path: Path, tamper: bool = False) -> tuple[Path, str]:
    """served/wheelhouse.tar.gz: the shim agent wheel, one dependency wheel and requirements.lock
    pinning that dependency by hash (wrong hash when tamper); returns (served dir, tar sha256)."""
    house = tmp_path / "house"
    house.mkdir()
    _shim_wheel(house)
    dep = _dep_wheel(house)
    digest = hashlib.sha256(dep.read_bytes()).hexdigest()
    if tamper:
        digest = "0" * 64
    (house / "requirements.lock").write_text(f"gcewd-dep==1.0 --hash=sha256:{digest}\n")
    served = tmp_path / "served"
    served.mkdir()
    tar = served / "wheelhouse.tar.gz"
    with tarfile.open(tar, "w:gz") as t:
        for f in sorted(house.iterdir()):
            t.add(f, arcname=f"wheelhouse/{f.name}")
    return served, hashlib.sha256(tar.read_bytes()).hexdigest()


def _shim_wheel(dest: Path) -> Path:
    """A hand-built gce-watchdog wheel whose console script runs this checkout's agent.

    The real wheel's dependencies cannot be fetched offline; the install mechanics (download,
    unpack, venv, pip --no-index --require-hashes, the console script) are what is under test.
    """
    files = {
        "gcewd_shim.py": (
            "import os, sys\n"
            f"def main():\n    os.execv({PY!r}, [{PY!r}, '-m', 'gce_watchdog', *sys.argv[1:]])\n"
        ),
        "gce_watchdog-0.1.0.dist-info/METADATA": (
            "Metadata-Version: 2.1\nName: gce-watchdog\nVersion: 0.1.0\n"
        ),
        "gce_watchdog-0.1.0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        "gce_watchdog-0.1.0.dist-info/entry_points.txt": (
            "[console_scripts]\ngce-watchdog = gcewd_shim:main\n"
        ),
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append("gce_watchdog-0.1.0.dist-info/RECORD,,")
    files["gce_watchdog-0.1.0.dist-info/RECORD"] = "\n".join(record) + "\n"
    whl = dest / "gce_watchdog-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return whl


@pytest.mark.slow
def test_install_from_wheelhouse_url(vm: Vm, tmp_path: Path) -> None:
    served, digest = _wheelhouse(tmp_path)
    with StaticFileServer(served) as files:
        # user:TOKEN@ in the URL: the host is still 127.0.0.1, and TOKEN is never shown.
        url = f"http://alice:TOKEN123@127.0.0.1:{files.port}/wheelhouse.tar.gz?sig=SIG456"
        vm.mds.set_attribute("gce-watchdog-wheel-url", url)
        vm.mds.set_attribute("gce-watchdog-wheel-sha256", digest)
        vm.mds.set_attribute("gce-watchdog-workload", json.dumps([PY, "-c", "pass"]))
        vm.env["GCEWD_DNS_NAME"] = ""  # default: the wheel URL's host (127.0.0.1)
        # Every curl command line, as any local user sees it in /proc/PID/cmdline meanwhile.
        shims, argv_log = tmp_path / "shims", tmp_path / "curl-argv.log"
        shims.mkdir()
        real_curl = shutil.which("curl")
        assert real_curl, "curl is needed by the start-up script"
        (shims / "curl").write_text(
            f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{argv_log}"\nexec "{real_curl}" "$@"\n'
        )
        (shims / "curl").chmod(0o755)
        vm.env["PATH"] = f"{shims}:{vm.env.get('PATH', os.environ['PATH'])}"
        p = vm.run(timeout=300)
        assert p.returncode == 0, p.stderr
        argv = argv_log.read_text()
        assert "wheelhouse" in argv or "-K" in argv, f"the download never ran curl: {argv}"
        for secret in ("TOKEN123", "SIG456", "alice"):
            assert secret not in argv, f"{secret} on a curl command line: {argv}"
        evs = vm.events()
        fetch = [e for e in evs if e.event == "fetch"]
        assert [e.get("out") for e in fetch] == ["ok"]
        inst = next(e for e in evs if e.event == "bootstrap_step" and e.get("step") == "install")
        assert "installed from http" in inst.text
        assert _phases(evs) == ["bootstrap", "workload", "done"]
        assert (vm.root / "opt/gce-watchdog/bin/gce-watchdog").exists()
        # The pinned dependency came from the wheelhouse, by hash.
        dep = vm.root / "opt/gce-watchdog/bin/python"
        assert subprocess.run([str(dep), "-c", "import gcewd_dep"], timeout=60).returncode == 0
        marker = vm.root / "opt/gce-watchdog/.installed-from"
        assert marker.stat().st_mode & 0o777 == 0o600
        assert digest in marker.read_text()
        for secret in ("TOKEN123", "SIG456", "alice"):
            assert secret not in p.stderr and secret.encode() not in vm.serial.read_bytes()
            assert secret not in marker.read_text()
        # The next boot reuses the install instead of downloading again.
        p = vm.run(timeout=300)
        assert p.returncode == 0, p.stderr
        inst = [e for e in vm.events() if e.get("step") == "install"][-1]
        assert "already installed" in inst.text
        assert len([e for e in vm.events() if e.event == "fetch"]) == 1


@pytest.mark.slow
def test_tampered_dependency_is_refused_by_its_hash(vm: Vm, tmp_path: Path) -> None:
    served, digest = _wheelhouse(tmp_path, tamper=True)
    with StaticFileServer(served) as files:
        vm.mds.set_attribute("gce-watchdog-wheel-url", f"{files.base}/wheelhouse.tar.gz")
        vm.mds.set_attribute("gce-watchdog-wheel-sha256", digest)
        p = vm.run(timeout=300)
    assert p.returncode != 0
    (sf,) = [e for e in vm.events() if e.event == "setup_failed"]
    assert (sf.get("step"), sf.get("cause")) == ("install", "job"), sf
    assert "require-hashes" in sf.text
    assert not (vm.root / "opt/gce-watchdog/.installed-from").exists()


def test_no_source_is_setup_failed_job_and_no_index_is_asked(vm: Vm) -> None:
    p = vm.run()
    assert p.returncode == 78, p.stderr
    (sf,) = [e for e in vm.events() if e.event == "setup_failed"]
    assert (sf.get("step"), sf.get("rc"), sf.get("cause")) == ("install", "78", "job")
    assert "no agent source" in sf.text
    assert "pip" not in p.stderr and not (vm.root / "opt/gce-watchdog").exists()


WHEEL, WHEEL_SHA = "gce-watchdog-wheel-url", "gce-watchdog-wheel-sha256"


@pytest.mark.parametrize(
    ("attrs", "why"),
    [
        ({WHEEL: "http://127.0.0.1:9/wheelhouse.tar"}, "sha256"),
        ({WHEEL: "http://127.0.0.1:9/w.tar", WHEEL_SHA: "ab"}, "sha256"),
        ({"gce-watchdog-deb-url": "http://127.0.0.1:9/a.deb"}, "sha256"),
        ({WHEEL: "http://127.0.0.1:9/a.whl", WHEEL_SHA: "a" * 64}, "wheelhouse"),
    ],
    ids=["wheel-no-sha", "wheel-short-sha", "deb-no-sha", "lone-wheel"],
)  # fmt: skip
def test_unpinned_sources_are_refused_before_any_download(
    vm: Vm, attrs: dict[str, str], why: str
) -> None:
    for k, v in attrs.items():
        vm.mds.set_attribute(k, v)
    vm.env["GCEWD_DNS_NAME"] = "localhost"
    p = vm.run()
    assert p.returncode == 64, p.stderr
    evs = vm.events()
    (sf,) = [e for e in evs if e.event == "setup_failed"]
    assert (sf.get("step"), sf.get("cause")) == ("install", "job") and why in sf.text
    assert not [e for e in evs if e.event == "fetch"], "nothing downloaded"


def test_deb_source_is_checked_then_given_to_dpkg(vm: Vm, tmp_path: Path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    deb = served / "gce-watchdog.deb"
    deb.write_bytes(b"!<arch>\nnot really a package\n")
    digest = hashlib.sha256(deb.read_bytes()).hexdigest()
    # dpkg stand-in: records what it was given and "installs" the agent (the real .deb is
    # installed by dpkg in tests/e2e: the chroot test and the VM's wedge scenario).
    fake = tmp_path / "dpkg"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > "{tmp_path}/dpkg-args"\n'
        f'sha256sum "$3" | cut -d" " -f1 > "{tmp_path}/dpkg-sha"\n'
        f'mkdir -p "{vm.root}/opt/gce-watchdog/bin"\n'
        f"printf '#!/bin/sh\\nexec {PY} -m gce_watchdog \"$@\"\\n' > "
        f'"{vm.root}/opt/gce-watchdog/bin/gce-watchdog"\n'
        f'chmod 755 "{vm.root}/opt/gce-watchdog/bin/gce-watchdog"\n'
    )
    fake.chmod(0o755)
    vm.env["GCEWD_DPKG"] = str(fake)
    with StaticFileServer(served) as files:
        vm.mds.set_attribute("gce-watchdog-deb-url", f"{files.base}/gce-watchdog.deb")
        vm.mds.set_attribute("gce-watchdog-deb-sha256", "0" * 64)
        bad = vm.run()
        assert bad.returncode == 65, bad.stderr
        assert not (tmp_path / "dpkg-args").exists(), "a mismatching package never reaches dpkg"
        (sf,) = [e for e in vm.events() if e.event == "setup_failed"]
        assert (sf.get("rc"), sf.get("cause")) == ("65", "job")
        vm.mds.set_attribute("gce-watchdog-deb-sha256", digest)
        vm.mds.set_attribute("gce-watchdog-workload", json.dumps([PY, "-c", "pass"]))
        p = vm.run()
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "dpkg-args").read_text().startswith("-i --force-confold ")
    assert (tmp_path / "dpkg-sha").read_text().strip() == digest
    inst = [e for e in vm.events() if e.event == "bootstrap_step" and e.get("step") == "install"]
    assert inst and "installed from http" in inst[-1].text


def test_download_that_gives_up_is_infra(vm: Vm) -> None:
    vm.mds.set_attribute("gce-watchdog-wheel-url", "http://127.0.0.1:9/wheelhouse.tar")
    vm.mds.set_attribute("gce-watchdog-wheel-sha256", "a" * 64)
    vm.env["GCEWD_DOWNLOAD_DEADLINE"] = "3"
    p = vm.run()
    assert p.returncode == 75, p.stderr
    (sf,) = [e for e in vm.events() if e.event == "setup_failed"]
    assert (sf.get("step"), sf.get("rc"), sf.get("cause")) == ("install", "75", "infra")


def test_wheel_url_404_is_setup_failed_install(vm: Vm, tmp_path: Path) -> None:
    with StaticFileServer(tmp_path) as files:
        vm.mds.set_attribute("gce-watchdog-wheel-url", f"{files.base}/missing.tar")
        vm.mds.set_attribute("gce-watchdog-wheel-sha256", "a" * 64)
        p = vm.run()
    assert p.returncode == 69, p.stderr
    evs = vm.events()
    (sf,) = [e for e in evs if e.event == "setup_failed"]
    assert (sf.get("step"), sf.get("rc")) == ("install", "69") and "404" in sf.text
    assert sf.get("cause") == "job", "a 404 is the job's configuration, not the network"
    (f,) = [e for e in evs if e.event == "fetch"]
    assert (f.get("out"), f.get("att")) == ("refused", "1")


def test_bake_image_refuses_unpinned_and_non_image_roots(vm: Vm, tmp_path: Path) -> None:
    # A working bake (the agent runs inside the image) is tested in tests/e2e/test_deb_chroot.py
    # against a real Debian 12 tree; here: what it refuses, before writing anything.
    house = tmp_path / "house"
    house.mkdir()
    _shim_wheel(house)
    env = {**vm.env, "GCEWD_ROOT": ""}
    cases = [
        ["--spec", "gce-watchdog"],  # from an index: unpinned
        ["--wheel", str(house / "gce_watchdog-0.1.0-py3-none-any.whl")],
        ["--wheelhouse", str(house)],  # no requirements.lock
        ["--bogus"],
        [],
    ]
    (house / "requirements.lock").write_text("")
    cases.append(["--wheelhouse", str(house), "--root", str(vm.root)])  # no /bin/sh there
    (house / "requirements.lock").unlink()
    for args in cases:
        before = sorted(p.relative_to(vm.root) for p in vm.root.rglob("*"))
        p = subprocess.run(
            ["bash", str(BAKE), *args], env=env, capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 64, (args, p.stderr)
        assert sorted(q.relative_to(vm.root) for q in vm.root.rglob("*")) == before, args


def test_unit_step_runs_gce_watchdog_install_when_systemd_runs(vm: Vm) -> None:
    if shutil.which("systemctl") is None:
        pytest.skip("systemctl not installed")
    vm.bake()
    (vm.root / "run/systemd/system").mkdir(parents=True)  # "systemd is running"
    p = vm.run()
    assert p.returncode == 0, p.stderr
    unit = next(e for e in vm.events() if e.get("step") == "unit")
    assert unit.get("st") == "ok", p.stderr
    assert (vm.root / "etc/systemd/system/gce-watchdog.service").is_file()


def test_script_emitter_keeps_a_line_with_long_fields_within_the_limit(vm: Vm) -> None:
    # download()'s outcome line with a 40-character host and a long wheel file name: the fields
    # alone are over 184 bytes, and a reader rejects an over-long line as a whole.
    fields = [
        "out=gave_up",
        "att=123",
        "host=" + "h" * 40,
        "dst=" + "d" * 64,
        "rc=75",
        "dur=600",
        "supp=10",
    ]
    assert vm.run("emit", "fetch", *fields, "--", "gave up").returncode == 0
    raw = vm.serial.read_bytes()
    assert all(len(ln) <= protocol.MAX_LINE for ln in raw.splitlines())
    (ev,) = vm.events()
    assert [k for k, _ in ev.fields] == ["out", "att", "host", "dst", "rc", "dur", "supp", "bc"]
    assert ev.get("out") == "gave_up" and ev.get("rc") == "75"
    assert ev.get("bc") == "1"  # the boot counter is never the value shortened


def test_credentials_in_urls_and_step_arguments_stay_off_the_console(
    vm: Vm, tmp_path: Path
) -> None:
    # The runner copies the script's stderr to the serial console, readable by anyone allowed
    # getSerialPortOutput: a signed URL's signature or a token argument must not show there.
    vm.bake()
    vm.mds.set_attribute(
        "gce-watchdog-bootstrap", json.dumps([[PY, "-c", "pass", "--token", "s3cr3t-arg"]])
    )
    vm.mds.set_attribute("gce-watchdog-workload", json.dumps([PY, "-c", "pass"]))
    p = vm.run()
    assert p.returncode == 0, p.stderr
    assert "s3cr3t" not in p.stderr and b"s3cr3t" not in vm.serial.read_bytes()
    # Not baked: install from a (missing) signed URL.
    (vm.root / "opt/gce-watchdog/.baked").unlink()
    with StaticFileServer(tmp_path) as files:
        url = f"http://u:s3cr3t-pw@127.0.0.1:{files.port}/missing.tar?X-Goog-Signature=s3cr3t-sig"
        vm.mds.set_attribute("gce-watchdog-wheel-url", url)
        vm.mds.set_attribute("gce-watchdog-wheel-sha256", "a" * 64)
        p = vm.run()
    assert p.returncode == 69, p.stderr
    assert "missing.tar" in p.stderr
    assert "s3cr3t" not in p.stderr and b"s3cr3t" not in vm.serial.read_bytes()


@pytest.mark.parametrize("failing", ["false", "false 'two\nlines'"])
def test_failure_inside_command_substitution_is_reported_once(vm: Vm, failing: str) -> None:
    """set -E runs the ERR trap inside a command substitution too; the subshell must hand its
    failure to the main shell instead of reporting it: one setup_failed line, one failure action,
    and the innermost detail (the command that failed, not the assignment)."""
    code = f"""
source {SCRIPT}
STATE_DIR={vm.state}; mkdir -p "$STATE_DIR"; FAIL_NOTE=$STATE_DIR/.startup-failure
STEP=probe
inner() {{ {failing}; echo not-reached; }}
trap 'on_error $? $LINENO "$BASH_COMMAND"' ERR
value=$(inner)
echo "still running: $value"
"""
    p = subprocess.run(["bash", "-c", code], env=vm.env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.returncode == 1, p.stderr
    assert "still running" not in p.stdout
    failed = [e for e in vm.events() if e.event == "setup_failed"]
    assert len(failed) == 1, [e.text for e in failed]
    assert failed[0].get("step") == "probe"
    assert failing.replace("\n", " ") in failed[0].text  # whole, a newline in it or not
    assert vm.actions == SCRIPT_END  # no agent here: the script's own end of life
    assert not (vm.state / ".startup-failure").exists()


# -- the gce-watchdog-config attribute: checked, then a drop-in ------------------------------------


def _show(vm: Vm) -> str:
    cfg = vm.root / "etc/gce-watchdog/config.toml"
    p = subprocess.run(
        [PY, "-m", "gce_watchdog", "config", "show", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_config_attribute_becomes_a_checked_root_only_drop_in(vm: Vm) -> None:
    vm.bake()
    # A value a shell would act on: it only ever goes into a file.
    md = (
        '[agent]\naction = "dry-run"\nthreshold = 3\n'
        '[memory]\non_climb = "command"\nclimb_command = ["sh", "-c", "$(touch pwned) `touch x`"]\n'
    )
    vm.mds.set_attribute("gce-watchdog-config", md)
    vm.mds.set_attribute("gce-watchdog-workload", json.dumps([PY, "-c", "pass"]))
    p = vm.run()
    assert p.returncode == 0, p.stderr
    dropin = vm.root / "etc/gce-watchdog/config.d/50-metadata.toml"
    assert dropin.read_text() == md
    assert dropin.stat().st_mode & 0o777 == 0o600
    assert not list(dropin.parent.glob(".*"))  # no temporary file left beside it
    assert not (vm.root / "pwned").exists() and not Path("pwned").exists()
    step = next(e for e in vm.events() if e.get("step") == "config")
    assert step.get("st") == "ok" and "written to 50-metadata.toml" in step.text
    names = [e.get("step") for e in vm.events() if e.event == "bootstrap_step"]
    assert names.index("install") < names.index("config") < names.index("unit")
    shown = _show(vm)
    assert f'action = "dry-run"  # {dropin}' in shown
    assert f"threshold = 3  # {dropin}" in shown
    assert f'state_dir = "{vm.state}"  # {vm.root}/etc/gce-watchdog/config.toml' in shown

    # The next boot with the same value: nothing rewritten.
    p = vm.run()
    assert p.returncode == 0, p.stderr
    last = [e for e in vm.events() if e.get("step") == "config"][-1]
    assert "unchanged" in last.text
    # The attribute removed: the drop-in it owns goes too.
    vm.mds.set_attribute("gce-watchdog-config", None)
    p = vm.run()
    assert p.returncode == 0, p.stderr
    assert not dropin.exists()
    assert "threshold = 10  # default" in _show(vm)


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("[agent]\nthreshold = 0\nintervall = 3\n", "agent.threshold: must be between 1 and"),
        ("[agent\n", "not valid TOML"),
        ('[agent]\nprobe_timeout = "40s"\n', "agent.probe_timeout: must be less than"),
    ],
)
def test_a_bad_config_attribute_is_setup_failed_job_and_the_agent_never_sees_it(
    vm: Vm, value: str, want: str
) -> None:
    vm.bake()
    marker = vm.root / "ran"
    vm.mds.set_attribute("gce-watchdog-config", value)
    vm.mds.set_attribute(
        "gce-watchdog-workload", json.dumps([PY, "-c", f"open({str(marker)!r}, 'w')"])
    )
    p = vm.run()
    assert p.returncode == 78, p.stderr
    (sf,) = [e for e in vm.events() if e.event == "setup_failed"]
    assert (sf.get("step"), sf.get("rc"), sf.get("cause")) == ("config", "78", "job")
    # the first error, key path first (the line has room for ~30 bytes of text)
    assert sf.text.startswith(want.split(":")[0]), sf.text
    assert not sf.text.startswith("gce-watchdog-config: gce-watchdog-config")
    # every error, with the attribute's name for the file, on the console (stderr)
    assert "refused by gce-watchdog config check" in p.stderr
    assert want in p.stderr and "gce-watchdog-config: " in p.stderr
    assert "/tmp" not in sf.text  # the candidate's temporary path is not what the operator set
    assert not (vm.root / "etc/gce-watchdog/config.d/50-metadata.toml").exists()
    assert not marker.exists()  # no workload, no agent with the defaults instead
    assert vm.actions == AGENT_END  # the failure action, through the baked agent


def test_a_bad_config_attribute_leaves_the_last_good_drop_in_alone(vm: Vm) -> None:
    vm.bake()
    vm.mds.set_attribute("gce-watchdog-config", "[agent]\nthreshold = 4\n")
    assert vm.run().returncode == 0
    dropin = vm.root / "etc/gce-watchdog/config.d/50-metadata.toml"
    vm.mds.set_attribute("gce-watchdog-config", "[agent]\nthreshold = -1\n")
    assert vm.run().returncode == 78
    assert dropin.read_text() == "[agent]\nthreshold = 4\n"


# -- the end of life (issue 24) --------------------------------------------------------------------


def _steps(evs: list[protocol.Event]) -> list[tuple[str | None, str | None]]:
    return [(e.get("step"), e.get("status")) for e in evs if e.event == "action"]


@pytest.mark.parametrize(("code", "reason"), [("pass", "done"), ("raise SystemExit(3)", "failed")])
def test_done_action_poweroff_ends_through_the_agent_chain(vm: Vm, code: str, reason: str) -> None:
    vm.bake()
    vm.mds.set_attribute("gce-watchdog-workload", json.dumps([PY, "-c", code]))
    vm.mds.set_attribute("gce-watchdog-done-action", "poweroff")
    vm.mds.set_attribute("gce-watchdog-linger", "1s")
    p = vm.run()
    assert p.returncode == (0 if reason == "done" else 3), p.stderr
    evs = vm.events()
    names = [e.event for e in evs]
    i_exit, i_end = names.index("exit"), names.index("end")
    i_done = next(i for i, e in enumerate(evs) if e.event == "phase" and e.get("ph") == "done")
    assert i_exit < i_done < i_end, "the end of life comes after the terminal lines"
    end = evs[i_end]
    assert (end.get("reason"), end.get("action")) == (reason, "poweroff")
    assert end.get("chain") == "linger+poweroff+force"
    steps = _steps(evs)
    assert steps.index(("linger", "ok")) < steps.index(("poweroff", "start"))
    linger = next(e for e in evs if e.get("step") == "linger" and e.get("status") == "start")
    assert linger.get("ms") == "1000", "gce-watchdog-linger reaches the agent's chain"
    assert "shutdown" not in names
    assert vm.actions == AGENT_END
    assert not (vm.root / "sysrq").exists()


def test_done_action_none_leaves_the_vm_up(vm: Vm) -> None:
    vm.bake()
    vm.mds.set_attribute("gce-watchdog-workload", json.dumps([PY, "-c", "pass"]))
    assert vm.run().returncode == 0
    assert "end" not in [e.event for e in vm.events()] and vm.actions == []


def test_without_an_agent_the_script_ends_the_vm_itself(vm: Vm) -> None:
    # No agent source: the install fails (cause job) before any agent exists.
    vm.mds.set_attribute("gce-watchdog-linger", "inf")  # refused: the default (0 in tests)
    p = vm.run()
    assert p.returncode == 78, p.stderr
    evs = vm.events()
    names = [e.event for e in evs]
    assert names.index("setup_failed") < names.index("end")
    end = evs[names.index("end")]
    assert (end.get("reason"), end.get("action")) == ("setup_failed", "poweroff")
    assert "gce-watchdog-linger 'inf' is not 0 to 1h" in p.stderr
    assert vm.actions == SCRIPT_END
    assert (vm.root / "sysrq").read_text() == "o\n", "the last resort: sysrq o"


def test_expect_result_from_metadata_marks_a_silent_job_missing(vm: Vm) -> None:
    vm.bake()
    vm.mds.set_attribute("gce-watchdog-workload", json.dumps([PY, "-c", "pass"]))
    vm.mds.set_attribute("gce-watchdog-expect-result", "true")
    assert vm.run().returncode == 0
    ex = next(e for e in vm.events() if e.event == "exit")
    assert (ex.get("rc"), ex.get("result")) == ("0", "missing")
