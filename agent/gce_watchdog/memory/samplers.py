"""Reading memory gauges: host memory through psutil, GPU memory through NVML.

Gauges are plain ``dict[str, int]`` of bytes, named:

- ``host_total``, ``host_used``, ``host_available``, ``swap_total``, ``swap_used``
- ``tree_rss``: resident set of one process and all its descendants (``memwatch --pid``)
- ``gpu<i>_used``, ``gpu<i>_total`` for each NVML device index ``i``

Samplers never raise on a read: a gauge that cannot be read this time is absent from the dict.
The GPU sampler turns "no GPU here" into one reason string (:attr:`GpuSampler.reason`), not an error
per sample. ``pynvml`` (package ``nvidia-ml-py``, extra ``gpu``) is imported only when opened.
"""

from __future__ import annotations

import contextlib
import heapq
import importlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol


class GpuGauges(Protocol):
    """What the memory monitor reads GPU memory through: :class:`GpuSampler` (NVML in this
    process, for ``memwatch``), or the agent's GPU probe child (gpu/service.py: NVML never runs in
    the agent's process, and not at all where there is no driver)."""

    reason: str
    names: list[str]
    last_error: str

    @property
    def count(self) -> int: ...
    def open(self) -> bool: ...
    def sample(self) -> dict[str, int] | None:
        """The gauges read now ({} when every read failed), or None when there is no news yet."""

    def close(self) -> None: ...


def preload() -> None:
    """Import psutil now. The daemon calls it on its main thread: imported at the first sample,
    on the monitor's thread, its allocations stay in that thread's malloc arena, about 0.3 MiB
    more RSS for the same module (docs/performance.md, "The RSS target"). Without psutil, the
    first sample still fails as it did."""
    with contextlib.suppress(ImportError):
        importlib.import_module("psutil")


def host_gauges(psutil_mod: Any = None) -> dict[str, int]:
    """Host memory and swap in bytes (``used`` as psutil counts it: without page cache)."""
    ps = psutil_mod or importlib.import_module("psutil")
    out: dict[str, int] = {}
    try:
        vm = ps.virtual_memory()
        out.update(host_total=vm.total, host_used=vm.used, host_available=vm.available)
    except (OSError, RuntimeError):
        pass
    try:
        sw = ps.swap_memory()
        out.update(swap_total=sw.total, swap_used=sw.used)
    except (OSError, RuntimeError):
        pass
    return out


def tree_rss(pid: int, psutil_mod: Any = None) -> int | None:
    """RSS of ``pid`` plus every descendant (recursive); None when ``pid`` is gone or hidden.

    A descendant that exits between listing and reading is skipped. Shared pages are counted once
    per process (RSS semantics): the number over-states a tree that shares memory, but its trend is
    what the detector judges.
    """
    ps = psutil_mod or importlib.import_module("psutil")
    try:
        root = ps.Process(pid)
        procs = [root, *root.children(recursive=True)]
        total = root.memory_info().rss
    except (ps.NoSuchProcess, ps.AccessDenied, ps.ZombieProcess):
        return None
    for p in procs[1:]:
        try:
            total += p.memory_info().rss
        except (ps.NoSuchProcess, ps.AccessDenied, ps.ZombieProcess):
            continue
    return int(total)


@dataclass(frozen=True)
class TopProcess:
    pid: int
    name: str
    rss: int


def top_processes(n: int = 3, proc_root: str = "/proc") -> list[TopProcess]:
    """The ``n`` processes with the largest resident set: one pass over ``proc_root`` that keeps
    only the ``n`` largest (constant memory, whatever the number of processes; psutil's
    ``process_iter`` kept a cached object per process, about 1.4 KiB of the agent's RSS each).

    Per proc(5): ``/proc/PID/statm``'s second field is the resident set in pages ("same as VmRSS
    in /proc/pid/status"), ``/proc/PID/comm`` the command name (truncated to 15 bytes by the
    kernel). A process that exits during the pass, or an entry that cannot be read or parsed,
    is skipped."""
    page = os.sysconf("SC_PAGE_SIZE")
    return heapq.nlargest(n, _processes(proc_root, page), key=lambda t: t.rss)


def _processes(proc_root: str, page: int) -> Iterator[TopProcess]:
    try:
        entries = os.scandir(proc_root)
    except OSError:
        return
    with entries:
        for e in entries:
            if not e.name.isdigit():
                continue
            base = os.path.join(proc_root, e.name)
            try:
                statm = _read_small(os.path.join(base, "statm"))
                name = _read_small(os.path.join(base, "comm")).strip() or "?"
                rss = int(statm.split()[1]) * page
            except (OSError, ValueError, IndexError):
                continue
            yield TopProcess(int(e.name), name, rss)


def _read_small(path: str) -> str:
    """At most 256 bytes of a /proc file, opened without following a symlink and without
    blocking (a FIFO planted in a fake root is an error, not a hang)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        return os.read(fd, 256).decode("utf-8", "replace")
    finally:
        os.close(fd)


class GpuSampler:
    """Per-GPU used/total memory through NVML.

    ``open()`` returns True when GPU gauges will be available; otherwise :attr:`reason` says why
    (package missing, driver not loaded, no device) in one line. Tests pass a fake module with
    NVML's function names as ``nvml``; production imports ``pynvml`` lazily.
    """

    def __init__(
        self,
        nvml: Any = None,
        importer: Callable[[str], ModuleType] = importlib.import_module,
    ) -> None:
        self._nvml: Any = nvml
        self._importer = importer
        self._handles: list[Any] = []
        self._opened = False
        self.reason = "not opened"
        self.names: list[str] = []
        self.totals: dict[int, int] = {}
        self.read_errors = 0  # per-device reads that failed since open
        self.last_error = ""

    @property
    def count(self) -> int:
        return len(self._handles)

    def open(self) -> bool:
        if self._opened:
            return bool(self._handles)
        self._opened = True
        if self._nvml is None:
            try:
                self._nvml = self._importer("pynvml")
            except ImportError:
                self.reason = "nvidia-ml-py not installed (pip install 'gce-watchdog[gpu]')"
                return False
        nv = self._nvml
        try:
            nv.nvmlInit()
        except Exception as e:  # NVMLError subclasses: library not found, driver not loaded
            self.reason = f"NVML init failed: {_nvml_text(e)}"
            return False
        try:
            n = int(nv.nvmlDeviceGetCount())
            handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        except Exception as e:
            self.reason = f"NVML device enumeration failed: {_nvml_text(e)}"
            self._shutdown()
            return False
        if not handles:
            self.reason = "NVML loaded but reports no GPU"
            self._shutdown()
            return False
        self._handles = handles
        self.names = [_device_name(nv, h) for h in handles]
        self.reason = f"{n} GPU(s) via NVML"
        return True

    def sample(self) -> dict[str, int]:
        """``gpu<i>_used`` / ``gpu<i>_total`` for each device that answered this time."""
        out: dict[str, int] = {}
        nv = self._nvml
        for i, h in enumerate(self._handles):
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                used, total = int(mem.used), int(mem.total)
            except Exception as e:  # a lost GPU ("fallen off the bus") must not stop the host
                self.read_errors += 1
                self.last_error = f"gpu{i}: {_nvml_text(e)}"
                continue
            out[f"gpu{i}_used"] = used
            out[f"gpu{i}_total"] = total
            self.totals[i] = total
        return out

    def close(self) -> None:
        if self._handles:
            self._shutdown()
        self._handles = []

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # best effort at the edge: nothing to do about a failed shutdown
            return


def _nvml_text(e: BaseException) -> str:
    # pynvml's NVMLError.__str__ calls into the library, which may itself be missing.
    try:
        text = str(e)
    except Exception:
        text = ""
    return text or type(e).__name__


def _device_name(nv: Any, h: Any) -> str:
    try:
        name = nv.nvmlDeviceGetName(h)
    except Exception:
        return "?"
    # nvidia-ml-py < 11.515 returns bytes, later versions str.
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)
