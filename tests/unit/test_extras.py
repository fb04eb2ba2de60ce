"""What to install for a missing optional library (lib/extras.py, issue 39): never `pip install`
where there is no pip (the Debian packages' venv), the Debian package where one has it."""

from __future__ import annotations

import itertools

import pytest
from gce_watchdog.lib.extras import EXTRAS, Install, importable, install_hint

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    ("extra", "debian", "has_pip"),
    list(itertools.product(sorted(EXTRAS), (False, True), (False, True))),
)
def test_the_hint_suggests_pip_only_where_pip_is(extra: str, debian: bool, has_pip: bool) -> None:
    hint = install_hint(extra, Install(debian=debian, has_pip=has_pip and not debian))
    pip_here = f"pip install 'gce-watchdog[{extra}]'"
    if has_pip and not debian:
        assert hint == pip_here
    else:  # pip only in a venv of one's own (DIR/bin/pip), or the Debian package
        assert not hint.startswith("pip") and " pip install" not in hint, hint
        deb = EXTRAS[extra].deb
        if debian and deb is not None:
            assert hint.startswith(f"install the {deb} package (apt-get install {deb})"), hint
        else:
            assert f"DIR/bin/pip install 'gce-watchdog[{extra}]'" in hint, hint


def test_the_debian_packages_name_the_poller_package_for_postgres_and_pubsub() -> None:
    assert {x: e.deb for x, e in EXTRAS.items()} == {
        "postgres": "gce-watchdog-poller",
        "pubsub": "gce-watchdog-poller",
        "report": None,
    }


def test_importable() -> None:
    assert importable("json") and importable("gce_watchdog.lib.extras")
    assert not importable("no_such_module_xyz") and not importable("no_such_pkg_xyz.sub")
