"""The bootstrap commands: ``fetch``, ``phase``, ``setup-failed``, ``exec``, ``install`` and
``uninstall``. argparse code only; the work is done in fetch.py, phases.py and install.py."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from gce_watchdog.bootstrap.fetch import (
    _SHA_RE,
    DEFAULT_DEADLINE,
    FetchDeps,
    FetchRequest,
    Interrupted,
    Url,
    parse_url,
    run_fetch,
)
from gce_watchdog.bootstrap.install import InstallError, InstallOptions, install, uninstall
from gce_watchdog.bootstrap.phases import (
    CAUSES,
    PHASES,
    SETUP_FAILED,
    emit_terminal,
    job_windows,
    report_result,
    run_exec,
)
from gce_watchdog.job.progress import socket_path
from gce_watchdog.job.stuck import Windows
from gce_watchdog.lib.cli import (
    EX_FAIL,
    EX_IOERR,
    EX_NOPERM,
    EX_OK,
    EX_UNAVAILABLE,
    EX_USAGE,
    CommandError,
    duration_arg,
)
from gce_watchdog.lib.durations import parse_duration
from gce_watchdog.lib.netaddr import parse_dns_server
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.cli import add_config_arg
from gce_watchdog.vm.runtime import load_config_or_exit, open_console
from gce_watchdog.wire import vocab
from gce_watchdog.wire.protocol import sanitize_value


def usage_errors_exit_64(p: argparse.ArgumentParser) -> None:
    """argparse exits 2 on bad arguments; these commands document sysexits' EX_USAGE (64)."""

    def error(message: str) -> Any:
        p.print_usage(sys.stderr)
        p.exit(EX_USAGE, f"{p.prog}: error: {message}\n")

    p.error = error  # type: ignore[method-assign]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    register_fetch(sub)
    register_phases(sub)
    register_install(sub)


def register_phases(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "phase",
        help="record the job phase (serial line written and drained before returning)",
    )
    p.add_argument("phase", choices=PHASES)
    add_config_arg(p)
    usage_errors_exit_64(p)
    p.set_defaults(func=cmd_phase)

    f = sub.add_parser(
        "setup-failed",
        help="record that bootstrap failed (cause job: no failover; cause infra: fail over)",
    )
    f.add_argument("--step", required=True, help="the bootstrap step that failed")
    f.add_argument(
        "--cause",
        choices=CAUSES,
        default="job",
        help=(
            "infra: the network, DNS or the package source never came up (the job never ran: "
            "the poller fails over); job: the step itself failed (no failover). Default job"
        ),
    )
    f.add_argument("--reason", required=True, help="why, one line")
    f.add_argument("--exit-code", type=int, default=None, help="the failed command's exit code")
    add_config_arg(f)
    usage_errors_exit_64(f)
    f.set_defaults(func=cmd_setup_failed)

    e = sub.add_parser(
        "exec",
        help="run the workload: phase workload, the command, then a drained `exit` line",
        description=(
            "Run CMD ARGS (no shell), forwarding SIGTERM/SIGINT/SIGHUP, and return its status "
            "(128+N for a death by signal N, 127 not found, 126 not executable)."
        ),
    )
    add_config_arg(e)
    e.add_argument(
        "--expect-result",
        action="store_true",
        help=(
            "the job reports its result (`gce-watchdog result`); the exit line says "
            "result=reported or result=missing"
        ),
    )
    for flag, key, what in (
        ("--stuck-after", "stuck_after", "no progress this long while the job is idle"),
        ("--stuck-max", "stuck_max", "no progress this long whatever the job does"),
        ("--stuck-first", "stuck_first", "no first step this long after the start"),
    ):
        e.add_argument(
            flag,
            type=duration_arg(0.0, open_min=False),
            default=None,
            metavar="DURATION",
            help=f"{what} is job_stuck (docs/job-progress.md; default [job] {key}; 0: off)",
        )
    e.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")
    usage_errors_exit_64(e)
    e.set_defaults(func=cmd_exec)

    r = sub.add_parser(
        "result",
        help="the job's own result: a signed `result` line, written and drained",
        description=(
            "Write `result status=ok|fail [detail=k:v,...]` on the serial console, synchronously "
            "and signed, through no log pipeline. Under `gce-watchdog exec` it also tells exec "
            "that this run reported (the exit line's result=reported with --expect-result). "
            "From Python: gce_watchdog.jobresult.report(ok=True, step=1)."
        ),
    )
    r.add_argument("status", choices=vocab.RESULT_STATUSES)
    r.add_argument(
        "--detail",
        action="append",
        default=[],
        metavar="K=V",
        help="a key=value about the run (repeatable; 64 characters in all on the line)",
    )
    add_config_arg(r)
    usage_errors_exit_64(r)
    r.set_defaults(func=cmd_result)

    g = sub.add_parser(
        "progress",
        help="the job's progress: a step for the agent's stuck watch (docs/job-progress.md)",
        description=(
            "Tell the agent the job advanced (to STEP: steps strictly increase; without --step "
            "each call is the next step). Only the process tree of the job `gce-watchdog exec` "
            "started, or [job] progress_uid, may report; anyone else is refused (exit 77). "
            "From Python: gce_watchdog.jobprogress.progress(step)."
        ),
    )
    g.add_argument("--step", type=int, default=None, metavar="N", help="the step reached")
    add_config_arg(g)
    usage_errors_exit_64(g)
    g.set_defaults(func=cmd_progress)


def cmd_phase(args: argparse.Namespace) -> int:
    cfg = load_config_or_exit(args.config)
    ok = emit_terminal(cfg, vocab.PHASE, {"ph": args.phase}, phase=args.phase)
    if not ok:  # not confirmed written: emit_terminal said so
        raise CommandError(EX_IOERR)
    return EX_OK


def cmd_setup_failed(args: argparse.Namespace) -> int:
    step, reason = args.step.strip(), args.reason.strip()
    if not step or not reason:
        raise CommandError(
            EX_USAGE, "gce-watchdog setup-failed: --step and --reason must not be empty"
        )
    cfg = load_config_or_exit(args.config)
    fields: dict[str, object] = {
        "step": sanitize_value(step, 32),
        "reason": sanitize_value(reason, 32),
        "rc": "-" if args.exit_code is None else args.exit_code,
        "cause": args.cause,
    }
    ok = emit_terminal(cfg, SETUP_FAILED, fields, reason, phase=SETUP_FAILED)
    if not ok:  # not confirmed written: emit_terminal said so
        raise CommandError(EX_IOERR)
    return EX_OK


def cmd_exec(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv or not argv[0]:
        raise CommandError(
            EX_USAGE, "gce-watchdog exec: usage: gce-watchdog exec [--config PATH] -- CMD [ARGS...]"
        )
    cfg = load_config_or_exit(args.config)
    base = job_windows(cfg)

    def pick(flag: float | None, default: float | None) -> float | None:
        return default if flag is None else (flag or None)

    windows = Windows(
        pick(args.stuck_after, base.after),
        pick(args.stuck_max, base.max),
        pick(args.stuck_first, base.first),
    )
    return run_exec(
        cfg, argv, expect_result=args.expect_result, config_path=args.config, windows=windows
    )


def cmd_result(args: argparse.Namespace) -> int:
    bad = [d for d in args.detail if "=" not in d or not d.partition("=")[0].strip()]
    if bad:
        raise CommandError(EX_USAGE, f"gce-watchdog result: --detail must be K=V, got {bad[0]!r}")
    cfg = load_config_or_exit(args.config)
    ok = report_result(cfg, args.status, args.detail)
    if not ok:  # not confirmed written: emit_terminal said so
        raise CommandError(EX_IOERR)
    return EX_OK


def cmd_progress(args: argparse.Namespace) -> int:
    from gce_watchdog import jobprogress

    path = socket_path(load_config_or_exit(args.config).agent.run_dir) if args.config else None
    try:
        counted = jobprogress.progress(args.step, path)
    except jobprogress.ProgressRefused as e:
        raise CommandError(EX_NOPERM, f"gce-watchdog progress: {e}") from None
    except jobprogress.ProgressUnavailable as e:
        raise CommandError(EX_UNAVAILABLE, f"gce-watchdog progress: {e}") from None
    if not counted:
        print(
            f"gce-watchdog progress: step {args.step} is not after the latest one: not progress",
            file=sys.stderr,
        )
    return EX_OK


def register_fetch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "fetch",
        help="download a file, waiting out DNS and network failures until a deadline",
        description=(
            "Download URL to PATH. Waits for DNS, retries connection errors, timeouts, HTTP 5xx, "
            "408 and 429 (honouring Retry-After) with jittered exponential back-off until the "
            "deadline. Exit codes: 0 ok, 64 bad arguments, 65 checksum mismatch, 69 refused by "
            "the server, 73 cannot write PATH, 75 gave up at the deadline."
        ),
    )
    p.add_argument("url", metavar="URL")
    p.add_argument("-o", "--output", metavar="PATH", required=True)
    p.add_argument("--sha256", metavar="HEX", help="expected SHA-256 of the file (64 hex digits)")
    p.add_argument("--mode", default="0644", help="permissions of PATH, octal (default 0644)")
    p.add_argument("--deadline", default="10m", help="give up after this long (default 10m)")
    p.add_argument(
        "--dns-server",
        metavar="IP[:PORT]",
        action="append",
        default=[],
        help="resolve with this DNS server (repeatable); default /etc/hosts + /etc/resolv.conf",
    )
    p.add_argument("--ca-file", metavar="PATH", help="trust these CA certificates for https")
    add_config_arg(p)
    usage_errors_exit_64(p)
    p.set_defaults(func=cmd_fetch)


def request_from_args(args: argparse.Namespace) -> FetchRequest:
    """Validate the arguments; raises ValueError with every problem found."""
    errors: list[str] = []
    url: Url | None = None
    try:
        url = parse_url(args.url)
    except ValueError as e:
        errors.append(str(e))
    if args.sha256 is not None and not _SHA_RE.match(args.sha256):
        errors.append(f"--sha256 must be 64 hex digits, got {args.sha256!r}")
    mode = 0o644
    try:
        mode = int(args.mode, 8)
        if not 0 <= mode <= 0o7777:
            raise ValueError
    except ValueError:
        errors.append(f"--mode must be octal permissions like 0644, got {args.mode!r}")
    deadline = DEFAULT_DEADLINE
    try:
        deadline = parse_duration(args.deadline)
        if deadline <= 0:
            errors.append("--deadline must be > 0")
    except ValueError as e:
        errors.append(f"--deadline: {e}")
    servers: list[tuple[str, int]] = []
    for s in args.dns_server:
        try:
            servers.append(parse_dns_server(s))
        except ValueError as e:
            errors.append(str(e))
    out = Path(args.output)
    if not args.output or args.output.endswith("/") or out.is_dir():
        errors.append(f"-o must name a file, got {args.output!r}")
    else:
        why = _not_regular(out)
        if why:
            errors.append(f"-o {args.output!r} is {why}: fetch only writes regular files")
    if args.ca_file and not os.path.isfile(args.ca_file):
        errors.append(f"--ca-file {args.ca_file!r}: no such file")
    if errors or url is None:
        raise ValueError("; ".join(errors))
    return FetchRequest(url, out, deadline, args.sha256, mode, tuple(servers), args.ca_file or None)


def _not_regular(path: Path) -> str | None:
    """What path is when it exists and is not a regular file (following symlinks), else None.

    fetch replaces its target by renaming a temp file onto it: onto /dev/null that would replace
    the device node with a file (as root, for every process on the machine)."""
    import stat

    try:
        st = path.stat()
    except OSError:
        return None  # absent (or unreadable: the write says why later)
    if stat.S_ISREG(st.st_mode):
        return None
    kinds = [
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ]
    return next((what for test, what in kinds if test(st.st_mode)), "not a regular file")


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def cmd_fetch(args: argparse.Namespace) -> int:
    try:
        req = request_from_args(args)
    except ValueError as e:
        raise CommandError(EX_USAGE, f"gce-watchdog fetch: {e}") from None
    cfg = load_config_or_exit(args.config)
    con = open_console(cfg)
    try:
        import signal

        deps = FetchDeps(
            emitter=con.emitter,
            stderr=sys.stderr,
            progress=sys.stderr if sys.stderr.isatty() else None,
        )
        old = {
            sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            return run_fetch(req, deps).rc
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
    finally:
        con.close()


def _root_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--root",
        default=None,
        metavar="DIR",
        help="install into DIR instead of / (an image, a test); default $GCEWD_ROOT or /",
    )


def register_install(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    i = sub.add_parser(
        "install",
        help="install the systemd unit and a default config, enable and start it (idempotent)",
    )
    _root_arg(i)
    i.add_argument("--no-start", action="store_true", help="enable the unit but do not start it")
    i.add_argument(
        "--exec",
        dest="exec_path",
        default=None,
        metavar="PATH",
        help="the gce-watchdog executable the unit runs (default: the one beside this Python)",
    )
    i.add_argument(
        "--config",
        default=str(cfgmod.DEFAULT_PATH),
        metavar="PATH",
        help=f"config file the agent reads (default {cfgmod.DEFAULT_PATH}; written if missing)",
    )
    i.set_defaults(func=cmd_install)
    u = sub.add_parser("uninstall", help="stop, disable and remove the systemd unit")
    _root_arg(u)
    u.add_argument("--purge", action="store_true", help="also remove config, state and logs")
    u.set_defaults(func=cmd_uninstall)


def _root(args: argparse.Namespace) -> Path:
    return Path(args.root or os.environ.get("GCEWD_ROOT") or "/").absolute()


def cmd_install(args: argparse.Namespace) -> int:
    opts = InstallOptions(
        root=_root(args),
        exec_path=args.exec_path,
        config_path=args.config,
        start=not args.no_start,
    )
    try:
        return install(opts)
    except InstallError as e:
        raise CommandError(e.code, f"gce-watchdog install: {e}") from None
    except OSError as e:
        raise CommandError(EX_FAIL, f"gce-watchdog install: {e}") from None


def cmd_uninstall(args: argparse.Namespace) -> int:
    try:
        return uninstall(_root(args), args.purge)
    except InstallError as e:
        raise CommandError(e.code, f"gce-watchdog uninstall: {e}") from None
    except OSError as e:
        raise CommandError(EX_FAIL, f"gce-watchdog uninstall: {e}") from None
