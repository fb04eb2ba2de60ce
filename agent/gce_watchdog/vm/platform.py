"""Is this a Google Compute Engine VM? The DMI product name says so, with no network.

GCE's own guest environment makes the same check: the SMBIOS system product name of every GCE VM
is ``Google Compute Engine`` (``/sys/class/dmi/id/product_name``). On a laptop, a build host or a
CI runner it is something else (``Standard PC (Q35 + ICH9, 2009)``, a vendor model) or missing,
and there the agent must never power the machine off: it watches and reports but does not act
unless the config says ``agent.allow_non_gce = true``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GCE_PRODUCT = "Google Compute Engine"
DMI_PRODUCT_PATH = "/sys/class/dmi/id/product_name"


@dataclass(frozen=True)
class Platform:
    gce: bool
    product: str  # the DMI product name as read ("" when it could not be read)
    why: str  # one sentence for people: why this is (not) taken for GCE

    @property
    def token(self) -> str:
        """A line-field value: ``gce`` or ``not-gce``."""
        return "gce" if self.gce else "not-gce"


def detect(path: str = DMI_PRODUCT_PATH) -> Platform:
    """Read the DMI product name at ``path``; never raises."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(256)
        product = raw.decode("utf-8", "replace").strip()
    except OSError as e:
        return Platform(False, "", f"cannot read the DMI product name at {path}: {e.strerror or e}")
    if product == GCE_PRODUCT:
        return Platform(True, product, f"DMI product name is {GCE_PRODUCT!r}")
    return Platform(False, product, f"DMI product name is {product!r}, not {GCE_PRODUCT!r}")


def arming(platform: Platform, allow_non_gce: bool) -> tuple[bool, str]:
    """Whether the agent may act here, and a sentence saying why not (empty when it may)."""
    if platform.gce:
        return True, ""
    if allow_non_gce:
        return True, ""
    return False, (
        f"not a GCE VM ({platform.why}): watching and reporting only, never acting "
        "(agent.allow_non_gce = true to act anyway)"
    )
