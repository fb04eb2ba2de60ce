"""``make deb``'s packages, built by packaging/build-deb.sh (issue 17 item 6, issue 39): their
names and contents, the maintainer scripts, lintian (no errors), and two builds giving the same
bytes, the second on another day (faketime: the man page's date is the changelog's); here the
Debian 12 build (the Debian 13 one, and installing both with apt in fresh trees:
tests/root/test_deb_releases.py; in the VM: the wedge scenario)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from kit.locks import canonical, hash_pinned
from kit.paths import REPO

BUILD = REPO / "packaging" / "build-deb.sh"
UPSTREAM = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
VERSION = f"{UPSTREAM}-1~deb12u1"  # the bookworm build (build-deb.sh's default release)

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(600)]


def _usable() -> str | None:
    if shutil.which("dpkg-deb") is None:
        return "dpkg-deb missing"
    if os.geteuid() != 0:
        return "build-deb.sh builds in a debootstrap tree of the release (root: chroot)"
    cached = (REPO / "build/cache/debroot/bookworm-base.tar").exists()
    if not cached and shutil.which("debootstrap") is None:
        return "debootstrap missing and no cached tree (build/cache/debroot)"
    return None


@pytest.fixture(scope="module")
def debs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The agent's package of two builds (the poller's beside each): the second, when faketime
    is installed, 40 days later by the clock, man pages included (make cli-docs)."""
    why = _usable()
    if why:
        pytest.skip(why)
    out = []
    for name in ("a", "b"):
        d = tmp_path_factory.mktemp(f"deb-{name}")
        later = ["faketime", "-f", "+40d"] if name == "b" and shutil.which("faketime") else []
        env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
        p = subprocess.run(
            [*later, "make", "--no-print-directory", "cli-docs", f"CLI_DOCS={d / 'cli-docs'}",
             "STAMP=pyproject.toml"],
            cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert p.returncode == 0, p.stdout + p.stderr
        p = subprocess.run(
            [*later, "bash", str(BUILD), str(d)], capture_output=True, text=True, timeout=600,
            env={**env, "GCEWD_CLI_DOCS": str(d / "cli-docs")},
        )  # fmt: skip
        assert p.returncode == 0, p.stderr
        out.append(d / f"gce-watchdog_{VERSION}_amd64.deb")
    return out[0], out[1]


def poller_of(deb: Path) -> Path:
    return deb.parent / f"gce-watchdog-poller_{VERSION}_amd64.deb"


def deb_field(deb: Path, field: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), field], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def contents(deb: Path) -> dict[str, str]:
    lines = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True,
                           check=True).stdout.splitlines()  # fmt: skip
    out = {}
    for line in lines:
        parts = line.split(None, 5)
        path = parts[5].split(" -> ")[0].removeprefix("./")
        if path:  # not the archive's root, ./
            out[path] = parts[0]
    return out


def test_name_and_control(debs: tuple[Path, Path]) -> None:
    deb = debs[0]
    assert deb.name == f"gce-watchdog_{VERSION}_amd64.deb" and deb.is_file()
    assert deb_field(deb, "Package") == "gce-watchdog"
    assert deb_field(deb, "Version") == VERSION
    assert deb_field(deb, "Architecture") == "amd64"
    assert "python3 (>= 3.11), python3 (<< 3.12)" in deb_field(deb, "Depends")
    maint = deb_field(deb, "Maintainer")
    assert maint == "gce-watchdog maintainers <maintainers@gce-watchdog.invalid>", maint


def test_contents_venv_unit_config(debs: tuple[Path, Path]) -> None:
    files = contents(debs[0])
    for path in (
        "opt/gce-watchdog/bin/gce-watchdog",
        "opt/gce-watchdog/pyvenv.cfg",
        "usr/lib/systemd/system/gce-watchdog.service",
        "etc/gce-watchdog/config.toml",
        "usr/bin/gce-watchdog",
        "usr/share/doc/gce-watchdog/copyright",
        "usr/share/doc/gce-watchdog/changelog.Debian.gz",
        "usr/share/gce-watchdog/startup-script.sh",
    ):
        assert path in files, path
    site = "opt/gce-watchdog/lib/python3.11/site-packages/"
    for dep in ("gce_watchdog/", "dns/", "psutil/", "tenacity/", "structlog/", "google/auth/"):
        assert site + dep in files, dep
    assert site + "pynvml.py" in files, "nvidia-ml-py (GPU gauges) is in the package"
    assert "opt/gce-watchdog/.gitignore" not in files
    assert not [p for p in files if "__pycache__" in p or p.endswith(".pyc")]
    assert not [p for p in files if p.endswith("direct_url.json")]
    # Units under /usr/lib (not the aliased /lib, issue 39); the poller's is the other package's.
    assert not [p for p in files if p.startswith("lib/")]
    assert "usr/lib/systemd/system/gce-watchdog-poller.service" not in files
    for page in ("usr/share/man/man1/gce-watchdog.1.gz",
                 "usr/share/man/man5/gce-watchdog.toml.5.gz",
                 "usr/share/bash-completion/completions/gce-watchdog"):  # fmt: skip
        assert page in files, page


def test_the_poller_package_adds_its_libraries_and_unit_to_the_agents_venv(
    debs: tuple[Path, Path], tmp_path: Path
) -> None:
    """gce-watchdog-poller (issue 39): the unit and what the PostgreSQL ledger and Pub/Sub need,
    added to /opt/gce-watchdog; no file of the agent's package; depends on exactly this agent."""
    deb = poller_of(debs[0])
    assert deb_field(deb, "Package") == "gce-watchdog-poller"
    assert deb_field(deb, "Depends").startswith(f"gce-watchdog (= {VERSION}), python3 (>= 3.11)")
    files = contents(deb)
    agent = contents(debs[0])
    ours = {p for p in files if not p.endswith("/")}
    assert ours and not ours & {p for p in agent if not p.endswith("/")}, "no file in both"
    assert "usr/lib/systemd/system/gce-watchdog-poller.service" in files
    site = "opt/gce-watchdog/lib/python3.11/site-packages/"
    for dep in ("psycopg/", "psycopg_binary/", "google/cloud/pubsub_v1/", "grpc/"):
        assert site + dep in files, dep
    assert "usr/share/doc/gce-watchdog-poller/copyright" in files
    assert not [p for p in files if "__pycache__" in p or p.endswith(".pyc")]
    # The libraries import with the agent's venv (the Debian 12 python3, both packages unpacked).
    if not Path("/usr/lib/python3.11").is_dir():
        pytest.skip("this host's python3 is not Debian 12's 3.11")
    x = tmp_path / "x"
    for d in (debs[0], deb):
        subprocess.run(["dpkg-deb", "-x", str(d), str(x)], check=True)
    site_dir = x / site
    p = subprocess.run(["/usr/bin/python3", "-I", "-c",
                        f"import sys; sys.path.insert(0, {str(site_dir)!r}); "
                        "import psycopg, grpc; from google.cloud import pubsub_v1; "
                        "print(psycopg.pq.__impl__)"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0 and p.stdout.strip() == "binary", p.stderr


def test_control_files(debs: tuple[Path, Path], tmp_path: Path) -> None:
    subprocess.run(["dpkg-deb", "-e", str(debs[0]), str(tmp_path / "c")], check=True)
    c = tmp_path / "c"
    assert (c / "conffiles").read_text().split() == ["/etc/gce-watchdog/config.toml"]
    post = (c / "postinst").read_text()
    # Enabled always (an image bake), started only where systemd runs.
    assert "deb-systemd-helper enable" in post and "[ -d /run/systemd/system ]" in post
    start = post.index("[ -d /run/systemd/system ]")
    assert post.index("deb-systemd-helper enable") < start < post.index("deb-systemd-invoke start")
    subprocess.run(["dpkg-deb", "-e", str(poller_of(debs[0])), str(tmp_path / "p")], check=True)
    poller = tmp_path / "p"
    assert not (poller / "conffiles").exists()
    assert "deb-systemd-helper enable" not in (poller / "postinst").read_text(), "not enabled"
    assert "/var/lib/private/gce-watchdog-poller" in (poller / "postrm").read_text()
    if shutil.which("shellcheck"):
        scripts = [str(d / s) for d in (c, poller) for s in ("postinst", "prerm", "postrm")]
        p = subprocess.run(["shellcheck", "--shell=sh", *scripts], capture_output=True,
                           text=True)  # fmt: skip
        assert p.returncode == 0, p.stdout


def test_venv_names_no_build_path_and_runs_here(debs: tuple[Path, Path], tmp_path: Path) -> None:
    x = tmp_path / "x"
    subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(x)], check=True)
    bin_ = x / "opt/gce-watchdog/bin"
    assert (bin_ / "gce-watchdog").read_text().startswith("#!/opt/gce-watchdog/bin/python\n")
    assert "/tmp" not in (x / "opt/gce-watchdog/pyvenv.cfg").read_text()
    # The packaged code itself imports and runs on this (Debian 12) python3.
    if not Path("/usr/lib/python3.11").is_dir():
        pytest.skip("this host's python3 is not Debian 12's 3.11")
    site = next((x / "opt/gce-watchdog/lib").glob("python3.11/site-packages"))
    p = subprocess.run(["/usr/bin/python3", "-I", "-c",
                        f"import sys; sys.path.insert(0, {str(site)!r}); "
                        "from gce_watchdog.cli import main; main(['--version'])"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0 and p.stdout.startswith("gce-watchdog "), p.stderr


def test_lintian_reports_no_errors(debs: tuple[Path, Path], tmp_path: Path) -> None:
    if shutil.which("lintian") is None:
        pytest.skip("lintian missing (make apt-test installs it)")
    # lintian leaves an MLDBM file (mldbm-elf-XXXXXXXX) in $TMPDIR after every run: its own,
    # under the test's folder, not the machine's /tmp
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    p = subprocess.run(["lintian", "--fail-on", "error", str(debs[0]), str(poller_of(debs[0]))],
                       capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert not [ln for ln in p.stdout.splitlines() if ln.startswith("E:")]


def test_two_builds_are_the_same_bytes(debs: tuple[Path, Path]) -> None:
    """The second build ran 40 days later by the clock (faketime, when installed): the same
    bytes, man pages and all (their date is the changelog's, SOURCE_DATE_EPOCH)."""
    for a, b in (debs, (poller_of(debs[0]), poller_of(debs[1]))):
        ha, hb = (hashlib.sha256(d.read_bytes()).hexdigest() for d in (a, b))
        assert ha == hb, f"build-deb.sh is not reproducible: {a.name}"
    if shutil.which("faketime") is None:
        pytest.skip("faketime missing (apt-get install faketime): both builds on the same day")


def test_license_matches_pyproject() -> None:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 10_000, "the full text"


def test_lock_pins_every_runtime_dependency_by_hash() -> None:
    import re

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    path = REPO / "packaging" / "requirements.lock"
    # One hash per wheel: a compiled dependency has one for each Python of the lock.
    pins = hash_pinned(path)
    assert "# python: 3.11 3.12 3.13" in path.read_text().splitlines()
    for dep in meta["dependencies"] + meta["optional-dependencies"]["gpu"]:
        name = canonical(re.split(r"[\[<>=!~; ]", dep, maxsplit=1)[0])
        assert name in pins, f"{name} ({dep}) is not in requirements.lock: run packaging/lock.sh"


def test_the_poller_packages_lock_adds_to_the_agents() -> None:
    """requirements-deb-poller.lock: psycopg and google-cloud-pubsub with what they pull in,
    for the .debs' three Pythons, none of requirements.lock's distributions again."""
    text = (REPO / "packaging/requirements-deb-poller.lock").read_text()
    assert "# python: 3.11 3.12 3.13" in text
    extra = hash_pinned(REPO / "packaging/requirements-deb-poller.lock")
    agent = hash_pinned(REPO / "packaging/requirements.lock")
    assert {"psycopg", "psycopg-binary", "google-cloud-pubsub", "grpcio"} <= set(extra)
    assert not set(extra) & set(agent)
    assert "matplotlib" not in extra


def test_poller_lock_pins_the_operator_side_and_the_agent_the_same() -> None:
    """report --png (matplotlib), the PostgreSQL ledger (psycopg), Pub/Sub: pinned for the
    container, every dependency the agent shares at the agent's lock's version."""
    poller = hash_pinned(REPO / "packaging/requirements-poller.lock")
    agent = hash_pinned(REPO / "packaging/requirements.lock")
    for name in ("matplotlib", "psycopg", "psycopg-binary", "google-cloud-pubsub", "grpcio"):
        assert name in poller, name
    shared = {k: v for k, v in agent.items() if k != "nvidia-ml-py"}
    assert {k: poller.get(k) for k in shared} == shared, "run packaging/lock.sh"
    assert set(hash_pinned(REPO / "packaging/requirements-build.lock")) >= {"setuptools", "wheel"}


def test_dockerfile_installs_only_hash_pinned_wheels() -> None:
    import re

    text = (REPO / "Dockerfile").read_text()
    runs = re.sub(r"\\\n", " ", text)
    installs = [ln for ln in runs.splitlines() if re.search(r"\bpip\b.*\binstall\b", ln)]
    assert installs, "the Dockerfile installs the poller with pip"
    for ln in installs:
        for cmd in ln.split("&&"):
            if re.search(r"\bpip\b.*\binstall\b", cmd):
                pinned = "--require-hashes" in cmd and "--only-binary=:all:" in cmd
                local = "--no-deps" in cmd and "--no-index" in cmd
                assert pinned or local, f"an unpinned install: {cmd.strip()}"
