"""The systemd unit: required settings, `systemd-analyze verify`, and the measured security score.

Needs `systemd-analyze` (Debian package `systemd`, in the Makefile's APT_TEST); skips without it.
It runs offline: nothing here starts a unit or talks to a running systemd.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.bootstrap.install import HIDDEN_PREFIXES, default_exec, render_unit, template
from gce_watchdog.lib.durations import parse_duration
from gce_watchdog.vm import config as cfgmod
from kit.paths import REPO

UNIT_SRC = REPO / "agent" / "gce_watchdog" / "data" / "gce-watchdog.service"
DOC = REPO / "docs" / "systemd.md"
TARGET_EXPOSURE = 2.5  # the target for `systemd-analyze security --offline=true`

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (apt-get install systemd; `make test` does)",
)


def settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        k, _, v = line.partition("=")
        out.setdefault(k, []).append(v)
    return out


@pytest.fixture
def rendered(tmp_path: Path) -> Iterator[Path]:
    """The unit as `gce-watchdog install` writes it: ExecStart= is this venv's gce-watchdog.

    `systemd-analyze verify` wants ExecStart= to exist, and install refuses paths the sandbox
    hides (/tmp, /home, ...). A checkout under such a directory (a CI clone in /tmp) gets a
    symlink to its console script in a fresh directory under /run for the test's duration.
    """
    agent = default_exec()
    if not Path(agent).is_file():
        pytest.skip(f"no gce-watchdog console script beside {sys.executable}")
    link_dir: Path | None = None
    if agent.startswith(HIDDEN_PREFIXES):
        try:
            link_dir = Path(tempfile.mkdtemp(prefix="gcewd-unit-test-", dir="/run"))
        except OSError as e:
            pytest.skip(f"{agent} is hidden by the sandbox and /run is not writable: {e}")
        (link_dir / "gce-watchdog").symlink_to(agent)
        agent = str(link_dir / "gce-watchdog")
    text = render_unit(
        template("gce-watchdog.service"), agent, "/etc/gce-watchdog/config.toml", cfgmod.Config()
    )
    p = tmp_path / "gce-watchdog.service"
    p.write_text(text)
    try:
        yield p
    finally:
        if link_dir is not None:
            shutil.rmtree(link_dir, ignore_errors=True)


@pytest.mark.pure
def test_the_repository_unit_is_the_packaged_one() -> None:
    assert (REPO / "systemd" / "gce-watchdog.service").resolve() == UNIT_SRC.resolve()
    assert template("gce-watchdog.service") == UNIT_SRC.read_text()


@pytest.mark.pure
def test_required_settings() -> None:
    s = settings(UNIT_SRC.read_text())
    assert s["Type"] == ["notify"]
    assert s["Restart"] == ["always"]
    # a crash loop ends in a failed unit; a config error (78) is not restarted at all
    assert s["StartLimitIntervalSec"] == ["10min"] and s["StartLimitBurst"] == ["20"]
    assert s["RestartPreventExitStatus"] == ["78"]
    assert s["Documentation"] == ["man:gce-watchdog(1) man:gce-watchdog.toml(5)"]
    assert int(s["OOMScoreAdjust"][0]) <= -900
    assert s["StateDirectory"] == ["gce-watchdog"]
    assert s["RuntimeDirectory"] == ["gce-watchdog"]
    assert s["DevicePolicy"] == ["closed"]
    assert "/dev/ttyS0 rw" in s["DeviceAllow"]
    assert s.get("PrivateDevices", ["no"]) == ["no"]  # would hide /dev/ttyS0
    assert s["ExecStart"] == ["/opt/gce-watchdog/bin/gce-watchdog run"]
    # Not stopped by a shutdown it started, so it can escalate a stuck one.
    assert s["DefaultDependencies"] == ["no"]
    assert "Conflicts" not in s
    # WatchdogSec must comfortably exceed one default tick (interval + probe timeout).
    wd = parse_duration(s["WatchdogSec"][0])
    a = cfgmod.Config().agent
    assert wd >= 2 * (a.interval + a.probe_timeout)
    # The chain's keepalive runs every actions.repeat_every (checked <= 30 s by the config).
    assert wd > 2 * cfgmod.Config().actions.repeat_every
    assert s["CapabilityBoundingSet"] == ["CAP_SYS_BOOT"]
    assert "NoNewPrivileges" in s and s["NoNewPrivileges"] == ["yes"]


@pytest.mark.pure
def test_exec_start_default_matches_the_bootstrap_prefix() -> None:
    # startup/startup-script.sh installs the agent into $PREFIX=/opt/gce-watchdog (a venv).
    script = (REPO / "startup" / "startup-script.sh").read_text()
    assert 'PREFIX="${GCEWD_PREFIX:-$ROOT/opt/gce-watchdog}"' in script
    assert 'AGENT="$PREFIX/bin/gce-watchdog"' in script


@pytest.mark.process
@needs_analyze
def test_systemd_analyze_verify(rendered: Path) -> None:
    # --man=no: Documentation='s pages are the package's, not this host's (test_cli_docs.py
    # checks that make cli-docs generates every page a unit names).
    p = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(rendered)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    ours = [line for line in p.stderr.splitlines() if "gce-watchdog" in line]
    assert ours == [], ours


def _security(unit: Path) -> tuple[float, list[dict[str, str]]]:
    p = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d)", p.stdout + p.stderr)
    assert m, p.stdout + p.stderr
    j = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--json=short", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    items = [x for x in json.loads(j.stdout) if x.get("exposure") and float(x["exposure"]) > 0]
    return float(m.group(1)), items


@pytest.mark.process
@needs_analyze
def test_security_exposure_within_target_and_every_exposed_item_documented(
    rendered: Path,
) -> None:
    score, exposed = _security(rendered)
    assert score <= TARGET_EXPOSURE, f"exposure {score} > {TARGET_EXPOSURE}"
    # The number docs/systemd.md states is the measured one.
    doc = DOC.read_text().replace("\\|", "|")  # Markdown escapes | in table cells
    assert f"exposure level {score}" in doc
    missing = [x["name"] for x in exposed if f"`{x['name']}`" not in doc]
    assert missing == [], f"exposed items not explained in docs/systemd.md: {missing}"


@pytest.mark.process
@needs_analyze
def test_threshold_rc_agrees(rendered: Path) -> None:
    p = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--threshold=25", str(rendered)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stdout[-2000:]


@pytest.mark.process
@needs_analyze
def test_the_score_notices_a_weakened_unit(tmp_path: Path, rendered: Path) -> None:
    # The measurement is live: dropping the capability bound must cost exposure.
    weak = tmp_path / "weak" / "gce-watchdog.service"
    weak.parent.mkdir()
    weak.write_text(rendered.read_text().replace("CapabilityBoundingSet=CAP_SYS_BOOT\n", ""))
    assert _security(weak)[0] > _security(rendered)[0]
