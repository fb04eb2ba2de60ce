"""The agent acts only on GCE (issue 16, item 5).

The DMI product name (a configurable path, so each case is a file the test writes) must say
"Google Compute Engine"; elsewhere `run` watches and reports but never acts and says why at start,
`check` says so and says plainly when no metadata server answered, and `install` warns. Real agent
processes against the simulated GCE; the action commands are a recorder script, so a chain that
ran would leave a trace.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from pathlib import Path

import pytest
from gce_watchdog.bootstrap.install import InstallOptions, install
from gce_watchdog.testing.simgce import SimGCE
from gce_watchdog.vm.platform import GCE_PRODUCT, Platform, arming, detect
from gce_watchdog.wire import protocol
from kit.agent import LADDER_ONLY, SHORT_LADDER, agent_config, agent_in, run_agent
from kit.cli import agent_env, gcewd, gcewd_argv
from kit.events import read_events
from kit.journal import parse_native

QEMU = "Standard PC (Q35 + ICH9, 2009)"


def dmi(tmp: Path, product: str | None) -> Path:
    p = tmp / "product_name"
    if product is not None:
        p.write_text(product + "\n")
    return p


@pytest.mark.pure
def test_detect_reads_the_product_name(tmp_path: Path) -> None:
    assert detect(str(dmi(tmp_path, GCE_PRODUCT))) == Platform(
        True, GCE_PRODUCT, "DMI product name is 'Google Compute Engine'"
    )
    other = detect(str(dmi(tmp_path, QEMU)))
    assert not other.gce and other.product == QEMU and QEMU in other.why
    missing = detect(str(tmp_path / "absent"))
    assert not missing.gce and "cannot read the DMI product name" in missing.why


@pytest.mark.pure
def test_arming_matrix() -> None:
    gce, other = Platform(True, GCE_PRODUCT, ""), Platform(False, QEMU, "x")
    assert arming(gce, False) == (True, "")
    assert arming(other, True) == (True, "")
    ok, why = arming(other, False)
    assert not ok and why.startswith("WATCH ONLY, never acting here: not a GCE VM (x)")


def _config(tmp: Path, sim: SimGCE, product: str | None, **agent: object) -> Path:
    rec = tmp / "recorder"
    rec.write_text(f'#!/bin/sh\necho "$@" >> "{tmp}/actions.log"\nexit 1\n')
    rec.chmod(0o755)
    return agent_config(
        tmp,
        sim,
        {
            **SHORT_LADDER,
            "action": "poweroff",
            "dmi_product_path": str(dmi(tmp, product)),
            **agent,
        },
        actions={
            "poweroff_cmd": [str(rec), "poweroff"],
            "force_cmd": [str(rec), "force"],
            "kernel": [],
        },
        **LADDER_ONLY,
    )


def _run(tmp: Path, product: str | None, **agent: object) -> list[protocol.Event]:
    with SimGCE() as sim:
        cfg = _config(tmp, sim, product, **agent)
        sim.outage(True)
        r = run_agent(cfg, "--max-ticks", "4")
    assert r.returncode == 0, r.stderr
    return read_events(tmp / "ttyS0")


@pytest.mark.process
@pytest.mark.parametrize("product", [QEMU, None], ids=["other-product", "no-dmi"])
def test_off_gce_the_agent_watches_and_reports_but_never_acts(
    tmp_path: Path, product: str | None
) -> None:
    evs = _run(tmp_path, product)
    names = [e.event for e in evs]
    assert names[:2] == ["start", "warn"]
    assert evs[1].get("what") == "gce" and evs[1].text.startswith("WATCH ONLY, never acting here")
    assert "not a GCE VM" in evs[1].text
    would = [e for e in evs if e.event == "would_shutdown"]
    assert len(would) == 1 and would[0].get("why") == "not-gce"
    assert "shutdown" not in names and "action" not in names
    assert not (tmp_path / "actions.log").exists()  # nothing was run


@pytest.mark.process
def test_on_gce_the_same_outage_runs_the_chain(tmp_path: Path) -> None:
    evs = _run(tmp_path, GCE_PRODUCT)
    names = [e.event for e in evs]
    assert "warn" not in names and "would_shutdown" not in names
    assert names.count("shutdown") == 1
    assert (tmp_path / "actions.log").read_text().split() == ["poweroff", "force"]


@pytest.mark.process
def test_off_gce_the_config_can_allow_acting(tmp_path: Path) -> None:
    evs = _run(tmp_path, QEMU, allow_non_gce=True)
    assert [e.event for e in evs].count("shutdown") == 1
    assert (tmp_path / "actions.log").exists()


def _check(tmp: Path, product: str | None, outage: bool) -> subprocess.CompletedProcess[str]:
    with SimGCE() as sim:
        cfg = _config(tmp, sim, product)
        sim.outage(outage)
        return gcewd("check", "--config", str(cfg))


@pytest.mark.process
def test_check_says_not_gce_and_no_metadata_server(tmp_path: Path) -> None:
    r = _check(tmp_path, QEMU, outage=True)
    assert r.returncode == 2
    assert (
        f"platform: WATCH ONLY, never acting here: not a GCE VM (DMI product name is '{QEMU}'"
        in (r.stdout)
    )
    assert "metadata: no metadata server answered at" in r.stdout


@pytest.mark.process
def test_check_on_gce_with_a_healthy_metadata_server_says_neither(tmp_path: Path) -> None:
    r = _check(tmp_path, GCE_PRODUCT, outage=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "platform: GCE (DMI product name is 'Google Compute Engine'): the agent acts" in r.stdout
    assert "no metadata server" not in r.stdout


def _install(tmp: Path, plat: Platform | None, config: str = "") -> list[str]:
    root = tmp / "root"
    agent_in(root, "/opt/gce-watchdog/bin/gce-watchdog")  # an agent baked into the image tree
    if config:
        (root / "etc/gce-watchdog").mkdir(parents=True)
        (root / "etc/gce-watchdog/config.toml").write_text(config)
    lines: list[str] = []
    opts = InstallOptions(root=root, exec_path="/opt/gce-watchdog/bin/gce-watchdog", live=False,
                          platform=plat)  # fmt: skip

    def runner(argv: object, timeout: float) -> object:
        from gce_watchdog.lib.proc import RunResult

        return RunResult(1, "no systemctl here")

    assert install(opts, runner=runner, out=lines.append) == 0  # type: ignore[arg-type]
    return lines


@pytest.mark.process
def test_install_off_gce_warns_that_it_installs_disarmed(tmp_path: Path) -> None:
    lines = _install(tmp_path, Platform(False, QEMU, f"DMI product name is {QEMU!r}"))
    warn = [ln for ln in lines if ln.startswith("warning: not a GCE VM")]
    assert len(warn) == 1 and "installed disarmed" in warn[0] and "never acts" in warn[0]


@pytest.mark.process
def test_install_on_gce_does_not_warn(tmp_path: Path) -> None:
    lines = _install(tmp_path, Platform(True, GCE_PRODUCT, "x"))
    assert not [ln for ln in lines if ln.startswith("warning")]


@pytest.mark.process
def test_install_off_gce_with_allow_says_it_will_act(tmp_path: Path) -> None:
    lines = _install(tmp_path, Platform(False, QEMU, "x"), config="[agent]\nallow_non_gce = true\n")
    assert any("it WILL act" in ln for ln in lines)


def _datagrams(sock: socket.socket) -> list[bytes]:
    out = []
    sock.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            out.append(sock.recv(1 << 20))
    return out


@pytest.mark.process
def test_off_gce_the_journal_gets_the_whole_reason_and_systemctl_status_says_watch_only(
    tmp_path: Path,
) -> None:
    """Issue 39: the journal got the console's 100-character text (the reason cut mid-path), and
    `systemctl status` (sd_notify STATUS=) never said the agent only watches."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    journal, notify = (
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM),
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM),
    )
    journal.bind(str(tmp_path / "journal.sock"))
    notify.bind(str(tmp_path / "notify.sock"))
    with SimGCE() as sim, (tmp_path / "stderr").open("w") as err:
        cfg = _config(tmp_path, sim, None, dmi_product_path=str(deep / "product_name"))
        st = os.fstat(err.fileno())
        env = {**agent_env(), "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}",
               "GCEWD_JOURNAL_SOCKET": str(tmp_path / "journal.sock"),
               "NOTIFY_SOCKET": str(tmp_path / "notify.sock")}  # fmt: skip
        r = subprocess.run(
            gcewd_argv("run", "--config", str(cfg), "--max-ticks", "2"),
            env=env, stderr=err, stdout=subprocess.PIPE, timeout=120, check=False,
        )  # fmt: skip
    assert r.returncode == 0, (tmp_path / "stderr").read_text()
    entries = [dict(parse_native(d)) for d in _datagrams(journal)]
    journal.close()
    warn = next(e for e in entries if e["GCEWD_EVENT"] == b"warn")
    text = warn["GCEWD_TEXT"].decode()
    assert str(deep / "product_name") in text, text  # the whole path, not cut at 100
    assert text.endswith("(agent.allow_non_gce = true to act anyway)")
    assert text.startswith("WATCH ONLY") and warn["PRIORITY"] == b"4"
    assert text in warn["MESSAGE"].decode()
    # the serial line keeps its 100-character text
    line = next(e for e in read_events(tmp_path / "ttyS0") if e.event == "warn")
    assert len(line.text) <= protocol.MAX_TEXT and text.startswith(line.text.removesuffix("..."))
    grams = _datagrams(notify)
    statuses = [
        a.removeprefix("STATUS=")
        for d in grams
        for a in d.decode().split("\n")
        if a.startswith("STATUS=")
    ]
    notify.close()
    assert statuses and all("; watch only: not a GCE VM (" in s for s in statuses), statuses
    assert any(s.startswith("rung 0/2, metadata ok, egress ok;") for s in statuses), statuses
