"""Is this a Google Compute Engine VM? The DMI (SMBIOS) strings say so, with no network.

The rules are the ones Google's own guest software applies, each cited next to it (docs/agent.md
lists them too). Everything else (``Standard PC (Q35 + ICH9, 2009)``, a vendor model, a missing
file) is not taken for GCE: there the agent must never power the machine off, since a machine
that is not a GCE VM has no metadata server and would always look cut off. It watches and
reports but does not act unless the config says ``agent.allow_non_gce = true``.

A false "GCE" powers off a laptop or a build host; a false "not GCE" leaves a VM watched but
unguarded and says so loudly (``check``, the ``start``/``warn`` lines, the journal). So a rule is
taken only where a Google reference applies it to decide "this is GCE".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DMI_DIR = "/sys/class/dmi/id"
DMI_PRODUCT_PATH = DMI_DIR + "/product_name"
SERIAL_FILE = "product_serial"  # cloud-init's ``system-serial-number`` (root only: mode 0400)

GCE_PRODUCT = "Google Compute Engine"

# DMI product names taken for GCE, each with the reference that takes it.
GCE_PRODUCTS: dict[str, str] = {
    # cloud-init cloudinit/sources/DataSourceGCE.py platform_reports_gce(): the product name of
    # GCE VMs (e2e/vm.py gives its qemu guest the same: `-smbios type=1,product=...`).
    GCE_PRODUCT: "cloud-init DataSourceGCE.platform_reports_gce",
    # cloud-init platform_reports_gce(): `pname == "Google Compute Engine" or pname == "Google"`.
    "Google": "cloud-init DataSourceGCE.platform_reports_gce",
    # C3 bare metal: compute-image-tools daisy_workflows/image_build/bare_metal/
    # c3metal-ubuntu_preparer.sh patches cloud-init to `pname in (..., "Google", "Izumi")`.
    "Izumi": "compute-image-tools c3metal-ubuntu_preparer.sh",
}

# cloud-init platform_reports_gce(): "system-product-name is not always guaranteed (LP: #1674861)",
# then `serial.startswith("GoogleCloud-")` on the DMI system serial number.
GCE_SERIAL_PREFIX = "GoogleCloud-"

# google-auth compute_engine/_metadata.py detect_gce_residency_linux() takes any product name that
# starts with "Google". Not taken here: google-auth uses it only after the metadata server did not
# answer, to guess which credentials to try (a wrong guess costs a timeout); here a wrong guess
# powers off a machine that is not a GCE VM. Such a name is reported by name instead.
GOOGLE_PREFIX = "Google"


@dataclass(frozen=True)
class Platform:
    gce: bool
    product: str  # the DMI product name as read ("" when it could not be read)
    why: str  # one sentence for people: why this is (not) taken for GCE
    serial: str = ""  # the DMI serial number when it was read and decided ("" otherwise)

    @property
    def token(self) -> str:
        """A line-field value: ``gce`` or ``not-gce``."""
        return "gce" if self.gce else "not-gce"


def _read(path: str) -> str:
    """A DMI string (at most 256 bytes, stripped); raises OSError. O_NONBLOCK: a FIFO planted
    at the path must not hang the agent."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(256)
    return raw.decode("utf-8", "replace").strip()


def detect(path: str = DMI_PRODUCT_PATH) -> Platform:
    """Decide from the DMI product name at ``path`` and the serial number beside it
    (``product_serial`` in the same directory); never raises."""
    serial_path = os.path.join(os.path.dirname(path), SERIAL_FILE)
    try:
        product = _read(path)
    except OSError as e:
        product, product_error = (
            "",
            f"cannot read the DMI product name at {path}: {e.strerror or e}",
        )
    else:
        product_error = ""
        if product in GCE_PRODUCTS:
            return Platform(True, product, f"DMI product name is {product!r}")
    try:
        serial = _read(serial_path)
    except OSError as e:
        serial, serial_error = "", f"{serial_path}: {e.strerror or e}"
    else:
        serial_error = ""
        if serial.startswith(GCE_SERIAL_PREFIX):
            name = product_error or f"DMI product name is {product!r}"
            return Platform(
                True,
                product,
                f"{name}, but the DMI serial number starts with {GCE_SERIAL_PREFIX!r} "
                "(cloud-init DataSourceGCE.platform_reports_gce)",
                serial,
            )
    why = product_error or f"DMI product name is {product!r}"
    if product.startswith(GOOGLE_PREFIX):  # and not one of GCE_PRODUCTS
        why += f" (a name starting {GOOGLE_PREFIX!r} is not enough, docs/agent.md)"
    why += (
        f"; DMI serial number unreadable ({serial_error})"
        if serial_error
        else f"; DMI serial number not {GCE_SERIAL_PREFIX}*"
    )
    return Platform(False, product, why)


def detect_in(dmi_dir: str) -> Platform:
    """:func:`detect` for a DMI directory (``/sys/class/dmi/id`` or a test's copy of it)."""
    return detect(os.path.join(dmi_dir, "product_name"))


WATCH_ONLY_PREFIX = "WATCH ONLY, never acting here: "  # how the sentence of arming() begins


def arming(platform: Platform, allow_non_gce: bool) -> tuple[bool, str]:
    """Whether the agent may act here, and a sentence saying why not (empty when it may)."""
    if platform.gce:
        return True, ""
    if allow_non_gce:
        return True, ""
    return False, (
        f"{WATCH_ONLY_PREFIX}not a GCE VM ({platform.why}); it watches and reports "
        "(agent.allow_non_gce = true to act anyway)"
    )
