"""Judge an e2e serial log as the poller does: through the fake Compute API and the real poller.

:class:`LivePoller` is handed to :func:`e2e.vm.run` as its ``watch``: while the VM runs, the new
serial bytes go to :class:`testing.simcompute.FakeComputeAPI` in its faithful mode (serial output
only while RUNNING, as GCE serves it) and :class:`poller.poller.Poller` polls every ``every``
seconds with ``reap``, deciding and claiming in a real SQLite ledger, as the central poller would
(reads land wherever the file happens to end, often inside a line). When qemu has exited, the
guest powered itself off: the fake records ``compute.instances.guestTerminate`` and the VM is
TERMINATED, and **nothing written after the last live read reaches the poller** (the agent's
linger exists so that the terminal line is read while the VM runs). Three more looks follow: the
final poll, the same poller again, and a second poller with a fresh cursor sharing the ledger: a
FAILOVER must be claimed exactly once. ``preempt_on``: GCE preempts the (Spot) VM at the first
look whose serial output contains these bytes (the fake records ``compute.instances.preempted``;
the guest, which is not told, writes on unread).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gce_watchdog.lib.compute import ComputeClient
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.poller.poller import Poller, PollOutcome
from gce_watchdog.poller.reader import CursorStore
from gce_watchdog.poller.timeline import Timeline, parse_bytes
from gce_watchdog.poller.verdict import Policy
from gce_watchdog.testing.simcompute import Call, FakeComputeAPI
from gce_watchdog.wire.protocol import Event
from kit.netns import EGRESS_IP, Topology

from e2e import vm

PROJECT, ZONE, NAME = "e2e-project", "us-central1-a", "e2e-vm"
TOKEN = "e2e-token"  # noqa: S105 - the fake Compute API's test token
POLL_EVERY = 2.0  # seconds between live polls: several reads inside the agent's 6 s linger
# Where the guest reaches the same fake Compute API (LivePoller.expose): the 443 stand-in's
# address on the gce side, through the guest's gateway, on a port nothing else uses.
GUEST_API_PORT = 8080
GUEST_API_BASE = f"http://{EGRESS_IP}:{GUEST_API_PORT}/compute/v1"


class SerialFeed:
    """The serial output of a qemu guest so far, appended to one instance's port 1 in the fake,
    each byte once (what GCE's serial buffer holds; the fake serves it only while RUNNING)."""

    def __init__(self, api: FakeComputeAPI, name: str) -> None:
        self.api = api
        self.name = name
        self.sent = 0

    def feed(self, data: bytes) -> None:
        if len(data) > self.sent:
            self.api.append_serial(self.name, data[self.sent :])
            self.sent = len(data)


@dataclass(frozen=True)
class PollRun:
    """What the poller said: the live polls, the final poll, and the two later looks."""

    during: list[PollOutcome]  # while the VM ran (status RUNNING)
    final: PollOutcome  # after qemu exited (status TERMINATED)
    again: PollOutcome  # the same poller, after the decision
    other: PollOutcome  # a second poller (own cursor), same ledger

    def looks(self) -> list[PollOutcome]:
        return [*self.during, self.final, self.again, self.other]


class LivePoller:
    """The poller reading the VM's serial port while it runs; use as a context manager."""

    def __init__(
        self,
        workdir: Path,
        every: float = POLL_EVERY,
        clock: Callable[[], float] = time.monotonic,
        *,
        spot: bool = False,
        preempt_on: bytes | None = None,
        reap: bool = True,
        guest_token: str | None = None,
    ) -> None:
        self.workdir = workdir
        self.every = every
        self.clock = clock
        self.spot = spot
        self.preempt_on = preempt_on
        self.reap = reap
        # A second accepted token, for a poller in the guest (expose): the fake accepts both.
        self.guest_token = guest_token
        self.preempted = False
        self.during: list[PollOutcome] = []
        self._last = float("-inf")
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> LivePoller:
        from google.oauth2.credentials import Credentials

        # A fresh ledger and fresh cursors: the fake API numbers instances the same way every
        # run, so a cursor left by an earlier run would carry that run's boot (and its shutdown)
        # into this one, and the poller would rightly decide for both boots.
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True)
        tokens = [TOKEN, *([self.guest_token] if self.guest_token else [])]
        self.api = self._stack.enter_context(
            FakeComputeAPI(token=tokens, serial_needs_running=True)
        )
        self.api.add_instance(NAME, project=PROJECT, zone=ZONE, spot=self.spot)
        self._feed = SerialFeed(self.api, NAME)
        self.ledger = self._stack.enter_context(open_ledger(self.workdir / "ledger.sqlite", "e2e"))
        creds = Credentials(TOKEN)  # type: ignore[no-untyped-call]
        self.client = ComputeClient.create(creds, api_base=self.api.base_url)
        self._stack.callback(self.client.close)
        self.poller = self._poller("cursors-a")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def expose(self, topo: Topology) -> None:
        """vm.run's on_network: serve the same fake on GUEST_API_BASE in the guest's network too,
        when there is a guest token (a poller in the guest reads the VM's own serial port)."""
        if self.guest_token:
            self.api.serve_socket(vm.listen_in_netns(topo.gce, EGRESS_IP, GUEST_API_PORT))

    def guest_calls(self) -> list[Call]:
        """The requests that came from the guest (its address), in order."""
        return [c for c in self.api.calls if c.client == vm.GUEST_ADDR]

    def _poller(self, cursors: str) -> Poller:
        store = CursorStore(self.workdir / cursors)
        return Poller(self.client, store, PROJECT, ZONE, self.ledger, Policy(), reap=self.reap)

    def _append(self, data: bytes) -> None:
        self._feed.feed(data)

    def watch(self, data: bytes) -> None:
        """The serial output so far (vm.run's watch): poll if ``every`` seconds have passed."""
        now = self.clock()
        if now - self._last < self.every:
            return
        self._last = now
        if self.preempt_on is not None and self.preempt_on in data and not self.preempted:
            self.preempted = True
            self.api.preempt(NAME)
        if not self.preempted:  # the guest keeps writing, but GCE took the VM back
            self._append(data)
        self.during.append(self.poller.poll(NAME))

    def finish(self, data: bytes, status: str = "TERMINATED") -> PollRun:
        """The VM is off (``TERMINATED``: the guest powered itself off) or still running
        (``RUNNING``: the harness timed out and killed qemu), then the three last looks.
        Bytes written after the last live read are served only to a RUNNING VM."""
        if status == "RUNNING":
            self._append(data)
        elif not self.preempted:
            self.api.guest_shutdown(NAME)
        final = self.poller.poll(NAME)
        again = self.poller.poll(NAME)
        other = self._poller("cursors-b").poll(NAME)
        return PollRun(list(self.during), final, again, other)


def timeline(serial: bytes) -> Timeline:
    return parse_bytes(serial)


def latest_boot_events(tl: Timeline) -> list[Event]:
    """The current boot's lines, in seq order (the boot with the latest signed start)."""
    boot = tl.latest_boot
    if boot is None:
        return []
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
        [sys.executable, "-m", "gce_watchdog", "report", str(serial_log), "--png", str(out_png),
         "--status", status],
        capture_output=True,
        text=True,
        timeout=120,  # matplotlib's first import builds a font cache (~10 s on 2 cores)
        check=False,
    )  # fmt: skip
    if r.returncode == 0 and out_png.exists():
        return None
    return f"report rc={r.returncode}: {(r.stderr or r.stdout).strip()[-500:]}"
