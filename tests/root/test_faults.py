"""gce-watchdog fault: the rule plan (pure), the operations against a fake iptables, and the real
thing inside a network namespace (tests/kit/netns.py): rules in and out, SSH kept, TTL revert with a
killed CLI, no stacking, status, no root.

Nothing here touches the host firewall: the real iptables only ever runs under ``ip netns exec``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gce_watchdog.faults import cli as faults_cli
from gce_watchdog.faults import firewall
from gce_watchdog.faults import plan as fplan
from gce_watchdog.faults.firewall import Deps, Paths, Result
from gce_watchdog.faults.plan import CHAIN_IN, CHAIN_OUT, Cut, FaultError
from gce_watchdog.lib.cli import EX_NOPERM, EX_UNAVAILABLE, CommandError
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from gce_watchdog.wire.protocol import Event, decode_all
from hypothesis import given
from hypothesis import strategies as st
from kit.netns import EGRESS_IP, METADATA_IP, PY, VM_ADDR, Topology
from kit.nobody import Nobody
from kit.schemas import validate

ALL_CUTS = [Cut(*bits) for bits in itertools.product([False, True], repeat=4)]
NOW = 1_800_000_000.0

# -- the plan (pure) -------------------------------------------------------------------------------


@pytest.mark.pure
@given(st.sampled_from(ALL_CUTS), st.sampled_from(["4", "6"]))
def test_plan_ssh_and_loopback_come_first_and_every_drop_is_port_scoped(cut: Cut, fam: str) -> None:
    rules = fplan.plan(cut, fam, "abcd1234", NOW)
    for chain in (CHAIN_OUT, CHAIN_IN):
        mine = [r.args for r in rules if r.chain == chain]
        head = mine[:3]
        assert all(a[-1] == "RETURN" for a in head)
        assert head[0][:4] == ("-p", "tcp", "--dport", "22")
        assert head[1][:4] == ("-p", "tcp", "--sport", "22")
        assert "lo" in head[2]
        # After the head only DROPs, each for one protocol and one port that is never 22.
        for a in mine[3:]:
            assert a[-1] == "DROP"
            assert a[a.index("-p") + 1] in ("tcp", "udp")
            port = a[a.index("--dport") + 1] if "--dport" in a else a[a.index("--sport") + 1]
            assert port in ("80", "443", "53")
    assert {r.chain for r in rules} == {CHAIN_OUT, CHAIN_IN}


@pytest.mark.pure
@pytest.mark.parametrize("cut", ALL_CUTS, ids=lambda c: c.label)
def test_plan_cuts_exactly_what_was_asked(cut: Cut) -> None:
    drops = [r.args for r in fplan.plan(cut, "4", "abcd1234", NOW) if r.args[-1] == "DROP"]
    md = [a for a in drops if "80" in a]
    eg = [a for a in drops if "443" in a]
    dns_all = [a for a in drops if "53" in a and "-s" not in a]
    dns_md = [a for a in drops if "53" in a and "-s" in a]
    assert bool(md) == cut.metadata
    assert all(a[a.index("-d") + 1] == METADATA_IP for a in md)
    assert bool(eg) == cut.egress443
    assert all(a[: a.index("-d") + 2] == ("!", "-d", "169.254.0.0/16") for a in eg)
    assert bool(dns_all) == cut.dns
    assert bool(dns_md) == (cut.metadata_dns and not cut.dns)
    # DNS is cut by dropping replies (INPUT): outgoing UDP DROP fails at once with EPERM.
    for a in dns_all + dns_md:
        assert "--sport" in a
    ids = {a[a.index("--comment") + 1] for a in drops}
    assert len(ids) <= 1


@pytest.mark.pure
def test_plan_v6_uses_the_v6_metadata_address_and_link_local() -> None:
    cut = Cut(metadata=True, egress443=True)
    args = [r.args for r in fplan.plan(cut, "6", "abcd1234", NOW)]
    assert any(fplan.METADATA_V6 in a for a in args)
    assert any("fe80::/10" in a for a in args)
    assert not any(METADATA_IP in a for a in args)


@pytest.mark.pure
@pytest.mark.parametrize("cut", ALL_CUTS, ids=lambda c: c.label)
def test_cut_label_round_trips(cut: Cut) -> None:
    back = Cut.parse(cut.label)
    assert back.label == cut.label
    assert bool(back) == bool(cut)


@pytest.mark.pure
def test_cut_parse_rejects_unknown_parts() -> None:
    with pytest.raises(ValueError, match="unknown cut part"):
        Cut.parse("metadata+ssh")


@pytest.mark.pure
@pytest.mark.parametrize(
    ("text", "ok"),
    [("10m", 600.0), ("90s", 90.0), ("1", 1.0), ("24h", 86400.0)],
)
def test_parse_ttl_accepts(text: str, ok: float) -> None:
    assert fplan.parse_ttl(text) == ok


@pytest.mark.pure
@pytest.mark.parametrize("text", ["0", "0.5s", "25h", "soon", "-1m", ""])
def test_parse_ttl_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        fplan.parse_ttl(text)


@pytest.mark.pure
def test_parse_listing_reads_id_until_and_cut_back() -> None:
    cut = Cut(metadata=True, dns=True)
    c = fplan.comment("0badcafe", NOW, cut)
    listing = (
        f"-N {CHAIN_OUT}\n"
        f'-A {CHAIN_OUT} -p tcp -m tcp --dport 22 -m comment --comment "{c}" -j RETURN\n'
        f'-A {CHAIN_OUT} -d 169.254.169.254/32 -p tcp -m comment --comment "{c}" -j DROP\n'
    )
    inst = fplan.parse_listing({"4": listing, "6": ""})
    assert inst is not None
    assert (inst.fault_id, inst.until, inst.cut.label) == ("0badcafe", NOW, cut.label)
    assert (inst.families, inst.rules) == (("4",), 2)
    assert fplan.parse_listing({"4": f"-N {CHAIN_OUT}\n", "6": ""}) is None


# -- operations against a hand-written fake iptables ------------------------------------------


@dataclass
class FakeXtables:
    """A tiny in-memory iptables/ip6tables (the subset we use) plus systemd-run/systemctl."""

    chains: dict[str, dict[str, list[tuple[str, ...]]]] = field(
        default_factory=lambda: {
            fam: {"INPUT": [], "OUTPUT": [], "FORWARD": []} for fam in ("4", "6")
        }
    )
    calls: list[list[str]] = field(default_factory=list)
    fail: Sequence[str] = ()  # an argv containing all of these fails
    no_v6: bool = False
    missing: bool = False

    def __call__(self, argv: Sequence[str]) -> Result:
        argv = list(argv)
        self.calls.append(argv)
        if self.fail and all(x in argv for x in self.fail):
            return Result(1, "", "injected failure")
        tool = Path(argv[0]).name
        if tool in ("systemd-run", "systemctl"):
            return Result(0, "", "")
        if self.missing:
            return Result(127, "", "No such file")
        fam = "6" if tool == "ip6tables" else "4"
        if fam == "6" and self.no_v6:
            return Result(3, "", "ip6tables: no IPv6 support")
        args = argv[3:] if argv[1] == "-w" else argv[1:]
        op, chain, rest = args[0], args[1] if len(args) > 1 else "", tuple(args[2:])
        t = self.chains[fam]
        if op == "-S":
            if chain not in t:
                return Result(1, "", "No chain/target/match by that name.")
            lines = [f"-N {chain}"] + [f"-A {chain} {self._fmt(r)}" for r in t[chain]]
            return Result(0, "\n".join(lines) + "\n", "")
        if op == "-N":
            if chain in t:
                return Result(1, "", "Chain already exists.")
            t[chain] = []
            return Result(0, "", "")
        if chain not in t:
            return Result(1, "", "No chain/target/match by that name.")
        if op == "-F":
            t[chain] = []
        elif op == "-X":
            if t[chain] or any(r[-1] == chain for rules in t.values() for r in rules):
                return Result(1, "", "Directory not empty / chain in use")
            del t[chain]
        elif op == "-A":
            self._target_exists(t, rest)
            t[chain].append(rest)
        elif op == "-I":
            self._target_exists(t, rest[1:])
            t[chain].insert(int(rest[0]) - 1, rest[1:])
        elif op == "-C":
            return Result(0 if rest in t[chain] else 1, "", "")
        elif op == "-D":
            if rest not in t[chain]:
                return Result(1, "", "Bad rule")
            t[chain].remove(rest)
        else:
            return Result(2, "", f"fake: unsupported {op}")
        return Result(0, "", "")

    @staticmethod
    def _target_exists(t: dict[str, list[tuple[str, ...]]], rule: tuple[str, ...]) -> None:
        target = rule[-1]
        assert target in ("DROP", "RETURN", "ACCEPT") or target in t, f"no chain {target}"

    @staticmethod
    def _fmt(rule: tuple[str, ...]) -> str:
        return " ".join(f'"{a}"' if " " in a else a for a in rule)

    def ours(self, fam: str = "4") -> int:
        t = self.chains[fam]
        return len(t.get(CHAIN_OUT, [])) + len(t.get(CHAIN_IN, []))

    def hooks(self, fam: str = "4") -> int:
        t = self.chains[fam]
        return sum(r[-1] in (CHAIN_OUT, CHAIN_IN) for c in ("INPUT", "OUTPUT") for r in t[c])

    def clean(self) -> bool:
        return all(
            CHAIN_OUT not in t and CHAIN_IN not in t and self.hooks(f) == 0
            for f, t in self.chains.items()
        )


@dataclass
class World:
    fw: FakeXtables
    deps: Deps
    paths: Paths
    sink: MemorySink
    spawned: list[list[str]]
    clock: list[float]

    def events(self) -> list[Event]:
        evs, _ = decode_all("\n".join(self.sink.lines).encode() + b"\n", pin=SYNTH_KEY.public)
        return [e for e in evs if e.event != "key"]


def make_world(tmp_path: Path, systemd: bool = False, **fake: object) -> World:
    fw = FakeXtables(**fake)  # type: ignore[arg-type]
    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(tmp_path / "state", "0000abcd"), "0000abcd", key=SYNTH_KEY)
    spawned: list[list[str]] = []
    clock = [NOW]

    def spawn(argv: Sequence[str], log: str) -> int:
        spawned.append(list(argv))
        fw.calls.append(["<spawn>"])
        return 999_999_999  # no such pid: cancelling it is a no-op

    def emit(event: str, fields: dict[str, object], text: str) -> bool:
        em.emit(event, fields, text, sync=True)
        return True

    deps = Deps(
        run=fw,
        systemd_usable=lambda: systemd,
        spawn=spawn,
        now=lambda: clock[0],
        emit=emit,
        out=lambda s: None,
    )
    return World(fw, deps, Paths(tmp_path / "run", "/etc/x.toml"), sink, spawned, clock)


@pytest.mark.process
def test_inject_installs_both_families_and_records_the_expiry(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    inj = firewall.inject(w.deps, w.paths, Cut(metadata=True, egress443=True), 600)
    assert inj.families == ("4", "6")
    assert inj.until == NOW + 600
    for fam in ("4", "6"):
        assert w.fw.ours(fam) == len(fplan.plan(inj.cut, fam, inj.fault_id, inj.until))
        assert w.fw.hooks(fam) == 2
    state = json.loads(w.paths.state.read_text())
    assert (state["id"], state["until"], state["cut"]) == (inj.fault_id, NOW + 600, inj.cut.label)
    [ev] = w.events()
    assert ev.event == "fault"
    assert ev.fields_dict == {
        "op": "inject",
        "id": inj.fault_id,
        "cut": "metadata+egress443",
        "ttl": "600s",
        "until": fplan.iso(NOW + 600),
        "rev": "process",
    }


@pytest.mark.process
def test_reverter_is_scheduled_before_any_rule_goes_in(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    inj = firewall.inject(w.deps, w.paths, Cut(dns=True), 60)
    first_append = next(i for i, c in enumerate(w.fw.calls) if "-A" in c)
    assert w.fw.calls.index(["<spawn>"]) < first_append
    [argv] = w.spawned
    assert argv[argv.index("--expire-id") + 1] == inj.fault_id
    assert float(argv[argv.index("--at") + 1]) == pytest.approx(NOW + 60, abs=0.01)
    assert argv[argv.index("--config") + 1] == "/etc/x.toml"


@pytest.mark.process
def test_injecting_twice_replaces_never_stacks(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    a = firewall.inject(w.deps, w.paths, Cut(metadata=True, egress443=True), 60)
    n = w.fw.ours()
    b = firewall.inject(w.deps, w.paths, Cut(metadata=True, egress443=True), 120)
    assert a.fault_id != b.fault_id
    assert w.fw.ours() == n and w.fw.hooks() == 2
    inst = firewall.Firewall(w.deps).installed()
    assert inst is not None and inst.fault_id == b.fault_id
    # The replaced fault gets its clear line, between the two injects, naming its successor.
    assert [(e.get("op"), e.get("id"), e.get("why")) for e in w.events()] == [
        ("inject", a.fault_id, None),
        ("clear", a.fault_id, "replaced"),
        ("inject", b.fault_id, None),
    ]
    assert w.events()[1].get("by") == b.fault_id
    # The report closes the first window at the replacement, not at its planned end.
    from gce_watchdog.report.model import build_report
    from gce_watchdog.wire.protocol import encode

    lines = b"".join(encode(e, SYNTH_KEY).encode() + b"\n" for e in w.events())
    r = build_report(lines, pin=SYNTH_KEY.public)
    assert [(f.fault_id, f.end) for f in r.faults] == [
        (a.fault_id, "replaced"),
        (b.fault_id, "open"),
    ]
    # A different cut replaces the rules too (the DNS chain rules go away).
    firewall.inject(w.deps, w.paths, Cut(dns=True), 60)
    firewall.inject(w.deps, w.paths, Cut(metadata=True), 60)
    assert not any("53" in r for r in w.fw.chains["4"][CHAIN_IN])


@pytest.mark.process
def test_old_reverter_cannot_clear_the_replacement(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    a = firewall.inject(w.deps, w.paths, Cut(metadata=True), 60)
    b = firewall.inject(w.deps, w.paths, Cut(metadata=True), 600)
    removed, msg = firewall.clear(w.deps, w.paths, expire_id=a.fault_id)
    assert removed is None and "no longer installed" in msg
    assert w.fw.ours() > 0
    removed, _ = firewall.clear(w.deps, w.paths, expire_id=b.fault_id)
    assert removed is not None and removed.fault_id == b.fault_id
    assert w.fw.clean()
    ops = [e.get("op") for e in w.events()]
    assert ops == ["inject", "clear", "inject", "expire"]  # the clear: a replaced


@pytest.mark.process
def test_clear_removes_everything_and_says_so(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    inj = firewall.inject(w.deps, w.paths, Cut(metadata=True, egress443=True, dns=True), 60)
    removed, msg = firewall.clear(w.deps, w.paths)
    assert removed is not None and removed.fault_id == inj.fault_id
    assert w.fw.clean() and not w.paths.state.exists()
    last = w.events()[-1]
    assert last.fields_dict == {"op": "clear", "id": inj.fault_id, "cut": "metadata+egress443+dns"}
    assert inj.fault_id in msg


@pytest.mark.process
def test_clear_with_nothing_installed_writes_no_line(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    removed, msg = firewall.clear(w.deps, w.paths)
    assert removed is None and msg.startswith("no fault installed")
    assert w.sink.lines == []


@pytest.mark.process
def test_systemd_timer_when_systemd_runs(tmp_path: Path) -> None:
    w = make_world(tmp_path, systemd=True)
    inj = firewall.inject(w.deps, w.paths, Cut(metadata=True), 90.2)
    [call] = [c for c in w.fw.calls if c[0] == "systemd-run"]
    assert "--on-active=91s" in call
    cmd = call[call.index("--") + 1 :]
    assert cmd[cmd.index("--expire-id") + 1] == inj.fault_id
    assert "--at" not in cmd  # the timer does the waiting
    assert w.spawned == []
    assert inj.revert == {"kind": "systemd", "unit": f"gcewd-fault-revert-{inj.fault_id}"}
    firewall.clear(w.deps, w.paths)
    assert ["systemctl", "stop", f"gcewd-fault-revert-{inj.fault_id}.timer"] in w.fw.calls


@pytest.mark.process
def test_auto_falls_back_to_a_process_when_systemd_run_fails(tmp_path: Path) -> None:
    w = make_world(tmp_path, systemd=True, fail=("systemd-run",))
    inj = firewall.inject(w.deps, w.paths, Cut(metadata=True), 60)
    assert inj.revert["kind"] == "process" and len(w.spawned) == 1


@pytest.mark.process
def test_forced_systemd_that_fails_installs_nothing(tmp_path: Path) -> None:
    w = make_world(tmp_path, fail=("systemd-run",))
    with pytest.raises(FaultError, match="systemd-run failed"):
        firewall.inject(w.deps, w.paths, Cut(metadata=True), 60, revert_with="systemd")
    assert w.fw.clean() and w.sink.lines == []


@pytest.mark.process
def test_failed_install_rolls_back(tmp_path: Path) -> None:
    w = make_world(tmp_path, fail=("443", "DROP"))
    with pytest.raises(FaultError, match="443"):
        firewall.inject(w.deps, w.paths, Cut(metadata=True, egress443=True), 60)
    assert w.fw.clean()
    assert not w.paths.state.exists()
    # The inject line goes out before the first rule; the roll-back says the fault is over.
    assert [(e.get("op"), e.get("why")) for e in w.events()] == [
        ("inject", None),
        ("clear", "install_failed"),
    ]


@pytest.mark.process
def test_ipv4_only_where_ip6tables_does_not_work(tmp_path: Path) -> None:
    w = make_world(tmp_path, no_v6=True)
    inj = firewall.inject(w.deps, w.paths, Cut(metadata=True), 60)
    assert inj.families == ("4",)
    assert w.fw.ours("4") > 0
    firewall.clear(w.deps, w.paths)
    assert w.fw.clean()


@pytest.mark.process
def test_missing_iptables_is_a_clear_error(tmp_path: Path) -> None:
    w = make_world(tmp_path, missing=True)
    with pytest.raises(firewall.ToolMissing, match="apt-get install iptables"):
        firewall.inject(w.deps, w.paths, Cut(metadata=True), 60)


@pytest.mark.process
def test_nothing_to_cut_is_refused(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    with pytest.raises(FaultError, match="nothing to cut"):
        firewall.inject(w.deps, w.paths, Cut(), 60)
    assert w.fw.calls == []


@pytest.mark.process
def test_status_shows_expiry_and_overdue(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    assert firewall.status(w.deps, w.paths) == {"active": False}
    inj = firewall.inject(w.deps, w.paths, Cut(egress443=True), 300)
    w.clock[0] = NOW + 100
    s = firewall.status(w.deps, w.paths)
    assert s["active"] and s["id"] == inj.fault_id and s["cut"] == "egress443"
    assert (s["until"], s["remaining_s"], s["overdue"]) == (fplan.iso(NOW + 300), 200, False)
    assert s["revert"]["kind"] == "process"
    w.clock[0] = NOW + 301
    assert firewall.status(w.deps, w.paths)["overdue"] is True
    # The expiry lives in the rules' comments too: status works without the state file.
    w.paths.state.unlink()
    assert firewall.status(w.deps, w.paths)["until"] == fplan.iso(NOW + 300)


@pytest.mark.pure
def test_cli_usage_errors_exit_2_before_touching_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gce_watchdog.cli import main

    assert main(["fault", "inject", "--ttl", "10m"]) == 64
    assert "nothing to cut" in capsys.readouterr().err
    assert main(["fault", "inject", "--metadata", "--ttl", "3d"]) == 64
    assert "--ttl must be between" in capsys.readouterr().err


# -- the real thing, inside a network namespace --------------------------------------------------


def write_config(d: Path) -> Path:
    cfg = d / "agent.toml"
    (d / "serial.log").touch()  # the "serial device" (a missing one is unusable)
    cfg.write_text(
        f'[agent]\nstate_dir = "{d}/state"\nrun_dir = "{d}/run"\n'
        f'[serial]\ndevice = "{d}/serial.log"\nfallback_file = "{d}/serial-fallback.log"\n'
    )
    return cfg


def fault_cli(topo: Topology, cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return topo.run_in(topo.vm, [PY, "-m", "gce_watchdog", "fault", *args, "--config", str(cfg)])


def fault_events(d: Path) -> list[Event]:
    p = d / "serial.log"
    evs, stats = decode_all(p.read_bytes() if p.exists() else b"")
    assert stats.rejected == 0
    return [e for e in evs if e.event == "fault"]


def rule_count(topo: Topology) -> int:
    out = topo.run_in(topo.vm, ["iptables", "-S"], check=True).stdout
    return sum("gcewd-fault id=" in ln for ln in out.splitlines())


def poll(cond: object, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within}s: {what}")
        time.sleep(0.05)


@pytest.mark.netns
def test_real_inject_cuts_paths_keeps_ssh_and_clears(topo: Topology, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    topo.start_simgce(tmp_path / "sim")
    topo.start_tcp_listener(topo.vm, "0.0.0.0", 22)  # stand-in sshd in the VM
    topo.start_tcp_listener(topo.gce, "0.0.0.0", 22)  # a host the operator ssh-es on to
    topo.wait_tcp(topo.gce, VM_ADDR, 22)
    # An SSH session that is already open when the fault goes in.
    session = topo.popen_in(
        topo.gce,
        [PY, "-c", (
            "import socket,sys\n"
            f"s=socket.create_connection(({VM_ADDR!r},22),timeout=5)\n"
            "print('up',flush=True); sys.stdin.readline()\n"
            "s.sendall(b'still-here'); print(s.recv(64).decode(),flush=True)\n"
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert session.stdout is not None and session.stdin is not None
    assert session.stdout.readline().strip() == "up"

    r = fault_cli(topo, cfg, "inject", "--metadata", "--egress443", "--ttl", "5m", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    validate("fault-inject", info)  # docs/json.md
    assert info["cut"] == "metadata+egress443" and info["revert"]["kind"] == "process"
    assert rule_count(topo) > 0

    assert not topo.tcp_ok(topo.vm, METADATA_IP, 80, timeout=0.5)
    assert not topo.tcp_ok(topo.vm, EGRESS_IP, 443, timeout=0.5)
    assert topo.tcp_ok(topo.gce, VM_ADDR, 22)  # new SSH in
    assert topo.tcp_ok(topo.vm, "192.0.2.1", 22)  # SSH out of the VM
    session.stdin.write("go\n")
    session.stdin.flush()
    assert session.stdout.readline().strip() == "still-here"  # established session lives on

    st = json.loads(fault_cli(topo, cfg, "status", "--json").stdout)
    validate("fault-status", st)
    assert st["active"] and st["id"] == info["id"] and 0 < st["remaining_s"] <= 300

    r = fault_cli(topo, cfg, "clear")
    assert r.returncode == 0 and info["id"] in r.stdout
    assert rule_count(topo) == 0
    assert "GCEWD" not in topo.run_in(topo.vm, ["iptables", "-S"]).stdout
    assert "GCEWD" not in topo.run_in(topo.vm, ["ip6tables", "-S"]).stdout
    assert topo.tcp_ok(topo.vm, METADATA_IP, 80) and topo.tcp_ok(topo.vm, EGRESS_IP, 443)
    # The reverter was cancelled with the clear.
    poll(lambda: not Path(f"/proc/{info['revert']['pid']}").exists(), 5, "reverter gone")
    ops = [(e.get("op"), e.get("cut")) for e in fault_events(tmp_path)]
    assert ops == [("inject", "metadata+egress443"), ("clear", "metadata+egress443")]


@pytest.mark.netns
def test_real_dns_cut_is_silence_not_eperm(topo: Topology, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    topo.start_simgce(tmp_path / "sim")
    resolve = (
        "import socket,time\nt=time.monotonic()\n"
        "try:\n    socket.getaddrinfo('egress.test',443); print('ok')\n"
        "except OSError as e:\n    print('fail', round(time.monotonic()-t,2))\n"
    )
    assert topo.py_in(topo.vm, resolve).stdout.strip() == "ok"
    assert fault_cli(topo, cfg, "inject", "--dns", "--ttl", "5m").returncode == 0
    verdict, took = topo.py_in(topo.vm, resolve).stdout.split()
    # resolv.conf in the vm namespace: timeout 1 s, 1 attempt. EPERM would fail in ~0 s.
    assert verdict == "fail" and float(took) >= 0.9
    assert topo.tcp_ok(topo.vm, METADATA_IP, 80)  # only DNS was cut
    assert fault_cli(topo, cfg, "clear").returncode == 0
    assert topo.py_in(topo.vm, resolve).stdout.strip() == "ok"


@pytest.mark.netns
def test_real_reinject_replaces_and_cancels_the_old_reverter(
    topo: Topology, tmp_path: Path
) -> None:
    cfg = write_config(tmp_path)
    first = json.loads(fault_cli(topo, cfg, "inject", "--metadata", "--ttl", "5m", "--json").stdout)
    n = rule_count(topo)
    second = json.loads(
        fault_cli(topo, cfg, "inject", "--metadata", "--ttl", "10m", "--json").stdout
    )
    assert rule_count(topo) == n
    out = topo.run_in(topo.vm, ["iptables", "-S"]).stdout
    assert first["id"] not in out and second["id"] in out
    assert sum(ln.endswith(f"-j {CHAIN_OUT}") for ln in out.splitlines()) == 1
    poll(lambda: not Path(f"/proc/{first['revert']['pid']}").exists(), 5, "old reverter gone")
    # Even if the old reverter were still alive, it would not remove the replacement.
    r = fault_cli(topo, cfg, "clear", "--expire-id", first["id"])
    assert r.returncode == 0 and "no longer installed" in r.stdout
    assert rule_count(topo) == n


@pytest.mark.netns
@pytest.mark.slow
def test_real_ttl_reverts_after_the_cli_is_killed(topo: Topology, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    ttl = 2.0
    cli = topo.popen_in(
        topo.vm,
        [PY, "-m", "gce_watchdog", "fault", "inject", "--metadata", "--egress443",
         "--ttl", f"{ttl}s", "--config", str(cfg)],
        start_new_session=True,  # its own process group, like an SSH session's shell
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    t0 = time.monotonic()
    poll(lambda: rule_count(topo) > 0, 10, "rules installed")
    # The operator's session dies: the whole process group goes (if it is still there).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(cli.pid, signal.SIGKILL)
    cli.wait(5)
    state = json.loads((tmp_path / "run" / firewall.STATE_FILE).read_text())
    reverter = state["revert"]["pid"]
    assert os.getpgid(reverter) != cli.pid  # not in the killed group
    poll(lambda: rule_count(topo) == 0, ttl + 8, "rules removed at the TTL")
    assert time.monotonic() - t0 >= ttl - 0.5  # not before the TTL
    poll(lambda: len(fault_events(tmp_path)) == 2, 5, "expire line")
    ops = [e.get("op") for e in fault_events(tmp_path)]
    assert ops == ["inject", "expire"]
    assert not (tmp_path / "run" / firewall.STATE_FILE).exists()
    st = json.loads(fault_cli(topo, cfg, "status", "--json").stdout)
    validate("fault-status", st)
    assert st == {"v": 1, "active": False}


@pytest.mark.netns
def test_real_systemd_path_timer_command_clears(topo: Topology, tmp_path: Path) -> None:
    """The systemd path with a recording systemd-run; the recorded command is then run for real."""
    recorded: list[list[str]] = []

    def run(argv: Sequence[str]) -> Result:
        if argv[0] == "systemd-run":
            recorded.append(list(argv))
            return Result(0, "", "")
        return firewall.run_argv(Topology.exec_argv(topo.vm, argv))

    cfg = write_config(tmp_path)
    sink = MemorySink()
    em = Emitter(sink, SeqAllocator(tmp_path / "state", "0000abcd"), "0000abcd", key=SYNTH_KEY)
    deps = Deps(
        run=run,
        systemd_usable=lambda: True,
        python=[PY, "-m", "gce_watchdog"],
        emit=lambda e, f, t: em.emit(e, f, t, sync=True) is not None,
    )
    paths = Paths(tmp_path / "run", str(cfg))
    inj = firewall.inject(deps, paths, Cut(metadata=True), 30)
    assert inj.revert["kind"] == "systemd" and rule_count(topo) > 0
    [call] = recorded
    assert call[call.index("--on-active=30s")] == "--on-active=30s"
    r = topo.run_in(topo.vm, call[call.index("--") + 1 :])
    assert r.returncode == 0, r.stderr
    assert rule_count(topo) == 0
    assert [e.get("op") for e in fault_events(tmp_path)] == ["expire"]


@pytest.mark.pure
def test_without_root_nothing_runs() -> None:
    import argparse

    ran: list[bool] = []
    args = argparse.Namespace(config=None, iptables="iptables", ip6tables="ip6tables")
    with pytest.raises(CommandError) as e:
        faults_cli._run_op(args, True, lambda d, p: ran.append(True) or 0, euid=lambda: 1000)
    assert e.value.status == EX_NOPERM and ran == []


@pytest.mark.netns
def test_real_without_root_says_so(topo: Topology, nobody: Nobody, nobody_dir: Path) -> None:
    # uid 65534 runs the agent from a world-readable copy (kit/nobody.py): the checkout or the
    # interpreter may live under a 0700 directory (a private home, a `mktemp -d` clone)
    cfg = write_config(nobody_dir)
    cfg.chmod(0o644)
    r = subprocess.run(
        ["ip", "netns", "exec", topo.vm,
         *nobody.argv("-m", "gce_watchdog", "fault", "inject", "--metadata", "--ttl", "1m",
                      "--config", str(cfg))],
        capture_output=True, text=True, timeout=30, cwd="/", env=nobody.env(),
    )  # fmt: skip
    assert r.returncode == EX_NOPERM
    assert "must run as root" in r.stderr
    assert rule_count(topo) == 0


@pytest.mark.netns
def test_real_missing_iptables_exits_69(topo: Topology, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    r = fault_cli(topo, cfg, "inject", "--metadata", "--ttl", "1m", "--iptables", "/nonexistent")
    assert r.returncode == EX_UNAVAILABLE
    assert "apt-get install iptables" in r.stderr


@pytest.mark.netns
def test_real_fault_from_metadata_cuts_keeps_ssh_and_reverts_after_the_agent_dies(
    topo: Topology, tmp_path: Path
) -> None:
    """The metadata path end to end: the watcher sees the request on a metadata server and runs
    the real `fault inject` in the VM's namespace; the agent then dies and the TTL still reverts."""
    from gce_watchdog.daemon.metawatch import MetadataWatcher, SystemdFaultApplier, metadata_root
    from gce_watchdog.testing.simgce import FakeMetadataServer
    from gce_watchdog.vm import config as cfgmod

    cfg_path = write_config(tmp_path)
    topo.start_tcp_listener(topo.gce, "0.0.0.0", 22)
    with FakeMetadataServer() as md:
        cfg = cfgmod.from_dict(
            {
                "agent": {"state_dir": str(tmp_path / "agent-state")},
                "metadata": {"url": md.url},
                "watch": {"faults_from_metadata": True, "poll_timeout": "2s", "refresh": "5s"},
            }
        )
        em = Emitter(
            MemorySink(), SeqAllocator(tmp_path / "w", "0000abcd"), "0000abcd", key=SYNTH_KEY
        )
        applier = SystemdFaultApplier(
            str(cfg_path), ["ip", "netns", "exec", topo.vm, PY, "-m", "gce_watchdog"],
            systemd=lambda: False,
        )  # fmt: skip
        w = MetadataWatcher(
            cfg.watch, metadata_root(cfg), cfg.agent.state_dir, em, apply_fault=applier
        ).start()
        try:
            md.set_attribute(
                "gce-watchdog-fault", '{"id": "t1", "cut": "metadata+egress443", "ttl": "4s"}'
            )
            poll(lambda: rule_count(topo) > 0, 15, "rules installed from metadata")
            assert not topo.tcp_ok(topo.vm, EGRESS_IP, 443, timeout=0.5)
            assert topo.tcp_ok(topo.vm, "192.0.2.1", 22)  # SSH out of the VM stays open
        finally:
            w.stop()  # the agent dies with the fault on
    poll(lambda: rule_count(topo) == 0, 15, "rules removed at the TTL without the agent")
    poll(lambda: len(fault_events(tmp_path)) == 2, 5, "expire line")
    assert [e.get("op") for e in fault_events(tmp_path)] == ["inject", "expire"]
