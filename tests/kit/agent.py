"""A real agent process and its surroundings: its config against a SimGCE, starting and stopping
it, and an agent baked into an image tree."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from gce_watchdog.testing.simgce import SimGCE

from kit.cli import gcewd_argv
from kit.paths import REPO

AGENT = "/opt/gce-watchdog/bin/gce-watchdog"
# Overlays for agent_config: a two-tick ladder at 0.3 s with no heartbeat lines, and the
# metadata watch and memory monitor off (a test of the ladder alone).
SHORT_LADDER: dict[str, object] = {"interval": 0.3, "threshold": 2, "heartbeat_every": None}
LADDER_ONLY: dict[str, dict[str, object]] = {
    "watch": {"enabled": False},
    "memory": {"enabled": False},
}


def toml_value(v: object) -> str:
    """One TOML value: booleans, numbers, strings (basic strings, JSON's escapes), lists."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str | Path):
        return json.dumps(str(v))
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {v!r}")


def write_toml(path: Path, sections: Mapping[str, Mapping[str, object]]) -> Path:
    """``path`` with one table per section, in the order given."""
    parts = []
    for name, keys in sections.items():
        parts.append(f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items()))
    path.write_text("\n".join(parts))
    return path


def agent_config(
    tmp_path: Path,
    sim: SimGCE,
    agent: Mapping[str, object] | None = None,
    **sections: Mapping[str, object],
) -> Path:
    """``tmp_path/config.toml`` for a real agent against ``sim``: a fast ladder (0.4 s ticks,
    threshold 3), a dry run, state and run dirs and the "serial device" ``ttyS0`` (created) under
    ``tmp_path``. ``agent`` and each of ``sections`` (``actions={...}``, ``watch={...}``) are laid
    over the defaults key by key (a key set to None is left out); a section not among them is
    added."""
    assert sim.tcp is not None
    (tmp_path / "ttyS0").touch()  # the "serial device" (a missing one is unusable: fallback)
    base: dict[str, dict[str, object]] = {
        "agent": {
            "interval": 0.4,
            "probe_timeout": 0.2,
            "threshold": 3,
            "heartbeat_every": 1,
            "state_dir": f"{tmp_path}/state",
            "run_dir": f"{tmp_path}/run",
            "action": "dry-run",
        },
        "metadata": {"url": sim.metadata.url},
        "egress": {"targets": [f"127.0.0.1:{sim.tcp.port}"], "dns_timeout": 0.1},
        "actions": {"linger": 0},
        "serial": {"device": f"{tmp_path}/ttyS0"},
    }
    for name, over in {"agent": agent or {}, **sections}.items():
        merged = {**base.get(name, {}), **over}
        base[name] = {k: v for k, v in merged.items() if v is not None}
    return write_toml(tmp_path / "config.toml", base)


@contextmanager
def agent_process(
    cfg: Path, *args: str, stderr: int | IO[Any] | None = subprocess.DEVNULL, **popen: Any
) -> Iterator[subprocess.Popen[str]]:
    """``gce-watchdog run --config CFG ARGS`` running; killed on the way out if still alive."""
    p = subprocess.Popen(
        gcewd_argv("run", "--config", str(cfg), *args), cwd=REPO, stderr=stderr, text=True, **popen
    )
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
        if p.stderr:
            p.stderr.close()


def stop_agent(p: subprocess.Popen[str], timeout: float = 15) -> int:
    """SIGTERM, then its exit status (raises TimeoutExpired if it does not stop in time)."""
    p.send_signal(signal.SIGTERM)
    return p.wait(timeout)


def run_agent(cfg: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``gce-watchdog run --config CFG ARGS`` to its end (give it ``--max-ticks``)."""
    return subprocess.run(
        gcewd_argv("run", "--config", str(cfg), *args),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def agent_in(root: Path, exec_path: str = AGENT) -> None:
    """An agent baked into the image tree: the console script and the venv's interpreter."""
    agent = root / exec_path.lstrip("/")
    agent.parent.mkdir(parents=True, exist_ok=True)
    python = agent.parent / "python"
    python.write_text("")  # only its presence in the tree is checked
    agent.write_text(f"#!{exec_path.rsplit('/', 1)[0]}/python\n")
    agent.chmod(0o755)
