"""Core subcommands: config check (more are added by the feature modules)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from gce_watchdog.lib.cli import (
    EX_CONFIG,
    EX_IOERR,
    EX_NOPERM,
    EX_OK,
    EX_UNAVAILABLE,
    EX_USAGE,
    CommandError,
)
from gce_watchdog.vm import config as cfgmod


def add_config_arg(p: argparse.ArgumentParser) -> None:
    # GCEWD_CONFIG (what the start-up script exports to bootstrap steps) is the default, so a step
    # that runs `gce-watchdog fetch` writes to the console and state dir it was configured for.
    p.add_argument(
        "--config",
        metavar="PATH",
        default=os.environ.get("GCEWD_CONFIG") or None,
        help=(
            f"config file (default $GCEWD_CONFIG, else {cfgmod.DEFAULT_PATH}; "
            "missing default file = all defaults)"
        ),
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    k = sub.add_parser(
        "key",
        help="show this instance's line key (its public half, never the private key)",
        description="Print the fingerprint of this instance's protocol v3 line key (run as "
        "root on the VM), for `gce-watchdog pin INSTANCE_ID FINGERPRINT` on the poller side. "
        "Reads the key; creates it if the instance has none yet (as the first line would). "
        "Problems with the key file (a wrong mode or owner, no place to keep it) go to stderr. "
        "--rotate replaces the key: the console first gets a `rekey` line signed with the old "
        "key (readers move their pin only through it), then the key file is switched "
        "atomically; the running agent signs with the new key from its next line on "
        "(docs/serial-protocol.md, 'Key rotation').",
    )
    add_config_arg(k)
    kk = k.add_mutually_exclusive_group()
    kk.add_argument(
        "--fingerprint", action="store_true", help="print the fingerprint only (the default)"
    )
    kk.add_argument(
        "--rotate",
        action="store_true",
        help="make a new key, announce it signed with the old one, switch to it; print the "
        "new fingerprint",
    )
    k.set_defaults(func=cmd_key)
    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION")
    c = csub.add_parser("check", help="validate a config file and report every error")
    add_config_arg(c)
    c.add_argument(
        "path", nargs="?", default=None, metavar="PATH", help="the same as --config PATH"
    )
    c.add_argument(
        "--drop-in",
        metavar="FILE",
        default=None,
        help="check the merged result as if FILE were in config.d/ (it replaces the drop-in "
        "of its name); the start-up script checks the metadata's config this way",
    )
    c.set_defaults(func=cmd_config_check)
    s = csub.add_parser(
        "show",
        help="print the effective configuration as TOML, with where each value came from",
        description="Print every key's effective value (the config file merged with its "
        "config.d/*.toml drop-ins) as TOML that `config check` accepts and that loads back to the "
        "same values (durations as '30s', '1h30m'). Each key ends with a comment naming the file "
        "that set it, or 'default'.",
    )
    add_config_arg(s)
    s.add_argument(
        "--no-sources", action="store_true", help="leave out the comments that name the sources"
    )
    s.set_defaults(func=cmd_config_show)


def cmd_config_check(args: argparse.Namespace) -> int:
    if args.path and args.config and args.path != args.config:
        raise CommandError(
            EX_USAGE,
            f"gce-watchdog config check: two paths: --config {args.config} and {args.path}",
        )
    path = args.path or args.config
    try:
        loaded = cfgmod.load_sources(path, args.drop_in)
    except cfgmod.InvalidConfig as e:
        raise CommandError(EX_CONFIG, str(e)) from None
    _notes(loaded)
    src = path or (str(cfgmod.DEFAULT_PATH) + " (defaults if missing)")
    main = str(path) if path is not None else str(cfgmod.DEFAULT_PATH)
    n = sum(f != main for f in loaded.files)
    with_dropins = f" with {n} drop-in(s)" if n > 0 else ""
    print(f"{src}{with_dropins}: OK (digest {cfgmod.digest(loaded.config)})")
    return EX_OK


def _notes(loaded: cfgmod.Loaded) -> None:
    for name, why in loaded.ignored:
        print(f"gce-watchdog: note: {name}: {why}", file=sys.stderr)


def cmd_config_show(args: argparse.Namespace) -> int:
    try:
        loaded = cfgmod.load_sources(getattr(args, "config", None))
    except cfgmod.InvalidConfig as e:
        raise CommandError(EX_CONFIG, f"gce-watchdog: {e}") from None
    _notes(loaded)
    sys.stdout.write(cfgmod.to_toml(loaded.config, None if args.no_sources else loaded))
    return EX_OK


def cmd_key(args: argparse.Namespace) -> int:
    from gce_watchdog.vm.runtime import load_config_or_exit
    from gce_watchdog.vm.state import KeyUnavailable, load_line_key
    from gce_watchdog.wire.protocol import LineKey

    cfg = load_config_or_exit(args.config)
    if getattr(args, "rotate", False):
        return cmd_key_rotate(cfg)
    try:
        ks = load_line_key(cfg.agent.state_dir, cfg.agent.run_dir)
    except KeyUnavailable as e:
        raise CommandError(EX_NOPERM, f"gce-watchdog key: {e} (run as root)") from None
    for problem in ks.problems:
        print(f"gce-watchdog key: {problem}", file=sys.stderr)
    if ks.ephemeral:
        print("gce-watchdog key: ephemeral (not in the state dir): do not pin it", file=sys.stderr)
    print(LineKey(ks.seed, ks.ephemeral).fingerprint)
    return 1 if ks.ephemeral else EX_OK


def _boot_and_counter(cfg: cfgmod.Config, prog: str) -> tuple[str, str, str]:
    """(full boot id, short boot id, ``bc``) for the rotation's lines: every line carries the
    boot counter; when it is ``-`` the reason goes to stderr."""
    from gce_watchdog.vm.console import boot_count
    from gce_watchdog.vm.state import read_boot_id, short_boot

    full = read_boot_id(cfg.agent.boot_id_path)
    count = boot_count(cfg.agent.state_dir, cfg.agent.run_dir, full)
    if count.problem:
        print(f"{prog}: no boot counter (bc=-): {count.problem}", file=sys.stderr)
    return full, short_boot(full), count.value


def cmd_key_rotate(cfg: cfgmod.Config) -> int:
    """``key --rotate``: a new key, announced on the console signed with the old one, then the
    switch (vm.state.rotate_line_key). Refused without a durable key or an instance id (the
    rekey line binds the new key to the instance id: readers refuse one that names none)."""
    from gce_watchdog.vm.console import SerialPort, cached_instance_id
    from gce_watchdog.vm.state import (
        KeyUnavailable,
        RotateRefused,
        SeqAllocator,
        inspect_line_key,
        rotate_line_key,
    )
    from gce_watchdog.wire import protocol

    prog = "gce-watchdog key --rotate"
    state_dir, run_dir = cfg.agent.state_dir, cfg.agent.run_dir
    inst = cached_instance_id(state_dir)
    if inst == "-":
        raise CommandError(
            EX_UNAVAILABLE,
            f"{prog}: the instance id is not known yet ({state_dir}/instance.json: the agent's "
            "metadata watcher writes it): not rotated",
        )
    try:  # not root: say so before the console (root's too) is tried
        inspect_line_key(state_dir, run_dir)
    except KeyUnavailable as e:
        raise CommandError(EX_NOPERM, f"{prog}: {e} (run as root)") from None
    full, boot, bc = _boot_and_counter(cfg, prog)
    s = cfg.serial
    try:
        port = SerialPort(s.device, s.fallback_file, s.queue_size, s.sync_timeout).open()
    except OSError as e:
        raise CommandError(
            EX_IOERR, f"{prog}: cannot open {s.device} or {s.fallback_file}: {e}"
        ) from None
    seq = SeqAllocator(run_dir, boot)
    written: list[int] = []

    def announce(take: Callable[[], int], old_seed: bytes, new_seed: bytes) -> bool:
        import time

        old = protocol.LineKey(old_seed)
        new = protocol.LineKey(new_seed)
        ts_ms = int(time.time() * 1000)
        n = take()
        while protocol.needs_announcement(n):  # the old key's announcement takes its seqs
            port.submit(protocol.key_line(boot, n, ts_ms, old, inst, bc, full))
            n = take()
        rekey = protocol.rekey_line(boot, n, ts_ms, old, new.public, inst, bc)
        ok = port.write_line(rekey, True)
        written.append(n)
        return ok and port.dropped == 0

    try:
        _old, new_seed = rotate_line_key(state_dir, seq, announce)
    except KeyUnavailable as e:
        port.close()
        raise CommandError(EX_NOPERM, f"{prog}: {e} (run as root)") from None
    except RotateRefused as e:
        port.close()
        raise CommandError(EX_IOERR if written else EX_UNAVAILABLE, f"{prog}: {e}") from None
    except OSError as e:
        port.close()
        raise CommandError(EX_IOERR, f"{prog}: {e.strerror or e}: not rotated") from None
    import time

    new = protocol.LineKey(new_seed)
    # the new key, announced as usual (readers that moved their pin see it at once)
    ann = protocol.key_line(boot, seq.next(), int(time.time() * 1000), new, inst, bc, full)
    port.write_line(ann, True)
    port.close()
    print(f"{prog}: rekey line at seq {written[-1]} of boot {boot}", file=sys.stderr)
    print(new.fingerprint)
    return EX_OK
