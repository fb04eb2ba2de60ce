"""The poller's systemd unit and container image definition: valid, hardened, and running the
real command line."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from kit.paths import REPO

UNIT = REPO / "systemd" / "gce-watchdog-poller.service"
TARGET_EXPOSURE = 2.0  # issue 26: the poller unit's `systemd-analyze security` at most 2.0

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (apt-get install systemd; `make test` does)",
)


def rendered(d: Path) -> Path:
    """The unit with ExecStart= pointing at this venv's console script, via a path the sandbox
    does not hide (a checkout under /tmp would be hidden by PrivateTmp=)."""
    agent = Path(sys.executable).with_name("gce-watchdog")
    if not agent.is_file():
        pytest.skip(f"no gce-watchdog console script beside {sys.executable}")
    (d / "gce-watchdog").symlink_to(agent)
    text = UNIT.read_text().replace("/opt/gce-watchdog/bin/gce-watchdog", str(d / "gce-watchdog"))
    p = d / "gce-watchdog-poller.service"
    p.write_text(text)
    return p


@pytest.mark.process
@needs_analyze
def test_the_poller_unit_verifies_and_is_hardened() -> None:
    try:
        d = Path(tempfile.mkdtemp(prefix="gcewd-poller-unit-", dir="/run"))
    except OSError as e:
        pytest.skip(f"/run is not writable: {e}")
    try:
        unit = rendered(d)
        # --man=no: Documentation='s page is the package's (test_cli_docs.py)
        v = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                           capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        problems = [x for x in v.stderr.splitlines() if "gce-watchdog-poller" in x]
        assert problems == [], v.stderr
        s = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)],
                           capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", s.stdout + s.stderr)
        assert m is not None, s.stdout + s.stderr
        assert float(m.group(1)) <= TARGET_EXPOSURE
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.process
def test_the_unit_and_the_image_run_the_poller_with_a_real_command_line() -> None:
    exec_start = next(x for x in UNIT.read_text().splitlines() if x.startswith("ExecStart="))
    assert exec_start.split("=", 1)[1].split()[1:3] == ["poll", "--json"]
    # issue 38: the unit's journal gets changes only (and a summary per round); POLLER_ARGS last
    assert exec_start.split("=", 1)[1].split()[3:] == ["--log", "changes", "$POLLER_ARGS"]
    docker = (REPO / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["gce-watchdog", "poll", "--json"]' in docker
    # The parts the central side needs come pinned by hash from the poller's lock (issue 27).
    assert "--require-hashes" in docker and "-r packaging/requirements-poller.lock" in docker
    lock = (REPO / "packaging" / "requirements-poller.lock").read_text()
    for dist in ("psycopg==", "google-cloud-pubsub==", "matplotlib=="):
        assert re.search(rf"^{re.escape(dist)}\S+ --hash=sha256:[0-9a-f]{{64}}", lock, re.M), dist
    r = subprocess.run([sys.executable, "-m", "gce_watchdog", "poll", "--json", "--help"],
                       capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert r.returncode == 0 and "--label" in r.stdout and "--pubsub" in r.stdout


def settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            k, _, v = line.partition("=")
            out.setdefault(k, []).append(v)
    return out


@pytest.mark.pure
def test_the_unit_is_notify_with_a_watchdog_and_takes_its_secrets_as_credentials() -> None:
    """Issue 26: Type=notify with WatchdogSec=, the token and the PostgreSQL password file
    through LoadCredential= (each with a SetCredential= default of "-", so a host using
    application default credentials or SQLite still starts), no PGPASSFILE under /etc."""
    from gce_watchdog.lib.durations import parse_duration

    s = settings(UNIT.read_text())
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert 60 <= parse_duration(s["WatchdogSec"][0]) <= 3600
    loads = dict(x.split(":", 1) for x in s["LoadCredential"])
    assert set(loads) == {"token", "pgpass"}
    assert all(p.startswith("/etc/gce-watchdog/") for p in loads.values())
    assert sorted(s["SetCredential"]) == ["pgpass:-", "token:-"]
    assert not any("PGPASSFILE" in e for e in s.get("Environment", []))
    assert s["DynamicUser"] == ["yes"]


@pytest.mark.process
def test_under_systemd_the_poller_notifies_and_reads_its_credentials(tmp_path: Path) -> None:
    """What the unit gives the process, without systemd: $NOTIFY_SOCKET (a datagram socket we
    bind), $WATCHDOG_USEC, and $CREDENTIALS_DIRECTORY holding the token (the fake API accepts
    only it) and a pgpass file (the poller points PGPASSFILE at it: the hook sees it)."""
    import json
    import os
    import socket

    from gce_watchdog.testing.simcompute import FakeComputeAPI
    from gce_watchdog.testing.synth import Writer

    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "token").write_text("secret-token\n")
    (creds / "pgpass").write_text("db:5432:watchdog:poller:pw\n")
    sock_path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(60)
    hook = tmp_path / "hook.py"
    hook.write_text(
        "import os, sys\n"
        f"open({str(tmp_path / 'seen')!r}, 'w').write(os.environ.get('PGPASSFILE', ''))\n"
    )
    with FakeComputeAPI(token="secret-token") as api:
        api.add_instance("vm-1", project="test-project", zone="us-central1-a")
        w = Writer(boot="00000001")
        api.append_serial("vm-1", w.line("shutdown", {"reason": "ladder", "rung": "10/10"}, "x"))
        env = {k: v for k, v in os.environ.items() if k != "PGPASSFILE"}
        env |= {"PYTHONPATH": str(REPO / "agent"), "NOTIFY_SOCKET": str(sock_path),
                "WATCHDOG_USEC": "30000000", "CREDENTIALS_DIRECTORY": str(creds)}  # fmt: skip
        r = subprocess.run(
            [sys.executable, "-m", "gce_watchdog", "poll", "--project", "test-project", "--zone",
             "us-central1-a", "--api-base", api.base_url, "--ledger", str(tmp_path / "l.sqlite"),
             "--cursor-dir", str(tmp_path / "c"), "--json", "--once",
             "--on-failover", f"{sys.executable} {hook}", "vm-1"],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (out,) = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert out["action"] == "failover"  # authenticated with the credential's token
    assert "secret-token" not in r.stdout + r.stderr
    assert "Compute API token: the 'token' credential ($CREDENTIALS_DIRECTORY)" in r.stderr
    assert (tmp_path / "seen").read_text() == str(creds / "pgpass")
    got = []
    sock.setblocking(False)
    try:
        while True:
            got += sock.recv(4096).decode().split("\n")
    except BlockingIOError:
        pass
    finally:
        sock.close()
    assert got[0] == "READY=1" and "WATCHDOG=1" in got and got[-1] == "STOPPING=1"


@pytest.mark.pure
def test_a_credential_left_at_the_units_default_is_not_configured(tmp_path: Path) -> None:
    from gce_watchdog.poller.app import service_credentials

    (tmp_path / "token").write_text("-")  # SetCredential=token:- (no source file)
    (tmp_path / "pgpass").write_text("")
    assert service_credentials({"CREDENTIALS_DIRECTORY": str(tmp_path)}) == {}
    (tmp_path / "pgpass").write_text("h:5432:d:u:p\n")
    (tmp_path / "token").unlink()
    (tmp_path / "token").symlink_to(tmp_path / "pgpass")  # never followed
    assert service_credentials({"CREDENTIALS_DIRECTORY": str(tmp_path)}) == {
        "pgpass": str(tmp_path / "pgpass")
    }
    assert service_credentials({}) == {}


def _poll_without(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``gce-watchdog poll ARGS`` in a fresh interpreter where ``module`` cannot be imported, as
    in the gce-watchdog package without gce-watchdog-poller."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from gce_watchdog.cli import main\n"
        f"sys.exit(main(['poll', *{list(args)!r}]))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip


@pytest.mark.process
@pytest.mark.parametrize(
    ("module", "args", "want"),
    [
        ("psycopg", ("--ledger", "postgresql://poller@127.0.0.1:9/watchdog"),
         "a postgresql:// ledger needs psycopg, not installed: "
         "pip install 'gce-watchdog[postgres]'"),
        ("google.cloud.pubsub_v1", ("--publish", "projects/my-project/topics/failovers"),
         "--pubsub and --publish need google-cloud-pubsub, not installed: "
         "pip install 'gce-watchdog[pubsub]'"),
    ],
)  # fmt: skip
def test_a_missing_library_is_a_configuration_error_that_stops_the_unit(
    tmp_path: Path, module: str, args: tuple[str, ...], want: str
) -> None:
    """Issue 39: exit 78 (EX_CONFIG) with what to install, before anything is opened (the
    ledger file is not made, the API port is closed); the unit does not restart on 78, and a
    crash loop of other exits ends in a failed unit (a start limit)."""
    common = ("--once", "--project", "my-project", "--zone", "us-central1-a", "vm-1",
              "--api-base", "http://127.0.0.1:9")  # fmt: skip
    ledger = ("--ledger", str(tmp_path / "l.sqlite")) if "--ledger" not in args else ()
    r = _poll_without(module, *args, *ledger, *common)
    assert r.returncode == 78, r.stderr
    assert want in r.stderr, r.stderr
    assert not (tmp_path / "l.sqlite").exists()
    s = settings(UNIT.read_text())
    assert s["RestartPreventExitStatus"] == ["78"] and s["Restart"] == ["always"]
    assert s["StartLimitIntervalSec"] == ["1h"] and s["StartLimitBurst"] == ["120"]
    assert s["Documentation"] == ["man:gce-watchdog(1)"]
