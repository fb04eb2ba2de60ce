"""Whether the metadata disarm and fault attributes may be obeyed (pure; docs/actions.md,
"Who may disarm through metadata").

Instance metadata can be set by anyone who can call ``instances.setMetadata`` on the VM, and that
includes any local process when the VM's own service account can: it reads the account's token
from the metadata server. So the attributes are obeyed only when the VM's service account
cannot write its own metadata, or when the operator said so locally (``watch.trust_metadata =
true``). The account can write metadata when one of its **scopes** allows it (``cloud-platform``
or ``compute``; ``compute.readonly`` or no compute scope cannot) **and** IAM grants
``compute.instances.setMetadata`` on the instance (``instances.testIamPermissions`` on itself).

Fail closed: what cannot be told (the scopes unreadable, the permission check failed) is not
trusted. Inputs are plain values; the edges (``daemon/metawatch.py``, ``check``) read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The OAuth scopes under which a token may call instances.setMetadata (the method's "scopes" in
# the Compute Engine discovery document: cloud-platform and compute; compute.readonly is not).
WRITE_SCOPES = (
    "https://www.googleapis.com/auth/cloud-platform",
    "https://www.googleapis.com/auth/compute",
)
SET_METADATA = "compute.instances.setMetadata"

# why: one token each (it goes into journal fields and `check --json`)
TRUST_LOCAL = "trust_metadata"  # the operator's local config says so
NO_SERVICE_ACCOUNT = "no_service_account"  # the VM has no service account: no token to use
NO_WRITE_SCOPE = "no_write_scope"  # its scopes cannot write metadata
NO_PERMISSION = "no_permission"  # a write scope, but IAM does not grant setMetadata
CAN_WRITE = "can_write_metadata"  # a write scope and the permission: any local process can
SCOPES_UNKNOWN = "scopes_unknown"  # the scopes could not be read
PERMISSION_UNKNOWN = "permission_unknown"  # testIamPermissions could not tell
NOT_CHECKED = "not_checked"  # no check has finished yet (the agent's start)


@dataclass(frozen=True)
class Trust:
    """The answer: ``trusted`` and why (a token), with a sentence for people."""

    trusted: bool
    why: str
    detail: str


def not_checked(trust_local: bool) -> Trust:
    """The answer before any check finished: only the operator's local word trusts."""
    if trust_local:
        return decide(True, None, None)
    return Trust(False, NOT_CHECKED, "the service account has not been checked yet")


def decide(
    trust_local: bool,
    scopes: Sequence[str] | None,
    held: Sequence[str] | None,
) -> Trust:
    """``scopes``: the default service account's scopes (None: could not be read; empty: the VM
    has no service account). ``held``: what ``testIamPermissions`` on the instance answered for
    ``[SET_METADATA]`` (None: not asked or could not tell)."""
    if trust_local:
        return Trust(True, TRUST_LOCAL, "trust_metadata = true in the local config")
    if scopes is None:
        return Trust(
            False, SCOPES_UNKNOWN, "the service account's scopes could not be read (fail closed)"
        )
    if not scopes:
        return Trust(True, NO_SERVICE_ACCOUNT, "the VM has no service account")
    writing = [s for s in WRITE_SCOPES if s in scopes]
    if not writing:
        return Trust(True, NO_WRITE_SCOPE, "the service account's scopes cannot write metadata")
    scope = writing[0].rsplit("/", 1)[-1]
    if held is None:
        return Trust(
            False,
            PERMISSION_UNKNOWN,
            f"scope {scope} can write metadata and testIamPermissions could not tell whether "
            f"IAM grants {SET_METADATA} (fail closed)",
        )
    if SET_METADATA in held:
        return Trust(
            False,
            CAN_WRITE,
            f"the service account can write this VM's metadata (scope {scope}, {SET_METADATA} "
            "granted): any local process could",
        )
    return Trust(
        True, NO_PERMISSION, f"scope {scope}, but IAM does not grant {SET_METADATA} on this VM"
    )


def needs_permission_check(trust_local: bool, scopes: Sequence[str] | None) -> bool:
    """Whether the answer depends on ``testIamPermissions`` (a write scope, no local word)."""
    return not trust_local and scopes is not None and any(s in scopes for s in WRITE_SCOPES)
