"""NVIDIA Xid records: the one table of what each Xid means here, and the record parser. Pure.

Sources (cite with any change to the table):
- HARDWARE: the EKS node monitoring agent's ``WellKnownXidCodes`` (the hardware list it repairs a
  node for): 46, 48, 54, 62, 63, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 142, 143, 151, 155,
  156, 158. NVIDIA's Xid catalog (docs.nvidia.com, "Xid Errors") gives each a resolution of
  "reset the GPU", "reboot" or "contact support", never "restart the application".
- APPLICATION: the Xids NVIDIA's Kubernetes device plugin skips as the application's own
  (``--xids-to-skip`` default): 13, 31, 43, 45, 68. The catalog's resolution for each is "restart
  the application". 109 is on both lists; it stays HARDWARE here (the EKS list), and like every
  hardware Xid it needs a second signal before it is a fault.
- Xid 45 (a channel torn down, e.g. after another rank's crash) is written as an event only and
  never decides alone: NVSentinel flagged 77 healthy nodes while it treated Xid 45 bursts as fatal.

A hardware Xid is only a *candidate*: ``gpu.episode.decide`` needs a second signal on the same GPU.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from enum import Enum


class XidClass(Enum):
    HARDWARE = "hardware"  # a fault when a second signal on the same GPU confirms it
    APPLICATION = "application"  # the job's own error: a ``gpu_event`` line, never a fault
    OTHER = "other"  # not in either list: a ``gpu_event`` line


HARDWARE_XIDS: frozenset[int] = frozenset(
    {46, 48, 54, 62, 63, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 142, 143, 151, 155, 156, 158}
)
APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68})
# The largest Xid number in NVIDIA's catalog is in the 100s; anything past this is a misparse.
MAX_XID = 65535


def classify(xid: int) -> XidClass:
    if xid in HARDWARE_XIDS:
        return XidClass.HARDWARE
    if xid in APPLICATION_XIDS:
        return XidClass.APPLICATION
    return XidClass.OTHER


@dataclass(frozen=True, slots=True)
class XidRecord:
    """One Xid line: the GPU's PCI id (as the driver prints it), the Xid, the pid and the text."""

    pci: str
    xid: int
    pid: int | None
    text: str

    @property
    def xid_class(self) -> XidClass:
        return classify(self.xid)


# The driver's shape (NVIDIA Xid catalog; seen on driver 470 .. 580):
#   NVRM: Xid (PCI:0000:00:04): 79, pid=1234, name=python, GPU has fallen off the bus.
#   NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception ...
# Older drivers print the id without "PCI:". The pid/name part is absent for errors tied to no
# process.
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{1,8}(?::[0-9A-Fa-f]{1,4}){1,2}(?:\.[0-7])?)\): "
    r"(?P<xid>\d{1,5}),\s*(?:pid=(?P<pid>'?<unknown>'?|\d{1,10}),\s*)?(?P<text>.*)\Z",
    re.DOTALL,
)
# A text field ends up on a signed line: keep it short and printable.
TEXT_MAX = 120


@functools.lru_cache(maxsize=1024)  # floods repeat the same text: 800,000 records, 29 distinct
def parse_xid(message: str) -> XidRecord | None:
    """The Xid record in one kernel message, or None when the message is not an Xid record."""
    if "NVRM: Xid" not in message:
        return None
    m = _XID_RE.search(message)
    if m is None:
        return None
    xid = int(m["xid"])
    if xid > MAX_XID:
        return None
    pid_s = m["pid"]
    pid = int(pid_s) if pid_s is not None and pid_s.isdigit() else None
    text = m["text"][:TEXT_MAX]
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else "?" for ch in text)
    return XidRecord(m["pci"].lower(), xid, pid, text)
