"""Boot the e2e guest under qemu inside a private network namespace with a simulated GCE around it.

The guest image (``e2e/build-image.sh``) is a stock Debian minbase plus a GCE-like start-up script
runner; nothing of the agent is baked in. Each run:

1. creates a fresh namespace pair with the shared harness (``tests/kit/netns.py``) and adds a tap
   device to its ``gce`` side (169.254.169.254/16 on the tap: metadata, DNS, the guest's gateway);
2. starts ``python -m testing.simgce`` there: metadata on 169.254.169.254:80 (the scenario's
   attributes, ``startup-script`` among them), DNS on 169.254.169.254:53, the 443 stand-in and the
   wheelhouse file server on 192.0.2.10 (:443, :80), names ``egress.test`` / ``wheels.test``;
3. boots qemu (TCG unless asked for KVM) in that namespace with ``-snapshot`` and ``-no-reboot``,
   serial port 1 on a unix socket the harness listens on (:class:`SerialConsole`: it drains the
   output into ``serial.log`` byte for byte and can type on ttyS0), and waits (bounded) until the
   guest powers off.

Use from tests (``tests/e2e``) or by hand: ``python -m e2e.vm --help`` (docs/e2e.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from gce_watchdog.wire.line import MARKER_BYTES

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from kit.netns import (  # noqa: E402
    EGRESS_IP,
    EGRESS_NAME,
    METADATA_IP,
    SimHandle,
    Topology,
    netns_unavailable,
)

BUILD = REPO / "build" / "e2e"
IMAGE_DIR = BUILD / "image"
BAKED_IMAGE_DIR = BUILD / "image-baked"  # IMAGE_DIR with the run's agent baked in (--bake)
WWW_DIR = BUILD / "www"  # served by the fake GCE on 192.0.2.10:80 (wheels.test)

# The guest's static address (e2e/guest/etc/systemd/network/10-e2e.network): link-local, like the
# metadata server it talks to; its gateway and resolver are 169.254.169.254.
GUEST_ADDR = "169.254.10.2"
TAP = "e2etap0"
WHEELS_NAME = "wheels.test"  # resolved by the fake DNS to EGRESS_IP; the file server is on :80
WHEEL_URL = f"http://{WHEELS_NAME}/wheelhouse.tar"  # the gce-watchdog-wheel-url attribute
DEB_URL = f"http://{WHEELS_NAME}/gce-watchdog.deb"  # the gce-watchdog-deb-url attribute (make deb)
FILES_PORT = 80
FWCFG_PREFIX = "opt/gce-e2e"

# Bounded waits. A TCG boot to the start-up script takes ~20-30 s on an idle 2-core machine; the
# default budget leaves room for a busy machine and for a scenario's own run time.
DEFAULT_TIMEOUT = 300.0
SERIAL_POLL = 0.5  # seconds between looks at the serial log while waiting (timestamps only)
QUIET_KILL_S = 60.0  # past its budget, a guest whose console wrote nothing for this long is killed
HARD_CAP_FACTOR = 2.0  # ... and any guest at this many times its budget
QEMU_KILL_WAIT = 10.0
CONSOLE_ACCEPT_WAIT = 30.0  # qemu connects to the console socket while it starts, before the guest
CONSOLE_CLOSE_WAIT = 10.0  # for the reader to see EOF once qemu has exited

# The agent config.toml sections every scenario shares (the image's runner installs the file from
# fw_cfg; a GCE image has none): the fake internet's 443 stand-in (192.0.2.10, resolved by the
# fake GCE's DNS like a real name), a 6 s linger after a shutdown decision, no memory watch (a
# 1 GiB guest). Scenarios put their own [agent] section before it.
FAKE_INTERNET_CONFIG = """\
[egress]
targets = ["egress.test:443"]
dns_timeout = "500ms"

[actions]
linger = "6s"
repeat_every = "2s"

[memory]
enabled = false
"""

# The serial-console test user of the image (e2e/build-image.sh creates it; these must match).
# It exists in the e2e test image only, never on a GCE image (docs/e2e.md).
CONSOLE_USER = "gcewd-e2e"
CONSOLE_PASSWORD = "e2e-serial-console"  # noqa: S105 (a test image's, published)
# The login session's bounds: Enter presses to get a login prompt, seconds per prompt, seconds for
# the login itself (PAM, logind, the shell under TCG) and for any other step.
LOGIN_TRIES = 5
LOGIN_PROMPT_WAIT = 20.0
LOGIN_WAIT = 90.0
STEP_WAIT = 30.0
# agetty's prompt (/etc/hostname is gce-e2e) and the user's bash prompt (Debian's /etc/skel/.bashrc
# PS1 without colour, TERM=vt220 on the serial getty).
LOGIN_PROMPT = b"gce-e2e login: "
SHELL_PROMPT = f"{CONSOLE_USER}@gce-e2e:~$ ".encode()

# Lines whose first appearance is timed (wall seconds since qemu started), for the reports.
MILESTONES: Mapping[str, bytes] = {
    "kernel": b"Linux version",
    "systemd": b"systemd[1]: ",
    "startup_runner": b"gce-startup: ",
    "startup_script": b"gce-startup: running startup-script",
    # the wire format's own marker (wire/line.py), so a protocol bump cannot leave this behind
    "first_gcewd": MARKER_BYTES + b" ",
}


class E2EError(RuntimeError):
    """The harness itself failed (image build, namespace, qemu start); the message says how."""


def unavailable() -> str | None:
    """None when this machine can boot the e2e guest, else the reason (for pytest.skip)."""
    if os.geteuid() != 0:
        return "e2e needs root (network namespaces, tap devices, debootstrap)"
    why = netns_unavailable()
    if why:
        return why
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 missing: `make e2e` installs qemu-system-x86"
    if not Path("/dev/net/tun").exists():
        return "/dev/net/tun missing: tap devices unavailable"
    if not (IMAGE_DIR / "disk.img").exists():
        for tool in ("debootstrap", "mkfs.ext4"):
            if shutil.which(tool) is None:
                return f"{tool} missing and no image built: `make e2e` installs it"
    return None


@dataclass(frozen=True)
class Image:
    """A built guest: raw root filesystem, kernel and initrd taken from it, its Python version."""

    disk: Path
    kernel: Path
    initrd: Path
    python: str
    build_s: float = 0.0

    @classmethod
    def ensure(cls, out: Path = IMAGE_DIR, bake: Path | None = None) -> Image:
        """Build the image (or reuse the cached one) with e2e/build-image.sh; ``bake``: a
        wheelhouse directory whose agent is pre-installed in it (``--bake``)."""
        t0 = time.monotonic()
        extra = ["--bake", str(bake)] if bake is not None else []
        r = subprocess.run(
            ["bash", str(REPO / "e2e" / "build-image.sh"), str(out), *extra],
            capture_output=True,
            text=True,
            timeout=1500,  # debootstrap ~2-5 min; this only stops a wedged mirror
            check=False,
        )
        if r.returncode != 0:
            raise E2EError(f"e2e/build-image.sh failed rc={r.returncode}:\n{r.stderr[-4000:]}")
        return cls(
            disk=out / "disk.img",
            kernel=out / "vmlinuz",
            initrd=out / "initrd.img",
            python=(out / "guest-python").read_text().strip(),
            build_s=time.monotonic() - t0,
        )


# The Python packaging/requirements.lock pins wheels for (build-wheelhouse.sh refuses another).
LOCK_PYTHON = "3.11"


# `make e2e` prepares the image and the wheelhouse in a step of their own (a test's timeout
# must not count minutes of debootstrap), then runs pytest with the same token in this
# variable: the fixture's prepare() then reuses that step's wheelhouse (its .deb is not built
# twice). A token that does not match (another run, or none) builds it again.
PREPARED_ENV = "GCEWD_E2E_PREPARED"
PREPARED = WWW_DIR / "prepared.json"


def prepare() -> tuple[Image, Path, float]:
    """The image and the wheelhouse, built side by side (the debootstrap and the .deb's build
    tree take minutes each, and neither needs the other): (image, www, wheelhouse seconds).
    The wheelhouse is for the lock's Python; a guest with another one is refused once the
    image says which it has."""
    token = os.environ.get(PREPARED_ENV, "")
    try:
        done = json.loads(PREPARED.read_text())
    except (OSError, ValueError):
        done = {}
    if token and done.get("token") == token:
        image = Image.ensure()  # the step's image: its key check reuses it
        took = float(done.get("wheelhouse_s", 0.0))
    else:

        def timed() -> tuple[Path, float]:
            t0 = time.monotonic()
            return build_wheelhouse(LOCK_PYTHON), time.monotonic() - t0

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            www = pool.submit(timed)
            image = Image.ensure()
            _, took = www.result()
        PREPARED.write_text(json.dumps({"token": token, "wheelhouse_s": round(took, 1)}) + "\n")
    if image.python != LOCK_PYTHON:
        raise E2EError(f"the guest has Python {image.python}; the lock is for {LOCK_PYTHON}")
    return image, WWW_DIR, took


def build_wheelhouse(python: str, out: Path = WWW_DIR) -> Path:
    """out/wheelhouse.tar (WHEEL_URL: the agent's wheel from this tree, requirements.lock and the
    dependencies it pins by hash, for the guest's ``python``) and out/gce-watchdog.deb (DEB_URL,
    packaging/build-deb.sh), each with a .sha256 beside it; returns out, the file server's
    root."""
    r = subprocess.run(
        ["bash", str(REPO / "e2e" / "build-wheelhouse.sh"), str(out), python],
        capture_output=True,
        text=True,
        timeout=600,  # a cold dependency download; warm runs take seconds
        check=False,
    )
    if r.returncode != 0:
        raise E2EError(f"e2e/build-wheelhouse.sh failed rc={r.returncode}:\n{r.stderr[-4000:]}")
    return out


@dataclass(frozen=True)
class VmSpec:
    """One boot: what the fake GCE serves and how long the guest may take to power off."""

    name: str
    startup_script: str
    attributes: Mapping[str, str] = field(default_factory=dict)
    # A resolver that comes up late, timed by the guest, never by the harness: the fake DNS ignores
    # the guest's first dns_silent_queries queries, and then every query until dns_after seconds
    # after the guest's first one. Every query is logged to sim/simgce.log (`dns TS NAME how`).
    dns_silent_queries: int = 0
    dns_after: float = 0.0
    dns_never: bool = False
    config: str | None = None  # the agent's config.toml, installed by the image's runner
    startup_env: Mapping[str, str] = field(default_factory=dict)  # GCEWD_* for the script
    # More fw_cfg files, NAME -> content, written 0600 (e.g. a secret: never in metadata, never on
    # the console); the guest reads /sys/firmware/qemu_fw_cfg/by_name/opt/gce-e2e/NAME/raw.
    fw_secrets: Mapping[str, str] = field(default_factory=dict)
    # The boot's budget: past it, a guest whose console has been quiet for QUIET_KILL_S is
    # killed (a wedged or hung guest); one that still writes goes on to power off by itself, up
    # to HARD_CAP_FACTOR x timeout (a loaded host's TCG guest is slow, not wedged: a boot that
    # took 450 s of 480 beside a second `make test` took over 480 the next time).
    timeout: float = DEFAULT_TIMEOUT
    # Boot the image with this run's agent baked in (Harness.baked_image): the start-up script
    # skips the download and install. For the scenarios about the agent, not its install.
    baked: bool = False
    memory_mb: int = 1024
    smp: int = 2  # faster to boot than 1 under TCG (33 s vs 40 s measured)
    kvm: bool = field(default_factory=lambda: os.environ.get("E2E_KVM") == "1")
    # What the metadata server says the VM is (default: e2e-NAME, simgce's id and project); a
    # VM behind the fake Compute API gets that instance's name, id and project.
    instance_name: str | None = None
    instance_id: str | None = None
    project_id: str | None = None


@dataclass(frozen=True)
class VmResult:
    name: str
    outdir: Path
    serial_log: Path
    qemu_rc: int | None
    timed_out: bool
    wall_s: float
    milestones: Mapping[str, float]
    # What the console session (run()'s ``console``) raised, if anything; None when it ran to the
    # end or there was none.
    console_error: str | None = None
    # run()'s ``stop`` was set while the VM ran and qemu was killed (e.g. instances.delete).
    stopped: bool = False

    def serial(self) -> bytes:
        return self.serial_log.read_bytes() if self.serial_log.exists() else b""

    def dns_queries(self) -> list[tuple[str, bool]]:
        """(name, answered) for every query the fake DNS got from the guest, in order."""
        path = self.outdir / "sim" / "simgce.log"
        out: list[tuple[str, bool]] = []
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            parts = line.split()
            if len(parts) == 4 and parts[0] == "dns":
                out.append((parts[2], parts[3] == "answered"))
        return out

    def summary(self) -> str:
        ms = " ".join(f"{k}={v:.1f}s" for k, v in self.milestones.items())
        state = "TIMED OUT" if self.timed_out else f"qemu rc={self.qemu_rc}"
        state += " (stopped)" if self.stopped else ""
        return f"{self.name}: {state} after {self.wall_s:.1f}s ({ms}); serial: {self.serial_log}"


def qemu_argv(
    spec: VmSpec,
    image: Image,
    console_sock: Path,
    fw_strings: Mapping[str, str],
    fw_files: Mapping[str, Path],
) -> list[str]:
    accel = ["-accel", "kvm", "-cpu", "host"] if spec.kvm else ["-accel", "tcg"]
    argv = [
        "qemu-system-x86_64",
        "-name", f"gce-e2e-{spec.name}",
        *accel,
        "-m", str(spec.memory_mb),
        "-smp", str(spec.smp),
        "-nodefaults", "-no-user-config", "-display", "none",
        # The guest's poweroff (agent action, start-up script fail handler) ends qemu.
        "-no-reboot",
        "-kernel", str(image.kernel),
        "-initrd", str(image.initrd),
        # console= as on GCE images (38400 baud, 8 bits, no parity): the serial getty runs there.
        "-append", "root=/dev/vda rw console=ttyS0,38400n8 panic=-1",
        # -snapshot: every boot starts from the same image; writes go to a temporary overlay.
        "-drive", f"file={image.disk},format=raw,if=virtio",
        "-snapshot",
        "-netdev", f"tap,id=n0,ifname={TAP},script=no,downscript=no",
        "-device", "virtio-net-pci,netdev=n0",
        "-device", "virtio-rng-pci",
        # The DMI product name of a GCE VM: the agent arms only where it says so (issue 16).
        "-smbios", "type=1,product=Google Compute Engine",
        # Serial port 1 (ttyS0) on a unix socket the harness listens on (server=off: qemu
        # connects while it starts, before the guest runs, so no byte precedes the connection).
        # The harness writes serial.log from that stream (SerialConsole), what
        # getSerialPortOutput would return. Not the chardev's logfile=: qemu logs the whole
        # buffer when the back end's write fails, EAGAIN included (chardev/char.c
        # qemu_chr_write_buffer, "log it all right away"), and the 16550 then sends the same byte
        # again (hw/char/serial.c serial_xmit: a G_IO_OUT watch and a retry), so a socket that
        # is full for a moment doubles a byte in the log: measured, one `x` doubled inside a
        # GCEWD3 key line (CRC reject, a seq gap) while the socket stream itself was right.
        "-chardev", f"socket,id=s0,path={console_sock},server=off",
        "-serial", "chardev:s0",
    ]  # fmt: skip
    # Per-run input, read in the guest from /sys/firmware/qemu_fw_cfg/by_name/opt/gce-e2e/NAME/raw.
    # Values and paths must not contain commas (qemu's option separator).
    for name, value in fw_strings.items():
        argv += ["-fw_cfg", f"name={FWCFG_PREFIX}/{name},string={value}"]
    for name, path in fw_files.items():
        argv += ["-fw_cfg", f"name={FWCFG_PREFIX}/{name},file={path}"]
    return argv


def _add_tap(topo: Topology) -> None:
    ns = topo.gce
    for args in (
        ["tuntap", "add", "dev", TAP, "mode", "tap"],
        # A second address on the gce side: 169.254.169.254 is already a /32 on the veth; the /16
        # here gives the connected route to the guest (169.254.10.2). 192.0.2.10 (the 443 and
        # file server address) is reached by the guest through its gateway, 169.254.169.254.
        ["addr", "add", f"{METADATA_IP}/16", "dev", TAP],
        ["link", "set", TAP, "up"],
    ):
        r = subprocess.run(
            ["ip", "-n", ns, *args], capture_output=True, text=True, timeout=10, check=False
        )
        if r.returncode != 0:
            raise E2EError(f"ip -n {ns} {' '.join(args)}: {r.stderr.strip()}")


def _simgce_args(spec: VmSpec, outdir: Path, www: Path) -> list[str]:
    attrs = {"startup-script": spec.startup_script, **spec.attributes}
    args = ["--files", str(www), "--files-addr", f"{EGRESS_IP}:{FILES_PORT}"]
    args += ["--instance-name", spec.instance_name or f"e2e-{spec.name}"]
    if spec.instance_id:
        args += ["--instance-id", spec.instance_id]
    if spec.project_id:
        args += ["--project-id", spec.project_id]
    adir = outdir / "attributes"
    adir.mkdir(parents=True, exist_ok=True)
    for key, value in attrs.items():
        path = adir / key
        path.write_text(value)
        args += ["--attr-file", f"{key}={path}"]
    args += ["--dns-log"]
    if spec.dns_silent_queries > 0:
        args += ["--dns-silent-queries", str(spec.dns_silent_queries)]
    if spec.dns_after > 0:
        args += ["--dns-after", str(spec.dns_after)]
    if spec.dns_never:
        args += ["--dns-never"]
    return args


def _milestones(data: bytes, seen: dict[str, float], now: float) -> None:
    for key, needle in MILESTONES.items():
        if key not in seen and needle in data:
            seen[key] = now


def _fw_files(spec: VmSpec, outdir: Path) -> dict[str, Path]:
    fdir = outdir / "fw_cfg"
    fdir.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    if spec.config is not None:
        files["config.toml"] = fdir / "config.toml"
        files["config.toml"].write_text(spec.config)
    if spec.startup_env:
        files["startup-env"] = fdir / "startup-env"
        files["startup-env"].write_text("".join(f"{k}={v}\n" for k, v in spec.startup_env.items()))
    for name, value in spec.fw_secrets.items():
        path = fdir / name
        path.unlink(missing_ok=True)
        path.touch(mode=0o600)
        path.write_text(value)
        files[name] = path
    return files


CLONE_NEWNET = 0x40000000  # sched.h


def listen_in_netns(ns: str, host: str, port: int) -> socket.socket:
    """A listening TCP socket in network namespace ``ns`` (``ip netns``' /run/netns/NS), made by
    a throwaway thread that setns(2)s into it: a socket stays in the namespace it was made in,
    so a server in this process can serve the guest's side (e.g. the fake Compute API)."""
    made: list[socket.socket | OSError] = []

    def make() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"/run/netns/{ns}", "rb") as f:
                if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({ns}): {os.strerror(err)}")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(16)
            made.append(sock)
        except OSError as e:
            made.append(e)

    t = threading.Thread(target=make, name=f"netns-{ns}")
    t.start()
    t.join(10)
    if not made:
        raise E2EError(f"no socket in {ns} after 10s")
    if isinstance(made[0], OSError):
        raise E2EError(f"listen on {host}:{port} in {ns}: {made[0]}")
    return made[0]


class SerialConsole:
    """The host end of ttyS0: what the guest writes (drained by a reader thread for the whole run
    into ``log``, serial.log, so the guest waits on us as little as possible) and what we type.

    Every wait is bounded in time and wakes on new bytes (a condition variable), never on a
    timer; EOF (qemu gone) ends it at once. ``transcript`` records what was sent and seen, with
    seconds since the connection, for ``console.log``.
    """

    def __init__(self, conn: socket.socket, log: BinaryIO | None = None) -> None:
        self._conn = conn
        self._log = log
        self._buf = bytearray()
        self._eof = False
        self._cond = threading.Condition()
        self._t0 = time.monotonic()
        self.transcript: list[str] = []
        self._reader = threading.Thread(target=self._read, name="serial-console", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = self._conn.recv(65536)
            except OSError:
                chunk = b""
            if chunk and self._log is not None:
                self._log.write(chunk)
                self._log.flush()
            with self._cond:
                if not chunk:
                    self._eof = True
                    self._cond.notify_all()
                    return
                self._buf += chunk
                self._cond.notify_all()

    def note(self, what: str) -> None:
        self.transcript.append(f"{time.monotonic() - self._t0:7.1f}s {what}")

    def mark(self) -> int:
        """The offset of the next byte the guest writes (for ``expect(..., since=)``)."""
        with self._cond:
            return len(self._buf)

    def data(self) -> bytes:
        with self._cond:
            return bytes(self._buf)

    def expect(self, needle: bytes, since: int, timeout: float) -> int:
        """Wait until ``needle`` appears at or after offset ``since``; its end offset. Raises
        E2EError after ``timeout`` seconds or at EOF."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                at = self._buf.find(needle, since)
                if at >= 0:
                    self.note(f"seen {needle!r} at {at}")
                    return at + len(needle)
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    why = "EOF" if self._eof else f"{timeout:.0f}s"
                    tail = bytes(self._buf[max(since, len(self._buf) - 600) :])
                    raise E2EError(f"console: no {needle!r} after offset {since} ({why}): {tail!r}")
                self._cond.wait(left)

    def send(self, data: bytes, shown: str | None = None) -> None:
        self.note(f"sent {shown if shown is not None else repr(data)}")
        self._conn.sendall(data)

    def close(self) -> None:
        """Wait (bounded) for the reader to see EOF once qemu is gone, then close the socket."""
        self._reader.join(CONSOLE_CLOSE_WAIT)
        self._conn.close()


def login_session(
    con: SerialConsole,
    command: str,
    output: bytes,
    *,
    since: int = 0,
    prompt_wait: float = LOGIN_PROMPT_WAIT,
    login_wait: float = LOGIN_WAIT,
    step_wait: float = STEP_WAIT,
) -> int:
    """A real serial-console login as CONSOLE_USER, one command, and a logout; returns the offset
    in the console output where the fresh getty's prompt after the logout ends.

    Waits for ``login:`` (a bare Enter makes agetty print it again: at most LOGIN_TRIES), the
    password prompt, the shell prompt, ``output`` (what ``command`` prints: choose one that its
    echo does not contain) and, after ``exit``, the prompt of the getty systemd restarted.
    """
    at = -1
    for attempt in range(LOGIN_TRIES):
        mark = con.mark()
        con.send(b"\r")
        try:
            at = con.expect(LOGIN_PROMPT, max(mark, since), prompt_wait)
            break
        except E2EError:
            if attempt == LOGIN_TRIES - 1:
                raise
    mark = con.mark()
    con.send(CONSOLE_USER.encode() + b"\r")
    con.expect(b"Password: ", max(mark, at), step_wait)
    mark = con.mark()
    con.send(CONSOLE_PASSWORD.encode() + b"\r", shown="<password>\\r")
    con.expect(SHELL_PROMPT, mark, login_wait)
    mark = con.mark()
    con.send(command.encode() + b"\r")
    done = con.expect(output, mark, step_wait)
    con.expect(SHELL_PROMPT, done, step_wait)
    mark = con.mark()
    con.send(b"exit\r")
    return con.expect(LOGIN_PROMPT, mark, login_wait)


def _console_listener(outdir: Path) -> tuple[socket.socket, Path, Path | None]:
    """A listening unix socket for qemu's console chardev: outdir/console.sock, or one in a
    private temporary directory when that path is too long for sun_path (108 bytes)."""
    path, tmp = outdir / "console.sock", None
    if len(os.fsencode(path)) > 100 or "," in str(path):
        tmp = Path(tempfile.mkdtemp(prefix="gce-e2e-"))
        path = tmp / "console.sock"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    srv.settimeout(CONSOLE_ACCEPT_WAIT)
    return srv, path, tmp


def run(
    spec: VmSpec,
    image: Image,
    www: Path,
    outdir: Path | None = None,
    watch: Callable[[bytes], None] | None = None,
    console: Callable[[SerialConsole], None] | None = None,
    on_network: Callable[[Topology], None] | None = None,
    stop: threading.Event | None = None,
    on_sim: Callable[[SimHandle], None] | None = None,
) -> VmResult:
    """Boot the guest once for spec; returns when qemu exits or the timeout kills it.

    ``watch`` is called with the serial output so far about every SERIAL_POLL seconds while the
    VM runs (e.g. a poller reading the port live); an exception from it ends the run.
    ``console``, when given, runs in its own thread from the start with the serial console (e.g.
    :func:`login_session`); what it raises is ``VmResult.console_error``, and what it typed and
    saw is ``console.log``. ``on_network`` is called with the namespaces once simgce runs and
    before qemu starts (e.g. to serve more on the guest's side: :func:`listen_in_netns`).
    ``stop``: once set (checked every SERIAL_POLL seconds), qemu is killed, as a VM is when it
    is deleted; ``VmResult.stopped`` says so. ``on_sim`` gets the fake GCE's handle once it
    runs, before qemu starts (its control socket changes what the metadata server serves while
    the guest runs).
    """
    outdir = outdir or BUILD / spec.name
    outdir.mkdir(parents=True, exist_ok=True)
    serial_log = outdir / "serial.log"
    for old in (serial_log, outdir / "qemu.log", outdir / "console.log"):
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
    run_id = f"{spec.name}-{secrets.token_hex(4)}"
    (outdir / "run-id").write_text(run_id + "\n")
    seen: dict[str, float] = {}
    timed_out = False
    stopped = False
    rc: int | None = None
    errors: list[str] = []
    srv, sock_path, sock_tmp = _console_listener(outdir)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(srv.close)
        cleanup.callback(lambda: sock_path.unlink(missing_ok=True))
        if sock_tmp is not None:
            cleanup.callback(lambda: shutil.rmtree(sock_tmp, ignore_errors=True))
        topo = cleanup.enter_context(Topology())
        _add_tap(topo)
        sim = topo.start_simgce(
            outdir / "sim",
            extra=_simgce_args(spec, outdir, www),
            records={WHEELS_NAME: EGRESS_IP, EGRESS_NAME: EGRESS_IP},
        )
        if on_network is not None:
            on_network(topo)
        if on_sim is not None:
            on_sim(sim)
        fw_strings = {"run-id": run_id}
        argv = qemu_argv(spec, image, sock_path, fw_strings, _fw_files(spec, outdir))
        (outdir / "qemu.argv").write_text(" ".join(argv) + "\n")
        qlog = cleanup.enter_context(open(outdir / "qemu.log", "wb"))
        t0 = time.monotonic()
        proc = topo.popen_in(topo.gce, argv, stdout=qlog, stderr=subprocess.STDOUT)
        try:
            conn, _ = srv.accept()  # bounded: CONSOLE_ACCEPT_WAIT
        except TimeoutError as e:
            raise E2EError(
                f"qemu did not connect to {sock_path} in {CONSOLE_ACCEPT_WAIT:.0f}s "
                f"(rc={proc.poll()}); see {outdir / 'qemu.log'}"
            ) from e
        slog = cleanup.enter_context(open(serial_log, "wb"))
        con = SerialConsole(conn, slog)
        cleanup.callback(lambda: _write_transcript(outdir / "console.log", con))
        cleanup.callback(con.close)
        cleanup.callback(_reap, proc)  # first (LIFO): the reader then sees EOF at once
        session: threading.Thread | None = None
        if console is not None:
            session = threading.Thread(
                target=_run_session,
                args=(console, con, errors),
                name="console-session",
                daemon=True,  # its waits end at EOF anyway; never what keeps pytest alive
            )
            session.start()
        deadline, hard = t0 + spec.timeout, t0 + HARD_CAP_FACTOR * spec.timeout
        size, wrote_at = -1, t0  # the serial log's size and when it last grew
        while True:
            try:
                rc = proc.wait(SERIAL_POLL)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if serial_log.exists():
                data = serial_log.read_bytes()
                if len(data) != size:
                    size, wrote_at = len(data), now
                _milestones(data, seen, now - t0)
                if watch is not None:
                    watch(data)
            if stop is not None and stop.is_set():
                stopped = True
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(QEMU_KILL_WAIT)
                rc = proc.poll()
                break
            if (now > deadline and now - wrote_at > QUIET_KILL_S) or now > hard:
                timed_out = True
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(QEMU_KILL_WAIT)
                break
        wall = time.monotonic() - t0
        con.close()  # serial.log is complete once the reader has seen EOF (qemu gone)
        if session is not None:
            # Its waits end at EOF or at their own bounds, whichever comes first.
            session.join(CONSOLE_CLOSE_WAIT)
            if session.is_alive():
                errors.append("the console session did not end after qemu exited")
        if serial_log.exists():
            _milestones(serial_log.read_bytes(), seen, wall)
    return VmResult(
        name=spec.name,
        outdir=outdir,
        serial_log=serial_log,
        qemu_rc=rc,
        timed_out=timed_out,
        wall_s=wall,
        milestones=dict(sorted(seen.items(), key=lambda kv: kv[1])),
        console_error="; ".join(errors) or None,
        stopped=stopped,
    )


def _run_session(
    console: Callable[[SerialConsole], None], con: SerialConsole, errors: list[str]
) -> None:
    try:
        console(con)
        con.note("session done")
    except Exception as e:  # reported in VmResult.console_error; the VM runs on to its poweroff
        con.note(f"session failed: {e}")
        errors.append(f"{type(e).__name__}: {e}")


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """qemu must not outlive run(), whatever raised."""
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(QEMU_KILL_WAIT)


def _write_transcript(path: Path, con: SerialConsole) -> None:
    path.write_text("".join(line + "\n" for line in con.transcript))


def sha256_of(www: Path, name: str) -> str:
    """The sha256 build_wheelhouse wrote for www/name (the attribute the start-up script needs)."""
    return (www / f"{name}.sha256").read_text().strip()


class Harness:
    """A built image and wheelhouse; boots scenarios one after another and keeps their timings."""

    def __init__(self, image: Image, www: Path, wheelhouse_s: float = 0.0) -> None:
        self.image = image
        self.www = www
        self.timings: dict[str, object] = {
            "image_s": round(image.build_s, 1),
            "wheelhouse_s": round(wheelhouse_s, 1),
        }
        self._baked: Image | None = None

    def baked_image(self) -> Image:
        """The image with this run's wheelhouse baked in, built at the first boot that asks."""
        if self._baked is None:
            self._baked = Image.ensure(BAKED_IMAGE_DIR, bake=self.www / "wheelhouse")
            self.timings["baked_image_s"] = round(self._baked.build_s, 1)
        return self._baked

    def boot(
        self,
        spec: VmSpec,
        watch: Callable[[bytes], None] | None = None,
        console: Callable[[SerialConsole], None] | None = None,
        on_network: Callable[[Topology], None] | None = None,
        stop: threading.Event | None = None,
        on_sim: Callable[[SimHandle], None] | None = None,
    ) -> VmResult:
        image = self.baked_image() if spec.baked else self.image
        res = run(
            spec, image, self.www, watch=watch, console=console, on_network=on_network,
            stop=stop, on_sim=on_sim,
        )  # fmt: skip
        self.timings[spec.name] = {
            "wall_s": round(res.wall_s, 1),
            "qemu_rc": res.qemu_rc,
            "timed_out": res.timed_out,
            **({"stopped": True} if res.stopped else {}),
            **{k: round(v, 1) for k, v in res.milestones.items()},
        }
        print(res.summary())
        return res


def _kv(items: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m e2e.vm", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("image", help="build (or reuse) the guest image and the wheelhouse")
    b = sub.add_parser("boot", help="boot the guest once with a start-up script; wait for poweroff")
    b.add_argument("--name", default="manual", help="run name: output goes to build/e2e/NAME/")
    b.add_argument("--startup-script", required=True, help="file served as startup-script")
    b.add_argument("--attr", action="append", default=[], help="KEY=VALUE instance attribute")
    b.add_argument("--attr-file", action="append", default=[], help="KEY=PATH attribute")
    b.add_argument(
        "--dns-after",
        type=float,
        default=0.0,
        help="DNS silent until SECONDS after the first query",
    )
    b.add_argument(
        "--dns-silent-queries", type=int, default=0, help="DNS ignores the guest's first N queries"
    )
    b.add_argument("--dns-never", action="store_true", help="DNS never answers")
    b.add_argument("--config", default=None, help="agent config.toml installed before the script")
    b.add_argument("--env", action="append", default=[], help="GCEWD_NAME=VALUE for the script")
    b.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    b.add_argument("--kvm", action="store_true", help="use /dev/kvm instead of TCG")
    a = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"e2e unavailable: {why}", file=sys.stderr)
        return 2
    image, www, took = prepare()
    print(
        f"image: {image.disk} (python {image.python}, {image.build_s:.1f}s); "
        f"wheelhouse: {www / 'wheelhouse.tar'} (served as {WHEEL_URL}, {took:.1f}s)"
    )
    if a.cmd == "image":
        return 0
    attrs = _kv(a.attr)
    attrs.update({k: Path(v).read_text() for k, v in _kv(a.attr_file).items()})
    spec = VmSpec(
        name=a.name,
        startup_script=Path(a.startup_script).read_text(),
        attributes=attrs,
        dns_after=a.dns_after,
        dns_silent_queries=a.dns_silent_queries,
        dns_never=a.dns_never,
        config=Path(a.config).read_text() if a.config else None,
        startup_env=_kv(a.env),
        timeout=a.timeout,
        kvm=a.kvm or os.environ.get("E2E_KVM") == "1",
    )
    res = run(spec, image, www)
    print(res.summary())
    return 1 if res.timed_out else 0


if __name__ == "__main__":
    raise SystemExit(main())
