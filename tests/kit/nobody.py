"""Running the agent as uid ``nobody`` from a checkout that ``nobody`` cannot read.

Tests that play an unprivileged attacker (a workload on the VM) run code as uid 65534 with
``setpriv``. CI and the proof runs clone into ``mktemp -d`` (mode 0700), so neither the checkout's
``agent/`` nor a virtual environment inside it can be read by that uid; an editable install's
``.pth`` may even point ``nobody`` at some *other* checkout that it can read. So the tests never let
``nobody`` import from the checkout: :func:`nobody_python` makes a world-readable copy, under a
0755 directory of its own in /tmp, of the checkout's ``agent/gce_watchdog`` and of the files of the
agent's runtime dependencies (``[project].dependencies`` of pyproject.toml and what they require,
as installed for this interpreter), finds an interpreter ``nobody`` can run that is this one's
``major.minor`` (their compiled modules are built for it), checks that ``nobody`` then imports
``gce_watchdog`` from the copy, and removes the copy at the end. ``nobody``'s interpreter runs
with ``-S`` (no site-packages): it sees the standard library and the copies only.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

from kit.paths import AGENT_SRC, REPO

NOBODY_UID = 65534
SETPRIV = ("setpriv", f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups")
PROBE_TIMEOUT_S = 60


class NobodyUnavailable(RuntimeError):
    """Code cannot be run as nobody here; the message says why."""


@dataclass(frozen=True)
class Nobody:
    """An interpreter uid nobody can run and a PYTHONPATH of world-readable copies."""

    root: Path  # the 0755 directory holding the copies (removed when the context exits)
    python: str
    pythonpath: str

    @property
    def agent(self) -> Path:
        """The copy of the checkout's ``agent/`` (holds ``gce_watchdog``)."""
        return self.root / "agent"

    def argv(self, *args: str) -> list[str]:
        """``setpriv ... <python> -S <args>``: the interpreter as uid/gid 65534, no groups, and no
        ``site`` (no site-packages, no ``.pth``): the stdlib and the copies, nothing else."""
        return [*SETPRIV, self.python, "-S", *args]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with PYTHONPATH set to the copies."""
        env = dict(os.environ if base is None else base)
        env["PYTHONPATH"] = self.pythonpath
        env.pop("PYTHONHOME", None)
        return env

    def run(
        self, args: Sequence[str], cwd: str | Path = "/", timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run ``python -S <args>`` as nobody with the copies on PYTHONPATH; never raises on rc."""
        return subprocess.run(
            self.argv(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
            env=self.env(), check=False,
        )  # fmt: skip


def unavailable() -> str | None:
    """Why code cannot run as nobody here at all (before any copy is made), or None."""
    if os.geteuid() != 0:
        return "needs root to switch to uid nobody"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux)"
    return None


@contextmanager
def open_dir(prefix: str = "gcewd-nobody-") -> Iterator[Path]:
    """A fresh 0755 directory under /tmp that nobody can reach (pytest's tmp_path is under a 0700
    directory), removed at the end."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        d.chmod(0o755)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def runtime_distributions(pyproject: Path = REPO / "pyproject.toml") -> list[md.Distribution]:
    """The installed distributions the agent needs at run time: pyproject's dependencies (no
    extras of ours) and, recursively, what they require (with the extras they ask for)."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    stack = [Requirement(d) for d in deps]
    extras: dict[str, set[str]] = {}
    found: dict[str, md.Distribution] = {}
    for _ in range(10_000):  # bounded: a dependency graph, each (name, extra) visited once
        if not stack:
            break
        req = stack.pop()
        key = _key(req.name)
        if key in found and set(req.extras) <= extras[key]:
            continue
        extras.setdefault(key, set()).update(req.extras)
        try:
            dist = found.get(key) or md.distribution(req.name)
        except md.PackageNotFoundError as e:
            raise NobodyUnavailable(f"{req.name} is not installed for {sys.executable}") from e
        found[key] = dist
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker is None or any(
                sub.marker.evaluate({"extra": x}) for x in {"", *extras[key]}
            ):
                stack.append(sub)
    else:
        raise NobodyUnavailable("the dependency graph did not close")
    return sorted(found.values(), key=lambda d: _key(d.metadata["Name"]))


def _copy_readable(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    dst.chmod(0o644)


def copy_dependencies(dists: Sequence[md.Distribution], dest: Path) -> int:
    """Copy each distribution's installed files (not its metadata, caches or scripts) into
    ``dest``, world-readable; namespace packages (``google``) get only these files. Returns the
    number of files copied."""
    n = 0
    for dist in dists:
        for f in dist.files or []:
            top = f.parts[0]
            if top == ".." or top.endswith((".dist-info", ".egg-info")) or "__pycache__" in f.parts:
                continue
            if f.suffix in (".pyc", ".pth"):
                continue
            src = Path(str(dist.locate_file(f)))
            if src.is_file():
                _copy_readable(src, dest / Path(*f.parts))
                n += 1
    return n


def _world_readable(root: Path) -> None:
    for p in (root, *root.rglob("*")):
        p.chmod(0o755 if p.is_dir() else 0o644)


def _candidates() -> list[str]:
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    found = [
        sys.executable,
        os.path.realpath(sys.executable),
        getattr(sys, "_base_executable", sys.executable),
        f"/usr/bin/python{v}",
        f"/usr/local/bin/python{v}",
        "/usr/bin/python3",
    ]
    return list(dict.fromkeys(found))


PROBE = (
    "import sys, gce_watchdog, nacl.bindings, psutil\n"
    "print('%d.%d' % sys.version_info[:2], gce_watchdog.__file__)\n"
)


def _pick_python(nb: Nobody) -> tuple[str, list[str]]:
    """The first candidate nobody can run, of this major.minor, importing the copy; else the
    reasons each one failed."""
    want = f"{sys.version_info.major}.{sys.version_info.minor}"
    why: list[str] = []
    for cand in _candidates():
        probe = Nobody(nb.root, cand, nb.pythonpath)
        try:
            r = probe.run(["-c", PROBE], timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            why.append(f"{cand}: {e}")
            continue
        out = r.stdout.split()
        if r.returncode != 0 or len(out) != 2:
            why.append(f"{cand}: rc={r.returncode} {r.stderr.strip()[-160:]}")
        elif out[0] != want:
            why.append(f"{cand}: is Python {out[0]}, not {want}")
        elif not Path(out[1]).is_relative_to(nb.agent):
            why.append(f"{cand}: imported gce_watchdog from {out[1]}, not the copy")
        else:
            return cand, why
    return "", why


@contextmanager
def nobody_python(prefix: str = "gcewd-nobody-py-") -> Iterator[Nobody]:
    """The copies and an interpreter for nobody (see the module's docstring); raises
    NobodyUnavailable (with every candidate's reason) where none works."""
    why = unavailable()
    if why:
        raise NobodyUnavailable(why)
    with open_dir(prefix) as root:
        shutil.copytree(
            AGENT_SRC / "gce_watchdog", root / "agent" / "gce_watchdog",
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )  # fmt: skip
        copy_dependencies(runtime_distributions(), root / "deps")
        _world_readable(root)
        nb = Nobody(root, "", f"{root / 'agent'}{os.pathsep}{root / 'deps'}")
        python, reasons = _pick_python(nb)
        if not python:
            raise NobodyUnavailable("no interpreter works as nobody: " + "; ".join(reasons))
        yield Nobody(root, python, nb.pythonpath)
