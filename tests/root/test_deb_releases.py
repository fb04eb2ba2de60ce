"""The .deb of each Debian release (issue 27 item 2), in a fresh debootstrap tree of that release.

For Debian 12 (bookworm) and Debian 13 (trixie): ``packaging/build-deb.sh OUT RELEASE`` builds
the package in that release's build root (packaging/debroot.sh: its own python3), then in a fresh
copy of that release's minbase tree, as an operator would:

- ``apt-get install ./gce-watchdog_*.deb`` resolves the dependencies (python3 of that release,
  from the tree's apt cache: no network needed once the tree is cached);
- ``gce-watchdog check`` says the GPU gauge is absent and why: the installed nvidia-ml-py is
  imported and NVML's library is not there (no driver in a chroot);
- ``gce-watchdog memwatch`` with the project's NVML fake (tests/kit/fake_pynvml.py) found as
  ``pynvml`` on the import path, through the sampler's production import (no injection): PASS;
- without gce-watchdog-poller, ``poll --ledger postgresql://...`` exits 78 naming that package, and
  ``report --png`` suggests no ``pip install`` (the venv has no pip); with it, psycopg and
  google-cloud-pubsub import and the poller's unit is in /usr/lib/systemd/system (issue 39);
- an upgrade to newer packages keeps an administrator's change to the conffile, and the unit
  stays enabled;
- ``apt-get purge`` of both, after the units' state was made as systemd makes it (the poller's
  SQLite ledger under /var/lib/private), leaves the tree exactly as a fresh one with only the
  dependencies installed, with no dpkg warning.

Needs root (chroot, mount) and debootstrap or the cached trees under build/cache/debroot (made
once per release from Debian's archive: about 1.5 min each; then a run takes about 1 min per
release). Runs in ``make test``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kit.paths import REPO

PKG = REPO / "packaging"
UPSTREAM = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
RELEASES = {"bookworm": ("12", "3.11"), "trixie": ("13", "3.13")}
# What dpkg and apt keep about packages, and scratch space: not part of "the system as it was".
VOLATILE = ("tmp/", "var/lib/dpkg/", "var/cache/", "var/log/", "var/lib/apt/", "run/", "proc/")
TIMINGS: dict[str, dict[str, float]] = {}

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1200)]


def _unusable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (chroot, mount)"
    for tool in ("dpkg-deb", "chroot", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} missing"
    if not (REPO / ".venv/bin/python").exists():
        return "make venv first"
    cached = all((REPO / f"build/cache/debroot/{r}-base.tar").exists() for r in RELEASES)
    if not cached and shutil.which("debootstrap") is None:
        return "debootstrap missing (apt-get install debootstrap) and no cached trees"
    return None


@dataclass
class Built:
    release: str
    major: str
    python: str
    deb: Path
    poller: Path
    base: Path
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def version(self) -> str:
        return f"{UPSTREAM}-1~deb{self.major}u1"


def _run(argv: list[str], timeout: int = 900) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{argv}: rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module", params=sorted(RELEASES))
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    why = _unusable()
    if why:
        pytest.skip(why)
    release: str = request.param
    major, python = RELEASES[release]
    t: dict[str, float] = {}
    t0 = time.monotonic()
    base = Path(_run(["bash", str(PKG / "debroot.sh"), "base", release]).stdout.strip())
    _run(["bash", str(PKG / "debroot.sh"), "build", release])
    t["trees_s"] = round(time.monotonic() - t0, 1)
    out = tmp_path_factory.mktemp(f"deb-{release}")
    t0 = time.monotonic()
    _run(["bash", str(PKG / "build-deb.sh"), str(out), release])
    t["build_s"] = round(time.monotonic() - t0, 1)
    debs = sorted(out.glob("*.deb"))
    version = f"{UPSTREAM}-1~deb{major}u1"
    assert [d.name for d in debs] == [
        f"gce-watchdog-poller_{version}_amd64.deb",
        f"gce-watchdog_{version}_amd64.deb",
    ]
    TIMINGS[release] = t
    return Built(release, major, python, debs[1], debs[0], base, t)


class Tree:
    """A fresh copy of the release's minbase tree; commands run in it under chroot."""

    def __init__(self, base: Path, root: Path) -> None:
        self.root = root
        root.mkdir()
        with tarfile.open(base) as t:
            t.extractall(root, filter="fully_trusted")
        subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True)

    def close(self) -> None:
        proc = self.root / "proc"
        subprocess.run(["umount", "-l", str(proc)], check=False)
        # Never walk into a proc still mounted (rmtree would try the host's /proc entries).
        if subprocess.run(["mountpoint", "-q", str(proc)], check=False).returncode != 0:
            shutil.rmtree(self.root, ignore_errors=True)

    def run(
        self, *argv: str, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        e = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive",
             "LC_ALL": "C.UTF-8", **(env or {})}  # fmt: skip
        p = subprocess.run(["chroot", str(self.root), *argv], capture_output=True, text=True,
                           timeout=600, env=e)  # fmt: skip
        if check:
            assert p.returncode == 0, f"{argv}: rc {p.returncode}\n{p.stdout}\n{p.stderr}"
        return p

    def snapshot(self) -> dict[str, tuple[int, str]]:
        """Every path (mode and link target), volatile dirs left out."""
        out: dict[str, tuple[int, str]] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                rel = str(p.relative_to(self.root)) + ("/" if name in dirnames else "")
                if rel.startswith(VOLATILE):
                    continue
                st = p.lstat()
                out[rel] = (st.st_mode, os.readlink(p) if p.is_symlink() else "")
        return out


@pytest.fixture
def tree(built: Built, tmp_path: Path) -> Iterator[Tree]:
    t0 = time.monotonic()
    tr = Tree(built.base, tmp_path / "root")
    built.timings["fresh_tree_s"] = round(time.monotonic() - t0, 1)
    yield tr
    tr.close()


def test_control_version_depends_and_changelog(built: Built, tmp_path: Path) -> None:
    deb = str(built.deb)

    def field(name: str) -> str:
        return _run(["dpkg-deb", "-f", deb, name]).stdout.strip()

    assert field("Version") == built.version
    major, minor = built.python.split(".")
    depends = field("Depends")
    assert f"python3 (>= {built.python}), python3 (<< {major}.{int(minor) + 1})" in depends
    assert ".invalid>" in field("Maintainer") and "example.org" not in field("Maintainer")
    x = tmp_path / "x"
    _run(["dpkg-deb", "-x", deb, str(x)])
    cl = x / "usr/share/doc/gce-watchdog/changelog.Debian.gz"
    text = subprocess.run(["gzip", "-dc", str(cl)], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    first = text.splitlines()[0]
    assert first == f"gce-watchdog ({built.version}) {built.release}; urgency=medium"
    entries = tomllib.loads((PKG / "debian/changes.toml").read_text())["release"]
    heads = [ln for ln in text.splitlines() if ln.startswith("gce-watchdog (")]
    assert heads == [
        f"gce-watchdog ({e['version']}-1~deb{built.major}u1) {built.release}; urgency=medium"
        for e in entries
    ], "one changelog entry per version of changes.toml"
    site = x / f"opt/gce-watchdog/lib/python{built.python}/site-packages"
    assert (site / "pynvml.py").is_file(), "nvidia-ml-py is in the package"
    assert not (x / "lib").exists(), "units under /usr/lib/systemd/system, not the aliased /lib"
    y = tmp_path / "y"
    _run(["dpkg-deb", "-x", str(built.poller), str(y)])
    assert (y / "usr/lib/systemd/system/gce-watchdog-poller.service").is_file()
    assert not (y / "lib").exists()
    cl = y / "usr/share/doc/gce-watchdog-poller/changelog.Debian.gz"
    text = subprocess.run(["gzip", "-dc", str(cl)], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    assert text.splitlines()[0] == (
        f"gce-watchdog-poller ({built.version}) {built.release}; urgency=medium"
    )


def _repack(deb: Path, version: str, out: Path) -> Path:
    """The same package under a newer version (what the next release's upgrade path sees); an
    exact dependency on the agent moves with it."""
    d = out / f"repack-{deb.name}"
    _run(["dpkg-deb", "-R", str(deb), str(d)])
    control = d / "DEBIAN/control"
    lines = control.read_text().splitlines()
    old = next(ln for ln in lines if ln.startswith("Version:")).split(":", 1)[1].strip()
    control.write_text(
        "\n".join(
            f"Version: {version}"
            if ln.startswith("Version:")
            else ln.replace(f"(= {old})", f"(= {version})")
            for ln in lines
        )
        + "\n"
    )
    name = deb.name.split("_")[0]
    new = out / f"{name}_{version}_amd64.deb"
    _run(["dpkg-deb", "--root-owner-group", "-Zxz", "-b", str(d), str(new)])
    return new


def test_apt_install_check_memwatch_upgrade_purge(built: Built, tree: Tree, tmp_path: Path) -> None:
    before = tree.snapshot()
    base_pkgs = _packages(tree)
    shutil.copy(built.deb, tree.root / "tmp" / built.deb.name)
    t0 = time.monotonic()
    # What the README says: apt resolves python3 (the tree has none yet; its .debs are in the
    # tree's apt cache, so apt downloads nothing).
    assert tree.run("sh", "-c", "command -v python3", check=False).returncode != 0
    tree.run("apt-get", "install", "-y", "-q", f"/tmp/{built.deb.name}")
    built.timings["apt_install_s"] = round(time.monotonic() - t0, 1)
    v = tree.run("python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])").stdout
    assert v.strip() == built.python, "the release's own python3"
    assert tree.run("gce-watchdog", "--version").stdout.startswith("gce-watchdog ")
    wants = tree.root / "etc/systemd/system/multi-user.target.wants/gce-watchdog.service"
    assert wants.is_symlink(), "enabled for the next boot"

    # check: the installed nvidia-ml-py is imported; NVML's library is absent in a chroot.
    p = tree.run("gce-watchdog", "check", "--json", check=False)
    assert p.returncode in (0, 1, 2), p.stderr
    gpu = json.loads(p.stdout)["gpu"]
    assert gpu == {"present": False, "reason": "NVML init failed: NVML Shared Library Not Found"}
    text = tree.run("gce-watchdog", "check", check=False).stdout
    assert "gpu: no GPU (NVML init failed: NVML Shared Library Not Found)" in text

    # memwatch: the fake NVML module is what `import pynvml` finds (first on the path).
    fake = tree.root / "tmp/fakenvml"
    fake.mkdir()
    shutil.copy(REPO / "tests/kit/fake_pynvml.py", fake / "fake_pynvml.py")
    (fake / "pynvml.py").write_text(
        "import sys\nimport fake_pynvml\n"
        "sys.modules[__name__] = fake_pynvml.make("
        "[fake_pynvml.Device('NVIDIA L4', 24 << 30, 2 << 30)])\n"
    )
    argv = ["gce-watchdog", "memwatch", "--interval", "0.05", "--warmup", "2",
            "--min-samples", "10", "--gate", "gpu", "--out", "/tmp/mw.json", "--",
            "python3", "-c", "import time; time.sleep(2)"]  # fmt: skip
    p = tree.run(*argv, check=False, env={"PYTHONPATH": "/tmp/fakenvml"})
    assert p.returncode == 0, p.stdout + p.stderr
    mw = json.loads((tree.root / "tmp/mw.json").read_text())
    assert mw["verdict"] == "PASS" and mw["gpu"]["names"] == ["NVIDIA L4"], mw["gpu"]
    assert mw["gauges"]["gpu0_used"]["gated"] is True

    # Without gce-watchdog-poller: a postgresql:// ledger is a configuration error (78, which
    # the unit does not restart) that names the package; the venv has no pip, so no pip advice.
    pg = ("--ledger", "postgresql://poller@127.0.0.1:9/watchdog")
    (tree.root / "tmp/token").write_text("t\n")  # not ADC: the ledger is what is tried
    poll = ("gce-watchdog", "poll", "--once", "--project", "my-project", "--zone",
            "us-central1-a", "vm-1", "--api-base", "http://127.0.0.1:9",
            "--access-token-file", "/tmp/token")  # fmt: skip
    p = tree.run(*poll, *pg, check=False)
    assert p.returncode == 78, p.stderr
    assert (
        "install the gce-watchdog-poller package (apt-get install gce-watchdog-poller)" in p.stderr
    )
    (tree.root / "tmp/x.log").write_text("console\n")
    p = tree.run("gce-watchdog", "report", "/tmp/x.log", "--png", "/tmp/x.png", check=False)
    assert p.returncode == 69 and "matplotlib" in p.stderr, p.stderr
    assert "has no pip" in p.stderr and " pip install" not in p.stderr, p.stderr

    # With it: its libraries import in the agent's venv, its unit is where systemd looks.
    shutil.copy(built.poller, tree.root / "tmp" / built.poller.name)
    tree.run("apt-get", "install", "-y", "-q", f"/tmp/{built.poller.name}")
    tree.run("/opt/gce-watchdog/bin/python", "-c",
             "import psycopg, grpc; from google.cloud import pubsub_v1; "
             "assert psycopg.pq.__impl__ == 'binary'")  # fmt: skip
    assert (tree.root / "usr/lib/systemd/system/gce-watchdog-poller.service").is_file()
    p = tree.run(*poll, *pg, check=False)
    assert p.returncode == 74 and "cannot open the ledger" in p.stderr, p.stderr  # psycopg ran

    # What the units make at run time, as systemd makes it: the poller's state directory under
    # DynamicUser= (its SQLite ledger), the agent's state, metrics and metadata drop-in.
    private = tree.root / "var/lib/private/gce-watchdog-poller/gce-watchdog"
    private.mkdir(parents=True)
    (tree.root / "var/lib/private").chmod(0o700)
    (private / "ledger.sqlite").write_bytes(b"SQLite format 3\0")
    (private / "cursors").mkdir()
    (tree.root / "var/lib/gce-watchdog-poller").symlink_to("private/gce-watchdog-poller")
    for made in ("var/lib/gce-watchdog/ladder.json", "var/log/gce-watchdog/serial.log",
                 "var/lib/prometheus/node-exporter/gce_watchdog.prom",
                 "etc/gce-watchdog/config.d/50-metadata.toml"):  # fmt: skip
        (tree.root / made).parent.mkdir(parents=True, exist_ok=True)
        (tree.root / made).write_text("# made at run time\n")

    # Upgrade: the administrator's change to the conffile stays, the unit stays enabled.
    conf = tree.root / "etc/gce-watchdog/config.toml"
    conf.write_text(conf.read_text() + "# changed by the administrator\n")
    v2 = f"{UPSTREAM}-2~deb{built.major}u1"
    newer = [_repack(d, v2, tmp_path) for d in (built.deb, built.poller)]
    for n in newer:
        shutil.copy(n, tree.root / "tmp" / n.name)
    tree.run("apt-get", "install", "-y", "-q", *(f"/tmp/{n.name}" for n in newer))
    for pkg in ("gce-watchdog", "gce-watchdog-poller"):
        got = tree.run("dpkg-query", "-W", "-f", "${Version} ${db:Status-Status}", pkg)
        assert got.stdout == f"{v2} installed", pkg
    assert conf.read_text().endswith("# changed by the administrator\n")
    assert wants.is_symlink()
    assert tree.run("gce-watchdog", "--version").returncode == 0

    # Purge: the tree is exactly as a fresh tree in which only the dependencies apt brought
    # are installed (the same packages, installed by name: their own files, e.g. the
    # certificates ca-certificates generates, are theirs and not ours to judge).
    p = tree.run("apt-get", "purge", "-y", "-q", "gce-watchdog-poller", "gce-watchdog")
    assert "dpkg: warning" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert not (tree.root / "opt/gce-watchdog").exists() and not conf.exists()
    assert not (tree.root / "var/lib/private/gce-watchdog-poller").exists()
    assert not (tree.root / "var/lib/prometheus/node-exporter/gce_watchdog.prom").exists()
    # its directory is node_exporter's package's (made above to stand for it), not ours
    (tree.root / "var/lib/prometheus/node-exporter").rmdir()
    (tree.root / "var/lib/prometheus").rmdir()
    deps = sorted(_packages(tree) - base_pkgs)
    assert "python3" in deps and not {"gce-watchdog", "gce-watchdog-poller"} & set(deps), deps
    after = tree.snapshot()
    ref = Tree(built.base, tmp_path / "reference")
    try:
        ref.run("apt-get", "install", "-y", "-q", *deps)
        expected = ref.snapshot()
    finally:
        ref.close()
    assert {k: v for k, v in after.items() if k not in expected} == {}, "nothing left behind"
    assert {k: v for k, v in expected.items() if k not in after} == {}, "nothing else removed"
    assert after == expected
    assert {k: v for k, v in before.items() if k not in after} == {}, "nothing of the base gone"


def _bake(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(REPO / "startup/bake-image.sh"), *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GCEWD_ROOT": ""})  # fmt: skip


def test_bake_image_refuses_a_tree_without_python3_before_changing_it(
    built: Built, tree: Tree
) -> None:
    before = tree.snapshot()
    p = _bake("--deb", str(built.deb), "--root", str(tree.root))
    assert p.returncode == 1, p.stderr
    assert f"refused, nothing in {tree.root} was changed" in p.stderr
    assert "needs python3, which the image does not have" in p.stderr
    assert tree.snapshot() == before
    assert "gce-watchdog" not in _packages(tree)


def test_bake_image_refuses_the_other_releases_python_then_bakes_its_own(
    built: Built, tmp_path: Path
) -> None:
    other = next(r for r in RELEASES if r != built.release)
    base = Path(_run(["bash", str(PKG / "debroot.sh"), "base", other]).stdout.strip())
    tr = Tree(base, tmp_path / "other")
    try:
        tr.run("apt-get", "install", "-y", "-q", "python3")  # from the tree's apt cache
        before = tr.snapshot()
        p = _bake("--deb", str(built.deb), "--root", str(tr.root))
        assert p.returncode == 1, p.stderr
        major, minor = built.python.split(".")
        want = f"needs python3 (<< {major}.{int(minor) + 1})"
        if built.release == "trixie":
            want = f"needs python3 (>= {built.python})"
        assert want in p.stderr and "use the package built for" in p.stderr, p.stderr
        assert tr.snapshot() == before, "nothing changed"
    finally:
        tr.close()


def test_bake_image_deb_into_a_tree_with_python3(built: Built, tree: Tree) -> None:
    tree.run("apt-get", "install", "-y", "-q", "python3")
    p = _bake("--deb", str(built.deb), "--root", str(tree.root))
    assert p.returncode == 0, p.stderr
    version = tree.run("/opt/gce-watchdog/bin/gce-watchdog", "--version").stdout.strip()
    assert (tree.root / "opt/gce-watchdog/.baked").read_text().strip() == version
    got = tree.run("dpkg-query", "-W", "-f", "${db:Status-Status}", "gce-watchdog").stdout
    assert got == "installed", "not half-installed"


def _packages(tree: Tree) -> set[str]:
    out = tree.run("dpkg-query", "-W", "-f", "${Package} ${db:Status-Status}\n").stdout
    return {ln.split()[0] for ln in out.splitlines() if ln.endswith(" installed")}


def teardown_module() -> None:
    if TIMINGS:
        path = REPO / "build/deb/timings.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            merged = json.loads(path.read_text())
        except (OSError, ValueError):
            merged = {}
        merged.update(TIMINGS)
        path.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
