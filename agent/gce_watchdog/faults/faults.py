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

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gce_watchdog.lib import proc
from gce_watchdog.lib.durations import parse_duration
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.wire import vocab

CHAIN_OUT = "GCEWD-FAULT"
CHAIN_IN = "GCEWD-FAULT-IN"
TAG = "gcewd-fault"  # first word of every rule comment of ours
METADATA_V4 = "169.254.169.254"
# GCE's metadata server also answers on this IPv6 address on IPv6-enabled VMs.
METADATA_V6 = "fd20:ce::254"
LINK_LOCAL = {"4": "169.254.0.0/16", "6": "fe80::/10"}
STATE_FILE = "fault.json"
LOCK_FILE = "fault.lock"
REVERT_LOG = "fault-revert.log"

# A fault is a test, not a configuration: one longer than a day is almost certainly a typo.
MAX_TTL = 24 * 3600.0
MIN_TTL = 1.0
# iptables waits this long for the xtables lock (legacy backend; nft ignores it).
XT_WAIT = "5"
CMD_TIMEOUT = 20.0  # one iptables/systemd-run call; they take milliseconds when healthy
LOCK_WAIT = 30.0  # another fault command (e.g. a reverter firing) holds the lock at most this long
HOOK_MAX = 8  # bound on removing duplicate jump rules (only a hand edit could make more than 1)

EX_OK = 0
EX_FAIL = 1
EX_USAGE = 2
EX_UNAVAILABLE = 69  # sysexits.h: iptables missing
EX_NOPERM = 77  # sysexits.h: not root
EX_IOERR = 74  # sysexits.h: done, but its serial line could not be written


class FaultError(Exception):
    """A fault operation failed; the message says what and how to recover."""


class ToolMissing(FaultError):
    """iptables is not installed."""


# -- what to cut (pure) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Cut:
    """The paths a fault cuts. ``dns`` covers every DNS server, the metadata one included."""

    metadata: bool = False
    egress443: bool = False
    dns: bool = False
    metadata_dns: bool = False

    PARTS = ("metadata", "metadata-dns", "egress443", "dns")

    def parts(self) -> tuple[str, ...]:
        on = {
            "metadata": self.metadata,
            # Implied by dns (every DNS server), so not listed twice.
            "metadata-dns": self.metadata_dns and not self.dns,
            "egress443": self.egress443,
            "dns": self.dns,
        }
        return tuple(p for p in self.PARTS if on[p])

    @property
    def label(self) -> str:
        """``metadata+egress443+dns`` style (the ``cut`` field on the wire)."""
        return "+".join(self.parts()) or "none"

    def __bool__(self) -> bool:
        return bool(self.parts())

    @classmethod
    def parse(cls, label: str) -> Cut:
        parts = set(label.split("+")) - {"none", ""}
        bad = parts - set(cls.PARTS)
        if bad:
            raise ValueError(f"unknown cut part(s): {', '.join(sorted(bad))}")
        return cls(
            metadata="metadata" in parts,
            egress443="egress443" in parts,
            dns="dns" in parts,
            metadata_dns="metadata-dns" in parts,
        )


@dataclass(frozen=True)
class Rule:
    """One rule to append: chain and match/target arguments (an argv fragment, never a string)."""

    chain: str
    args: tuple[str, ...]


def comment(fault_id: str, until: float, cut: Cut) -> str:
    return f"{TAG} id={fault_id} until={iso(until)} cut={cut.label}"


def plan(cut: Cut, family: str, fault_id: str, until: float) -> list[Rule]:
    """The rules for one address family ("4" or "6"). Pure: no I/O.

    Order matters: the RETURN rules for SSH and loopback come first, so nothing after them can
    match the operator's session. RETURN (not ACCEPT) hands the packet back to the host's own
    rules: a fault must not widen the firewall either.
    """
    c = ("-m", "comment", "--comment", comment(fault_id, until, cut))
    out: list[Rule] = []
    for chain in (CHAIN_OUT, CHAIN_IN):
        for flag in ("--dport", "--sport"):
            out.append(Rule(chain, ("-p", "tcp", flag, "22", *c, "-j", "RETURN")))
    out.append(Rule(CHAIN_OUT, ("-o", "lo", *c, "-j", "RETURN")))
    out.append(Rule(CHAIN_IN, ("-i", "lo", *c, "-j", "RETURN")))
    md = METADATA_V4 if family == "4" else METADATA_V6
    if cut.metadata:
        out.append(Rule(CHAIN_OUT, ("-d", md, "-p", "tcp", "--dport", "80", *c, "-j", "DROP")))
    # DNS is cut by dropping the REPLIES: dropping an outgoing UDP packet makes sendto() fail at
    # once with EPERM, so a resolver fails in milliseconds; a wedged network is silence.
    if cut.dns:
        for proto in ("udp", "tcp"):
            out.append(Rule(CHAIN_IN, ("-p", proto, "--sport", "53", *c, "-j", "DROP")))
    elif cut.metadata_dns:
        for proto in ("udp", "tcp"):
            out.append(Rule(CHAIN_IN, ("-s", md, "-p", proto, "--sport", "53", *c, "-j", "DROP")))
    if cut.egress443:
        out.append(
            Rule(
                CHAIN_OUT,
                ("!", "-d", LINK_LOCAL[family], "-p", "tcp", "--dport", "443", *c, "-j", "DROP"),
            )
        )
    return out


def hooks(family: str) -> list[tuple[str, tuple[str, ...]]]:
    """(builtin chain, rule args) of the jumps into our chains."""
    c = ("-m", "comment", "--comment", f"{TAG} hook")
    return [("OUTPUT", (*c, "-j", CHAIN_OUT)), ("INPUT", (*c, "-j", CHAIN_IN))]


def iso(ts: float) -> str:
    return datetime.fromtimestamp(int(ts), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(s: str) -> float | None:
    try:
        return datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


def parse_ttl(value: str) -> float:
    ttl = parse_duration(value)
    if not MIN_TTL <= ttl <= MAX_TTL:
        raise ValueError(
            f"--ttl must be between {MIN_TTL:g}s and {MAX_TTL / 3600:g}h, got {ttl:g}s"
        )
    return ttl


_COMMENT_RE = re.compile(rf"{TAG} id=([0-9a-f]+) until=(\S+) cut=([a-z0-9+-]+)")


@dataclass(frozen=True)
class Installed:
    """What the firewall holds, read back from the rules' comments."""

    fault_id: str
    until: float | None
    cut: Cut
    families: tuple[str, ...]
    rules: int


def parse_listing(listings: dict[str, str]) -> Installed | None:
    """Read our injection back from ``iptables -S`` output per family. Pure."""
    found: tuple[str, str, str] | None = None
    fams: list[str] = []
    n = 0
    for fam, text in sorted(listings.items()):
        hit = False
        for line in text.splitlines():
            m = _COMMENT_RE.search(line)
            if m and line.startswith("-A "):
                found = found or (m.group(1), m.group(2), m.group(3))
                hit = True
                n += 1
        if hit:
            fams.append(fam)
    if found is None:
        return None
    try:
        cut = Cut.parse(found[2])
    except ValueError:
        cut = Cut()
    return Installed(found[0], parse_iso(found[1]), cut, tuple(fams), n)


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
    from gce_watchdog.lib.files import read_json

    raw = read_json(paths.state)
    return raw if isinstance(raw, dict) else {}


def _write_state(paths: Paths, obj: dict[str, Any]) -> None:
    from gce_watchdog.lib.files import write_json

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


# -- CLI -------------------------------------------------------------------------------------------


def register(sub: Any) -> None:
    from gce_watchdog.vm.runtime import add_config_arg

    p = sub.add_parser(
        "fault",
        help="inject network faults with iptables (operators; needs root)",
        description="Cut network paths with iptables for a bounded time, keeping SSH open.",
    )
    fsub = p.add_subparsers(dest="fault_command", metavar="ACTION")

    def common(q: argparse.ArgumentParser) -> None:
        add_config_arg(q)
        q.add_argument("--iptables", default="iptables", help="iptables binary (default: PATH)")
        q.add_argument(
            "--ip6tables", default="ip6tables", help="ip6tables binary, or 'none' for IPv4 only"
        )

    i = fsub.add_parser("inject", help="install DROP rules until --ttl runs out")
    i.add_argument("--metadata", action="store_true", help="169.254.169.254 tcp/80")
    i.add_argument("--egress443", action="store_true", help="tcp/443 to non-link-local addresses")
    i.add_argument("--dns", action="store_true", help="every DNS server (replies dropped)")
    i.add_argument("--metadata-dns", action="store_true", help="DNS from the metadata server only")
    i.add_argument("--ttl", required=True, help="how long the fault lasts, e.g. 90s, 10m (max 24h)")
    i.add_argument(
        "--revert-with",
        choices=("auto", "systemd", "process"),
        default="auto",
        help="what removes the rules at the TTL (auto: a systemd timer if systemd runs this "
        "network namespace, else a detached process)",
    )
    i.add_argument("--json", action="store_true", help="machine-readable output")
    common(i)
    i.set_defaults(func=cmd_inject)

    s = fsub.add_parser("status", help="show the installed fault and its expiry")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    common(s)
    s.set_defaults(func=cmd_status)

    c = fsub.add_parser("clear", help="remove the fault now")
    c.add_argument("--expire-id", default=None, help=argparse.SUPPRESS)  # the reverter
    c.add_argument("--at", type=float, default=None, help=argparse.SUPPRESS)  # reverter's wait
    common(c)
    c.set_defaults(func=cmd_clear)
    p.set_defaults(func=lambda a: (p.print_help(sys.stderr), EX_USAGE)[1])


def _deps_from_args(
    args: argparse.Namespace, emit: bool, cfg: cfgmod.Config
) -> tuple[Deps, Paths, Any]:
    from gce_watchdog.vm.runtime import make_emitter

    deps = Deps(
        iptables=args.iptables,
        ip6tables=None if args.ip6tables in ("none", "") else args.ip6tables,
    )
    port = None
    if emit:
        serial_ok: list[bool] = []

        def log(event: str, **kw: object) -> None:
            serial_ok.append(bool(kw.get("serial_ok", True)))

        try:
            emitter, port = make_emitter(cfg, log=log)
        except OSError as e:
            print(
                f"gce-watchdog fault: warning: no serial port ({e}); no fault line written",
                file=sys.stderr,
            )
            deps.emit = _unwritable(deps)
        else:

            def emit_fn(event: str, fields: dict[str, object], text: str) -> bool:
                serial_ok.clear()
                emitter.emit(event, fields, text, sync=True)
                return all(serial_ok)

            deps.emit = emit_fn
    return deps, Paths(Path(cfg.agent.run_dir), getattr(args, "config", None)), port


def _unwritable(deps: Deps) -> Callable[[str, dict[str, object], str], bool]:
    """The emit of a command with no serial port at all: every line counts as not written."""

    def emit(event: str, fields: dict[str, object], text: str) -> bool:
        return False

    return emit


def _run_op(
    args: argparse.Namespace,
    emit: bool,
    op: Callable[[Deps, Paths], int],
    euid: Callable[[], int] = os.geteuid,
    before: Callable[[], None] = lambda: None,
) -> int:
    from gce_watchdog.vm.runtime import load_config_or_exit

    if euid() != 0:
        print(
            "gce-watchdog fault: must run as root (iptables needs CAP_NET_ADMIN); "
            "try: sudo gce-watchdog fault ...",
            file=sys.stderr,
        )
        return EX_NOPERM
    # The config is read before `before` (the reverter's wait): a config edited or broken during
    # the TTL must not stop the rules from being removed.
    cfg = load_config_or_exit(args)
    before()
    deps, paths, port = _deps_from_args(args, emit, cfg)
    try:
        rc = op(deps, paths)
        if rc == EX_OK and deps.unwritten:
            # Done, but the console does not say so: callers must be able to tell and fall back.
            print(
                f"gce-watchdog fault: {deps.unwritten} serial line(s) not written (exit 74)",
                file=sys.stderr,
            )
            return EX_IOERR
        return rc
    except FaultError as e:
        print(f"gce-watchdog fault: {e}", file=sys.stderr)
        return EX_UNAVAILABLE if isinstance(e, ToolMissing) else EX_FAIL
    finally:
        if port is not None:
            port.close()


def cmd_inject(args: argparse.Namespace) -> int:
    try:
        ttl = parse_ttl(args.ttl)
    except ValueError as e:
        print(f"gce-watchdog fault: {e}", file=sys.stderr)
        return EX_USAGE
    cut = Cut(args.metadata, args.egress443, args.dns, args.metadata_dns)
    if not cut:
        print(
            "gce-watchdog fault: nothing to cut: give --metadata, --egress443, --dns "
            "and/or --metadata-dns",
            file=sys.stderr,
        )
        return EX_USAGE

    def op(deps: Deps, paths: Paths) -> int:
        inj = inject(deps, paths, cut, ttl, args.revert_with)
        if args.json:
            print(
                json.dumps(
                    {
                        "id": inj.fault_id,
                        "cut": cut.label,
                        "ttl": ttl,
                        "until": iso(inj.until),
                        "families": list(inj.families),
                        "revert": inj.revert,
                    }
                )
            )
        else:
            how = inj.revert["kind"]
            print(
                f"fault {inj.fault_id}: cut {cut.label} until {iso(inj.until)} "
                f"({int(ttl)}s; reverted by {how}); SSH (tcp/22) stays open; "
                "undo now: gce-watchdog fault clear"
            )
        return EX_OK

    return _run_op(args, True, op)


def cmd_status(args: argparse.Namespace) -> int:
    def op(deps: Deps, paths: Paths) -> int:
        st = status(deps, paths)
        if args.json:
            print(json.dumps(st, sort_keys=True))
        elif not st["active"]:
            extra = (
                " (a state file is left over; `fault clear` removes it)"
                if st.get("stale_state")
                else ""
            )
            print("no fault installed" + extra)
        else:
            line = (
                f"fault {st['id']}: cut {st['cut']} (IPv{'+'.join(st['families'])}, "
                f"{st['rules']} rules) until {st['until']}"
            )
            if st.get("overdue"):
                line += " - OVERDUE: the reverter did not run; `gce-watchdog fault clear`"
            elif st.get("remaining_s") is not None:
                line += f" ({st['remaining_s']}s left)"
            print(line)
        return EX_OK

    return _run_op(args, False, op)


def cmd_clear(args: argparse.Namespace) -> int:
    def op(deps: Deps, paths: Paths) -> int:
        _, msg = clear(deps, paths, args.expire_id)
        print(msg)
        return EX_OK

    at = args.at
    return _run_op(args, True, op, before=(lambda: _sleep_until(at)) if at is not None else _noop)


def _noop() -> None:
    return None


def _sleep_until(at: float, now: Callable[[], float] = time.time) -> None:
    """The detached reverter's wait. Wall clock, in chunks, so a clock step is noticed; bounded
    by MAX_TTL plus a margin however the clock moves."""
    limit = time.monotonic() + MAX_TTL + 60
    while (left := at - now()) > 0 and time.monotonic() < limit:
        time.sleep(min(left, 5.0))
