"""GCE detection as Google's references do it (issue 23, item 5).

Each case is a DMI directory the test writes (``product_name``, ``product_serial``, either absent),
handed to ``detect_in``: no patching. The rules and their sources are in vm/platform.py and
docs/agent.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gce_watchdog.vm.platform import (
    GCE_PRODUCT,
    GCE_PRODUCTS,
    GCE_SERIAL_PREFIX,
    arming,
    detect,
    detect_in,
)

pytestmark = pytest.mark.pure

QEMU = "Standard PC (Q35 + ICH9, 2009)"

# (id, product_name or None for absent, product_serial or None for absent, taken for GCE)
CASES: list[tuple[str, str | None, str | None, bool]] = [
    ("gce", "Google Compute Engine", "GoogleCloud-0123456789ABCDEF", True),
    ("gce-no-serial", "Google Compute Engine", None, True),
    ("google", "Google", None, True),  # cloud-init: pname == "Google"
    ("izumi-c3-metal", "Izumi", None, True),  # compute-image-tools c3metal-ubuntu_preparer.sh
    ("serial-only", QEMU, "GoogleCloud-0123456789ABCDEF", True),  # cloud-init: LP: #1674861
    ("serial-no-product-file", None, "GoogleCloud-X", True),
    ("qemu", QEMU, "", False),
    ("qemu-no-serial", QEMU, None, False),
    ("nothing", None, None, False),
    ("empty", "", "", False),
    # google-auth's prefix rule is not taken (a wrong GCE powers a machine off).
    ("google-prefix-only", "Google Pixel", None, False),
    ("google-compute-engine-suffix", "Google Compute Engine 2", None, False),
    ("case-differs", "google compute engine", None, False),
    ("serial-prefix-case", QEMU, "googlecloud-0123", False),
    ("serial-prefix-inside", QEMU, "X-GoogleCloud-0123", False),
    ("izumi-prefix", "Izumi2", None, False),
]


def _dmi(tmp: Path, product: str | None, serial: str | None) -> Path:
    d = tmp / "dmi"
    d.mkdir()
    if product is not None:
        (d / "product_name").write_text(product + "\n")  # sysfs ends each string with \n
    if serial is not None:
        (d / "product_serial").write_text(serial + "\n")
    return d


@pytest.mark.parametrize(
    ("product", "serial", "gce"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_detection_table(
    tmp_path: Path, product: str | None, serial: str | None, gce: bool
) -> None:
    plat = detect_in(str(_dmi(tmp_path, product, serial)))
    assert plat.gce is gce, plat.why
    assert plat.product == (product or "")
    assert plat.token == ("gce" if gce else "not-gce")
    if product is not None and product in GCE_PRODUCTS:
        assert plat.why == f"DMI product name is {product!r}"
    elif gce:  # taken by its serial number: the why says so
        assert GCE_SERIAL_PREFIX in plat.why and "serial number" in plat.why
        assert plat.serial == serial
    else:
        ok, why = arming(plat, allow_non_gce=False)
        assert not ok and why.startswith("WATCH ONLY, never acting here: not a GCE VM (")
        assert arming(plat, allow_non_gce=True) == (True, "")


def test_a_name_starting_google_says_why_it_is_not_taken(tmp_path: Path) -> None:
    plat = detect_in(str(_dmi(tmp_path, "Google Pixel", None)))
    assert not plat.gce and "a name starting 'Google' is not enough" in plat.why


def test_an_unreadable_serial_is_named(tmp_path: Path) -> None:
    # product_serial is root-only on sysfs (0400): `check` as a user cannot read it. A directory
    # stands in for it here (reading it fails with EISDIR even for root).
    d = _dmi(tmp_path, QEMU, None)
    (d / "product_serial").mkdir()
    plat = detect_in(str(d))
    assert (
        not plat.gce and "DMI serial number unreadable" in plat.why and "product_serial" in plat.why
    )


def test_a_fifo_at_the_dmi_path_does_not_hang(tmp_path: Path) -> None:
    d = tmp_path / "dmi"
    d.mkdir()
    os.mkfifo(d / "product_name")
    os.mkfifo(d / "product_serial")
    plat = detect_in(str(d))  # O_NONBLOCK: a FIFO without a writer reads as empty at once
    assert not plat.gce and plat.product == ""


def test_detect_takes_the_product_file_and_reads_the_serial_beside_it(tmp_path: Path) -> None:
    d = _dmi(tmp_path, QEMU, "GoogleCloud-1")
    assert detect(str(d / "product_name")).gce
    assert detect(str(d / "product_name")) == detect_in(str(d))
    assert GCE_PRODUCT in GCE_PRODUCTS
