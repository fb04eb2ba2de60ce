"""Small durable state in the state directory: the boot id, the line counter, the job phase.

Files are written atomically (``gce_watchdog.lib.files``); readers treat a missing or unreadable
file as "no state" and never raise.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from gce_watchdog.lib.files import atomic_write
from gce_watchdog.wire.protocol import PIN_MAX_SEQ

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_T = TypeVar("_T")


def read_boot_id(path: str = BOOT_ID_PATH) -> str:
    """The kernel boot id without dashes (32 hex); 'unknown' style fallback is all zeros. A
    hex id of another length (not the kernel's) is padded with zeros or cut to 32: the boot
    counter and the announcement's ``bid`` carry exactly 32."""
    try:
        raw = Path(path).read_text().strip().replace("-", "").lower()
    except OSError:
        return "0" * 32
    ok = raw and all(c in "0123456789abcdef" for c in raw)
    return (raw + "0" * 32)[:32] if ok else "0" * 32


def short_boot(boot_id: str) -> str:
    """The 8-hex form used on the wire."""
    return (boot_id + "0" * 8)[:8]


def untrusted_dir(path: str | Path, euid: int | None = None) -> str | None:
    """Why a state or run directory must not be trusted by an agent running as root, or None.

    As root, a directory owned by another user, writable by group or others, or a symlink could
    have been prepared by someone else (a planted ``disarm.json``, a link where the lock goes).
    A directory that does not exist yet is fine: the agent creates it (root, 0755). Not root:
    nothing to check (the kernel's permissions are the owner's).
    """
    if (os.geteuid() if euid is None else euid) != 0:
        return None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be inspected ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != 0:
        return f"is owned by uid {st.st_uid}, not root"
    if st.st_mode & 0o022:
        who = " and ".join(
            w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit
        )
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


class SeqAllocator:
    """Per-boot line counter shared by every process that writes lines (agent, CLI, start-up
    script): ``<run_dir>/seq.<boot>`` (tmpfs, so a full or read-only state dir cannot touch it)
    under an exclusive flock. A new boot has a new file and starts at 0.

    The record is fixed-width and rewritten in place (``pwrite``, never truncated), so once the
    file exists an update needs no new block: a full tmpfs cannot fail it. If the file cannot be
    used at all (it could not even be created) or its record is corrupt, numbering never falls
    back to 0 for a line other than the announcement: it continues
    from CLOCK_BOOTTIME in microseconds, above every seq the counter can have handed out (the
    console carries far fewer than one line per microsecond), and strictly increasing within
    this process. The one exception: a process whose first seqs the file cannot give takes
    seq 0 and 1 from memory (:data:`PIN_MAX_SEQ`), which the emitter always fills with the key
    announcement, so the boot's start stays placeable for readers (a full or read-only run
    dir); a copy of an announcement at a seq another writer used is harmless (same key).
    """

    WIDTH = 20  # digits of the in-place record: up to 10**20 lines

    def __init__(
        self,
        directory: str | Path,
        boot: str,
        floor: Callable[[], int] = lambda: time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1000,
    ) -> None:
        self.path = Path(directory) / f"seq.{boot}"
        self.boot = boot
        self.floor = floor
        self.fallbacks = 0  # lines numbered without the file
        self._last = -1

    def next(self) -> int:
        try:
            n = self._next_locked()
        except OSError:
            self.fallbacks += 1
            # seq 0 and 1 (the announcement's) from memory, every other one from the floor
            floor = self._last + 1 if self._last < PIN_MAX_SEQ else self.floor()
            n = max(self._last + 1, floor)
        self._last = n
        return n

    def _next_locked(self) -> int:
        return self.locked(lambda take: take())

    def locked(self, fn: Callable[[Callable[[], int]], _T]) -> _T:
        """Call ``fn(take)`` while holding the counter's lock: ``take()`` hands out the next
        seq (as :meth:`next`), and no other writer gets one until ``fn`` returns. Used by the
        key rotation: the rekey line's seq and the switch of the key file are one step for
        every other writer (docs/serial-protocol.md, "Key rotation"). Raises OSError when the
        file cannot be used."""
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW  # a planted link: refused
        fd = os.open(self.path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)

            def take() -> int:
                n = self._take(fd)
                self._last = n
                return n

            return fn(take)
        finally:
            os.close(fd)  # releases the lock

    def _take(self, fd: int) -> int:
        raw = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        if raw.isdigit():
            n = int(raw)
        elif raw:
            # A corrupt record (a torn write, someone's edit): numbering never goes back to
            # 0 (that would reuse seqs): it continues from the boot-time floor, as when the
            # file cannot be used, and the record is rewritten from there.
            self.fallbacks += 1
            n = max(self._last + 1, self.floor())
        else:
            n = 0  # a new file: the boot's first line
        data = f"{n + 1:0{self.WIDTH}d}\n".encode()
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(errno.ENOSPC, "short write of the seq record")
        return n


class KeyUnavailable(Exception):
    """The line key cannot be read: not root (it is root's alone). Lines are then not written."""


# v3's private line key (an Ed25519 seed). v2's ``key`` file held an HMAC key that v2 announced
# in clear on the console: it is never reused (docs/serial-protocol.md, "Upgrade").
KEY_FILE = "signing.key"
SEED_BYTES = 32


@dataclass
class KeyState:
    """The line key a writer uses, where it lives, and what is wrong with it (``problems``:
    raised on the console as ``warn what=key`` and by ``check``; never a reason to replace it)."""

    seed: bytes
    path: Path | None  # None: in memory only (nothing could keep it)
    ephemeral: bool  # not in the state dir: the next boot (or process) has another key
    problems: list[str] = field(default_factory=list)


def _read_key(p: Path, problems: list[str]) -> bytes | None:
    """The seed in ``p``; None when absent or unusable (the problem noted). PermissionError
    (not root) propagates. A key whose mode or owner is wrong is **kept** and noted."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise
    except OSError as e:
        problems.append(f"{p}: {e.strerror or e}: not used, not replaced")
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{p} is not a regular file: not used, not replaced")
            return None
        data = os.read(fd, SEED_BYTES + 1)
        if len(data) != SEED_BYTES:
            problems.append(f"{p} holds {len(data)} bytes, not {SEED_BYTES}: not used nor replaced")
            return None
        if st.st_mode & 0o077:
            problems.append(
                f"{p} has mode {stat.S_IMODE(st.st_mode):04o}: others may have read it (kept;"
                " set 0600, and recreate the instance if it may have leaked)"
            )
        if st.st_uid != os.geteuid():
            problems.append(f"{p} is owned by uid {st.st_uid}, not {os.geteuid()} (kept)")
        return data
    finally:
        os.close(fd)


def _create_key(d: Path, seed: bytes) -> Path:
    """Put ``seed`` in ``d/KEY_FILE`` (0600), unless a key is there already (then that one is
    returned's path and the caller reads it again): O_EXCL then link, so two writers racing keep
    one key. Raises OSError when the directory cannot hold it."""
    d.mkdir(mode=0o755, parents=True, exist_ok=True)
    p = d / KEY_FILE
    tmp = d / f".{KEY_FILE}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if os.write(fd, seed) != SEED_BYTES:
                raise OSError(errno.ENOSPC, "short write of the key")
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another writer won: its key is the key
            os.link(tmp, p)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return p


def inspect_line_key(state_dir: str | Path, run_dir: str | Path) -> KeyState | None:
    """The line key as it stands, for ``check``: never creates, never changes anything. None:
    no key yet (the first line creates it). Raises KeyUnavailable when not readable (not
    root)."""
    problems: list[str] = []
    try:
        seed = _read_key(Path(state_dir) / KEY_FILE, problems)
        if seed is not None:
            return KeyState(seed, Path(state_dir) / KEY_FILE, False, problems)
        boot_seed = _read_key(Path(run_dir) / KEY_FILE, problems)
    except PermissionError as e:
        raise KeyUnavailable(f"{e.filename}: {e.strerror or e}") from e
    if boot_seed is not None:
        problems.append("the key is in the run dir only (ephemeral): the state dir cannot hold it")
        return KeyState(boot_seed, Path(run_dir) / KEY_FILE, True, problems)
    if problems:
        return KeyState(b"", None, True, problems)
    return None


def _not_root(e: OSError) -> None:
    """A permission error of a process that is not root: it must not sign at all."""
    if isinstance(e, PermissionError) and os.geteuid() != 0:
        raise KeyUnavailable(f"{e.filename}: {e.strerror or e} (the line key is root's)") from e


def load_line_key(state_dir: str | Path, run_dir: str | Path) -> KeyState:
    """The instance's private line key, creating it (0600) on first use. Never replaces one.

    ``<state_dir>/signing.key`` is the key for the life of the instance (readers pin its public
    half). A key there with a wrong mode or owner is kept (and reported). When the state dir
    cannot hold a key (full, read-only, the path is a directory) the key of this boot is kept in
    the run dir (tmpfs; copied to the state dir as soon as that works, so a boot that started
    with a full disk keeps its key once space is back), and if even that fails, in memory for
    this process. Such a key is **ephemeral**: its lines say ``eph=1`` and readers raise an
    alarm instead of deciding from a key conflict. Raises KeyUnavailable only when an existing
    key cannot be read for lack of permission (not root).
    """
    problems: list[str] = []
    state = Path(state_dir)
    run = Path(run_dir)
    try:
        seed = _read_key(state / KEY_FILE, problems)
        if seed is not None:
            return KeyState(seed, state / KEY_FILE, False, problems)
        state_broken = bool(problems)  # a key path there that is not a usable file
        boot_seed = _read_key(run / KEY_FILE, problems)
    except PermissionError as e:
        raise KeyUnavailable(f"{e.filename}: {e.strerror or e}") from e
    if not state_broken:
        try:
            p = _create_key(state, boot_seed or secrets.token_bytes(SEED_BYTES))
            again = _read_key(p, problems)
            if again is not None:
                return KeyState(again, p, False, problems)
        except OSError as e:
            _not_root(e)
            problems.append(f"{state / KEY_FILE}: cannot be created ({e.strerror or e})")
    if boot_seed is not None:
        return KeyState(boot_seed, run / KEY_FILE, True, problems)
    try:
        p = _create_key(run, secrets.token_bytes(SEED_BYTES))
        again = _read_key(p, problems)
        if again is not None:
            return KeyState(again, p, True, problems)
    except OSError as e:
        _not_root(e)
        problems.append(f"{run / KEY_FILE}: cannot be created ({e.strerror or e})")
    problems.append("no place keeps the line key: a key of this process only")
    return KeyState(secrets.token_bytes(SEED_BYTES), None, True, problems)


class RotateRefused(Exception):
    """The key cannot be rotated (ephemeral, not in the state dir, unusable): nothing changed."""


def read_key_file(path: str | Path) -> tuple[bytes | None, tuple[int, int] | None]:
    """The seed in ``path`` and the file's identity (device, inode), for a writer that follows
    a rotation (:class:`vm.console.KeyFollower`); (None, None) when it is not a usable key.
    Never raises but PermissionError (not root)."""
    p = Path(path)
    try:
        st = os.stat(p, follow_symlinks=False)
    except FileNotFoundError:
        return None, None
    except PermissionError:
        raise
    except OSError:
        return None, None
    seed = _read_key(p, [])
    return seed, ((st.st_dev, st.st_ino) if seed is not None else None)


def key_identity(path: str | Path) -> tuple[int, int] | None:
    """(device, inode) of the key file, or None: the cheap check a following writer makes."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def rotate_line_key(
    state_dir: str | Path,
    seq: SeqAllocator,
    announce: Callable[[Callable[[], int], bytes, bytes], bool],
    new_seed: bytes | None = None,
) -> tuple[bytes, bytes]:
    """Replace the instance's durable line key with a new one, announced first.

    The new seed is written (0600, fsynced) next to the key; then, holding the seq counter's
    lock, ``announce(take, old_seed, new_seed)`` writes the rekey line (signed with the old
    key) and says whether the console confirmed it; only then is the new file renamed over
    the key (atomic) and the directory fsynced. Every other writer takes its next seq after
    the rename, and checks the key file after taking it (``KeyFollower``): no line after the
    rekey line is signed with the old key. When ``announce`` says False (or raises) the old key
    stays and the new one is deleted. Returns (old seed, new seed); raises RotateRefused when
    there is no durable key to rotate, KeyUnavailable when not root, OSError when the state
    dir or the counter cannot be written."""
    problems: list[str] = []
    path = Path(state_dir) / KEY_FILE
    try:
        old = _read_key(path, problems)
    except PermissionError as e:
        raise KeyUnavailable(f"{e.filename}: {e.strerror or e}") from e
    if old is None:  # an ephemeral key (run dir, memory) is not rotated: not kept anyway
        why = "; ".join(problems) or f"{path}: no durable key (ephemeral or none yet)"
        raise RotateRefused(why)
    seed = new_seed if new_seed is not None else secrets.token_bytes(SEED_BYTES)
    if len(seed) != SEED_BYTES or seed == old:
        raise RotateRefused("the new key must be 32 new bytes")
    tmp = path.parent / f".{KEY_FILE}.rotate.{os.getpid()}.tmp"
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(tmp, flags, 0o600)
    except PermissionError as e:
        _not_root(e)
        raise
    try:
        try:
            if os.write(fd, seed) != SEED_BYTES:
                raise OSError(errno.ENOSPC, "short write of the new key")
            os.fsync(fd)
        finally:
            os.close(fd)

        def switch(take: Callable[[], int]) -> bool:
            if not announce(take, old, seed):
                return False
            os.replace(tmp, path)  # still under the counter's lock
            dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            return True

        if not seq.locked(switch):
            raise RotateRefused("the rekey line was not confirmed on the console: key kept")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return old, seed


# The current job phase (bootstrap, workload, done, setup_failed), written by `gce-watchdog phase`
# and friends, read by the agent for its heartbeat lines.
PHASE_FILE = "phase"


def read_phase(state_dir: str | Path) -> str:
    try:
        fd = os.open(Path(state_dir) / PHASE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(256)
        return raw.decode("utf-8").strip() or "unknown"
    except (OSError, ValueError):  # ValueError: not UTF-8 (anyone with root may write it)
        return "unknown"


def write_phase(state_dir: str | Path, phase: str) -> None:
    atomic_write(Path(state_dir) / PHASE_FILE, (phase + "\n").encode())
