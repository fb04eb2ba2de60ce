"""Real-network test harness: a "vm" and a "gce" network namespace joined by a veth pair.

Used by the tests, the benchmarks and the VM end-to-end helpers (no pytest import here)::

    from kit.netns import Topology, netns_unavailable  # tests/ is on sys.path under pytest
    # elsewhere: sys.path.insert(0, "<repo>/tests"); from kit.netns import Topology

    reason = netns_unavailable()       # None, or why namespaces cannot be used here
    with Topology() as topo:
        sim = topo.start_simgce()      # metadata 169.254.169.254:80, DNS :53, 443 on 192.0.2.10
        topo.run_in(topo.vm, ["iptables", "-S"])
        proc = topo.popen_in(topo.vm, [PY, "-m", "gce_watchdog", "run", "--config", cfg])
        ...
    # on exit (also on exceptions): every process started in either namespace is killed, then the
    # namespaces (and with them the veth pair) are deleted.

Layout (all addresses are TEST-NET-1 or the link-local metadata address, and exist only inside
the namespaces this module creates)::

    vm  ns: <veth> 192.0.2.2/24, lo up; routes: 169.254.169.254 dev <veth>, default via 192.0.2.1
            /etc/netns/<vm>/resolv.conf: nameserver 169.254.169.254 (what a GCE VM has)
    gce ns: <veth> 192.0.2.1/24 + 169.254.169.254/32 + 192.0.2.10/32, lo up

Names are unique per run: ``gw-<pid>-<hex>-vm`` / ``-gce``; a run that died without tearing down
is swept by the next one (only namespaces whose creating pid is gone are touched).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kit.paths import REPO

# The interpreter the agent runs under: the project's venv when present, else this one.
PY = (
    str(REPO / ".venv" / "bin" / "python")
    if (REPO / ".venv" / "bin" / "python").exists()
    else (sys.executable)
)

VM_ADDR = "192.0.2.2"
GCE_ADDR = "192.0.2.1"
METADATA_IP = "169.254.169.254"
EGRESS_IP = "192.0.2.10"  # the "internet on 443" stand-in (TEST-NET-1)
EGRESS_NAME = "egress.test"  # resolved by the fake DNS to EGRESS_IP
PREFIX_LEN = 24

_NAME_RE = re.compile(r"^gw-(\d+)-([0-9a-f]+)-(vm|gce)$")
# Bounded waits: every step of set-up/teardown is a local kernel operation taking milliseconds;
# these limits only exist so a wedged kernel or process cannot hang a test run forever.
CMD_TIMEOUT = 10.0
KILL_WAIT = 5.0
READY_WAIT = 10.0


class NetnsError(RuntimeError):
    """A namespace command failed; the message carries the argv and its stderr."""


def _ip(
    *args: str, check: bool = True, timeout: float = CMD_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and r.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: rc={r.returncode}: {r.stderr.strip()}")
    return r


_UNAVAILABLE: list[str | None] = []


def netns_unavailable() -> str | None:
    """None when this machine can create network namespaces, else the reason (cached)."""
    if _UNAVAILABLE:
        return _UNAVAILABLE[0]
    reason: str | None = None
    if os.geteuid() != 0:
        reason = "network namespaces need root (run the tests as root, e.g. in CI)"
    elif shutil.which("ip") is None:
        reason = "the ip command (iproute2) is missing: apt-get install iproute2"
    else:
        probe = f"gw-{os.getpid()}-{secrets.token_hex(3)}-vm"
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            reason = f"cannot create a network namespace: {r.stderr.strip()}"
        else:
            _ip("netns", "del", probe, check=False)
    _UNAVAILABLE.append(reason)
    return reason


def iptables_unavailable() -> str | None:
    """None when iptables can be used (inside a namespace), else the reason."""
    why = netns_unavailable()
    if why:
        return why
    if shutil.which("iptables") is None:
        return "iptables is missing: apt-get install iptables (make apt-test)"
    return None


def ns_pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def kill_ns_pids(ns: str, wait: float = KILL_WAIT) -> list[int]:
    """SIGKILL every process inside ns and wait (bounded) until none is left; returns the pids.

    A process left in a namespace keeps it (and its veth) alive after ``ip netns del``.
    """
    killed: list[int] = []
    deadline = time.monotonic() + wait
    while True:
        pids = ns_pids(ns)
        if not pids:
            return killed
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        if time.monotonic() > deadline:
            raise NetnsError(f"processes still alive in {ns} after {wait}s: {pids}")
        time.sleep(0.02)  # teardown poll, not a wait on code under test


def delete_ns(ns: str) -> None:
    """Kill what runs in ns, then delete it (and its /etc/netns/<ns> folder); idempotent."""
    kill_ns_pids(ns)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def harness_namespaces() -> list[tuple[str, int]]:
    """The namespaces harness runs made (``gw-<pid>-...``), each with its maker's pid."""
    r = _ip("netns", "list", check=False)
    found: list[tuple[str, int]] = []
    for line in r.stdout.splitlines():
        m = _NAME_RE.match((line.split() or [""])[0])
        if m:
            found.append((m.group(0), int(m.group(1))))
    return found


def sweep_stale() -> list[str]:
    """Delete namespaces left by harness runs whose process is gone; returns their names."""
    gone: list[str] = []
    for name, pid in harness_namespaces():
        if not Path(f"/proc/{pid}").exists():
            delete_ns(name)
            gone.append(name)
    return gone


@dataclass
class Topology:
    """A vm and a gce namespace joined by a veth pair. Use as a context manager."""

    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    vm: str = ""
    gce: str = ""
    setup_s: float = 0.0  # measured set-up time
    teardown_s: float = 0.0
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    _created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        base = f"gw-{os.getpid()}-{self.tag}"
        self.vm = self.vm or f"{base}-vm"
        self.gce = self.gce or f"{base}-gce"
        # Interface names are at most 15 bytes; they live in the namespaces, so they only need
        # to be unique while both sides are being created in the root namespace.
        self.veth_vm = f"gw{self.tag}v"
        self.veth_gce = f"gw{self.tag}g"

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> Topology:
        t0 = time.monotonic()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        self.setup_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        sweep_stale()
        for ns in (self.vm, self.gce):
            _ip("netns", "add", ns)
            self._created.append(ns)
        _ip("link", "add", self.veth_vm, "type", "veth", "peer", "name", self.veth_gce)
        try:
            _ip("link", "set", self.veth_vm, "netns", self.vm)
            _ip("link", "set", self.veth_gce, "netns", self.gce)
        except NetnsError:
            _ip("link", "del", self.veth_vm, check=False)
            raise
        vm, gce = self.vm, self.gce
        _ip("-n", vm, "addr", "add", f"{VM_ADDR}/{PREFIX_LEN}", "dev", self.veth_vm)
        for addr in (f"{GCE_ADDR}/{PREFIX_LEN}", f"{METADATA_IP}/32", f"{EGRESS_IP}/32"):
            _ip("-n", gce, "addr", "add", addr, "dev", self.veth_gce)
        for ns, dev in ((vm, self.veth_vm), (gce, self.veth_gce)):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        _ip("-n", vm, "route", "add", f"{METADATA_IP}/32", "dev", self.veth_vm)
        _ip("-n", vm, "route", "add", "default", "via", GCE_ADDR)
        # `ip netns exec` bind-mounts /etc/netns/<ns>/resolv.conf over /etc/resolv.conf.
        etc = Path("/etc/netns") / vm
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(
            f"nameserver {METADATA_IP}\noptions timeout:1 attempts:1\n"
        )

    def close(self) -> None:
        """Stop tracked processes, kill everything left in the namespaces, delete them."""
        t0 = time.monotonic()
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(KILL_WAIT)
        errors: list[str] = []
        for ns in reversed(self._created):
            try:
                delete_ns(ns)
            except NetnsError as e:
                errors.append(str(e))
        self._created.clear()
        self._procs.clear()
        self.teardown_s = time.monotonic() - t0
        if errors:
            raise NetnsError("; ".join(errors))

    # -- running things ----------------------------------------------------------------------------
    @staticmethod
    def exec_argv(ns: str, argv: Sequence[str]) -> list[str]:
        """The argv that runs argv inside ns (Python 3.11 has no os.setns)."""
        return ["ip", "netns", "exec", ns, *argv]

    def run_in(
        self,
        ns: str,
        argv: Sequence[str],
        timeout: float = 30.0,
        check: bool = False,
        env: dict[str, str] | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run argv inside ns to completion (bounded); text output captured."""
        r = subprocess.run(
            self.exec_argv(ns, argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=env,
            input=input,
            cwd=str(REPO),
        )
        if check and r.returncode != 0:
            raise NetnsError(f"{' '.join(argv)} in {ns}: rc={r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def popen_in(self, ns: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start argv inside ns; the process is killed at teardown if still running."""
        kw.setdefault("cwd", str(REPO))
        kw.setdefault("stdin", subprocess.DEVNULL)
        p: subprocess.Popen[Any] = subprocess.Popen(self.exec_argv(ns, argv), **kw)
        self._procs.append(p)
        return p

    def py_in(self, ns: str, code: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run a short Python snippet inside ns."""
        return self.run_in(ns, [PY, "-c", code], timeout=timeout)

    def tcp_ok(self, ns: str, host: str, port: int, timeout: float = 1.0) -> bool:
        """Whether a TCP connection from ns to host:port succeeds within timeout."""
        code = (
            "import socket,sys\n"
            f"s=socket.create_connection(({host!r},{port}),timeout={timeout})\n"
            "s.close()\n"
        )
        return self.py_in(ns, code, timeout=timeout + 10).returncode == 0

    def wait_tcp(self, ns: str, host: str, port: int, within: float = READY_WAIT) -> None:
        """Poll (bounded) until host:port accepts connections from ns."""
        deadline = time.monotonic() + within
        while not self.tcp_ok(ns, host, port, timeout=0.5):
            if time.monotonic() > deadline:
                raise NetnsError(f"{host}:{port} not reachable from {ns} within {within}s")
            time.sleep(0.05)  # poll interval

    def start_tcp_listener(self, ns: str, host: str, port: int) -> subprocess.Popen[Any]:
        """A tiny accept-and-echo TCP server in ns (e.g. a stand-in sshd on port 22)."""
        code = (
            "import socket\n"
            "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(({host!r},{port})); s.listen(16)\n"
            "while True:\n"
            "    c,_=s.accept(); c.settimeout(5)\n"
            "    try:\n"
            "        d=c.recv(64); c.sendall(d)\n"
            "    except OSError: pass\n"
            "    c.close()\n"
        )
        return self.popen_in(ns, [PY, "-c", code])

    def start_simgce(
        self,
        workdir: str | Path,
        extra: Sequence[str] = (),
        records: dict[str, str] | None = None,
    ) -> SimHandle:
        """Start ``python -m testing.simgce`` in the gce namespace and wait until it is ready.

        Metadata on 169.254.169.254:80, DNS on 169.254.169.254:53 (``egress.test`` ->
        192.0.2.10 plus ``records``), a TCP listener on 192.0.2.10:443, and a control socket
        (a Unix socket, reachable from the root namespace) in workdir.
        """
        wd = Path(workdir)
        wd.mkdir(parents=True, exist_ok=True)
        ready = wd / "simgce.ready"
        control = wd / "simgce.sock"
        with contextlib.suppress(FileNotFoundError):
            ready.unlink()
        recs = {EGRESS_NAME: EGRESS_IP, **(records or {})}
        argv = [
            PY, "-m", "gce_watchdog.testing.simgce",
            "--metadata", f"{METADATA_IP}:80",
            "--dns", f"{METADATA_IP}:53",
            "--tcp", f"{EGRESS_IP}:443",
            "--control", str(control),
            "--ready-file", str(ready),
        ]  # fmt: skip
        for name, ip in recs.items():
            argv += ["--record", f"{name}={ip}"]
        log = open(wd / "simgce.log", "wb")  # noqa: SIM115 - lives as long as the process
        proc = self.popen_in(self.gce, [*argv, *extra], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + READY_WAIT
        while (ports := _read_ready(ready)) is None:
            if proc.poll() is not None:
                raise NetnsError(
                    f"simgce exited rc={proc.returncode}: {(wd / 'simgce.log').read_text()}"
                )
            if time.monotonic() > deadline:
                raise NetnsError(f"simgce not ready within {READY_WAIT}s")
            time.sleep(0.02)  # poll interval
        return SimHandle(proc, str(control), ports)


def _read_ready(path: Path) -> dict[str, Any] | None:
    """The ready file's ports, or None while it is missing or still being written."""
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


@dataclass
class SimHandle:
    """A running simgce process: send control commands with :meth:`command`."""

    proc: subprocess.Popen[Any]
    control: str
    ports: dict[str, Any]

    def command(self, **cmd: Any) -> dict[str, Any]:
        from gce_watchdog.testing.simgce import send_command

        return send_command(self.control, **cmd)
