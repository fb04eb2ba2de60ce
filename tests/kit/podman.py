"""A real container builder and runtime for the poller's image (tests/root/test_container.py).

podman (Debian's 4.3) with runc, in a storage root of the test's own that is reset and removed
afterwards, so nothing is left in /var/lib/containers. The base image is a Debian 12 tree made
by ``packaging/debroot.sh build bookworm`` (the tree the .deb is built in: python3 3.11 and its
venv module), imported with ``podman import``: no registry is reachable here, and the
Dockerfile's ``BASE`` build argument takes any image with python3. The locks' wheels are fetched
once into ``build/cache/container-wheels`` (by hash) and mounted into the build, which runs with
no network (``FIND_LINKS``).

Why the options: this machine's hard RLIMIT_NOFILE/NPROC are below podman's defaults (crun and
runc refuse to raise them: ``default_ulimits = []`` keeps the caller's), and its cgroups are
v1/hybrid, which crun refuses (runc takes it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from kit.paths import REPO

CONF = "[containers]\ndefault_ulimits = []\npids_limit = 0\n"
WHEELS = REPO / "build" / "cache" / "container-wheels"
LOCKS = ("packaging/requirements-poller.lock", "packaging/requirements-build.lock")


def unavailable() -> str | None:
    """Why the image cannot be built and run here, or None."""
    if os.geteuid() != 0:
        return "needs root (podman's storage, debootstrap)"
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} missing (make apt-test installs it)"
    cached = (REPO / "build/cache/debroot/bookworm-base.tar").exists()
    if not cached and shutil.which("debootstrap") is None:
        return "debootstrap missing and no cached tree (build/cache/debroot)"
    return None


class Podman:
    """podman with a private storage root under ``root``; :meth:`close` removes all of it.

    Its state is private too: ``--runroot`` and ``--tmpdir`` (libpod's default tmpdir is the
    machine-wide ``/run/libpod``, which another run's ``system reset`` empties: two ``make test``
    at once failed with "creating runtime status file: open /run/libpod/alive")."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "run").mkdir(parents=True, exist_ok=True)
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        self.conf = root / "containers.conf"
        self.conf.write_text(CONF)

    def argv(self, *args: str) -> list[str]:
        return ["podman", "--root", str(self.root / "storage"), "--runroot",
                str(self.root / "run"), "--tmpdir", str(self.root / "tmp"),
                "--runtime", "runc", *args]  # fmt: skip

    def env(self) -> dict[str, str]:
        return {**os.environ, "CONTAINERS_CONF": str(self.conf)}

    def run(
        self, *args: str, timeout: float = 120, stdin: bytes | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args), input=stdin.decode() if stdin is not None else None,
            capture_output=True, text=True, env=self.env(), timeout=timeout, check=False,
        )  # fmt: skip

    def popen(self, *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env()
        )

    def import_tree(self, tree: Path, ref: str) -> None:
        tar = subprocess.Popen(["tar", "-C", str(tree), "--numeric-owner", "-c", "."],
                               stdout=subprocess.PIPE)  # fmt: skip
        assert tar.stdout is not None
        p = subprocess.run(self.argv("import", "--quiet", "-", ref), stdin=tar.stdout,
                           capture_output=True, text=True, env=self.env(), timeout=300)  # fmt: skip
        tar.stdout.close()
        assert tar.wait(timeout=60) == 0 and p.returncode == 0, p.stderr

    def close(self) -> None:
        self.run("system", "reset", "--force", timeout=300)
        shutil.rmtree(self.root, ignore_errors=True)


def debian_tree() -> Path:
    """The Debian 12 build tree (packaging/debroot.sh; cached under build/ after the first)."""
    p = subprocess.run(["bash", str(REPO / "packaging/debroot.sh"), "build", "bookworm"],
                       capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return Path(p.stdout.strip().splitlines()[-1])


def fetch_wheels(dest: Path = WHEELS) -> Path:
    """The locks' wheels, checked against their hashes by pip (a cache: pip skips the files
    that are there with the right hash)."""
    dest.mkdir(parents=True, exist_ok=True)
    reqs: list[str] = []
    for lock in LOCKS:
        reqs += ["-r", str(REPO / lock)]
    argv = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
            "--require-hashes", "--only-binary=:all:", "--no-deps", "-d", str(dest),
            *reqs]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert p.returncode == 0, p.stderr
    return dest


def build(pm: Podman, base: str, tag: str, extra: Sequence[str] = ()) -> None:
    """``podman build`` of the repository's Dockerfile, offline, from the cached wheels."""
    wheels = fetch_wheels()
    p = pm.run("build", "--quiet", "--network=none", "--volume", f"{wheels}:/wheels:ro",
               "--build-arg", f"BASE={base}", "--build-arg", "FIND_LINKS=/wheels",
               "-t", tag, *extra, str(REPO), timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
