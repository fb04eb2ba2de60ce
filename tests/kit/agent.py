"""A real agent process's surroundings: its config against a SimGCE, and an agent baked into an
image tree."""

from __future__ import annotations

from pathlib import Path

from gce_watchdog.testing.simgce import SimGCE

AGENT = "/opt/gce-watchdog/bin/gce-watchdog"


def agent_config(tmp_path: Path, sim: SimGCE, **agent: object) -> Path:
    assert sim.tcp is not None
    (tmp_path / "ttyS0").touch()  # the "serial device" (a missing one is unusable: fallback)
    extra = "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in agent.items())
    p = tmp_path / "config.toml"
    p.write_text(f"""
[agent]
interval = 0.4
probe_timeout = 0.2
threshold = 3
heartbeat_every = 1
state_dir = "{tmp_path}/state"
run_dir = "{tmp_path}/run"
action = "dry-run"
{extra}
[metadata]
url = "{sim.metadata.url}"
[egress]
targets = ["127.0.0.1:{sim.tcp.port}"]
dns_timeout = 0.1
[actions]
linger = 0
[serial]
device = "{tmp_path}/ttyS0"
""")
    return p


def agent_in(root: Path, exec_path: str = AGENT) -> None:
    """An agent baked into the image tree: the console script and the venv's interpreter."""
    agent = root / exec_path.lstrip("/")
    agent.parent.mkdir(parents=True, exist_ok=True)
    python = agent.parent / "python"
    python.write_text("")  # only its presence in the tree is checked
    agent.write_text(f"#!{exec_path.rsplit('/', 1)[0]}/python\n")
    agent.chmod(0o755)
