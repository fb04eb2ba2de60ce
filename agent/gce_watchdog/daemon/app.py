"""The agent's composition root: the real objects for ``run``, ``check``, ``disarm`` and ``arm``.

The CLI (``daemon/cli.py``) parses and hands plain values over; the functions here load the
config, open the console and build each part of the agent from its own section. Nothing below
this module chooses a real implementation (google-guest-agent's ``setup.go`` has the same shape).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gce_watchdog.daemon import ladder
from gce_watchdog.daemon.actions import ActionChain
from gce_watchdog.daemon.disarm import MAX_DISARM_S, DisarmGate, disarm_path, disarm_status, iso
from gce_watchdog.daemon.endoflife import (
    LINGER_MAX_S,
    EndBox,
    EndWatch,
    RealWaiter,
    flock_held,
    hand_off,
    parse_linger,
    run_here,
)
from gce_watchdog.daemon.ladder import ProbeVerdict
from gce_watchdog.daemon.mdtrust import Trust
from gce_watchdog.daemon.metawatch import (
    MetadataClient,
    MetadataWatcher,
    SystemdFaultApplier,
    TrustProbe,
    metadata_root,
    metadata_trust,
)
from gce_watchdog.daemon.metrics import MetricsExporter
from gce_watchdog.daemon.probes import Prober, build_prober
from gce_watchdog.daemon.sdnotify import Notifier
from gce_watchdog.daemon.service import (
    Agent,
    AgentLock,
    Deps,
    LadderStore,
    Notify,
    Service,
    _instance_id,
    read_uptime,
)
from gce_watchdog.daemon.tick import TickResult
from gce_watchdog.gpu.service import GpuService, ProbeGauges
from gce_watchdog.job.notice import write_notice
from gce_watchdog.job.progress import Proc, ProgressServer, Tracker
from gce_watchdog.job.service import JobService, JobWatch, gpu_util_of
from gce_watchdog.lib.cli import EX_FAIL, EX_OK, EX_TEMPFAIL, EX_USAGE, CommandError
from gce_watchdog.lib.clock import RealClock
from gce_watchdog.lib.durations import parse_duration
from gce_watchdog.lib.files import atomic_write
from gce_watchdog.memory.monitor import MemoryMonitor
from gce_watchdog.memory.samplers import preload as preload_psutil
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm import logs
from gce_watchdog.vm.console import Emitter
from gce_watchdog.vm.platform import WATCH_ONLY_PREFIX, arming, detect
from gce_watchdog.vm.runtime import load_config_or_exit, open_console
from gce_watchdog.vm.state import read_boot_id, read_phase, untrusted_dir
from gce_watchdog.wire import vocab

if TYPE_CHECKING:
    from gce_watchdog.memory.samplers import GpuSampler


def run(config_path: str | None, max_ticks: int | None) -> int:
    """``gce-watchdog run``: the agent until SIGTERM/SIGINT (or ``max_ticks``)."""
    cfg = load_config_or_exit(config_path)
    logs.setup()
    log = logs.get()
    notes: list[tuple[str, str]] = []  # (what, text): written on the console after `start`

    def note(what: str, text: str) -> None:
        notes.append((what, text))  # a `warn` line after `start`, mirrored to the journal whole

    private_state: str | None = None
    why = untrusted_dir(cfg.agent.state_dir)
    if why:
        # Not trusted (a planted disarm.json, links): not read, not written. The ladder, the
        # line counter and the disarm switch live in a private directory for this run only.
        import tempfile  # only here: the daemon's path does not load it (docs/performance.md)

        private_state = tempfile.mkdtemp(prefix="gce-watchdog-state-")
        note(
            "state_dir",
            f"state dir {cfg.agent.state_dir} {why}: not used, state kept in {private_state} "
            "for this run only",
        )
        cfg = cfgmod.replace(cfg, agent={"state_dir": private_state})
    lock = AgentLock(cfg.agent.run_dir)
    held: str | None = None
    why = untrusted_dir(cfg.agent.run_dir)
    if why:
        note("run_dir", f"run dir {cfg.agent.run_dir} {why}: running without the agent lock")
    else:
        try:
            held = lock.acquire()
        except OSError as e:
            note(
                "run_dir", f"cannot use {lock.path} ({e.strerror}): running without the agent lock"
            )
    if held:
        raise CommandError(EX_TEMPFAIL, f"gce-watchdog: {held}; refusing to run a second ladder")
    # a private state dir is not the instance's: the boot is not counted there (bc=-)
    console = open_console(
        cfg, log=logs.mirror(log), journal=log, count_state=private_state is None
    )
    if console.port is not None and console.port.open_error:
        log.warning("serial_fallback", error=console.port.open_error, target=console.port.target)
    emitter = console.emitter
    stop = threading.Event()

    agent, prober = build_agent(cfg, emitter, Notifier(), config_path=config_path, stop=stop)
    agent.notes.extend(notes)

    def on_signal(signum: int, _frame: object) -> None:
        reason = "sigint" if signum == signal.SIGINT else "sigterm"
        agent.request_stop(stop, reason, signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return agent.run(stop, max_ticks=max_ticks)
    finally:
        prober.close()
        console.close()
        if private_state is not None:
            shutil.rmtree(private_state, ignore_errors=True)


def build_agent(
    cfg: cfgmod.Config,
    emitter: Emitter,
    notifier: Notify,
    config_path: str | None = None,
    stop: threading.Event | None = None,
) -> tuple[Agent, Prober]:
    """The real edges for a config, each from its own section. Returns the agent and the
    prober (to close). ``config_path`` is passed on to a fault requested through metadata;
    ``stop``, the loop's stop event, ends a linger (a stop asked for during it)."""
    a = cfg.agent
    boot_id = read_boot_id(a.boot_id_path)
    prober = _prober(cfg)
    watcher = MetadataWatcher(
        cfg.watch,
        metadata_root(cfg),
        a.state_dir,
        emitter,
        apply_fault=SystemdFaultApplier(config_path),
        on_notice=lambda n: write_notice(a.run_dir, n),
        api_base=cfg.actions.api_base,
        log=logs.get().warning,  # its notes (metadata trust above all) go to the journal
    )

    def keepalive() -> None:  # the chain runs on the loop's thread: it pings for the loop
        notifier.notify("WATCHDOG=1", "STATUS=shutdown chain running")

    chain = ActionChain(
        cfg.actions,
        a.action,
        a.state_dir,
        emitter,
        keepalive=keepalive,
        instance=lambda: watcher.instance,
        stop=stop,
    )
    end_watch = EndWatch(
        EndBox(a.run_dir, boot_id),
        chain.end_of_life,
        wall=time.time,
        monotonic=time.monotonic,
        default_linger=cfg.actions.linger,
    )
    # The GPU watch (docs/gpu.md): off, with no GPU library imported, where there is no driver.
    # The two confirm each other: the job watch reads the GPUs' utilisation, and the GPU watch
    # takes the job's progress stopping as a second signal for a hardware Xid.
    job_service = _job_service(cfg, emitter, boot_id, lambda: gpu_service.latest_sample())
    gpu_service = GpuService(
        cfg.gpu,
        emitter,
        progress_stopped=lambda: job_service.watch.progress_stopped(time.monotonic()),
    )
    services: list[Service] = [watcher, end_watch, gpu_service, job_service]
    monitor = (
        MemoryMonitor(cfg.memory, emitter, gpu=ProbeGauges(gpu_service))
        if cfg.memory.enabled
        else None
    )
    if monitor is not None:
        preload_psutil()  # on this thread, not at the first sample on the monitor's
        services.append(monitor)
    exporter = MetricsExporter.from_config(
        cfg,
        dropped=lambda: emitter.sink.dropped,
        reopens=lambda: getattr(emitter.sink, "reopens", 0),
        memory=(lambda: monitor.latest) if monitor is not None else None,
    )
    armed, gce_note = platform_gate(
        a, DisarmGate(a.state_dir, emitter, lambda: watcher.disarm_requested)
    )
    if gce_note:  # `systemctl status` says so on every STATUS= line
        notifier = WatchOnlyStatus(notifier, gce_note)
    deps = Deps(
        emitter=emitter,
        prober=prober.tick,
        clock=RealClock(),
        notifier=notifier,
        store=LadderStore(Path(a.state_dir) / "ladder.json", boot_id),
        # The exporter writes the "decided" metrics before the chain (which may never return).
        on_shutdown=exporter.wrap_shutdown(chain.execute),
        armed=armed,
        uptime=read_uptime,
        phase=lambda: read_phase(a.state_dir),
        # One identity cache: the metadata watcher's (instance.json, learnt while healthy).
        instance_id=lambda: _instance_id(a.state_dir, watcher.instance),
        instance_name=lambda: _instance_id(a.state_dir, watcher.instance, "name"),
        services=services,
        tick_hooks=[exporter],
        end_of_life=end_watch,
    )
    agent = Agent(a, deps, linger=cfg.actions.linger, cfg_digest=cfgmod.digest(cfg))
    if gce_note:
        agent.notes.append(("gce", gce_note))
    return agent, prober


class WatchOnlyStatus:
    """A :class:`Notify` that adds "watch only" and why to every ``STATUS=`` it passes on (what
    ``systemctl status`` shows), for an agent that is never armed on this machine."""

    def __init__(self, inner: Notify, note: str) -> None:
        self.inner = inner
        self.watchdog_interval = inner.watchdog_interval
        self.suffix = "; watch only: " + note.removeprefix(WATCH_ONLY_PREFIX)

    def notify(self, *assignments: str) -> bool:
        return self.inner.notify(
            *(a + self.suffix if a.startswith("STATUS=") else a for a in assignments)
        )


def _job_service(
    cfg: cfgmod.Config,
    emitter: Emitter,
    boot_id: str,
    latest_gpu: Callable[[], dict[str, object] | None],
) -> JobService:
    """The job watch (docs/job-progress.md): the progress socket, `progress` lines, and the stuck
    rule; a stuck job's end is requested as `gce-watchdog end --reason stuck` would."""
    a = cfg.agent
    tracker, proc = Tracker(), Proc()
    box = EndBox(a.run_dir, boot_id)

    def end(reason: str) -> None:
        try:
            box.request(reason, None)
        except OSError as e:
            emitter.emit(
                vocab.ERROR, {"where": "end_request", "err": type(e).__name__}, str(e)[:100]
            )

    watch = JobWatch(
        cfg.job,
        a.run_dir,
        emitter,
        tracker,
        proc,
        end=end,
        gpu_util=gpu_util_of(latest_gpu),
        line_every=a.interval * a.heartbeat_every,  # one heartbeat period
    )
    server = ProgressServer(
        a.run_dir, tracker, watch.job, proc, cfg.job.progress_uid, time.monotonic
    )
    return JobService(watch, server, a.interval)


def _prober(cfg: cfgmod.Config) -> Prober:
    a = cfg.agent
    return build_prober(cfg.egress, cfg.metadata.url, a.probe_timeout, a.state_dir)


def platform_gate(
    agent: cfgmod.AgentSection, gate: Callable[[], tuple[bool, str]]
) -> tuple[Callable[[], tuple[bool, str]], str]:
    """The ``armed`` input on this machine, and what to say at start ("" when nothing).

    Off GCE (the DMI product name) and without ``agent.allow_non_gce`` the agent is never armed:
    it climbs and reports (``would_shutdown why=not-gce``) but runs no chain. A dry run is left
    alone: it never acts anyway.
    """

    if agent.action == "dry-run":
        return gate, ""
    may_act, why_not = arming(detect(agent.dmi_product_path), agent.allow_non_gce)
    if may_act:
        return gate, ""
    return (lambda: (False, "not-gce")), why_not


def platform_line(agent: cfgmod.AgentSection) -> tuple[bool, str]:
    """Whether this is GCE, and what `check` says about acting on this machine."""

    plat = detect(agent.dmi_product_path)
    if plat.gce:
        return True, f"platform: GCE ({plat.why}): the agent acts ({agent.action})"
    may_act, why_not = arming(plat, agent.allow_non_gce)
    if agent.action == "dry-run":
        return False, f"platform: not GCE ({plat.why}); action dry-run: nothing is done anyway"
    if may_act:
        return False, f"platform: not GCE ({plat.why}), agent.allow_non_gce = true: the agent acts"
    return False, f"platform: {why_not}"


def gpu_line(sampler: GpuSampler | None = None) -> tuple[bool, str]:
    """Whether GPU memory gauges are available here (NVML through nvidia-ml-py), and why not."""
    from gce_watchdog.memory.samplers import GpuSampler

    sampler = sampler if sampler is not None else GpuSampler()
    try:
        present = sampler.open()
        names = ", ".join(sampler.names)
        return present, sampler.reason + (f" ({names})" if present and names else "")
    finally:
        sampler.close()


# check --json's version (docs/json.md, schemas/check.schema.json)
CHECK_JSON_VERSION = 1
NPD_OK, NPD_NONOK, NPD_UNKNOWN = 0, 1, 2  # node-problem-detector's custom plugin statuses


def _key_status(cfg: cfgmod.Config) -> tuple[str, list[str]]:
    """The protocol v3 line key as ``check`` shows it: its fingerprint (never the key) and its
    problems (a wrong mode or owner, kept; no place to keep it). Creates nothing."""
    from gce_watchdog.vm.state import KeyUnavailable, inspect_line_key
    from gce_watchdog.wire.protocol import pk_fingerprint

    try:
        ks = inspect_line_key(cfg.agent.state_dir, cfg.agent.run_dir)
    except KeyUnavailable as e:
        return f"not readable ({e}): run check as root", []
    if ks is None:
        return "none yet (the first line creates it)", []
    if not ks.seed:
        return "UNUSABLE (see below): lines use a key of their own process", ks.problems
    from gce_watchdog.wire.protocol import LineKey

    fp = pk_fingerprint(LineKey(ks.seed).public)
    eph = " EPHEMERAL" if ks.ephemeral else ""
    return f"{fp}{eph} ({ks.path})", ks.problems


def check(config_path: str | None, as_json: bool, as_npd: bool) -> int:
    """Exit 0: both paths up. 1: one path down or unknown (the ladder would reset). 2: both down
    (it would climb). 78: invalid config. With --npd: 0 OK, 1 NonOK, 2 Unknown, within
    NPD_DEADLINE_S of the process's start."""
    if as_npd:
        try:
            return _check_npd(config_path)
        except SystemExit as e:  # an invalid config (its errors are on stderr)
            print(f"check could not run: exit {e.code} (see stderr)")
            return NPD_UNKNOWN
        except Exception as e:  # NPD reads Unknown; the reason on stdout, where it looks
            print(f"check could not run: {type(e).__name__}: {e}"[:200])
            return NPD_UNKNOWN
    return _check(config_path, as_json)


# node-problem-detector kills a custom plugin at its timeout (5 s unless configured) and reads
# that as Unknown, not NonOK: `check --npd` answers within NPD_DEADLINE_S of its process's start
# whatever the network does, one deadline shared by everything it does (issue 39).
NPD_DEADLINE_S = 4.0
# What the deadline keeps after the probes' own timeouts: the cap's slack (NPD_CAP_SLACK_S),
# printing the answer and the exit, with room for a loaded machine's scheduling (0.5 s was
# measured short: 4.03 s on two cores beside three CPU hogs and two `make test`).
NPD_ANSWER_S = 0.8
NPD_CAP_SLACK_S = 0.1  # a probe ends by its own timeout before the cap calls it "deadline"
NPD_MIN_PROBE_S = 0.2  # a start-up that ate the deadline still probes, briefly


def process_age(stat_path: str = "/proc/self/stat") -> float:
    """Seconds since this process started: its start time (field 22 of ``/proc/self/stat``,
    proc(5), in clock ticks since boot) against CLOCK_BOOTTIME; 0.0 when it cannot be read."""
    try:
        raw = Path(stat_path).read_bytes()
        # The fields after the command name (which may hold spaces and parentheses) start at
        # field 3: starttime, field 22, is the 20th of them.
        ticks = int(raw.rsplit(b")", 1)[1].split()[19])
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        return max(0.0, now - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def npd_timeouts(
    probe_timeout: float, dns_timeout: float, left: float
) -> tuple[float, float, float]:
    """The probe timeout, DNS timeout and cap that fit in ``left`` seconds (pure): the configured
    timeouts, scaled down together when they do not fit (dns_timeout < probe_timeout holds)."""
    budget = max(NPD_MIN_PROBE_S, left - NPD_ANSWER_S)
    f = min(1.0, budget / probe_timeout)
    return probe_timeout * f, dns_timeout * f, probe_timeout * f + NPD_CAP_SLACK_S


def _check_npd(config_path: str | None) -> int:
    deadline = time.monotonic() - process_age() + NPD_DEADLINE_S
    cfg = load_config_or_exit(config_path)
    a = cfg.agent
    # Everything but the probes is done before them: what is left after the deadline's probes
    # is the answer itself.
    rung = _ladder(cfg).load(a.threshold).rung
    timeout, dns, cap = npd_timeouts(
        a.probe_timeout, cfg.egress.dns_timeout, deadline - time.monotonic()
    )
    prober = build_prober(
        cfg.egress, cfg.metadata.url, timeout, a.state_dir, dns_timeout=dns, cap=cap
    )
    try:
        res = prober.tick()
    finally:
        prober.close()
    verdict, _rc, npd, _say = _classify(res)
    md, eg = res.metadata, res.egress
    print(
        f"{verdict}: metadata {md.verdict.value} {md.reason}, egress {eg.verdict.value} "
        f"{eg.reason}; rung {rung}/{a.threshold}",
        flush=True,
    )
    # The answer is out: leave now. The interpreter's teardown (and a probe thread still stuck
    # in getaddrinfo(3), which has no deadline, that it would join) is time NPD would count.
    sys.stderr.flush()
    os._exit(npd)


def _ladder(cfg: cfgmod.Config) -> LadderStore:
    """The agent's ladder file, as this boot reads it (check's `rung`)."""
    return LadderStore(
        Path(cfg.agent.state_dir) / "ladder.json", read_boot_id(cfg.agent.boot_id_path)
    )


def _classify(res: TickResult) -> tuple[str, int, int, str]:
    """The verdict word, check's exit code, the NPD status and the sentence for one tick."""
    cls = ladder.classify(res.metadata.verdict, res.egress.verdict)
    if res.metadata.verdict is ProbeVerdict.OK and res.egress.verdict is ProbeVerdict.OK:
        return "healthy", 0, NPD_OK, "HEALTHY"
    if cls is ladder.TickClass.BOTH_FAIL:
        return "outage", 2, NPD_NONOK, "OUTAGE (both paths down: the ladder would climb)"
    return (
        "degraded",
        1,
        NPD_OK,
        "DEGRADED (one path down or unknown: a tick like this resets the ladder)",
    )


def _metadata_trust(cfg: cfgmod.Config) -> Trust:
    """Whether the running agent would obey the metadata disarm and fault attributes."""
    timeout = float(cfg.watch.request_timeout)
    client = MetadataClient(metadata_root(cfg))
    try:
        probe = TrustProbe(client, cfg.actions.api_base, timeout)
        return metadata_trust(cfg.watch.trust_metadata, probe, client, timeout)
    finally:
        client.abort()


def _check(config_path: str | None, as_json: bool) -> int:
    cfg = load_config_or_exit(config_path)
    prober = _prober(cfg)
    try:
        res = prober.tick()
    finally:
        prober.close()
    st = _ladder(cfg)
    rung = st.load(cfg.agent.threshold).rung
    gpu = gpu_line()
    verdict, rc, _npd, say = _classify(res)
    probes = {
        "metadata": {
            "verdict": res.metadata.verdict.value,
            "reason": res.metadata.reason,
            "latency_ms": res.metadata.latency_ms,
        },
        "egress": {
            "verdict": res.egress.verdict.value,
            "reason": res.egress.reason,
            "latency_ms": res.egress.latency_ms,
        },
    }
    key_line, key_problems = _key_status(cfg)
    trust = _metadata_trust(cfg)
    if as_json:
        out = {
            "v": CHECK_JSON_VERSION,
            "line_key": {"status": key_line, "problems": key_problems},
            "verdict": verdict,
            "exit": rc,
            "probes": probes,
            "dns": res.dns,
            "rung": rung,
            "threshold": cfg.agent.threshold,
            "ladder_file": str(st.path),
            "platform": platform_line(cfg.agent)[1],
            "gpu": {"present": gpu[0], "reason": gpu[1]},
            "metadata_trust": {
                "trusted": trust.trusted,
                "why": trust.why,
                "detail": trust.detail,
            },
        }
        print(json.dumps(out, sort_keys=True))
        return rc
    rows = [
        (
            "metadata",
            res.metadata.verdict.value,
            res.metadata.reason,
            f"{res.metadata.latency_ms}ms",
        ),
        ("egress", res.egress.verdict.value, res.egress.reason, f"{res.egress.latency_ms}ms"),
        ("dns", res.dns, "", ""),
    ]
    print(f"{'probe':<10}{'verdict':<9}{'reason':<18}latency")
    for name, v, why, lat in rows:
        print(f"{name:<10}{v:<9}{why:<18}{lat}")
    print(f"ladder    {rung}/{cfg.agent.threshold} (this boot, from {st.path})")
    print(f"line key  {key_line}")
    for problem in key_problems:
        print(f"line key: {problem}")
    gce, line = platform_line(cfg.agent)
    print(line)
    print(f"gpu: {gpu[1]}" if gpu[0] else f"gpu: no GPU ({gpu[1]}): GPU memory gauges absent")
    verb = "obeyed" if trust.trusted else "IGNORED"
    print(f"metadata disarm/fault attributes: {verb} ({trust.why}): {trust.detail}")
    if res.metadata.verdict is not ProbeVerdict.OK:
        hint = "" if gce else ": outside GCE there is none"
        print(
            f"metadata: no metadata server answered at {cfg.metadata.url} "
            f"({res.metadata.reason}){hint}"
        )
    print(f"verdict: {say}")
    return rc


def _who() -> str:
    import getpass  # disarm and arm only: not on the daemon's path

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _emit_cli(cfg: cfgmod.Config, event: str, fields: dict[str, object], text: str) -> bool:
    """Write one line on the serial console (best effort: the switch itself already changed)."""
    with open_console(cfg) as con:
        return con.write(event, fields, text)


def disarm(config_path: str | None, duration: str | None, reason: str, status: bool) -> int:
    """``gce-watchdog disarm``: write the local switch (or print it with ``status``)."""
    cfg = load_config_or_exit(config_path)
    now = time.time()
    if status:
        print(_status_line(cfg, now))
        return EX_OK
    if duration is None:
        raise CommandError(
            EX_USAGE, "gce-watchdog disarm: --for DURATION is required (e.g. --for 2h)"
        )
    try:
        secs = parse_duration(duration)
    except ValueError as e:
        raise CommandError(EX_USAGE, f"gce-watchdog disarm: --for: {e}") from None
    if not 0 < secs <= MAX_DISARM_S:
        raise CommandError(
            EX_USAGE,
            f"gce-watchdog disarm: --for must be more than 0 and at most "
            f"{MAX_DISARM_S / 3600:g}h (got {duration}); run it again later to extend",
        )
    until = now + secs
    rec = {"set_at": now, "until": until, "reason": reason[:200], "by": _who()}

    try:
        atomic_write(
            disarm_path(cfg.agent.state_dir),
            (json.dumps(rec, sort_keys=True) + "\n").encode(),
            0o644,
        )
    except OSError as e:
        raise CommandError(
            EX_FAIL, f"gce-watchdog disarm: cannot write {disarm_path(cfg.agent.state_dir)}: {e}"
        ) from None
    _emit_cli(
        cfg,
        vocab.DISARM,
        {"src": "local", "until": iso(until), "dur": f"{int(secs)}s", "by": rec["by"]},
        reason or "disarmed by an operator",
    )
    print(f"disarmed until {iso(until)} (re-arms by itself then; `gce-watchdog arm` ends it now)")
    return EX_OK


def _status_line(cfg: cfgmod.Config, now: float) -> str:
    """``disarm --status`` in words: the local switch, and where the other one is read."""
    armed, why = disarm_status(cfg.agent.state_dir, now, False)
    if not armed:
        state = f"disarmed locally until {why.removeprefix('local-until-')}"
    else:
        state = {
            "expired": "armed (a local disarm expired)",
            "bad-disarm-file": (
                f"armed (unreadable {disarm_path(cfg.agent.state_dir)}: it never disarms)"
            ),
        }.get(why, "armed")
    return (
        f"{state}; the metadata attribute {cfg.watch.disarm_attribute} is read by the running agent"
    )


def arm(config_path: str | None) -> int:
    """``gce-watchdog arm``: end a local disarm now."""
    cfg = load_config_or_exit(config_path)
    p = disarm_path(cfg.agent.state_dir)
    was = "armed" if disarm_status(cfg.agent.state_dir, time.time(), False)[0] else "disarmed"
    try:
        p.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        raise CommandError(EX_FAIL, f"gce-watchdog arm: cannot remove {p}: {e}") from None
    _emit_cli(cfg, vocab.ARM, {"src": "local", "was": was, "by": _who()}, "armed by an operator")
    print("armed" + ("" if was == "disarmed" else " (it was not disarmed locally)"))
    return EX_OK


def end(
    config_path: str | None, reason: str, linger_text: str | None, wait_text: str | None
) -> int:
    """``gce-watchdog end``: hand the ending to the agent, else run the chain here."""
    cfg = load_config_or_exit(config_path)
    linger: float | None = None
    if linger_text not in (None, ""):
        try:
            linger = parse_linger(linger_text)
        except ValueError as e:
            print(
                f"gce-watchdog end: --linger: {e}; using actions.linger ({cfg.actions.linger:g}s)",
                file=sys.stderr,
            )
    wait_s = 2 * cfg.agent.interval + 10.0
    if wait_text is not None:
        try:
            wait_s = parse_duration(wait_text)
            if not math.isfinite(wait_s) or not 0 <= wait_s <= LINGER_MAX_S:
                raise ValueError("must be 0 to 1h")
        except ValueError as e:
            raise CommandError(EX_USAGE, f"gce-watchdog end: --wait: {e}") from None
    box = EndBox(cfg.agent.run_dir, read_boot_id(cfg.agent.boot_id_path))
    try:
        box.request(reason, linger)
    except OSError as e:
        print(f"gce-watchdog end: cannot write the request in {box.dir}: {e}", file=sys.stderr)
        # No hand-off possible: the chain still runs, here, with no persisted progress.
    agent_lock = Path(cfg.agent.run_dir) / "agent.lock"  # daemon/service.py's AgentLock
    taken = hand_off(box, wait_s, RealWaiter(), agent_up=lambda: flock_held(agent_lock))
    if taken is None and box.busy():
        print("gce-watchdog end: handed to the agent", file=sys.stderr)
        return EX_OK
    # No agent took it: this process runs the chain, surviving the SIGTERM/SIGHUP that systemd
    # sends while it stops units during the very power-off the chain started.
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return run_here(cfg, box, taken, reason, linger)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
