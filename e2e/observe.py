"""Judge an e2e serial log as the poller does: through the fake Compute API and the real poller.

The serial log qemu wrote is served by :class:`agent.simcompute.FakeComputeAPI` (real HTTP,
``getSerialPortOutput`` semantics) in several chunks cut at arbitrary byte offsets, as if the
poller had read it while the VM ran; :class:`agent.poller.poller.Poller` reads, decides and claims
in a real SQLite ledger. After the last chunk the instance gets its final status (TERMINATED once
qemu has exited). Two more looks follow: the same poller again, and a second poller with a fresh
cursor sharing the ledger: a FAILOVER must be claimed exactly once.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.poller.ledger import Ledger
from agent.poller.poller import Poller, PollOutcome
from agent.poller.reader import ComputeClient, CursorStore
from agent.poller.timeline import Timeline, parse_bytes
from agent.poller.verdict import Policy
from agent.protocol import Event
from agent.simcompute import FakeComputeAPI

PROJECT, ZONE, NAME = "e2e-project", "us-central1-a", "e2e-vm"
TOKEN = "e2e-token"  # noqa: S105 - the fake Compute API's test token


@dataclass(frozen=True)
class PollRun:
    """What the poller said: one outcome per chunk, the final poll, and the two later looks."""

    during: list[PollOutcome]
    final: PollOutcome
    again: PollOutcome  # the same poller, after the decision
    other: PollOutcome  # a second poller (own cursor), same ledger


def _client(api: FakeComputeAPI) -> ComputeClient:
    from google.oauth2.credentials import Credentials

    return ComputeClient.create(Credentials(TOKEN), api_base=api.base_url)  # type: ignore[no-untyped-call]


def poll_as_poller(
    serial: bytes,
    workdir: Path,
    final_status: str = "TERMINATED",
    chunks: int = 4,
    spot: bool = False,
) -> PollRun:
    """Serve serial in chunks through the fake Compute API and poll after each (see module doc)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ledger_path = workdir / "ledger.sqlite"
    for p in workdir.glob("ledger.sqlite*"):
        p.unlink()
    with FakeComputeAPI(token=TOKEN) as api, Ledger(ledger_path, owner="e2e") as ledger:
        api.add_instance(NAME, project=PROJECT, zone=ZONE, spot=spot)
        client = _client(api)
        poller = Poller(client, CursorStore(workdir / "cursors-a"), PROJECT, ZONE, ledger, Policy())
        during: list[PollOutcome] = []
        # Cuts at fixed fractions of the log: most land inside a line, which the reader must join.
        cuts = [len(serial) * i // chunks for i in range(1, chunks)] + [len(serial)]
        prev = 0
        for cut in cuts:
            api.append_serial(NAME, serial[prev:cut])
            prev = cut
            during.append(poller.poll(NAME))
        api.set_status(NAME, final_status)
        final = poller.poll(NAME)
        again = poller.poll(NAME)
        other_poller = Poller(
            client, CursorStore(workdir / "cursors-b"), PROJECT, ZONE, ledger, Policy()
        )
        other = other_poller.poll(NAME)
        client.close()
    return PollRun(during, final, again, other)


def timeline(serial: bytes) -> Timeline:
    return parse_bytes(serial)


def latest_boot_events(tl: Timeline) -> list[Event]:
    """The latest boot's lines, in seq order."""
    if not tl.events:
        return []
    boot = tl.events[-1].boot
    return sorted((e for e in tl.events if e.boot == boot), key=lambda e: e.seq)


def seq_contiguous(events: Sequence[Event]) -> list[int]:
    """The seq numbers missing between the first and the last line (empty: none lost)."""
    seqs = {e.seq for e in events}
    if not seqs:
        return []
    return [s for s in range(min(seqs), max(seqs) + 1) if s not in seqs]


def report_png(serial_log: Path, out_png: Path, status: str = "TERMINATED") -> str | None:
    """``gce-watchdog report LOG --png OUT``; None when written, else why not (best effort)."""
    r = subprocess.run(
        [sys.executable, "-m", "agent", "report", str(serial_log), "--png", str(out_png),
         "--status", status],
        capture_output=True,
        text=True,
        timeout=120,  # matplotlib's first import builds a font cache (~10 s on 2 cores)
        check=False,
    )  # fmt: skip
    if r.returncode == 0 and out_png.exists():
        return None
    return f"report rc={r.returncode}: {(r.stderr or r.stdout).strip()[-500:]}"
