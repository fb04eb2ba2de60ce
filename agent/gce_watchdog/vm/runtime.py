"""Wiring shared by the CLI commands: config loading with clear errors, logging, the emitter.

This is the only place (with each command's handler) where real implementations are chosen.
"""

from __future__ import annotations

import sys
from typing import Any

from gce_watchdog.lib.cli import EX_CONFIG
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import (
    DiscardSink,
    Emitter,
    SerialPort,
    count_then_key,
    open_emitter,
)
from gce_watchdog.vm.state import SeqAllocator, read_boot_id, short_boot


def load_config_or_exit(path: str | None) -> cfgmod.Config:
    """Load the config at ``path`` (the command's --config; None: the default); print every
    error and exit 78 when invalid."""
    try:
        return cfgmod.load(path)
    except cfgmod.InvalidConfig as e:
        print(f"gce-watchdog: {e}", file=sys.stderr)
        raise SystemExit(EX_CONFIG) from None


def make_emitter(
    cfg: cfgmod.Config, log: Any = None, count_state: bool = True, boot_id: str | None = None
) -> tuple[Emitter, SerialPort]:
    """A real serial port (device, else the fallback file) and an emitter numbering lines.
    ``count_state`` False: the config's state dir is not the instance's (see open_emitter).
    ``boot_id``: the full boot id when the caller has read it (None: read here)."""
    s = cfg.serial
    full = boot_id if boot_id is not None else read_boot_id(cfg.agent.boot_id_path)
    return open_emitter(
        s.device,
        s.fallback_file,
        cfg.agent.state_dir,
        cfg.agent.run_dir,
        short_boot(full),
        queue_size=s.queue_size,
        sync_timeout=s.sync_timeout,
        log=log,
        boot_id=full,
        count_state=count_state,
    )


class CommandConsole:
    """The serial console as a command uses it: the one way a command opens it.

    Opened best effort: the device, else the fallback file; when neither opens, a warning says so
    on stderr, ``available`` is False and lines go nowhere (a command must not fail because the
    console is unusable). :meth:`write` writes one line synchronously and says whether it was
    confirmed written, so the caller can report it (exit 74 for the phase commands).
    """

    def __init__(self, emitter: Emitter, port: SerialPort | None) -> None:
        self.emitter = emitter
        self.port = port

    @property
    def available(self) -> bool:
        return self.port is not None

    def write(self, event: str, fields: dict[str, object], text: str = "") -> bool:
        ok = self.emitter.write(event, fields, text)
        return ok and self.available

    def close(self) -> None:
        if self.port is not None:
            self.port.close()

    def __enter__(self) -> CommandConsole:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_console(
    cfg: cfgmod.Config,
    log: Any = None,
    prog: str = "gce-watchdog",
    journal: Any = None,
    count_state: bool = True,
) -> CommandConsole:
    """The console for a command or the agent (see :class:`CommandConsole`); the caller closes
    it. The one fallback: when neither the device nor the fallback file opens, lines are counted
    as dropped (:class:`DiscardSink`) and still mirrored to ``log``; the reason goes to
    ``journal`` (the agent's logger) when given, else to stderr. ``count_state`` False: the
    boot counter is not kept in the config's state dir (the agent's private one)."""
    full = read_boot_id(cfg.agent.boot_id_path)  # once, for the port's emitter or the fallback
    try:
        emitter, port = make_emitter(cfg, log=log, count_state=count_state, boot_id=full)
    except OSError as e:
        s = cfg.serial
        if journal is not None:
            journal.error(
                "serial_unavailable", error=str(e), device=s.device, fallback=s.fallback_file
            )
        else:
            print(
                f"{prog}: cannot open {s.device} or {s.fallback_file}: {e}; lines are not written",
                file=sys.stderr,
            )
        boot = short_boot(full)
        count, key, problems = count_then_key(
            cfg.agent.state_dir, cfg.agent.run_dir, full, count_state
        )
        seq = SeqAllocator(cfg.agent.run_dir, boot)
        emitter = Emitter(
            DiscardSink(),
            seq,
            boot,
            log=log,
            key=key,
            key_problems=problems,
            count=count,
            boot_id=full,
        )
        return CommandConsole(emitter, None)
    return CommandConsole(emitter, port)
