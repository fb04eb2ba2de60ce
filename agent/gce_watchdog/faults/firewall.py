"""Operator fault injection: ``gce-watchdog fault inject|status|clear``.

Cuts chosen network paths with iptables so an operator can prove the recovery chain on a live VM,
without ever cutting their own SSH session, and always undoing itself:

- All rules live in two dedicated chains, :data:`CHAIN_OUT` (hooked first in OUTPUT) and
  :data:`CHAIN_IN` (hooked first in INPUT, for the DNS reply drop), for iptables and, where the
  machine has IPv6, ip6tables. Nothing else in the firewall is touched.
- Every chain starts with RETURN rules for tcp/22 (both directions) and loopback, so no rule of
  ours can ever match SSH; only tcp/udp rules with explicit ports follow. The serial console is not
  a network device: no rule can reach it.
- At the TTL the rules are removed even if this CLI is killed: a reverter is scheduled BEFORE the
  rules go in (a transient systemd timer when systemd runs this namespace, else a detached process
  in its own session). Each injection has an id, carried in every rule's comment: a reverter only
  removes the injection it was made for, so injecting twice replaces the rules (never stacks) and
  the old reverter cannot cut the new injection short.
- ``fault`` lines go to the serial console (synchronously) at inject, clear and expiry.

``docs/fault-injection.md`` describes the rules and the choices made.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gce_watchdog.faults.plan import (
    CHAIN_IN,
    CHAIN_OUT,
    Cut,
    FaultError,
    Installed,
    hooks,
    iso,
    parse_listing,
    plan,
)
from gce_watchdog.lib import proc
from gce_watchdog.lib.files import read_json, write_json
from gce_watchdog.wire import vocab

STATE_FILE = "fault.json"
LOCK_FILE = "fault.lock"
REVERT_LOG = "fault-revert.log"

# iptables waits this long for the xtables lock (legacy backend; nft ignores it).
XT_WAIT = "5"
CMD_TIMEOUT = 20.0  # one iptables/systemd-run call; they take milliseconds when healthy
LOCK_WAIT = 30.0  # another fault command (e.g. a reverter firing) holds the lock at most this long
HOOK_MAX = 8  # bound on removing duplicate jump rules (only a hand edit could make more than 1)


class ToolMissing(FaultError):
    """iptables is not installed."""


# -- what to cut (pure) ----------------------------------------------------------------------


# -- side effects, behind small injectable interfaces ----------------------------------------


@dataclass(frozen=True)
class Result:
    rc: int
    out: str
    err: str


Runner = Callable[[Sequence[str]], Result]


def run_argv(argv: Sequence[str]) -> Result:
    """Run an argv (never a shell string), bounded; a missing binary is rc 127."""
    r = proc.run(argv, CMD_TIMEOUT, stdout=True, stderr=True)
    if r.timed_out:
        return Result(124, "", f"timed out after {CMD_TIMEOUT:g}s")
    if isinstance(r.error, FileNotFoundError):
        return Result(127, "", str(r.error))
    if r.error is not None:
        raise r.error
    return Result(r.rc if r.rc is not None else 1, r.out, r.err)


def systemd_usable() -> bool:
    """Whether a transient systemd timer would run in THIS network namespace.

    systemd must be running (``/run/systemd/system``, what sd_booted() checks) and we must share
    PID 1's network namespace: a timer started from inside ``ip netns exec`` would run its clear in
    the host namespace, where our rules are not.
    """
    if not os.path.isdir("/run/systemd/system") or shutil.which("systemd-run") is None:
        return False
    try:
        return os.stat("/proc/self/ns/net").st_ino == os.stat("/proc/1/ns/net").st_ino
    except OSError:
        return False


def spawn_detached(argv: Sequence[str], log_path: str) -> int:
    """Start argv in its own session (it survives this process being killed); returns its pid."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        p = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # setsid(): no controlling tty, not in our process group
            close_fds=True,
            cwd="/",
        )
    return p.pid


@dataclass
class Deps:
    """Everything fault operations touch, so tests can swap any part."""

    run: Runner = run_argv
    systemd_usable: Callable[[], bool] = systemd_usable
    spawn: Callable[[Sequence[str], str], int] = spawn_detached
    now: Callable[[], float] = time.time
    iptables: str = "iptables"
    ip6tables: str | None = "ip6tables"  # None: IPv4 only
    python: Sequence[str] = field(default_factory=lambda: [sys.executable, "-m", "gce_watchdog"])
    emit: Callable[[str, dict[str, object], str], bool] | None = None
    out: Callable[[str], None] = print
    unwritten: int = 0  # fault lines that could not be written (the command then exits 74)


@dataclass(frozen=True)
class Paths:
    run_dir: Path
    config: str | None  # the --config given to us, passed on to the reverter

    @property
    def state(self) -> Path:
        return self.run_dir / STATE_FILE

    @property
    def lock(self) -> Path:
        return self.run_dir / LOCK_FILE

    @property
    def revert_log(self) -> Path:
        return self.run_dir / REVERT_LOG


@contextlib.contextmanager
def locked(path: Path, wait: float = LOCK_WAIT) -> Iterator[None]:
    """An exclusive flock on path, waited for at most ``wait`` seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise FaultError(
                        f"another fault command holds {path} for over {wait:g}s"
                    ) from None
                time.sleep(0.05)  # lock poll interval
        yield
    finally:
        os.close(fd)


class Firewall:
    """Our two chains in iptables/ip6tables, through an injectable runner."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps

    def binaries(self) -> dict[str, str]:
        b = {"4": self.deps.iptables}
        if self.deps.ip6tables:
            b["6"] = self.deps.ip6tables
        return b

    def _x(self, fam: str, *args: str) -> Result:
        return self.deps.run([self.binaries()[fam], "-w", XT_WAIT, *args])

    def usable_families(self) -> list[str]:
        """IPv4 must work; IPv6 ("6") is used where ip6tables exists and the kernel has IPv6."""
        r = self._x("4", "-S", "OUTPUT")
        if r.rc == 127:
            raise ToolMissing(
                f"{self.deps.iptables} not found: install iptables (apt-get install iptables)"
            )
        if r.rc != 0:
            raise FaultError(f"{self.deps.iptables} does not work here: {r.err.strip()}")
        fams = ["4"]
        if "6" in self.binaries() and self._x("6", "-S", "OUTPUT").rc == 0:
            fams.append("6")
        return fams

    def listings(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for fam in self.binaries():
            text = ""
            for chain in (CHAIN_OUT, CHAIN_IN):
                r = self._x(fam, "-S", chain)
                if r.rc == 0:
                    text += r.out
            out[fam] = text
        return out

    def installed(self) -> Installed | None:
        return parse_listing(self.listings())

    def install(self, cut: Cut, fault_id: str, until: float, families: Sequence[str]) -> None:
        for fam in families:
            for chain in (CHAIN_OUT, CHAIN_IN):
                self._x(fam, "-N", chain)  # fails harmlessly when it exists (flushed next)
                self._check(fam, "-F", chain)
            for rule in plan(cut, fam, fault_id, until):
                self._check(fam, "-A", rule.chain, *rule.args)
            for builtin, args in hooks(fam):
                if self._x(fam, "-C", builtin, *args).rc != 0:
                    self._check(fam, "-I", builtin, "1", *args)

    def remove(self) -> list[str]:
        """Unhook and delete our chains in every family; returns the problems (empty: clean)."""
        problems: list[str] = []
        for fam in self.binaries():
            for builtin, args in hooks(fam):
                for _ in range(HOOK_MAX):
                    if self._x(fam, "-C", builtin, *args).rc != 0:
                        break
                    self._x(fam, "-D", builtin, *args)
            for chain in (CHAIN_OUT, CHAIN_IN):
                if self._x(fam, "-S", chain).rc != 0:
                    continue  # no such chain (or no such family): nothing to remove
                self._x(fam, "-F", chain)
                r = self._x(fam, "-X", chain)
                if r.rc != 0:
                    problems.append(f"ip{'6' if fam == '6' else ''}tables -X {chain}: {r.err}")
        return problems

    def _check(self, fam: str, *args: str) -> None:
        r = self._x(fam, *args)
        if r.rc != 0:
            binary = self.binaries()[fam]
            raise FaultError(f"{binary} {' '.join(args)} failed (rc={r.rc}): {r.err.strip()}")


# -- operations ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Injected:
    fault_id: str
    cut: Cut
    ttl: float
    until: float
    families: tuple[str, ...]
    revert: dict[str, Any]


def _read_state(paths: Paths) -> dict[str, Any]:
    raw = read_json(paths.state)
    return raw if isinstance(raw, dict) else {}


def _write_state(paths: Paths, obj: dict[str, Any]) -> None:
    write_json(paths.state, obj)


def _remove_state(paths: Paths) -> None:
    with contextlib.suppress(FileNotFoundError):
        paths.state.unlink()


def _clear_argv(deps: Deps, paths: Paths, fault_id: str, at: float | None) -> list[str]:
    argv = [*deps.python, "fault", "clear", "--expire-id", fault_id]
    if at is not None:
        argv += ["--at", f"{at:.3f}"]
    if paths.config:
        argv += ["--config", paths.config]
    argv += ["--iptables", deps.iptables, "--ip6tables", deps.ip6tables or "none"]
    return argv


def _schedule(deps: Deps, paths: Paths, fault_id: str, until: float, how: str) -> dict[str, Any]:
    """Arrange for ``fault clear --expire-id`` to run at ``until``; returns how (for state)."""
    use_systemd = how == "systemd" or (how == "auto" and deps.systemd_usable())
    if use_systemd:
        unit = f"gcewd-fault-revert-{fault_id}"
        delay = max(1, math.ceil(until - deps.now()))
        r = deps.run(
            [
                "systemd-run",
                f"--unit={unit}",
                f"--description=gce-watchdog: revert fault {fault_id} at its TTL",
                f"--on-active={delay}s",
                "--timer-property=AccuracySec=1s",
                "--quiet",
                "--",
                *_clear_argv(deps, paths, fault_id, None),
            ]
        )
        if r.rc == 0:
            return {"kind": "systemd", "unit": unit}
        if how == "systemd":
            raise FaultError(f"systemd-run failed (rc={r.rc}): {r.err.strip()}")
        # auto: fall through to the detached process; it works everywhere.
    pid = deps.spawn(_clear_argv(deps, paths, fault_id, until), str(paths.revert_log))
    return {"kind": "process", "pid": pid}


def _cancel(deps: Deps, revert: dict[str, Any], fault_id: str) -> None:
    """Best effort: stop the reverter of a fault we are replacing or clearing.

    Not needed for correctness (a reverter only removes the fault it was made for), only tidy.
    """
    if revert.get("kind") == "systemd" and revert.get("unit"):
        deps.run(["systemctl", "stop", f"{revert['unit']}.timer"])
    elif revert.get("kind") == "process":
        pid = revert.get("pid")
        if not isinstance(pid, int) or pid == os.getpid():
            return
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return
        if fault_id.encode() in cmdline:  # still our reverter, not a recycled pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 15)


def inject(deps: Deps, paths: Paths, cut: Cut, ttl: float, revert_with: str = "auto") -> Injected:
    """Install (or replace) the fault; the reverter is scheduled before any rule goes in."""
    if not cut:
        raise FaultError("nothing to cut: give --metadata, --egress443, --dns or --metadata-dns")
    fw = Firewall(deps)
    with locked(paths.lock):
        families = tuple(fw.usable_families())
        old = _read_state(paths)
        if old.get("id"):
            _cancel(deps, old.get("revert") or {}, str(old["id"]))
        problems = fw.remove()
        if problems:
            raise FaultError("could not remove the previous fault: " + "; ".join(problems))
        fault_id = secrets.token_hex(4)
        if old.get("id"):
            # Its rules are gone: say so, or its window reads as open until its planned end.
            old_cut = Cut.parse(str(old.get("cut", "none")))
            _emit(
                deps,
                "clear",
                str(old["id"]),
                old_cut,
                {"why": "replaced", "by": fault_id},
                f"fault replaced: {old_cut.label} restored before the new fault",
            )
        now = deps.now()
        until = now + ttl
        revert = _schedule(deps, paths, fault_id, until, revert_with)
        state = {
            "id": fault_id,
            "cut": cut.label,
            "ttl": ttl,
            "until": until,
            "injected_at": now,
            "families": list(families),
            "revert": revert,
            "iptables": deps.iptables,
            "ip6tables": deps.ip6tables,
        }
        _write_state(paths, state)
        # The inject line goes out BEFORE the first rule: whenever our rules exist, the serial
        # console already says an injected fault is on (a killed CLI cannot leave an outage
        # that reads like a real one).
        inj = Injected(fault_id, cut, ttl, until, families, revert)
        _emit(
            deps,
            "inject",
            fault_id,
            cut,
            {"ttl": f"{int(ttl)}s", "until": iso(until), "rev": revert["kind"]},
            "fault injected by operator",
        )
        try:
            fw.install(cut, fault_id, until, families)
        except FaultError as e:
            fw.remove()
            _cancel(deps, revert, fault_id)
            _remove_state(paths)
            _emit(deps, "clear", fault_id, cut, {"why": "install_failed"}, str(e)[:80])
            raise
    return inj


def clear(deps: Deps, paths: Paths, expire_id: str | None = None) -> tuple[Installed | None, str]:
    """Remove the fault. With ``expire_id`` (the reverter), only if that fault is still the one
    installed. Returns (what was removed or None, message)."""
    fw = Firewall(deps)
    with locked(paths.lock):
        inst = fw.installed()
        state = _read_state(paths)
        current = inst.fault_id if inst else state.get("id")
        if expire_id is not None and current != expire_id:
            return None, f"fault {expire_id} is no longer installed (cleared or replaced)"
        if inst is None and not state:
            problems = fw.remove()  # a stray hook or empty chain, e.g. from an interrupted run
            return None, "no fault installed" + (f" ({'; '.join(problems)})" if problems else "")
        if expire_id is None and state.get("id"):
            _cancel(deps, state.get("revert") or {}, str(state["id"]))
        problems = fw.remove()
        if problems:
            raise FaultError("could not remove every rule: " + "; ".join(problems))
        _remove_state(paths)
    cut = inst.cut if inst else Cut.parse(str(state.get("cut", "none")))
    fid = inst.fault_id if inst else str(state.get("id", "-"))
    op = "expire" if expire_id is not None else "clear"
    _emit(
        deps,
        op,
        fid,
        cut,
        {},
        f"fault {'expired' if op == 'expire' else 'cleared'}: {cut.label} restored",
    )
    return inst, f"fault {fid} ({cut.label}) {'expired' if op == 'expire' else 'cleared'}"


def status(deps: Deps, paths: Paths) -> dict[str, Any]:
    """What is installed (read from the firewall) and what the state file says."""
    fw = Firewall(deps)
    inst = fw.installed()
    state = _read_state(paths)
    now = deps.now()
    out: dict[str, Any] = {"active": inst is not None}
    if inst is not None:
        until = inst.until if inst.until is not None else state.get("until")
        out.update(
            id=inst.fault_id,
            cut=inst.cut.label,
            families=list(inst.families),
            rules=inst.rules,
            until=iso(until) if isinstance(until, int | float) else None,
            remaining_s=max(0, round(until - now)) if isinstance(until, int | float) else None,
            overdue=isinstance(until, int | float) and now > until,
        )
        if state.get("id") == inst.fault_id:
            out["revert"] = state.get("revert")
    elif state:
        out["stale_state"] = True
    return out


def _emit(
    deps: Deps, op: str, fault_id: str, cut: Cut, extra: dict[str, object], text: str
) -> None:
    if deps.emit is None:
        return
    fields: dict[str, object] = {"op": op, "id": fault_id, "cut": cut.label, **extra}
    if not deps.emit(vocab.FAULT, fields, text):
        deps.unwritten += 1
        deps.out("gce-watchdog fault: warning: the serial line was not written (port stalled)")
