"""The boot counter's rule (pure): which ``bc`` a boot gets (docs/serial-protocol.md, "Boot
counter"). The file, the lock and the cache are :mod:`vm.bootcount`'s.

``<state_dir>/boot.count`` holds ``"<counter> <boot id>\\n"``: the counter of the last boot that
wrote a line and that boot's full kernel boot id (32 hex). :func:`plan` says, from what the file
holds, whether the line key exists and the current boot id, which value this boot carries and
whether it must first be written; :func:`parse` and :func:`render` are the file's format.
"""

from __future__ import annotations

from dataclasses import dataclass

from gce_watchdog.wire.protocol import valid_bid

COUNT_FILE = "boot.count"
LOCK_FILE = "boot.count.lock"
KEY_FILE = "signing.key"  # vm.state.KEY_FILE (not imported: the rule needs only its presence)
MAX_COUNT = 999_999_999_999  # the wire's bound: 1..12 digits
NONE = "-"  # the wire's "no counter"


@dataclass(frozen=True)
class Stored:
    """What ``boot.count`` holds: the last counted boot's value (0: none counted yet, an
    operator's seed) and its full boot id."""

    count: int
    boot_id: str


@dataclass(frozen=True)
class Unusable:
    """``boot.count`` is there but cannot be used (not a regular file, a symlink, garbage,
    unreadable): the counter is lost, never restarted."""

    why: str


@dataclass(frozen=True)
class Plan:
    """The rule's answer. ``value`` None: ``bc=-`` (``problem`` says why). ``write``: persist
    ``Stored(value, boot_id)`` durably before any line uses ``value``; if that fails the boot
    gets ``-`` (:func:`unwritable`)."""

    value: int | None
    write: bool
    problem: str = ""


def plan(stored: Stored | Unusable | None, key_exists: bool, boot_id: str) -> Plan:
    """Which counter the boot ``boot_id`` gets (pure).

    - the file names this boot: its value, nothing written (a later writer of the boot);
    - the file names another boot: that value + 1, written first (the boot's first write);
    - no file and no line key yet (the instance's first boot): 1, written first;
    - no file while the key exists, or a file that cannot be used: the counter was lost.
      ``-``, never a restart at 1 (that would hand out values earlier boots used);
    - the counter at its maximum: ``-`` (never wraps).
    """
    if isinstance(stored, Unusable):
        return Plan(None, False, f"{COUNT_FILE} {stored.why}: the counter is lost")
    if stored is None:
        if key_exists:
            return Plan(None, False, f"{COUNT_FILE} is missing while {KEY_FILE} exists: lost")
        return Plan(1, True)
    if stored.boot_id == boot_id and stored.count >= 1:
        return Plan(stored.count, False)
    if stored.count >= MAX_COUNT:
        return Plan(None, False, f"{COUNT_FILE} is at its maximum ({MAX_COUNT})")
    return Plan(stored.count + 1, True)


def unwritable(why: str) -> Plan:
    """The plan when the write a :func:`plan` asked for failed: ``-`` for this boot."""
    return Plan(None, False, f"{COUNT_FILE} cannot be written ({why})")


def parse(data: bytes) -> Stored | Unusable:
    """``boot.count``'s content: ``"<counter> <32 hex>\\n"``, counter 0..MAX_COUNT, no leading
    zeros (pure)."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return Unusable("is not ASCII")
    parts = text.split()
    if len(parts) != 2 or not text.endswith("\n"):
        return Unusable("is not '<counter> <boot id>'")
    n, bid = parts
    if not n.isdigit() or not n.isascii() or (len(n) > 1 and n[0] == "0") or int(n) > MAX_COUNT:
        return Unusable(f"holds a bad counter {n[:16]!r}")
    if not valid_bid(bid):
        return Unusable("holds a bad boot id")
    return Stored(int(n), bid)


def render(s: Stored) -> bytes:
    return f"{s.count} {s.boot_id}\n".encode()


def wire_value(value: int | None) -> str:
    """The ``bc`` field's value: decimal, or ``-``."""
    return NONE if value is None else str(value)
