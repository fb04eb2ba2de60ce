"""End-to-end outage scenarios on a real network (kit/netns.py): the agent runs as a real process
inside the "vm" namespace (``ip netns exec``), talks to the simulated GCE (testing.simgce) in the
"gce" namespace over a veth pair, and writes its serial lines to a file that the tests decode with
wire.protocol.decode_all. Outages are the operator's own ``gce-watchdog fault inject|clear``
(iptables inside the vm namespace), except flapping, which drops the VM's packets on the gce side
(iptables in the gce namespace) because it must change state every tick.

Short ticks (0.4-0.8 s) keep the suite to about a minute and a half; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gce_watchdog.faults import plan as fplan
from gce_watchdog.wire.protocol import Event, needs_announcement
from kit.events import read_events
from kit.netns import PY, VM_ADDR, SimHandle, Topology

pytestmark = [pytest.mark.netns, pytest.mark.netns, pytest.mark.slow]

# The scenes run the agent with action = "dry-run": its decision line is its own event (issue 15).
DECISION = "dry_run_shutdown"

POLL = 0.02  # seconds between looks at the serial file

DNS_TTL_S = 1  # seconds: the TTL of the simulated DNS's answers in these scenes


def wait_for(cond: Callable[[], Any], within: float, what: str) -> Any:
    """Poll cond until it returns something truthy (returned), at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within}s: {what}")
        time.sleep(POLL)


@dataclass
class Scene:
    """One scenario: a topology, simgce, a config, the agent process and its serial file."""

    topo: Topology
    sim: SimHandle
    d: Path
    interval: float = 0.5
    threshold: int = 10
    agent: subprocess.Popen[Any] | None = None

    @property
    def cfg(self) -> Path:
        return self.d / "agent.toml"

    @property
    def serial(self) -> Path:
        return self.d / "serial.log"

    def configure(self, interval: float, threshold: int, probe_timeout: float = 0.3) -> None:
        self.interval, self.threshold = interval, threshold
        self.serial.touch()  # the "serial device" (a missing one is unusable: fallback file)
        self.cfg.write_text(
            f"""
[agent]
interval = {interval}
probe_timeout = {probe_timeout}
threshold = {threshold}
heartbeat_every = 1
state_dir = "{self.d}/state"
run_dir = "{self.d}/run"
action = "dry-run"
[egress]
targets = ["egress.test:443"]
dns_timeout = 0.1
[serial]
device = "{self.serial}"
fallback_file = "{self.d}/serial-fallback.log"
[memory]
enabled = false
[watch]
enabled = false
[actions]
# The dry-run chain without its linger (75 s by default) and without a Compute API call.
linger = 0
dry_run_op = "none"
"""
        )

    def start_agent(self) -> subprocess.Popen[Any]:
        log = open(self.d / "agent.stderr", "ab")  # noqa: SIM115 - closed right after Popen
        self.agent = self.topo.popen_in(
            self.topo.vm,
            [PY, "-m", "gce_watchdog", "run", "--config", str(self.cfg)],
            stdout=log,
            stderr=log,
        )
        log.close()
        return self.agent

    def events(self) -> list[Event]:
        return read_events(self.serial, forged_ok=False, rejected_ok=False)

    def since(self, seq: int) -> list[Event]:
        return [e for e in self.events() if e.seq > seq]

    def fault(self, *args: str) -> subprocess.CompletedProcess[str]:
        r = self.topo.run_in(
            self.topo.vm, [PY, "-m", "gce_watchdog", "fault", *args, "--config", str(self.cfg)]
        )
        assert r.returncode == 0, f"fault {args}: {r.stdout}{r.stderr}"
        return r

    def fault_line(self, op: str) -> Event:
        return wait_for(
            lambda: next(
                (e for e in self.events() if e.event == "fault" and e.get("op") == op), None
            ),
            10,
            f"fault op={op} line",
        )

    def healthy(self, dns_ok: bool = True) -> Event:
        """Wait for a healthy heartbeat (with DNS answering, so the egress cache is filled)."""
        return wait_for(
            lambda: next(
                (
                    e
                    for e in reversed(self.events())
                    if e.event == "heartbeat" and (not dns_ok or e.get("dns") == "ok")
                ),
                None,
            ),
            15,
            "a healthy heartbeat",
        )

    def ticks_after(self, seq: int) -> list[Event]:
        return [e for e in self.since(seq) if e.event in ("tick", "heartbeat")]

    def debug(self) -> str:
        err = (self.d / "agent.stderr").read_text()[-2000:] if self.agent else ""
        lines = "\n".join(
            f"{e.seq} {e.event} {e.fields_dict} {e.text}" for e in self.events()[-40:]
        )
        return f"serial:\n{lines}\nagent stderr tail:\n{err}"


@pytest.fixture
def scene(topo: Topology, tmp_path: Path) -> Iterator[Scene]:
    # answers valid for DNS_TTL_S: the agent reuses one that long while egress works (docs/agent.md)
    sim = topo.start_simgce(tmp_path / "sim", extra=["--dns-ttl", str(DNS_TTL_S)])
    s = Scene(topo, sim, tmp_path)
    yield s
    if s.agent is not None and s.agent.poll() is None:
        s.agent.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.agent.wait(10)


def climbs(evs: list[Event]) -> list[str]:
    return [e.get("rung") or "" for e in evs if e.event == "tick" and "FAILED (" in e.text]


def rung_of(e: Event) -> int:
    return int((e.get("rung") or "0/0").split("/")[0])


def test_both_paths_dropped_shuts_down_after_exactly_threshold_ticks(scene: Scene) -> None:
    scene.configure(interval=0.5, threshold=10)
    scene.topo.start_tcp_listener(scene.topo.vm, "0.0.0.0", 22)  # stand-in sshd
    scene.start_agent()
    scene.healthy()
    t0 = time.monotonic()
    scene.fault("inject", "--metadata", "--egress443", "--ttl", "2m")
    inj = scene.fault_line("inject")
    assert inj.get("cut") == "metadata+egress443"
    assert scene.topo.tcp_ok(scene.topo.gce, VM_ADDR, 22)  # the operator keeps SSH
    shutdown = wait_for(
        lambda: next((e for e in scene.since(inj.seq) if e.event == DECISION), None),
        scene.threshold * scene.interval + 10,
        "the shutdown line",
    )
    took = time.monotonic() - t0
    scene.fault("clear")
    after = scene.since(inj.seq)
    ticks = [e for e in after if e.event == "tick" and e.seq < shutdown.seq]
    first = next(i for i, e in enumerate(ticks) if "FAILED (" in e.text)
    # From the first failing tick on, every tick climbed one rung: 1/10 .. 10/10, nothing else.
    assert [e.get("rung") for e in ticks[first:]] == [f"{n}/10" for n in range(1, 11)], (
        scene.debug()
    )
    assert all(
        (e.get("md") or "").startswith("fail") and (e.get("eg") or "").startswith("fail")
        for e in ticks[first:]
    )
    assert shutdown.fields_dict["rung"] == "10/10" and shutdown.get("action") == "dry-run"
    assert shutdown.seq > ticks[-1].seq
    assert not any(e.event == "recovered" for e in after if e.seq < shutdown.seq)
    assert [e.event for e in after].count(DECISION) == 1
    # The agent and both fault commands share one line counter: no gaps, no duplicates.
    seqs = [e.seq for e in scene.events()]
    # the key announcements (seq 0, 1 and every ANNOUNCE_EVERY, protocol v3) are left out
    assert seqs == [n for n in range(seqs[-1] + 1) if not needs_announcement(n)]
    assert took < scene.threshold * scene.interval + 6


@pytest.mark.parametrize(
    ("flags", "broken"),
    [
        (["--metadata"], "md"),
        (["--egress443"], "eg"),
        (["--dns"], "dns"),
        (["--metadata", "--metadata-dns"], "md+dns"),
    ],
    ids=["metadata", "egress443", "dns", "metadata+its-dns"],
)
def test_one_path_down_never_shuts_down(scene: Scene, flags: list[str], broken: str) -> None:
    scene.configure(interval=0.5, threshold=4)
    scene.start_agent()
    scene.healthy(dns_ok=True)  # the egress probe has resolved its target once
    scene.fault("inject", *flags, "--ttl", "2m")
    inj = scene.fault_line("inject")
    anchor = scene.events()[-1].seq  # the rules are in: the CLI has returned
    n = 3 * scene.threshold  # three times the threshold, all with the fault on
    wait_for(lambda: len(scene.ticks_after(anchor)) >= n + 1, n * scene.interval + 10, "ticks")
    scene.fault("clear")
    ticks = scene.ticks_after(anchor)[1 : n + 1]  # the first may have started before the rules
    after = scene.since(inj.seq)
    assert not any(e.event == DECISION for e in after), scene.debug()
    assert all(rung_of(e) == 0 for e in ticks), scene.debug()

    def field(e: Event, k: str) -> str:
        return (e.get(k) or "").split("/")[0]

    # DNS silent, egress up: the answer held is reused until its TTL runs out (a tick or two
    # here), then every tick asks, gets nothing, and connects to the cached addresses.
    ttl_ticks = int(DNS_TTL_S / scene.interval) + 1
    dns = [e.get("dns") for e in ticks]
    for i, e in enumerate(ticks):
        md = field(e, "md") if e.event == "tick" else "ok"
        eg = field(e, "eg") if e.event == "tick" else "ok"
        assert md == ("fail" if "md" in broken else "ok"), scene.debug()
        assert eg == ("fail" if broken == "eg" else "ok"), scene.debug()
        if "dns" in broken and i >= ttl_ticks:
            assert e.get("dns") == "fail", (dns, scene.debug())
    if "dns" in broken:  # once failing, it says so on every tick: no answer is kept
        assert "fail" in dns, (dns, scene.debug())
        first = dns.index("fail")
        assert set(dns[first:]) == {"fail"}, (dns, scene.debug())


def test_nine_tick_outage_then_clear_recovers_without_shutdown(scene: Scene) -> None:
    scene.configure(interval=0.8, threshold=10)
    agent = scene.start_agent()
    scene.healthy()
    scene.fault("inject", "--metadata", "--egress443", "--ttl", "2m")
    inj = scene.fault_line("inject")
    nine = wait_for(
        lambda: next((e for e in scene.since(inj.seq) if climbs([e]) == ["9/10"]), None),
        9 * scene.interval + 10,
        "rung 9/10",
    )
    # Hold the agent still while the operator clears the fault, so the tenth tick cannot race
    # the clear: the outage is exactly nine ticks long whatever the machine's load.
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        scene.fault("clear")
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    rec = wait_for(
        lambda: next((e for e in scene.since(nine.seq) if e.event == "recovered"), None),
        10,
        "recovered",
    )
    assert rec.get("from") == "9", scene.debug()
    assert climbs(scene.since(inj.seq)) == [f"{n}/10" for n in range(1, 10)], scene.debug()
    # A few healthy ticks more, then no shutdown anywhere.
    wait_for(lambda: len(scene.ticks_after(rec.seq)) >= 3, 3 * scene.interval + 10, "ticks")
    assert not any(e.event == DECISION for e in scene.events())
    assert [e.get("op") for e in scene.events() if e.event == "fault"] == ["inject", "clear"]


def test_flapping_never_shuts_down(scene: Scene) -> None:
    interval, flaps = 0.4, 30
    scene.configure(interval=interval, threshold=10, probe_timeout=0.15)
    scene.start_agent()
    hb = scene.healthy()
    gce = scene.topo.gce
    drop = ["INPUT", "-s", VM_ADDR, "-j", "DROP"]  # the gce side goes silent for the VM

    def flip(down: bool) -> None:
        r = scene.topo.run_in(gce, ["iptables", "-w", "-A" if down else "-D", *drop])
        assert r.returncode == 0, r.stderr

    # Driven by the agent's own lines, not by a schedule: after each tick's line the gce side is
    # set to the opposite of what that tick saw (a climb -> up, anything else -> down). A loaded
    # machine only makes a phase last longer; it never makes the test guess at the agent's grid.
    down, seen, recoveries = False, hb.seq, 0
    for _ in range(10 * flaps):  # bounded: each pass consumes one tick line
        e = wait_for(
            lambda: next(iter(scene.ticks_after(seen)), None), 10 * interval + 10, "next tick"
        )
        seen = e.seq
        climbed = e.event == "tick" and "FAILED (" in e.text
        if climbed == down:  # that tick saw the state we set: set the other one
            down = not climbed
            flip(down)
        recoveries = sum(x.event == "recovered" for x in scene.since(hb.seq))
        if recoveries >= flaps:
            break
    if down:
        flip(down=False)
    last = scene.events()[-1]
    wait_for(lambda: len(scene.ticks_after(last.seq)) >= 2, 10, "ticks after the flapping")
    evs = [e for e in scene.events() if e.seq > hb.seq]
    assert not any(e.event == DECISION for e in evs), scene.debug()
    assert recoveries >= flaps, scene.debug()  # the outage really came and went, again and again
    assert len(climbs(evs)) >= flaps, scene.debug()
    # Each outage ends as soon as its first climb is seen: the ladder never gets near 10.
    assert max(rung_of(e) for e in evs if e.event == "tick") < 10, scene.debug()


def test_sigkill_at_rung_five_restart_continues_and_fires_at_threshold(scene: Scene) -> None:
    scene.configure(interval=0.5, threshold=10)
    agent = scene.start_agent()
    scene.healthy()
    scene.fault("inject", "--metadata", "--egress443", "--ttl", "2m")
    inj = scene.fault_line("inject")
    wait_for(lambda: "5/10" in climbs(scene.since(inj.seq)), 5 * scene.interval + 10, "rung 5")
    agent.kill()  # SIGKILL: no stop line, no clean-up
    agent.wait(10)
    before = climbs(scene.since(inj.seq))
    last_line = scene.events()[-1].seq
    scene.start_agent()
    start = wait_for(
        lambda: next((e for e in scene.since(last_line) if e.event == "start"), None),
        15,
        "the restarted agent's start line",
    )
    shutdown = wait_for(
        lambda: next((e for e in scene.since(start.seq) if e.event == DECISION), None),
        10 * scene.interval + 15,
        "the shutdown line",
    )
    scene.fault("clear")
    after = climbs([e for e in scene.since(start.seq) if e.seq < shutdown.seq])
    resumed = rung_of(start)
    # The rung is saved before its line is written: a kill between the two may hide one line,
    # never a rung. The restarted agent starts where the ladder was and climbs on to 10.
    last_before = int(before[-1].split("/")[0])
    assert last_before >= 5 and resumed in (last_before, last_before + 1), scene.debug()
    assert after == [f"{n}/10" for n in range(resumed + 1, 11)], scene.debug()
    assert shutdown.get("rung") == "10/10"
    assert [e.event for e in scene.events()].count(DECISION) == 1
    assert [e.event for e in scene.events()].count("start") == 2


def test_killed_fault_cli_still_reverts_at_ttl_and_the_agent_recovers(scene: Scene) -> None:
    scene.configure(interval=0.5, threshold=10)
    scene.start_agent()
    scene.healthy()
    ttl = 3.0  # about six ticks: well under the threshold
    cli = scene.topo.popen_in(
        scene.topo.vm,
        [PY, "-m", "gce_watchdog", "fault", "inject", "--metadata", "--egress443",
         "--ttl", f"{ttl}s", "--config", str(scene.cfg)],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    inj = scene.fault_line("inject")

    def rules_in() -> bool:
        # In force only once hooked: `fault inject` fills its chains first and hooks them into
        # OUTPUT/INPUT last, so a DROP rule alone can be seen before it applies to anything.
        out = scene.topo.run_in(scene.topo.vm, ["iptables", "-S", "OUTPUT"]).stdout
        return f"-j {fplan.CHAIN_OUT}" in out

    wait_for(rules_in, 10, "the fault's rules, hooked")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(cli.pid, signal.SIGKILL)  # the operator's session is gone
    cli.wait(10)
    exp = wait_for(
        lambda: next(
            (e for e in scene.since(inj.seq) if e.event == "fault" and e.get("op") == "expire"),
            None,
        ),
        ttl + 10,
        "the expire line",
    )
    assert (exp.ts_ms - inj.ts_ms) / 1000 >= ttl - 1.0
    # The reverter removes the rules, then writes its line: the agent's next tick may recover
    # before that line gets its seq, so look for the recovery from the injection on.
    try:
        rec = wait_for(
            lambda: next((e for e in scene.since(inj.seq) if e.event == "recovered"), None),
            10,
            "recovered",
        )
    except AssertionError as e:
        raise AssertionError(f"{e}\n{scene.debug()}") from None
    reached = climbs([e for e in scene.since(inj.seq) if e.seq < rec.seq])
    assert len(reached) >= 3 and rec.get("from") == reached[-1].split("/")[0], scene.debug()
    assert not any(e.event == DECISION for e in scene.events())
