"""The fault's rule plan, pure: what to cut, the iptables rules that cut it, the comment that tags
them, and reading an iptables listing back. No clock, no processes, no files: the firewall module
(``firewall.py``) runs the plan; tests check it exhaustively without root.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from gce_watchdog.lib.durations import parse_duration

CHAIN_OUT = "GCEWD-FAULT"

CHAIN_IN = "GCEWD-FAULT-IN"

TAG = "gcewd-fault"  # first word of every rule comment of ours

METADATA_V4 = "169.254.169.254"

# GCE's metadata server also answers on this IPv6 address on IPv6-enabled VMs.
METADATA_V6 = "fd20:ce::254"

LINK_LOCAL = {"4": "169.254.0.0/16", "6": "fe80::/10"}

# A fault is a test, not a configuration: one longer than a day is almost certainly a typo.
MAX_TTL = 24 * 3600.0

MIN_TTL = 1.0


class FaultError(Exception):
    """A fault operation failed; the message says what and how to recover."""


@dataclass(frozen=True)
class Cut:
    """The paths a fault cuts. ``dns`` covers every DNS server, the metadata one included."""

    metadata: bool = False
    egress443: bool = False
    dns: bool = False
    metadata_dns: bool = False

    PARTS = ("metadata", "metadata-dns", "egress443", "dns")

    def parts(self) -> tuple[str, ...]:
        on = {
            "metadata": self.metadata,
            # Implied by dns (every DNS server), so not listed twice.
            "metadata-dns": self.metadata_dns and not self.dns,
            "egress443": self.egress443,
            "dns": self.dns,
        }
        return tuple(p for p in self.PARTS if on[p])

    @property
    def label(self) -> str:
        """``metadata+egress443+dns`` style (the ``cut`` field on the wire)."""
        return "+".join(self.parts()) or "none"

    def __bool__(self) -> bool:
        return bool(self.parts())

    @classmethod
    def parse(cls, label: str) -> Cut:
        parts = set(label.split("+")) - {"none", ""}
        bad = parts - set(cls.PARTS)
        if bad:
            raise ValueError(f"unknown cut part(s): {', '.join(sorted(bad))}")
        return cls(
            metadata="metadata" in parts,
            egress443="egress443" in parts,
            dns="dns" in parts,
            metadata_dns="metadata-dns" in parts,
        )


@dataclass(frozen=True)
class Rule:
    """One rule to append: chain and match/target arguments (an argv fragment, never a string)."""

    chain: str
    args: tuple[str, ...]


def comment(fault_id: str, until: float, cut: Cut) -> str:
    return f"{TAG} id={fault_id} until={iso(until)} cut={cut.label}"


def plan(cut: Cut, family: str, fault_id: str, until: float) -> list[Rule]:
    """The rules for one address family ("4" or "6"). Pure: no I/O.

    Order matters: the RETURN rules for SSH and loopback come first, so nothing after them can
    match the operator's session. RETURN (not ACCEPT) hands the packet back to the host's own
    rules: a fault must not widen the firewall either.
    """
    c = ("-m", "comment", "--comment", comment(fault_id, until, cut))
    out: list[Rule] = []
    for chain in (CHAIN_OUT, CHAIN_IN):
        for flag in ("--dport", "--sport"):
            out.append(Rule(chain, ("-p", "tcp", flag, "22", *c, "-j", "RETURN")))
    out.append(Rule(CHAIN_OUT, ("-o", "lo", *c, "-j", "RETURN")))
    out.append(Rule(CHAIN_IN, ("-i", "lo", *c, "-j", "RETURN")))
    md = METADATA_V4 if family == "4" else METADATA_V6
    if cut.metadata:
        out.append(Rule(CHAIN_OUT, ("-d", md, "-p", "tcp", "--dport", "80", *c, "-j", "DROP")))
    # DNS is cut by dropping the REPLIES: dropping an outgoing UDP packet makes sendto() fail at
    # once with EPERM, so a resolver fails in milliseconds; a wedged network is silence.
    if cut.dns:
        for proto in ("udp", "tcp"):
            out.append(Rule(CHAIN_IN, ("-p", proto, "--sport", "53", *c, "-j", "DROP")))
    elif cut.metadata_dns:
        for proto in ("udp", "tcp"):
            out.append(Rule(CHAIN_IN, ("-s", md, "-p", proto, "--sport", "53", *c, "-j", "DROP")))
    if cut.egress443:
        out.append(
            Rule(
                CHAIN_OUT,
                ("!", "-d", LINK_LOCAL[family], "-p", "tcp", "--dport", "443", *c, "-j", "DROP"),
            )
        )
    return out


def hooks(family: str) -> list[tuple[str, tuple[str, ...]]]:
    """(builtin chain, rule args) of the jumps into our chains."""
    c = ("-m", "comment", "--comment", f"{TAG} hook")
    return [("OUTPUT", (*c, "-j", CHAIN_OUT)), ("INPUT", (*c, "-j", CHAIN_IN))]


def iso(ts: float) -> str:
    return datetime.fromtimestamp(int(ts), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(s: str) -> float | None:
    try:
        return datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


def parse_ttl(value: str) -> float:
    ttl = parse_duration(value)
    if not MIN_TTL <= ttl <= MAX_TTL:
        raise ValueError(
            f"--ttl must be between {MIN_TTL:g}s and {MAX_TTL / 3600:g}h, got {ttl:g}s"
        )
    return ttl


_COMMENT_RE = re.compile(rf"{TAG} id=([0-9a-f]+) until=(\S+) cut=([a-z0-9+-]+)")


@dataclass(frozen=True)
class Installed:
    """What the firewall holds, read back from the rules' comments."""

    fault_id: str
    until: float | None
    cut: Cut
    families: tuple[str, ...]
    rules: int


def parse_listing(listings: dict[str, str]) -> Installed | None:
    """Read our injection back from ``iptables -S`` output per family. Pure."""
    found: tuple[str, str, str] | None = None
    fams: list[str] = []
    n = 0
    for fam, text in sorted(listings.items()):
        hit = False
        for line in text.splitlines():
            m = _COMMENT_RE.search(line)
            if m and line.startswith("-A "):
                found = found or (m.group(1), m.group(2), m.group(3))
                hit = True
                n += 1
        if hit:
            fams.append(fam)
    if found is None:
        return None
    try:
        cut = Cut.parse(found[2])
    except ValueError:
        cut = Cut()
    return Installed(found[0], parse_iso(found[1]), cut, tuple(fams), n)
