"""Operators cannot misfire (issue 35 item 6): each attack of the issue, against the real CLI.

``gce-watchdog pin`` with a typo in the VM name or id, or in the ledger path, or over a good
pin, against the fake Compute API over loopback and a real SQLite ledger.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gce_watchdog.cli import main
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.testing.simcompute import FakeComputeAPI

pytestmark = pytest.mark.process

P, Z = "test-project", "us-central1-a"
GOOD = "a" * 32
OTHER = "b" * 32


@pytest.fixture
def api() -> Iterator[FakeComputeAPI]:
    with FakeComputeAPI(token="tok") as a:
        a.add_instance("train-7", project=P, zone=Z, instance_id="4000000000000000007")
        a.add_instance("train-8", project=P, zone=Z, instance_id="4000000000000000008")
        yield a


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    path = tmp_path / "ledger.sqlite"
    with open_ledger(path) as led:  # a ledger in use: train-7 pinned from its first line
        led.pins.place_pin("4000000000000000007", b"\x07" * 32, GOOD, now=1.0)
    return path


def pin(api: FakeComputeAPI, tmp_path: Path, *args: str) -> int:
    tok = tmp_path / "token"
    tok.write_text("tok\n")
    return main(["pin", "--api-base", api.base_url, "--access-token-file", str(tok), *args])


def pinned(ledger: Path, iid: str = "4000000000000000007") -> tuple[str, str, bytes | None] | None:
    with open_ledger(ledger) as led:
        p = led.pins.get_pin(iid)
    return None if p is None else (p.fingerprint, p.source, p.public)


PLACED = (GOOD, "placed", b"\x07" * 32)


def test_a_typo_in_the_vm_name_pins_nothing(
    api: FakeComputeAPI, tmp_path: Path, ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = pin(api, tmp_path, "--ledger", str(ledger), f"{P}/{Z}/train-77", OTHER)
    assert rc == 69
    assert "no instance test-project/us-central1-a/train-77" in capsys.readouterr().err
    assert pinned(ledger) == PLACED


def test_a_typo_in_the_instance_id_pins_nothing(
    api: FakeComputeAPI, tmp_path: Path, ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = pin(api, tmp_path, "--ledger", str(ledger), "--project", P, "4000000000000000009", OTHER)
    assert rc == 69 and "no instance with id 4000000000000000009" in capsys.readouterr().err
    assert pinned(ledger, "4000000000000000009") is None
    # an id needs the projects it is looked up in
    assert pin(api, tmp_path, "--ledger", str(ledger), "4000000000000000008", OTHER) == 64


def test_an_api_that_cannot_tell_pins_nothing(
    api: FakeComputeAPI, tmp_path: Path, ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.set_unreachable(P, "europe-west1-b")  # absence from an incomplete list proves nothing
    rc = pin(api, tmp_path, "--ledger", str(ledger), "--project", P, "4000000000000000009", OTHER)
    assert rc == 75 and "cannot tell whether 4000000000000000009 exists" in capsys.readouterr().err
    assert pinned(ledger, "4000000000000000009") is None


def test_a_typo_in_the_ledger_path_creates_nothing(
    api: FakeComputeAPI, tmp_path: Path, ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    typo = tmp_path / "ledgr.sqlite"
    assert pin(api, tmp_path, "--ledger", str(typo), f"{P}/{Z}/train-8", OTHER) == 66
    assert f"no ledger at {typo}" in capsys.readouterr().err
    assert not typo.exists()
    assert pin(api, tmp_path, "--ledger", str(typo), "--create", f"{P}/{Z}/train-8", OTHER) == 0
    assert pinned(typo, "4000000000000000008") == (OTHER, "hand", None)


def test_replacing_a_good_pin_needs_replace_and_prints_both(
    api: FakeComputeAPI, tmp_path: Path, ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pin(api, tmp_path, "--ledger", str(ledger), f"{P}/{Z}/train-7", OTHER) == 1
    err = capsys.readouterr().err
    assert GOOD in err and OTHER in err and "--replace" in err
    assert pinned(ledger) == PLACED  # nothing changed
    # the same fingerprint again: nothing to do, the placed key is kept
    assert pin(api, tmp_path, "--ledger", str(ledger), f"{P}/{Z}/train-7", GOOD) == 0
    assert "already pinned" in capsys.readouterr().out
    assert pinned(ledger) == PLACED
    rc = pin(api, tmp_path, "--ledger", str(ledger), "--replace", f"{P}/{Z}/train-7", OTHER)
    assert rc == 0
    out = capsys.readouterr().out
    assert f"pinned 4000000000000000007 ({P}/{Z}/train-7) {OTHER}" in out
    assert f"replaced {GOOD}, placed" in out
    assert pinned(ledger) == (OTHER, "hand", None)


def test_a_new_pin_by_id_and_a_bad_fingerprint(
    api: FakeComputeAPI, tmp_path: Path, ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pin(api, tmp_path, "--ledger", str(ledger), f"{P}/{Z}/train-8", "XYZ") == 64
    rc = pin(api, tmp_path, "--ledger", str(ledger), "--project", P, "4000000000000000008", OTHER)
    assert rc == 0
    assert f"pinned 4000000000000000008 ({P}/{Z}/train-8) {OTHER}" in capsys.readouterr().out
    assert pinned(ledger, "4000000000000000008") == (OTHER, "hand", None)
