"""Render debian/changelog for one Debian release from packaging/debian/changes.toml.

    python packaging/changelog.py CHANGES.toml UPSTREAM_VERSION RELEASE DEBIAN_MAJOR
    python packaging/changelog.py --epoch CHANGES.toml

The second form prints the newest entry's date as seconds since the epoch: the build's
SOURCE_DATE_EPOCH (as dpkg-buildpackage takes it from debian/changelog), so the man pages' date
and the files' mtimes are the release's, not the build day's.

Every entry becomes ``gce-watchdog (<version>-1~deb<N>u1) <release>; urgency=medium`` with its
changes as bullets and its own date; the maintainer is debian/control's. The first entry must be
UPSTREAM_VERSION (pyproject.toml's): a release without a changelog entry is refused (exit 1).
"""

from __future__ import annotations

import datetime as dt
import sys
import textwrap
import tomllib
from email.utils import format_datetime
from pathlib import Path


def maintainer(control: Path) -> str:
    for line in control.read_text().splitlines():
        if line.startswith("Maintainer:"):
            return line.split(":", 1)[1].strip()
    raise SystemExit(f"changelog.py: no Maintainer: in {control}")


def render(changes: dict[str, object], upstream: str, release: str, major: str, who: str) -> str:
    entries = changes.get("release")
    if not isinstance(entries, list) or not entries:
        raise SystemExit("changelog.py: changes.toml has no [[release]] entry")
    if entries[0].get("version") != upstream:
        raise SystemExit(
            f"changelog.py: pyproject.toml's version {upstream} has no entry at the top of "
            f"changes.toml (its newest is {entries[0].get('version')})"
        )
    out = []
    for e in entries:
        when = e["date"]
        if not isinstance(when, dt.datetime) or when.tzinfo is None:
            raise SystemExit(f"changelog.py: {e['version']}: date must be a UTC date-time")
        lines = [f"gce-watchdog ({e['version']}-1~deb{major}u1) {release}; urgency=medium", ""]
        for c in e["changes"]:
            lines += textwrap.wrap(
                c, 78, initial_indent="  * ", subsequent_indent="    ", break_on_hyphens=False
            )
        lines += ["", f" -- {who}  {format_datetime(when.astimezone(dt.UTC))}", ""]
        out.append("\n".join(lines))
    return "\n".join(out)


def newest_epoch(changes: dict[str, object]) -> int:
    entries = changes.get("release")
    if not isinstance(entries, list) or not entries:
        raise SystemExit("changelog.py: changes.toml has no [[release]] entry")
    when = entries[0]["date"]
    if not isinstance(when, dt.datetime) or when.tzinfo is None:
        raise SystemExit(f"changelog.py: {entries[0]['version']}: date must be a UTC date-time")
    return int(when.timestamp())


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "--epoch":
        print(newest_epoch(tomllib.loads(Path(argv[2]).read_text())))
        return 0
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 64
    src = Path(argv[1])
    changes = tomllib.loads(src.read_text())
    who = maintainer(src.parent / "control")
    sys.stdout.write(render(changes, argv[2], argv[3], argv[4], who))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
