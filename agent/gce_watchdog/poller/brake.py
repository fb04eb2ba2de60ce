"""The fleet-wide brake's rule: how many failovers a fleet may take within a window (pure).

A mass event (a zone outage, the poller's own network, a bad image rolled out everywhere) looks
like every VM failing at once. Failing them all over at once would move the whole fleet to the
other provider on what may be one cause: the brake admits at most ``allowed(fleet)`` failover
decisions per sliding ``window_s`` and holds the rest until an operator releases them
(``gce-watchdog decisions release``). The ledger counts, under its claim lock, the decisions
of the window; this module only says yes or no (docs/poller.md, "The fleet-wide brake").

No clock, no I/O: the ledger passes the count and the fleet's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_SHARE = 0.1  # 10 % of the watched fleet ...
DEFAULT_WINDOW_S = 600.0  # ... per 10 minutes ...
DEFAULT_FLOOR = 3  # ... but never fewer than 3: one real wedge in a small fleet goes through


@dataclass(frozen=True)
class BrakeRule:
    """At most ``max(floor, floor(share * fleet))`` failovers per ``window_s``."""

    share: float = DEFAULT_SHARE
    window_s: float = DEFAULT_WINDOW_S
    floor: int = DEFAULT_FLOOR

    def __post_init__(self) -> None:
        if not (0.0 < self.share <= 1.0):
            raise ValueError(f"the brake's share must be in (0, 1], not {self.share!r}")
        if not (0.0 < self.window_s < math.inf):
            raise ValueError(f"the brake's window must be > 0 and finite, not {self.window_s!r}")
        if self.floor < 1:
            raise ValueError(f"the brake's floor must be >= 1, not {self.floor!r}")

    def allowed(self, fleet: int) -> int:
        """Failovers admitted per window for a fleet of ``fleet`` watched VMs."""
        return max(self.floor, math.floor(self.share * max(fleet, 0) + 1e-9))

    def admits(self, recent: int, fleet: int) -> bool:
        """May one more failover go through, ``recent`` having gone through in the window?"""
        return recent < self.allowed(fleet)


def parse_share(text: str) -> float:
    """``10%`` -> 0.1, ``0.1`` -> 0.1; ValueError for anything not in (0, 1]."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ValueError(f"share {text!r}: want a percentage (10%) or a fraction (0.1)") from None
    if not (0.0 < value <= 1.0):  # (nan fails this too)
        raise ValueError(f"share {text!r}: want more than 0 and at most 100%")
    return value
