"""A real PostgreSQL server for the tests: Debian's packages, initdb and pg_ctl in a temp dir.

Runs as the ``postgres`` user when we are root (the server refuses to run as root), listens on a
free loopback port with its socket in the data dir, uses ``trust`` auth for loopback only, and is
stopped (``pg_ctl stop -m immediate``) and removed when the context exits, also on failure.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kit.ports import free_port

START_TIMEOUT_S = 60  # pg_ctl -w waits for the server to accept connections, up to this


def pg_bindir() -> Path | None:
    """The newest /usr/lib/postgresql/N/bin with initdb and pg_ctl, or the ones on PATH."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4])
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def unavailable() -> str | None:
    """Why no server can be started here, or None."""
    if pg_bindir() is None:
        return "no PostgreSQL server binaries (apt-get install postgresql; make test does this)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no postgres user to run the server as"
    return None


@contextmanager
def postgres_server() -> Iterator[str]:
    """Start a server; yield a ``postgresql://`` URL of database ``postgres`` on it."""
    why = unavailable()
    if why:
        raise RuntimeError(why)
    bindir = pg_bindir()
    assert bindir is not None
    root = Path(tempfile.mkdtemp(prefix="gcewd-pg-"))
    data = root / "data"
    as_user: list[str] = []
    user = pwd.getpwuid(os.geteuid()).pw_name
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
        as_user = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups"]
        user = "postgres"
    port = free_port()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}
    log = root / "server.log"
    started = False
    try:
        subprocess.run(
            [
                *as_user,
                str(bindir / "initdb"),
                "-D",
                str(data),
                "-U",
                user,
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            env=env,
            timeout=START_TIMEOUT_S,
        )
        opts = (
            f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={root}"
            " -c max_connections=200 -c fsync=on -c synchronous_commit=on"
        )
        subprocess.run(
            [
                *as_user,
                str(bindir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(log),
                "-o",
                opts,
                "-w",
                "-t",
                str(START_TIMEOUT_S),
                "start",
            ],
            check=True,
            capture_output=True,
            env=env,
            timeout=START_TIMEOUT_S + 10,
        )
        started = True
        yield f"postgresql://{user}@127.0.0.1:{port}/postgres"
    except subprocess.CalledProcessError as e:
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise RuntimeError(
            f"{e.cmd[len(as_user)]} failed: {e.stderr.decode(errors='replace')}\n{tail}"
        ) from e
    finally:
        if started or (data / "postmaster.pid").exists():
            subprocess.run(
                [
                    *as_user,
                    str(bindir / "pg_ctl"),
                    "-D",
                    str(data),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                ],
                capture_output=True,
                env=env,
                timeout=START_TIMEOUT_S,
            )
        shutil.rmtree(root, ignore_errors=True)
