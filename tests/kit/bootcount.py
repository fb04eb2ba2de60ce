"""Lines of a writer with the boot counter: ``bc`` on every line, ``bid`` on announcements
(issue 35 item 1's wire contract), written with the library's own encoder as ordinary fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from gce_watchdog.testing.synth import Writer, shown_announcement
from gce_watchdog.wire.protocol import announce_event, encode, needs_announcement


@dataclass
class BcWriter(Writer):
    """A writer of this version: ``bc`` on every line, ``bid`` on its announcements."""

    bc: str = "1"

    def line(self, *args: object, **kwargs: object) -> bytes:
        """``line(name, fields)``: the line (after the announcement where one is due)."""
        head = b""
        while self.announce and needs_announcement(self.seq):
            ann = announce_event(self.boot, self.seq, self.ts_ms, self.key, self.inst)
            ann = replace(ann, fields=(*ann.fields, ("bc", self.bc), ("bid", self.boot * 4)))
            head += encode(ann, self.key).encode() + b"\n"
            self.written.append(shown_announcement(ann))
            self.seq += 1
        name = str(args[0])
        given = args[1] if len(args) > 1 else {}
        fields = dict(given) if isinstance(given, Mapping) else {}
        ev = self.event(name, {**fields, "bc": self.bc})
        return head + encode(ev, self.key).encode() + b"\n"
