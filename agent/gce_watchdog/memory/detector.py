"""The pure climb detector: a series of ``(t_seconds, bytes)`` in, a :class:`ClimbVerdict` out.

No clock, no I/O. The method (see ``docs/memory-watch.md`` for the why):

1. Skip ``warmup`` samples; fewer than ``window`` left: ``not_enough_data`` (never pass or fail).
2. Range (max - min of the raw samples) below ``band``: ``pass``. This is the team's pass band.
3. Out of band. If one change point splits the series into two segments that are each flat
   (each within the band, and neither has a trend line that rises or falls by band/4), it is a
   ``step``: a level shift such as a model being loaded, not a leak.
4. Mann-Kendall says the series rises (one-sided p < ``alpha``) and the Theil-Sen trend line
   accounts for at least half of the band over the window: ``climb``.
5. Anything else out of band (a wide sawtooth, a fall, large noise): ``unstable``.

Both statistics are rank based, so one outlier sample (a transient spike) moves neither.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from gce_watchdog.memory import GIB


class Status(StrEnum):
    NOT_ENOUGH_DATA = "not_enough_data"
    PASS = "pass"  # noqa: S105 (a verdict name, not a password)
    CLIMB = "climb"
    STEP = "step"
    UNSTABLE = "unstable"


# Mann-Kendall's variance formula is a normal approximation, reasonable from about 10 points; the
# team's own rule asks for at least 30 samples after warm-up.
MIN_WINDOW = 10
# Above this many points the series is averaged into this many equal bins before the O(n^2) rank
# statistics run: 512 points is ~130k pairs, a few tens of ms in pure Python. The range always uses
# every raw sample.
MAX_POINTS = 512
# A step's two segments must each hold at least this share of the points (and at least 5): a
# "segment" of two samples is an outlier, not a level.
STEP_MIN_SHARE = 0.1
STEP_MIN_POINTS = 5


@dataclass(frozen=True)
class DetectorParams:
    """Knobs of the detector. ``band`` is in bytes; ``warmup`` and ``window`` count samples."""

    warmup: int = 10
    window: int = 30
    band: float = float(GIB)
    alpha: float = 0.01
    max_points: int = MAX_POINTS

    def __post_init__(self) -> None:
        errs = []
        if self.warmup < 0:
            errs.append(f"warmup must be >= 0, got {self.warmup}")
        if self.window < MIN_WINDOW:
            errs.append(f"window must be >= {MIN_WINDOW} samples, got {self.window}")
        if not (self.band > 0 and math.isfinite(self.band)):
            errs.append(f"band must be > 0 bytes, got {self.band}")
        if not 0 < self.alpha < 0.5:
            errs.append(f"alpha must be in (0, 0.5), got {self.alpha}")
        if self.max_points < self.window or self.max_points < 2 * MIN_WINDOW:
            errs.append(f"max_points must be >= window and >= {2 * MIN_WINDOW}")
        if errs:
            raise ValueError("; ".join(errs))


@dataclass(frozen=True)
class ClimbVerdict:
    """What the detector concluded about one gauge, with the numbers behind it."""

    status: Status
    samples: int  # samples used (after warm-up, finite values only)
    reason: str
    range_bytes: float = 0.0
    min_bytes: float = 0.0
    max_bytes: float = 0.0
    last_bytes: float = 0.0
    span_s: float = 0.0
    slope_bytes_per_s: float = 0.0  # Theil-Sen
    rise_bytes: float = 0.0  # Theil-Sen slope x span: what the trend line climbs over the window
    mk_z: float = 0.0
    p_value: float = 1.0  # one-sided, for "rising"
    step_bytes: float | None = None  # the level shift when status is step
    step_at_s: float | None = None  # time of the first sample after the shift
    capacity_bytes: float | None = None
    seconds_to_full: float | None = None  # when climbing and a capacity is known

    @property
    def slope_gib_per_min(self) -> float:
        return self.slope_bytes_per_s * 60.0 / GIB

    @property
    def range_gib(self) -> float:
        return self.range_bytes / GIB

    def to_dict(self) -> dict[str, object]:
        return {
            "status": str(self.status),
            "reason": self.reason,
            "samples_used": self.samples,
            "range_bytes": round(self.range_bytes),
            "range_gib": round(self.range_gib, 4),
            "min_bytes": round(self.min_bytes),
            "max_bytes": round(self.max_bytes),
            "last_bytes": round(self.last_bytes),
            "span_s": round(self.span_s, 3),
            "slope_gib_per_min": round(self.slope_gib_per_min, 6),
            "rise_bytes": round(self.rise_bytes),
            "mk_z": round(self.mk_z, 4),
            "p_value": float(f"{self.p_value:.6g}"),
            "step_bytes": None if self.step_bytes is None else round(self.step_bytes),
            "step_at_s": None if self.step_at_s is None else round(self.step_at_s, 3),
            "capacity_bytes": None if self.capacity_bytes is None else round(self.capacity_bytes),
            "seconds_to_full": (
                None if self.seconds_to_full is None else round(self.seconds_to_full, 1)
            ),
        }


# --- statistics ---------------------------------------------------------------------------------


def mann_kendall(ys: Sequence[float]) -> tuple[float, float]:
    """Mann-Kendall trend test: (z, one-sided p for an increasing trend). Ties corrected."""
    n = len(ys)
    if n < 3:
        return 0.0, 1.0
    s = 0
    for i in range(n - 1):
        yi = ys[i]
        for j in range(i + 1, n):
            d = ys[j] - yi
            s += (d > 0) - (d < 0)
    counts: dict[float, int] = {}
    for y in ys:
        counts[y] = counts.get(y, 0) + 1
    ties = sum(c * (c - 1) * (2 * c + 5) for c in counts.values() if c > 1)
    var = (n * (n - 1) * (2 * n + 5) - ties) / 18.0
    if var <= 0:  # every value equal
        return 0.0, 1.0
    # Continuity correction: S moves in steps of 2.
    z = (s - 1) / math.sqrt(var) if s > 0 else (s + 1) / math.sqrt(var) if s < 0 else 0.0
    p = 0.5 * math.erfc(z / math.sqrt(2.0))  # P(Z >= z)
    return z, p


def theil_sen(ts: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Theil-Sen line: (median pairwise slope, median intercept). Pairs with equal t skipped."""
    slopes: list[float] = []
    n = len(ts)
    for i in range(n - 1):
        ti, yi = ts[i], ys[i]
        for j in range(i + 1, n):
            dt = ts[j] - ti
            if dt > 0:
                slopes.append((ys[j] - yi) / dt)
    if not slopes:
        return 0.0, _median(list(ys)) if ys else 0.0
    slope = _median(slopes)
    intercept = _median([y - slope * t for t, y in zip(ts, ys, strict=True)])
    return slope, intercept


def _median(xs: list[float]) -> float:
    xs.sort()
    n = len(xs)
    mid = n // 2
    return xs[mid] if n % 2 else (xs[mid - 1] + xs[mid]) / 2.0


def _bin(ts: list[float], ys: list[float], k: int) -> tuple[list[float], list[float]]:
    """Average consecutive samples into k nearly equal bins (keeps order and the time axis)."""
    n = len(ts)
    if n <= k:
        return ts, ys
    bt: list[float] = []
    by: list[float] = []
    for b in range(k):
        lo, hi = b * n // k, (b + 1) * n // k
        m = hi - lo
        bt.append(sum(ts[lo:hi]) / m)
        by.append(sum(ys[lo:hi]) / m)
    return bt, by


def _best_split(ys: Sequence[float], min_seg: int) -> int | None:
    """Index k maximising the between-segment sum of squares of ys[:k] vs ys[k:]."""
    n = len(ys)
    if n < 2 * min_seg:
        return None
    total = sum(ys)
    left = 0.0
    best_k, best = None, -1.0
    for k in range(1, n):
        left += ys[k - 1]
        if k < min_seg or n - k < min_seg:
            continue
        ml, mr = left / k, (total - left) / (n - k)
        score = k * (n - k) / n * (ml - mr) ** 2
        if score > best:
            best_k, best = k, score
    return best_k


def _flat(ts: Sequence[float], ys: Sequence[float], band: float) -> bool:
    """A plateau: within the band, and its trend line moves less than band/4 over its span."""
    if max(ys) - min(ys) >= band:
        return False
    slope, _ = theil_sen(ts, ys)
    return abs(slope * (ts[-1] - ts[0])) < band / 4


# --- the detector -------------------------------------------------------------------------------


def clean(samples: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Finite samples sorted by time (stable). Bad input is dropped, never raised on."""
    out = [
        (float(t), float(y))
        for t, y in samples
        if isinstance(t, int | float)
        and isinstance(y, int | float)
        and math.isfinite(t)
        and math.isfinite(y)
    ]
    out.sort(key=lambda s: s[0])
    return out


def detect(
    samples: Iterable[tuple[float, float]],
    params: DetectorParams | None = None,
    capacity: float | None = None,
) -> ClimbVerdict:
    """Judge one gauge's series. ``capacity`` (bytes) enables the time-to-full projection."""
    p = params or DetectorParams()
    series = clean(samples)[p.warmup :]
    n = len(series)
    cap = capacity if capacity is not None and capacity > 0 else None
    if n < p.window:
        return ClimbVerdict(
            Status.NOT_ENOUGH_DATA,
            n,
            f"{n} of {p.window} samples after a warm-up of {p.warmup}",
            capacity_bytes=cap,
        )
    ts = [s[0] for s in series]
    ys = [s[1] for s in series]
    lo, hi = min(ys), max(ys)
    rng = hi - lo
    span = ts[-1] - ts[0]
    bts, bys = _bin(ts, ys, p.max_points)
    # Rank statistics on the time axis relative to the first sample keep the intercept small.
    rel = [t - bts[0] for t in bts]
    z, pval = mann_kendall(bys)
    slope, intercept = theil_sen(rel, bys)
    rise = slope * span
    base = ClimbVerdict(
        Status.PASS,
        n,
        "",
        range_bytes=rng,
        min_bytes=lo,
        max_bytes=hi,
        last_bytes=ys[-1],
        span_s=span,
        slope_bytes_per_s=slope,
        rise_bytes=rise,
        mk_z=z,
        p_value=pval,
        capacity_bytes=cap,
    )
    band_gib = p.band / GIB
    if rng < p.band:
        trend = " (rising, p<alpha)" if pval < p.alpha and slope > 0 else ""
        return replace(base, reason=f"range {rng / GIB:.3f} < band {band_gib:g} GiB{trend}")
    min_seg = max(STEP_MIN_POINTS, math.ceil(len(bys) * STEP_MIN_SHARE))
    k = _best_split(bys, min_seg)
    if k is not None and _flat(rel[:k], bys[:k], p.band) and _flat(rel[k:], bys[k:], p.band):
        jump = sum(bys[k:]) / (len(bys) - k) - sum(bys[:k]) / k
        return replace(
            base,
            status=Status.STEP,
            reason=f"one level shift of {jump / GIB:+.3f} GiB between two flat plateaus",
            step_bytes=jump,
            step_at_s=bts[k],
        )
    if pval < p.alpha and slope > 0 and rise >= p.band / 2:
        eta = None
        if cap is not None:
            fitted_last = intercept + slope * (ts[-1] - bts[0])
            eta = max(0.0, (cap - max(fitted_last, ys[-1])) / slope)
        return replace(
            base,
            status=Status.CLIMB,
            reason=(
                f"monotone climb {slope * 60 / GIB:.3f} GiB/min (Mann-Kendall p={pval:.2g}), "
                f"range {rng / GIB:.3f} GiB >= band {band_gib:g}"
            ),
            seconds_to_full=eta,
        )
    return replace(
        base,
        status=Status.UNSTABLE,
        reason=f"range {rng / GIB:.3f} GiB >= band {band_gib:g} without a monotone climb or step",
    )
