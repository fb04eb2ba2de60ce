"""The agent's commands: ``run`` (what the systemd unit starts), ``check`` (one tick, printed),
``disarm`` and ``arm`` (the local switch). argparse code only; the agent lives in service.py."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from gce_watchdog.daemon import ladder
from gce_watchdog.daemon.disarm import MAX_DISARM_S, disarm_path, disarm_status, iso
from gce_watchdog.daemon.ladder import ProbeVerdict
from gce_watchdog.lib.cli import EX_USAGE
from gce_watchdog.lib.durations import parse_duration
from gce_watchdog.lib.files import atomic_write
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import (
    DiscardSink,
    Emitter,
    SerialPort,
    cached_instance_id,
    key_or_none,
)
from gce_watchdog.vm.platform import arming, detect
from gce_watchdog.vm.runtime import (
    add_config_arg,
    boot_of,
    load_config_or_exit,
    make_emitter,
    open_console,
)
from gce_watchdog.vm.state import SeqAllocator, read_boot_id, untrusted_dir
from gce_watchdog.wire import vocab


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser("run", help="run the watchdog agent (what the systemd unit starts)")
    add_config_arg(r)
    r.add_argument("--max-ticks", type=int, default=None, help="stop after N ticks (tests)")
    r.set_defaults(func=cmd_run)
    c = sub.add_parser(
        "check",
        help="run one tick of both probes and print the result",
        description=(
            "One tick of both probes with the real config, printed as a table (or --json); "
            "nothing is written to the state or the serial port. --npd speaks "
            "node-problem-detector's custom plugin protocol: one short line on stdout and exit "
            "0 OK (both up, or one path down: the ladder would reset), 1 NonOK (both down: the "
            "ladder would climb), 2 Unknown (the check could not run, e.g. an invalid config)."
        ),
    )
    add_config_arg(c)
    fmt = c.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print one JSON object")
    fmt.add_argument(
        "--npd",
        action="store_true",
        help="node-problem-detector plugin: exit 0 OK, 1 NonOK, 2 Unknown",
    )
    c.set_defaults(func=cmd_check)
    register_disarm(sub)


def cmd_run(args: argparse.Namespace) -> int:
    # The agent's modules (and structlog, http.client, ...) load when a command needs them, not
    # with the parser: every command builds the parser, `fetch` at boot included.
    from gce_watchdog.daemon.sdnotify import Notifier
    from gce_watchdog.daemon.service import EX_TEMPFAIL, AgentLock, build_agent
    from gce_watchdog.vm import logs

    cfg = load_config_or_exit(args)
    logs.setup()
    log = logs.get()
    notes: list[tuple[str, str]] = []  # (what, text): written on the console after `start`

    def note(what: str, text: str) -> None:
        print(f"gce-watchdog: {text}", file=sys.stderr)
        log.warning(what, text=text)
        notes.append((what, text))

    private_state: str | None = None
    why = untrusted_dir(cfg.agent.state_dir)
    if why:
        # Not trusted (a planted disarm.json, links): not read, not written. The ladder, the
        # line counter and the disarm switch live in a private directory for this run only.
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
        print(f"gce-watchdog: {held}; refusing to run a second ladder", file=sys.stderr)
        return EX_TEMPFAIL
    port: SerialPort | None = None
    try:
        emitter, port = make_emitter(cfg, log=logs.mirror(log))
        if port.open_error:
            log.warning("serial_fallback", error=port.open_error, target=port.target)
    except OSError as e:
        # No console at all: keep watching (the lines still reach the journal) rather than
        # crash-loop and leave a wedged VM unguarded.
        log.error(
            "serial_unavailable",
            error=str(e),
            device=cfg.serial.device,
            fallback=cfg.serial.fallback_file,
        )
        boot = boot_of(cfg)
        sink = DiscardSink()
        key, problems = key_or_none(cfg.agent.state_dir, cfg.agent.run_dir)
        emitter = Emitter(
            sink,
            SeqAllocator(cfg.agent.run_dir, boot),
            boot,
            log=logs.mirror(log),
            key=key,
            inst=cached_instance_id(cfg.agent.state_dir),
            key_problems=problems,
        )
    stop = threading.Event()

    agent, prober = build_agent(cfg, emitter, Notifier())
    agent.notes.extend(notes)

    def on_signal(signum: int, _frame: object) -> None:
        reason = "sigint" if signum == signal.SIGINT else "sigterm"
        agent.request_stop(stop, reason, signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return agent.run(stop, max_ticks=args.max_ticks)
    finally:
        prober.close()
        if port is not None:
            port.close()
        if private_state is not None:
            shutil.rmtree(private_state, ignore_errors=True)


def platform_line(cfg: cfgmod.Config) -> tuple[bool, str]:
    """Whether this is GCE, and what `check` says about acting on this machine."""

    plat = detect(cfg.agent.dmi_product_path)
    if plat.gce:
        return True, f"platform: GCE ({plat.why}): the agent acts ({cfg.agent.action})"
    may_act, why_not = arming(plat, cfg.agent.allow_non_gce)
    if cfg.agent.action == "dry-run":
        return False, f"platform: not GCE ({plat.why}); action dry-run: nothing is done anyway"
    if may_act:
        return False, f"platform: not GCE ({plat.why}), agent.allow_non_gce = true: the agent acts"
    return False, f"platform: {why_not}"


NPD_OK, NPD_NONOK, NPD_UNKNOWN = 0, 1, 2  # node-problem-detector's custom plugin statuses


def cmd_check(args: argparse.Namespace) -> int:
    """Exit 0: both paths up. 1: one path down or unknown (the ladder would reset). 2: both down
    (it would climb). 78: invalid config. With --npd: 0 OK, 1 NonOK, 2 Unknown."""
    if args.npd:
        try:
            return _check(args)
        except SystemExit as e:  # an invalid config (its errors are on stderr)
            print(f"check could not run: exit {e.code} (see stderr)")
            return NPD_UNKNOWN
        except Exception as e:  # NPD reads Unknown; the reason on stdout, where it looks
            print(f"check could not run: {type(e).__name__}: {e}"[:200])
            return NPD_UNKNOWN
    return _check(args)


def _check(args: argparse.Namespace) -> int:
    from gce_watchdog.daemon.probes import build_prober
    from gce_watchdog.daemon.service import LadderStore

    cfg = load_config_or_exit(args)
    prober = build_prober(cfg)
    try:
        res = prober.tick()
    finally:
        prober.close()
    st = LadderStore(
        Path(cfg.agent.state_dir) / "ladder.json", read_boot_id(cfg.agent.boot_id_path)
    )
    rung = st.load(cfg.agent.threshold).rung
    cls = ladder.classify(res.metadata.verdict, res.egress.verdict)
    if res.metadata.verdict is ProbeVerdict.OK and res.egress.verdict is ProbeVerdict.OK:
        verdict, rc, npd = "healthy", 0, NPD_OK
        say = "HEALTHY"
    elif cls is ladder.TickClass.BOTH_FAIL:
        verdict, rc, npd = "outage", 2, NPD_NONOK
        say = "OUTAGE (both paths down: the ladder would climb)"
    else:
        verdict, rc, npd = "degraded", 1, NPD_OK
        say = "DEGRADED (one path down or unknown: a tick like this resets the ladder)"
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
    if args.npd:
        md, eg = probes["metadata"], probes["egress"]
        print(
            f"{verdict}: metadata {md['verdict']} {md['reason']}, egress {eg['verdict']} "
            f"{eg['reason']}; rung {rung}/{cfg.agent.threshold}"
        )
        return npd
    if args.json:
        out = {
            "verdict": verdict,
            "exit": rc,
            "probes": probes,
            "dns": res.dns,
            "rung": rung,
            "threshold": cfg.agent.threshold,
            "ladder_file": str(st.path),
            "platform": platform_line(cfg)[1],
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
    gce, line = platform_line(cfg)
    print(line)
    if res.metadata.verdict is not ProbeVerdict.OK:
        hint = "" if gce else ": outside GCE there is none"
        print(
            f"metadata: no metadata server answered at {cfg.metadata.url} "
            f"({res.metadata.reason}){hint}"
        )
    print(f"verdict: {say}")
    return rc


def register_disarm(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser(
        "disarm",
        help="stop the watchdog from acting for a while (it still reports); always expires",
        description=(
            "Disarm the watchdog for a bounded time: the ladder still climbs and is reported, "
            "and at the threshold the agent writes 'disarmed: would shut down' instead of acting. "
            f"At most {MAX_DISARM_S / 3600:g}h; it re-arms by itself at expiry."
        ),
    )
    add_config_arg(d)
    d.add_argument(
        "--for",
        dest="duration",
        default=None,
        metavar="DURATION",
        help=f"how long, e.g. 30m, 2h (required unless --status; at most {MAX_DISARM_S / 3600:g}h)",
    )
    d.add_argument("--reason", default="", help="why (shown on the serial console)")
    d.add_argument("--status", action="store_true", help="print the local switch's state")
    d.set_defaults(func=cmd_disarm)
    a = sub.add_parser("arm", help="end a local disarm now")
    add_config_arg(a)
    a.set_defaults(func=cmd_arm)


def _who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _emit_cli(cfg: cfgmod.Config, event: str, fields: dict[str, object], text: str) -> bool:
    """Write one line on the serial console (best effort: the switch itself already changed)."""
    with open_console(cfg) as con:
        return con.write(event, fields, text)


def cmd_disarm(args: argparse.Namespace) -> int:
    cfg = load_config_or_exit(args)
    now = time.time()
    if args.status:
        print(_status_line(cfg, now))
        return 0
    if args.duration is None:
        print("gce-watchdog disarm: --for DURATION is required (e.g. --for 2h)", file=sys.stderr)
        return EX_USAGE
    try:
        secs = parse_duration(args.duration)
    except ValueError as e:
        print(f"gce-watchdog disarm: --for: {e}", file=sys.stderr)
        return EX_USAGE
    if not 0 < secs <= MAX_DISARM_S:
        print(
            f"gce-watchdog disarm: --for must be more than 0 and at most "
            f"{MAX_DISARM_S / 3600:g}h (got {args.duration}); run it again later to extend",
            file=sys.stderr,
        )
        return EX_USAGE
    until = now + secs
    rec = {"set_at": now, "until": until, "reason": args.reason[:200], "by": _who()}

    try:
        atomic_write(
            disarm_path(cfg.agent.state_dir),
            (json.dumps(rec, sort_keys=True) + "\n").encode(),
            0o644,
        )
    except OSError as e:
        print(
            f"gce-watchdog disarm: cannot write {disarm_path(cfg.agent.state_dir)}: {e}",
            file=sys.stderr,
        )
        return 1
    _emit_cli(
        cfg,
        vocab.DISARM,
        {"src": "local", "until": iso(until), "dur": f"{int(secs)}s", "by": rec["by"]},
        args.reason or "disarmed by an operator",
    )
    print(f"disarmed until {iso(until)} (re-arms by itself then; `gce-watchdog arm` ends it now)")
    return 0


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


def cmd_arm(args: argparse.Namespace) -> int:
    cfg = load_config_or_exit(args)
    p = disarm_path(cfg.agent.state_dir)
    was = "armed" if disarm_status(cfg.agent.state_dir, time.time(), False)[0] else "disarmed"
    try:
        p.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        print(f"gce-watchdog arm: cannot remove {p}: {e}", file=sys.stderr)
        return 1
    _emit_cli(cfg, vocab.ARM, {"src": "local", "was": was, "by": _who()}, "armed by an operator")
    print("armed" + ("" if was == "disarmed" else " (it was not disarmed locally)"))
    return 0
