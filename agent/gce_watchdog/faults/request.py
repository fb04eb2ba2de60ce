"""A fault requested through instance metadata, pure: parse the attribute's value, decide whether to
apply it, and the ``gce-watchdog fault inject`` command line that applies it. No clock, no
processes, no files (``daemon.metawatch`` reads the attribute and runs the command).

The value of the attribute (``watch.fault_attribute``, ``gce-watchdog-fault`` by default) is one
JSON object::

    {"id": "wedge-1", "cut": "metadata+egress443", "ttl": "15m"}

- ``id``: names this request; a request is applied at most once per VM (the applied ids are kept
  in the state directory), so leaving the key set, restarting the agent or rebooting never
  re-injects it;
- ``cut``: the paths, as ``fault inject`` names them (``metadata``, ``egress443``, ``dns``,
  ``metadata-dns``, joined by ``+``);
- ``ttl``: how long, as ``fault inject --ttl`` takes it (1 s .. 24 h).

Nothing here is acted on unless ``watch.faults_from_metadata`` is true (off by default): anyone who
can set instance metadata, on GCE every process on the VM through its service account, could
otherwise cut the network and have the watchdog power the VM off.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from gce_watchdog.faults.plan import Cut, parse_ttl

MAX_VALUE = 1024  # bytes: a request is a short object; anything longer is not one
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")
KEEP_IDS = 64  # applied ids remembered (oldest forgotten first)


@dataclass(frozen=True)
class FaultRequest:
    id: str
    cut: Cut
    ttl: float


@dataclass(frozen=True)
class Decision:
    """What to do with one value of the attribute: apply ``request``, or not, and why."""

    request: FaultRequest | None
    why: str  # "apply", "disabled", "absent", "applied-before" or the parse error

    @property
    def apply(self) -> bool:
        return self.request is not None


class BadRequest(ValueError):
    """The attribute's value is not a fault request; the message says why."""


def parse_request(value: str) -> FaultRequest:
    """The request in an attribute value; BadRequest says what is wrong with it."""
    if len(value.encode("utf-8", "replace")) > MAX_VALUE:
        raise BadRequest(f"longer than {MAX_VALUE} bytes")
    try:
        raw = json.loads(value)
    except ValueError:
        raise BadRequest("not JSON") from None
    if not isinstance(raw, dict):
        raise BadRequest("not a JSON object")
    unknown = set(raw) - {"id", "cut", "ttl"}
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(map(str, unknown)))}")
    rid, cut_s, ttl_s = raw.get("id"), raw.get("cut"), raw.get("ttl")
    if not isinstance(rid, str) or not _ID_RE.match(rid):
        raise BadRequest("id must be 1-63 letters, digits, '.', '_' or '-'")
    if not isinstance(cut_s, str):
        raise BadRequest("cut must be a string such as 'metadata+egress443'")
    try:
        cut = Cut.parse(cut_s)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    if not cut:
        raise BadRequest("nothing to cut")
    if not isinstance(ttl_s, str):
        raise BadRequest("ttl must be a string such as '90s' or '15m'")
    try:
        ttl = parse_ttl(ttl_s)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return FaultRequest(rid, cut, ttl)


def decide(
    value: str | None, enabled: bool, applied: Collection[str], trusted: bool = True
) -> Decision:
    """Whether a value of the attribute (None: the key is absent) is to be applied now.
    ``trusted``: whether metadata may be obeyed at all (daemon/mdtrust.py); a request while it
    may not is refused (``untrusted``), not kept for later."""
    if value is None or not value.strip():
        return Decision(None, "absent")
    if not enabled:
        return Decision(None, "disabled")
    if not trusted:
        return Decision(None, "untrusted")
    try:
        req = parse_request(value)
    except BadRequest as e:
        return Decision(None, f"invalid: {e}")
    if req.id in applied:
        return Decision(None, "applied-before")
    return Decision(req, "apply")


def remember(applied: Sequence[str], rid: str) -> list[str]:
    """The applied ids after ``rid`` was applied: newest last, at most KEEP_IDS."""
    out = [x for x in applied if x != rid] + [rid]
    return out[-KEEP_IDS:]


def inject_argv(req: FaultRequest, gce_watchdog: Sequence[str], config: str | None) -> list[str]:
    """The ``fault inject`` command that applies ``req`` (the same code an operator runs)."""
    flags = {
        "metadata": "--metadata",
        "metadata-dns": "--metadata-dns",
        "egress443": "--egress443",
        "dns": "--dns",
    }
    argv = [*gce_watchdog, "fault", "inject", *(flags[p] for p in req.cut.parts())]
    argv += ["--ttl", f"{int(req.ttl)}s"]
    if config:
        argv += ["--config", config]
    return argv
