"""The HTML report in a real browser (headless Chromium): each verdict class shows its own
colour, and only its own (issue 39, item 5). Skips, saying how to install it, without Chromium
(Debian: ``apt-get install chromium``).

The check reads the screenshot's pixels: the badge's colour fills a block of the page (flat
colour, no anti-aliasing inside it), so its exact RGB value is there, and no other class's
badge colour is anywhere on the page.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from gce_watchdog.report import html
from gce_watchdog.report.model import VERDICT_WORDS, verdict_class
from kit.reports import report_of

PIL = pytest.importorskip("PIL.Image", reason="Pillow comes with matplotlib (the report extra)")
BROWSER = next(
    (b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
)
pytestmark = [
    pytest.mark.skipif(BROWSER is None, reason="no Chromium (Debian: apt-get install -y chromium)"),
    pytest.mark.process,
    pytest.mark.slow,  # a browser per page: about 5 s each on two loaded cores
]
TOLERANCE = 3  # per channel: colour management may round a value by one or two


def screenshot(page: Path, out: Path) -> None:
    assert BROWSER is not None
    argv = [
        BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        "--force-color-profile=srgb", "--window-size=1000,300", f"--screenshot={out}",
        f"--user-data-dir={out.parent / 'profile'}", page.as_uri(),
    ]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and out.is_file(), r.stderr[-2000:]


def rgb(hex_colour: str) -> tuple[int, int, int]:
    h = hex_colour.lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def count(pixels: list[tuple[int, int, int]], colour: str) -> int:
    want = rgb(colour)
    return sum(all(abs(a - b) <= TOLERANCE for a, b in zip(p, want, strict=True)) for p in pixels)


@pytest.mark.parametrize("cls", sorted(VERDICT_WORDS))
def test_each_class_shows_its_own_colour_in_a_browser(tmp_path: Path, cls: str) -> None:
    r = report_of(cls)
    assert verdict_class(r) == cls
    page = tmp_path / "report.html"
    page.write_text(html.render(r, None))
    shot = tmp_path / "shot.png"
    screenshot(page, shot)
    with PIL.open(shot) as im:
        raw = im.convert("RGB").tobytes()
    pixels = [(raw[i], raw[i + 1], raw[i + 2]) for i in range(0, len(raw), 3)]
    own = count(pixels, html.COLOURS[cls])
    assert own >= 300, f"{cls}: the badge's colour {html.COLOURS[cls]} is not on the page"
    assert count(pixels, html.TINTS[cls]) >= 3000, f"{cls}: no tinted verdict line"
    for other, colour in html.COLOURS.items():
        if other != cls:
            assert count(pixels, colour) == 0, f"{cls}: {other}'s colour {colour} is shown"
