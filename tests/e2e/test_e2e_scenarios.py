"""The whole chain in a real booted VM (docs/e2e.md).

Each scenario boots the Debian guest under qemu (``-snapshot``: a fresh disk every time) with the
simulated GCE around it. The guest runs the REAL ``startup/startup-script.sh`` as its
``startup-script`` attribute: it installs the agent from the wheelhouse the fake GCE serves,
starts the systemd unit and runs the workload under ``gce-watchdog exec``. The serial log is then
read by the real poller through the fake Compute API while the VM runs, and once more after it is
off (``e2e/observe.py``).

Output per scenario: ``build/e2e/<scenario>/`` (serial.log, report.png, qemu.log, simgce log,
cursors and ledger).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Callable

import pytest
from gce_watchdog.poller.verdict import VerdictKind
from gce_watchdog.wire.protocol import Event
from kit.paths import REPO

from e2e import observe, vm

pytestmark = [pytest.mark.vm, pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(900)]

STARTUP_SCRIPT = (REPO / "startup" / "startup-script.sh").read_text()
AGENT = "/opt/gce-watchdog/bin/gce-watchdog"

# Short ticks so a scenario takes 1-2 minutes: a 2 s tick, 10 ticks to the decision, 6 s linger.
CONFIG = (
    """\
[agent]
interval = "2s"
probe_timeout = "1s"
threshold = 10
heartbeat_every = 3

"""
    + vm.FAKE_INTERNET_CONFIG
)

# Budget for one boot, start to poweroff. Measured: ~105 s for the healthy run on a 2-core
# machine (boot 25 s, agent install 50 s); the rest is room for a machine busy with other work.
TIMEOUT = 480.0


def spec(
    name: str, workload: list[str] | None, *, deb: bool = False, config: str = CONFIG, **kw: object
) -> vm.VmSpec:
    """The agent comes from the wheelhouse, or from the .deb (`make deb`'s output) when deb;
    with ``baked=True`` (a VmSpec field) it is this run's wheelhouse baked into the image, and
    the start-up script skips the download and install (docs/e2e.md, "Time")."""
    if deb:
        src = {
            "gce-watchdog-deb-url": vm.DEB_URL,
            "gce-watchdog-deb-sha256": vm.sha256_of(vm.WWW_DIR, "gce-watchdog.deb"),
        }
    else:
        src = {
            "gce-watchdog-wheel-url": vm.WHEEL_URL,
            "gce-watchdog-wheel-sha256": vm.sha256_of(vm.WWW_DIR, "wheelhouse.tar"),
        }
    # The linger of the end-of-life chain, with or without the agent (CONFIG's actions.linger):
    # three reads of the 2 s live poller while the VM is RUNNING.
    attrs = {**src, "gce-watchdog-done-action": "poweroff", "gce-watchdog-linger": "6s"}
    if workload is not None:
        attrs["gce-watchdog-workload"] = json.dumps(workload)
    return vm.VmSpec(
        name=name,
        startup_script=STARTUP_SCRIPT,
        attributes=attrs,
        config=config,
        timeout=TIMEOUT,
        **kw,  # type: ignore[arg-type]
    )


def boot(
    e2e: vm.Harness,
    spec: vm.VmSpec,
    console: Callable[[vm.SerialConsole], None] | None = None,
    seen: list[observe.LivePoller] | None = None,
    **live_kw: object,
) -> tuple[vm.VmResult, observe.PollRun]:
    """Boot once with the poller reading the serial port live (faithful fake: reads only while
    RUNNING, nothing fed after the VM is off; ``--reap``); the VM's final status is TERMINATED
    when qemu exited by itself. ``console``: what the harness types on ttyS0 (vm.run). The
    LivePoller is appended to ``seen`` (its fake's calls stay readable after the boot)."""
    with observe.LivePoller(vm.BUILD / spec.name / "poller", **live_kw) as live:  # type: ignore[arg-type]
        res = e2e.boot(spec, watch=live.watch, console=console, on_network=live.expose)
        run = live.finish(res.serial(), "RUNNING" if res.timed_out else "TERMINATED")
    if seen is not None:
        seen.append(live)
    return res, run


def events_of(res: vm.VmResult) -> list[Event]:
    return observe.latest_boot_events(observe.timeline(res.serial()))


def named(events: list[Event], event: str, **fields: str) -> list[Event]:
    return [e for e in events if e.event == event and all(e.get(k) == v for k, v in fields.items())]


def rung(e: Event) -> int:
    return int((e.get("rung") or "0/0").split("/")[0])


def check_powered_off(res: vm.VmResult) -> None:
    assert not res.timed_out, f"the guest did not power off within {TIMEOUT}s: {res.summary()}"
    assert res.qemu_rc == 0, res.summary()


def check_no_lost_lines(res: vm.VmResult, events: list[Event]) -> None:
    tl = observe.timeline(res.serial())
    assert events, f"no GCEWD3 line in {res.serial_log}"
    assert observe.seq_contiguous(events) == [], f"seq gaps in {res.serial_log}"
    assert tl.lost_lines == 0
    assert events[0].seq == 0 and events[0].event == "key", "seq 0: the key announcement"


def save_report(res: vm.VmResult) -> None:
    why = observe.report_png(res.serial_log, res.outdir / "report.png")
    if why:
        print(f"no report.png for {res.name}: {why}")


def bootstrap_ok(events: list[Event]) -> None:
    assert named(events, "phase", ph="bootstrap"), "phase bootstrap"
    for step in ("dns", "install", "unit"):
        assert named(events, "bootstrap_step", step=step, st="ok"), f"bootstrap_step {step} ok"
    assert named(events, "start"), "the agent's start line"
    assert named(events, "phase", ph="workload"), "phase workload"
    assert not named(events, "setup_failed")


# The guest's serial getty is restarted and the port hung up (vhangup) in the middle of the job
# (e2e/guest/usr/local/sbin/e2e-console-hangup), as util-linux login(1) does at every login.
HANGUP = "/usr/local/sbin/e2e-console-hangup"
# Then a real serial-console login and logout by the harness (vm.login_session) while the guest's
# half (e2e/guest/usr/local/sbin/e2e-console-login) waits for it, and a syslog marker after it.
LOGIN = "/usr/local/sbin/e2e-console-login"
# What the console user runs, and what it prints: "42" is not in the shell's echo of the command.
LOGIN_COMMAND = "echo e2e-login-$((6*7)) $(id -un) | tee /tmp/e2e-login-proof"
LOGIN_OUTPUT = f"e2e-login-42 {vm.CONSOLE_USER}".encode()


def console_login(con: vm.SerialConsole) -> None:
    ready = con.expect(b"e2e-console-login: ready", 0, TIMEOUT)
    vm.login_session(con, LOGIN_COMMAND, LOGIN_OUTPUT, since=ready)


def test_healthy_workload_completes(e2e: vm.Harness) -> None:
    # 14 s after the logout: at least two heartbeats (every 3 ticks of 2 s) on the reopened port.
    workload = [
        "bash", "-c", f"echo working; {HANGUP}; {LOGIN} || exit 1; sleep 14; echo finished",
    ]  # fmt: skip
    res, run = boot(e2e, spec("healthy", workload), console=console_login)
    save_report(res)
    check_powered_off(res)
    assert res.console_error is None, f"{res.console_error} (see {res.outdir / 'console.log'})"
    events = events_of(res)
    bootstrap_ok(events)
    exits = named(events, "exit")
    assert len(exits) == 1 and exits[0].get("rc") == "0" and exits[0].get("sig") == "-"
    assert named(events, "phase", ph="done")
    assert named(events, "heartbeat", ph="workload"), "the agent ticked healthy during the job"
    assert not named(events, "shutdown")
    # A tick line means a probe failed once; on a busy TCG host a 1 s probe can. The ladder must
    # not climb beyond such a blip in a healthy run.
    assert all(rung(e) <= 2 for e in named(events, "tick")), "no sustained outage"
    check_no_lost_lines(res, events)
    # The agent wrote on after the getty restart and the vhangup (no gap: check_no_lost_lines).
    raw = res.serial()
    hung = raw.find(b"e2e-console-hangup: done rc=0")
    assert hung > 0, "the getty restart and the vhangup ran"
    assert re.search(rb"GCEWD3 \S+ \d+ \S+ heartbeat ", raw[hung:]), "agent lines after the hangup"
    # ... and after a real login, a command and a logout on ttyS0: the shell's output, then the
    # prompt of the getty systemd restarted (TTYVHangup) after the logout, then heartbeats.
    said = raw.find(LOGIN_OUTPUT, hung)
    assert said > 0, "the console user's command ran in a login shell on ttyS0"
    logout = raw.find(vm.LOGIN_PROMPT, said)
    assert logout > 0, "a fresh getty prompted after the logout"
    # The guest says "done" once it saw the logout and the fresh getty; its line and the getty's
    # prompt are two writers on the port, in either order (a loaded run had the line first).
    assert b"e2e-console-login: done rc=0" in raw[said:], "the guest saw the logout"
    assert re.search(rb"GCEWD3 \S+ \d+ \S+ heartbeat ", raw[logout:]), "agent lines after logout"
    # Syslog on the console as on a GCE Debian 12 image (guest-configs' 90-google.conf:
    # daemon,kern.* /dev/console): the guest's daemon.info marker of this boot, and the kernel's
    # messages through imklog (rsyslog's "HOST kernel: " prefix, which the kernel's own console
    # output has not), interleaved with the agent's lines with no seq gap (check_no_lost_lines).
    boot_id = events[0].boot.encode()
    assert re.search(rb" gce-e2e e2e-syslog: marker " + boot_id, raw), "daemon.* via rsyslog"
    assert b" gce-e2e kernel: " in raw, "kern.* via rsyslog"

    assert run.final.verdict is not None
    assert run.final.verdict.kind is VerdictKind.WORKLOAD_OK, run.final.verdict
    # Read while RUNNING (the linger), never failed over, and deleted once off (--reap).
    assert any(o.verdict and o.verdict.kind is VerdictKind.WORKLOAD_OK for o in run.during)
    assert all(o.action == "none" for o in [*run.during, run.final, run.again])
    assert run.final.reaped and run.final.reap_error is None, run.final
    # a second poller with a fresh cursor: the VM is gone (404), it never saw it and the ledger
    # holds no decision (nothing failed over): no verdict, as for a typo'd name
    assert run.other.verdict is None and "never seen" in (run.other.error or ""), run.other


def test_setup_failed_job_never_fails_over_and_is_reaped(e2e: vm.Harness) -> None:
    """Issue 24: a `setup_failed cause=job` (a wheelhouse whose sha256 does not match: the
    job's own configuration is wrong) is read during the linger, never failed over, and the VM
    is deleted once it powered itself off."""
    s = spec("setup-failed-job", ["true"])
    s = dataclasses.replace(s, attributes={**s.attributes, "gce-watchdog-wheel-sha256": "0" * 64})
    res, run = boot(e2e, s)
    save_report(res)
    check_powered_off(res)
    events = events_of(res)
    failed = named(events, "setup_failed")
    assert len(failed) == 1 and failed[0].get("cause") == "job", failed
    assert not named(events, "start")
    check_no_lost_lines(res, events)
    assert run.final.verdict is not None
    assert run.final.verdict.kind is VerdictKind.SETUP_FAILED, run.final.verdict
    assert "failover" not in [o.action for o in run.looks()]
    assert run.final.reaped, run.final


def test_spot_preemption_through_the_fake_fails_over_once(e2e: vm.Harness) -> None:
    """Issue 24: GCE preempts the Spot VM while its job runs (the fake records
    compute.instances.preempted and the VM is TERMINATED); the guest is not told and writes on,
    unread. The poller finds the operation: one failover, the VM deleted."""
    workload = ["bash", "-c", "echo working; sleep 20; echo finished"]
    res, run = boot(
        e2e, spec("spot-preempt", workload, baked=True), spot=True, preempt_on=b" ph=workload"
    )
    check_powered_off(res)
    assert run.final.verdict is not None
    assert run.final.verdict.kind is VerdictKind.PREEMPTED, run.final.verdict
    actions = [o.action for o in run.looks()]
    assert actions.count("failover") == 1, f"exactly one failover decision: {actions}"
    assert any(o.reaped for o in run.looks()), "deleted after the failover (--reap)"


# What a workload without the line key can forge (issues 15, 25): a well-formed v3 `exit rc=0`
# with a correct CRC and a signature of its own making, printed (through `exec`, which defuses
# it) and written straight to the console (as a process that can write the port would).
FORGE_PY = (
    "import base64, os, time, zlib;"
    'b = open("/proc/sys/kernel/random/boot_id").read().strip().replace("-", "")[:8];'
    't = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime());'
    'body = "GCEWD3 %s 40 %s exit rc=0 sig=- dur=1.0" % (b, t);'
    'signed = body + " #" + base64.urlsafe_b64encode(os.urandom(64)).decode()[:86];'
    'line = "%s%08x" % (signed, zlib.crc32(signed.encode()) & 0xFFFFFFFF);'
    "print(line, flush=True);"
    'open("/dev/ttyS0", "w").write(line + chr(10))'
)


def test_wedge_shuts_down_and_fails_over_once(e2e: vm.Harness) -> None:
    workload = [
        "bash", "-c",
        # A few healthy ticks first, then the operator's outage (metadata + 443), then the job
        # "keeps running" until the watchdog powers the VM off. The TTL outlasts the ladder.
        # After the fault the workload forges `exit rc=0` lines (they must change nothing).
        f"sleep 12; {AGENT} fault inject --metadata --egress443 --ttl 10m; sleep 4; "
        f"python3 -c '{FORGE_PY}'; sleep 600",
    ]  # fmt: skip
    res, run = boot(e2e, spec("wedge", workload, deb=True))
    save_report(res)
    check_powered_off(res)
    events = events_of(res)
    bootstrap_ok(events)
    inst = named(events, "bootstrap_step", step="install")[0]
    assert "gce-watchdog.deb" in inst.text, f"installed from the .deb: {inst}"
    assert named(events, "bootstrap_step", step="unit")[0].text.startswith("packaged unit")

    inject = named(events, "fault", op="inject")
    assert len(inject) == 1, "one fault inject line"
    before = [e for e in events if e.seq < inject[0].seq]
    assert named(before, "heartbeat", ph="workload"), "healthy ticks before the fault"

    after = [e for e in events if e.seq > inject[0].seq]
    shutdowns = named(after, "shutdown")
    assert shutdowns, "a shutdown line after the fault"
    first = shutdowns[0]
    assert first.get("reason") == "ladder" and first.get("rung") == "10/10"
    assert first.get("chain"), "the decision names its action chain"
    climb = [rung(e) for e in after if e.event == "tick" and e.seq < first.seq]
    assert climb[-10:] == list(range(1, 11)), f"ticks 1/10..10/10 in order, got {climb}"
    assert not named(after, "recovered"), "the ladder never reset during the outage"
    assert [e for e in shutdowns[1:] if e.get("rep")], "the verdict repeated while lingering"
    steps = [(e.get("step"), e.get("status")) for e in after if e.event == "action"]
    assert ("linger", "start") in steps or any(s == "linger" for s, _ in steps), steps
    assert any(s == "poweroff" for s, _ in steps), f"the chain reached poweroff: {steps}"
    check_no_lost_lines(res, events)

    assert run.final.verdict is not None
    assert run.final.verdict.kind is VerdictKind.SELF_SHUTDOWN, run.final.verdict
    assert run.final.verdict.failover
    actions = [o.action for o in run.looks()]
    assert actions.count("failover") == 1, f"exactly one failover decision: {actions}"
    # The linger keeps the VM up so a poller reads the verdict while the VM still runs.
    assert "failover" in [o.action for o in run.during], "decided while the VM was RUNNING"
    assert run.final.action == "already_decided"
    assert run.again.action == "already_decided"
    assert run.other.action == "already_decided", "a second poller is refused by the ledger"
    assert run.other.decision is not None and run.final.decision is not None
    assert run.other.decision.token == run.final.decision.token
    # The forged `exit rc=0`: the copy through `exec` was defused, the one written to the port
    # is counted as forged; neither is an event, and the verdict above stayed self_shutdown.
    tl = observe.timeline(res.serial())
    assert tl.forged >= 1 and tl.forged_reasons.get("bad_sig", 0) >= 1, tl.forged_reasons
    assert b"GCEWd3 " in res.serial(), "exec passed the printed copy through defused"
    assert not named(events, "exit", rc="0")


# dns-late: the guest's first queries get no answer, counted in queries, never in seconds since the
# harness started (a slow boot once ate a 40 s silence whole). Measured: one look-up is one query
# (the A query; the script's 5 s bound per look-up ends it before glibc's retry), 7 s apart, so 6
# silent queries are 6 look-ups and a DNS step of ~43 s.
DNS_SILENT_QUERIES = 6


def test_dns_late_bootstrap_retries_and_succeeds(e2e: vm.Harness) -> None:
    res, run = boot(
        e2e,
        spec(
            "dns-late",
            ["bash", "-c", "echo working; sleep 4"],
            dns_silent_queries=DNS_SILENT_QUERIES,
        ),
    )
    save_report(res)
    check_powered_off(res)
    events = events_of(res)
    bootstrap_ok(events)
    serial = res.serial()
    assert b"does not resolve yet" in serial, "the start-up script waited for DNS"
    assert b"resolves after" in serial, "...and said after how many look-ups it resolved"
    dns = named(events, "bootstrap_step", step="dns")[0]
    assert int(dns.get("dur") or 0) >= 5, f"the DNS step took time: {dns}"
    queries = res.dns_queries()
    assert [a for _, a in queries[:DNS_SILENT_QUERIES]] == [False] * DNS_SILENT_QUERIES, queries
    assert any(a for _, a in queries[DNS_SILENT_QUERIES:]), f"then DNS answered: {queries}"
    exits = named(events, "exit")
    assert exits and exits[0].get("rc") == "0"
    check_no_lost_lines(res, events)

    assert run.final.verdict is not None
    assert run.final.verdict.kind is VerdictKind.WORKLOAD_OK, run.final.verdict


def test_dns_never_is_setup_failed_infra_and_fails_over(e2e: vm.Harness) -> None:
    # The script's DNS deadline (300 s by default) shortened to 30 s through the image's runner.
    res, run = boot(
        e2e,
        spec("dns-never", ["true"], dns_never=True, startup_env={"GCEWD_DNS_DEADLINE": "30"}),
    )
    save_report(res)
    check_powered_off(res)
    events = events_of(res)
    failed = named(events, "setup_failed")
    assert len(failed) == 1, "one setup_failed line"
    assert failed[0].get("step") == "dns" and failed[0].get("rc") == "75", failed[0]
    assert failed[0].get("cause") == "infra", "DNS never came up: the job never ran"
    assert not named(events, "bootstrap_step", step="install"), "nothing installed"
    assert not named(events, "start") and not named(events, "exit")
    check_no_lost_lines(res, events)

    assert run.final.verdict is not None
    assert run.final.verdict.kind is VerdictKind.SETUP_FAILED_INFRA, run.final.verdict
    assert run.final.verdict.failover
    actions = [o.action for o in run.looks()]
    assert actions.count("failover") == 1, f"exactly one failover decision: {actions}"


# The flap's ladder: each outage ends at `fault clear`, whose own start-up in a guest under TCG
# on a loaded host took over 20 s (a 6 s outage became 29 s and reached 10/10 at 2 s ticks).
# 100 rungs of 2 s outlast the fault's 2 min TTL, so no outage can reach the top whatever the
# load: the systemd timer reverts it first even if `fault clear` never ran.
FLAP_THRESHOLD = 100
FLAP_CONFIG = CONFIG.replace("threshold = 10\n", f"threshold = {FLAP_THRESHOLD}\n")


def test_flapping_outage_never_shuts_down(e2e: vm.Harness) -> None:
    # Three outages of ~3 ticks plus the CLI's own start-up, each cleared long before the top.
    assert f"threshold = {FLAP_THRESHOLD}" in FLAP_CONFIG
    cycle = (
        f"{AGENT} fault inject --metadata --egress443 --ttl 2m; sleep 6; "
        f"{AGENT} fault clear; sleep 6; "
    )
    res, run = boot(
        e2e,
        spec(
            "flap",
            ["bash", "-c", "set -e; sleep 6; " + cycle * 3 + "echo ok"],
            config=FLAP_CONFIG,
            baked=True,
        ),
    )
    save_report(res)
    check_powered_off(res)
    events = events_of(res)
    bootstrap_ok(events)
    assert len(named(events, "fault", op="inject")) == 3
    assert len(named(events, "fault", op="clear")) == 3
    rungs = [rung(e) for e in events if e.event == "tick"]
    assert rungs and max(rungs) < FLAP_THRESHOLD, (
        f"the ladder climbed ({rungs}) but never to the top"
    )
    assert max(rungs) >= 2, f"each outage held for several ticks: {rungs}"
    assert len(named(events, "recovered")) >= 2, "the ladder reset after the outages"
    assert not named(events, "shutdown")
    exits = named(events, "exit")
    assert exits and exits[0].get("rc") == "0"
    check_no_lost_lines(res, events)

    assert run.final.verdict is not None
    assert run.final.verdict.kind is VerdictKind.WORKLOAD_OK, run.final.verdict


# config by metadata (issue 27): the gce-watchdog-config attribute becomes a checked drop-in
# before the agent starts, and `config show` on the guest names it as the source.
MD_CONFIG = '[agent]\naction = "dry-run"\nheartbeat_every = 4\n'
DROPIN = "/etc/gce-watchdog/config.d/50-metadata.toml"


def _with_config(s: vm.VmSpec, value: str) -> vm.VmSpec:
    return dataclasses.replace(s, attributes={**s.attributes, "gce-watchdog-config": value})


def test_config_by_metadata_is_a_drop_in_the_agent_runs_with(e2e: vm.Harness) -> None:
    show = f"{AGENT} config show --config /etc/gce-watchdog/config.toml"
    pick = "grep -E '^(action|heartbeat_every|interval) =' | sed 's/^/shown: /'"
    res, _ = boot(
        e2e,
        _with_config(spec("config-md", ["bash", "-c", f"{show} | {pick}"], baked=True), MD_CONFIG),
    )
    check_powered_off(res)
    events = events_of(res)
    bootstrap_ok(events)
    assert named(events, "bootstrap_step", step="config", st="ok"), "the config step wrote it"
    serial = res.serial()
    assert f'shown: action = "dry-run"  # {DROPIN}'.encode() in serial, serial[-3000:]
    assert f"shown: heartbeat_every = 4  # {DROPIN}".encode() in serial
    assert b'shown: interval = "2s"  # /etc/gce-watchdog/config.toml' in serial
    assert named(events, "start"), "the agent started after the drop-in was written"
    exits = named(events, "exit")
    assert exits and exits[0].get("rc") == "0"
    check_no_lost_lines(res, events)


def test_a_bad_config_attribute_is_setup_failed_job_with_the_error(e2e: vm.Harness) -> None:
    res, run = boot(
        e2e, _with_config(spec("config-bad", ["true"], baked=True), "[agent]\nthreshold = 0\n")
    )
    check_powered_off(res)  # the failure action (poweroff)
    events = events_of(res)
    failed = named(events, "setup_failed")
    assert len(failed) == 1, events
    assert (failed[0].get("step"), failed[0].get("rc"), failed[0].get("cause")) == (
        "config",
        "78",
        "job",
    )
    # the serial line's text (room for ~30 bytes) starts with the key; the whole error is on
    # the console through the start-up script's stderr, with the attribute named
    assert failed[0].text.startswith("agent.threshold"), failed[0].text
    serial = res.serial()
    assert b"gce-watchdog-config: agent.threshold: must be between 1 and 10000" in serial
    assert b"refused by gce-watchdog config check (rc=78)" in serial
    assert not named(events, "start"), "no agent ran, with the bad value or the defaults"
    assert not named(events, "exit")
    check_no_lost_lines(res, events)
    assert run.final.verdict is not None
    assert run.final.verdict.kind is VerdictKind.SETUP_FAILED, run.final.verdict
    assert not run.final.verdict.failover


# The packaged poller unit under the guest's own systemd 252 (issue 26): the workload configures
# /usr/lib/systemd/system/gce-watchdog-poller.service from the gce-watchdog-poller .deb, which it
# installs beside the agent's (poller.env, a root-only token
# file for LoadCredential=), starts it and reports what systemd says (e2e-poller-unit). The
# poller polls this very VM through the same fake Compute API the harness's poller uses, reached
# at observe.GUEST_API_BASE; the token is the guest's own (a fw_cfg file), accepted by the fake.
POLLER_UNIT = "/usr/local/sbin/e2e-poller-unit"
EXPOSURE_BOUND = 2.0  # issue 26: `systemd-analyze security` of the poller unit at most 2.0
POLLER_WATCHDOG_S = 8  # e2e-poller-unit's drop-in (the unit's own WatchdogSec is 10m)


def poller_says(raw: bytes, what: str) -> dict[str, str]:
    """The KEY=VALUE words of the last ``e2e-poller: WHAT ...`` line on the console."""
    lines = re.findall(rb"e2e-poller: " + what.encode() + rb" ([^\r\n]*)", raw)
    assert lines, f"no e2e-poller: {what} line"
    words = lines[-1].decode(errors="replace").split()
    return dict(w.split("=", 1) for w in words if "=" in w)


def test_poller_unit_runs_under_systemd_with_its_token_from_a_credential(e2e: vm.Harness) -> None:
    token = f"e2e-credential-{secrets.token_hex(12)}"
    workload = [POLLER_UNIT, observe.GUEST_API_BASE, observe.PROJECT, observe.ZONE, observe.NAME]
    s = dataclasses.replace(
        spec("poller-unit", workload, deb=True), fw_secrets={"poller-token": token}
    )
    seen: list[observe.LivePoller] = []
    res, run = boot(e2e, s, seen=seen, guest_token=token)
    save_report(res)
    check_powered_off(res)
    events = events_of(res)
    bootstrap_ok(events)
    raw = res.serial()
    assert b"e2e-poller: done" in raw, raw[-3000:]

    # Started by systemd, Type=notify: `systemctl start` returned once READY=1 came.
    start = poller_says(raw, "start")
    assert start.get("rc") == "0", start
    up = poller_says(raw, "show")
    assert (up["Type"], up["ActiveState"], up["SubState"]) == ("notify", "active", "running"), up
    assert up["NRestarts"] == "0" and up["WatchdogUSec"] == f"{POLLER_WATCHDOG_S}s", up
    # Alive past twice its watchdog, pinging it (the last ping's time moved at least twice).
    alive = poller_says(raw, "alive")
    assert int(alive["elapsed"].rstrip("s")) > 2 * POLLER_WATCHDOG_S, alive
    assert int(alive["watchdog-stamps"]) >= 3, alive
    assert (alive["SubState"], alive["NRestarts"]) == ("running", "0"), alive
    # The credential: systemd's copy belongs to the dynamic user; the poller said where its
    # token came from, and the token itself is nowhere in the journal or on the console.
    cred = re.search(rb"e2e-poller: credential ([^\r\n]*)", raw)
    assert cred and b"No such file" not in cred.group(1), "systemd's copy of the token"
    print(f"the credential's copy (owner, mode): {cred.group(1).decode(errors='replace')}")
    journal = poller_says(raw, "journal")
    assert journal["token-hits"] == "0", journal
    assert int(journal["credential-lines"]) >= 1, journal
    assert int(journal["outcomes"]) >= 1, f"the poller printed outcomes: {journal}"
    assert token.encode() not in raw, "the token reached the console"
    assert token not in (res.outdir / "console.log").read_text(errors="replace")
    # Its requests reached the fake with the credential's token: every one authorized, and it
    # read this VM's serial port.
    calls = seen[0].guest_calls()
    assert calls, "the guest's poller reached the fake Compute API"
    assert all(c.bearer == token for c in calls), "every request carried the credential's token"
    assert all(c.authorized for c in calls)
    serial_reads = [c for c in calls if c.endpoint == "serial" and c.status == 200]
    assert serial_reads, sorted({(c.endpoint, c.status) for c in calls})
    # Its SQLite ledger in its StateDirectory.
    assert re.search(rb"e2e-poller: ledger \d+ bytes mode=\d+ at /var/lib/private/", raw), raw[
        raw.find(b"e2e-poller: ledger") :
    ][:200]
    # systemd-analyze security in the guest (systemd 252, the unit as installed).
    # (the line starts with an arrow glyph: "→ Overall exposure level for UNIT: 1.2 OK")
    m = re.search(rb"e2e-poller: sa: \S* ?Overall exposure level for \S+: ([0-9.]+)", raw)
    assert m, "the exposure line of systemd-analyze security"
    exposure = float(m.group(1))
    print(f"poller unit exposure in the guest: {exposure}")
    assert exposure <= EXPOSURE_BOUND, exposure
    # A stuck poller (SIGSTOP): the watchdog killed it and Restart= brought up a READY one.
    again = poller_says(raw, "restarted")
    assert int(again["NRestarts"]) >= 1 and again["SubState"] == "running", again
    assert again["old-pid-gone"] == "yes" and int(again["watchdog-kills"]) >= 1, again
    # systemd's own account of it, through rsyslog on the console (daemon.*)
    pid1 = rb" systemd\[1\]: gce-watchdog-poller\.service: "
    assert re.search(pid1 + rb"Watchdog timeout \(limit 8s\)!", raw), "the watchdog fired"
    assert re.search(pid1 + rb"Killing process \d+ \(gce-watchdog\) with signal SIGABRT", raw)
    assert re.search(pid1 + rb"Failed with result 'watchdog'", raw)
    assert poller_says(raw, "stop")["rc"] == "0"

    exits = named(events, "exit")
    assert len(exits) == 1 and exits[0].get("rc") == "0", exits
    check_no_lost_lines(res, events)
    assert run.final.verdict is not None
    assert run.final.verdict.kind is VerdictKind.WORKLOAD_OK, run.final.verdict
