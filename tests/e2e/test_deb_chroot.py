"""The .deb and the image path on a fresh Debian 12 tree (the e2e guest's debootstrap rootfs,
unpacked into a temp dir): ``dpkg -i`` there, the agent runs there, ``apt-get remove`` and
``purge`` leave the tree as it was; ``bake-image.sh --root`` (from the .deb and from the
wheelhouse) produces a tree in which ``gce-watchdog --version`` runs under chroot.

Runs with the VM scenarios (``make e2e``: root, and the rootfs the image is built from).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kit.paths import REPO

from e2e import vm

pytestmark = [pytest.mark.vm, pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(600)]

BAKE = REPO / "startup" / "bake-image.sh"
# What dpkg and apt keep about packages, and scratch space: not part of "the system as it was".
VOLATILE = ("tmp/", "var/lib/dpkg/", "var/cache/", "var/log/", "var/lib/apt/", "run/")


def rootfs_tar() -> Path:
    tars = sorted((vm.BUILD / "cache").glob("rootfs-*.tar"), key=lambda p: p.stat().st_mtime)
    if not tars:
        pytest.skip("no debootstrap rootfs yet: `make e2e` builds it")
    return tars[-1]


@pytest.fixture
def tree(e2e: vm.Harness, tmp_path: Path) -> Iterator[Path]:
    """A fresh Debian 12 file tree (the e2e harness built the rootfs and the .deb)."""
    root = tmp_path / "root"
    root.mkdir()
    with tarfile.open(rootfs_tar()) as t:
        t.extractall(root, filter="fully_trusted")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def chroot(root: Path, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive"}
    p = subprocess.run(
        ["chroot", str(root), *argv], capture_output=True, text=True, timeout=300, env=env
    )
    if check:
        assert p.returncode == 0, f"{argv}: rc {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every path in the tree (mode and link target), volatile dirs left out."""
    out: dict[str, tuple[int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root)) + ("/" if name in dirnames else "")
            if rel.startswith(VOLATILE):
                continue
            st = p.lstat()
            out[rel] = (st.st_mode, os.readlink(p) if p.is_symlink() else "")
    return out


def test_deb_installs_runs_and_removes_clean(tree: Path) -> None:
    deb = vm.WWW_DIR / "gce-watchdog.deb"
    before = snapshot(tree)
    shutil.copy(deb, tree / "tmp" / "gce-watchdog.deb")
    chroot(tree, "dpkg", "-i", "/tmp/gce-watchdog.deb")
    assert chroot(tree, "gce-watchdog", "--version").stdout.startswith("gce-watchdog ")
    assert chroot(tree, "/opt/gce-watchdog/bin/gce-watchdog", "--version").returncode == 0
    # Enabled for the next boot (an image bake), never started (no running systemd here).
    assert (
        chroot(tree, "systemctl", "is-enabled", "gce-watchdog.service").stdout.strip() == "enabled"
    )
    assert (tree / "etc/gce-watchdog/config.toml").is_file()
    unit = (tree / "usr/lib/systemd/system/gce-watchdog.service").read_text()
    assert "ExecStart=/opt/gce-watchdog/bin/gce-watchdog run" in unit
    assert not (tree / "run/gce-watchdog").exists(), "the agent was not started"

    chroot(tree, "apt-get", "remove", "-y", "-q", "gce-watchdog")
    assert not (tree / "opt/gce-watchdog").exists(), "remove takes the venv (and its byte-code)"
    assert (tree / "etc/gce-watchdog/config.toml").exists(), "remove keeps the conffile"
    chroot(tree, "apt-get", "purge", "-y", "-q", "gce-watchdog")
    after = snapshot(tree)
    assert {k: v for k, v in after.items() if k not in before} == {}, "purge leaves nothing new"
    assert {k: v for k, v in before.items() if k not in after} == {}, "...and removes nothing else"
    assert after == before


@pytest.mark.parametrize("source", ["deb", "wheelhouse"])
def test_bake_image_into_a_tree_gives_an_agent_that_runs_there(
    tree: Path, tmp_path: Path, source: str
) -> None:
    if source == "deb":
        args = ["--deb", str(vm.WWW_DIR / "gce-watchdog.deb")]
    else:
        house = tmp_path / "house"
        with tarfile.open(vm.WWW_DIR / "wheelhouse.tar") as t:
            t.extractall(house, filter="data")
        args = ["--wheelhouse", str(house)]
    p = subprocess.run(
        ["bash", str(BAKE), *args, "--root", str(tree)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GCEWD_ROOT": ""},
    )
    assert p.returncode == 0, p.stderr
    version = chroot(tree, "/opt/gce-watchdog/bin/gce-watchdog", "--version").stdout.strip()
    assert version.startswith("gce-watchdog ")
    assert (tree / "opt/gce-watchdog/.baked").read_text().strip() == version
    shebang = (tree / "opt/gce-watchdog/bin/gce-watchdog").read_text().splitlines()[0]
    assert shebang == "#!/opt/gce-watchdog/bin/python", "the image's interpreter, not the host's"
    assert (
        chroot(tree, "systemctl", "is-enabled", "gce-watchdog.service").stdout.strip() == "enabled"
    )
