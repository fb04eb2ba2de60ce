"""Whether the job released the GPUs (job/release.py, pure): samples shaped as the probe child
(gpu/probe_child.py) answers them."""

from __future__ import annotations

from typing import Any

import pytest
from gce_watchdog.job.release import MIB, SLACK_BYTES, released
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

GIB = 1024 * MIB


def sample(*gpus: dict[str, Any]) -> dict[str, Any]:
    return {
        "count": len(gpus),
        "gpus": [{"index": i, "lost": False, **g} for i, g in enumerate(gpus)],
    }


IDLE = {"used": 500 * MIB, "total": 80 * GIB, "procs": [], "util": 0}


@pytest.mark.parametrize(
    ("before", "after", "state"),
    [
        (sample(IDLE), sample(IDLE), "ok"),
        (sample(IDLE), sample({**IDLE, "procs": [4242]}), "busy"),  # a leftover process
        (sample(IDLE), sample({**IDLE, "used": 60 * GIB}), "busy"),  # memory still held
        (sample(IDLE), sample({**IDLE, "used": 500 * MIB + int(1.5 * GIB)}), "ok"),  # < 2 % of 80
        (sample(IDLE), sample({**IDLE, "used": 500 * MIB + 2 * GIB}), "busy"),  # > 2 % of 80
        (None, sample(IDLE), "ok"),  # no baseline: only the processes count
        (None, sample({**IDLE, "procs": [1]}), "busy"),
        (sample(IDLE), None, "unknown"),
        (sample(IDLE), {"error": "NVML init failed"}, "unknown"),
        (sample(IDLE), sample(), "unknown"),
        (sample(IDLE, IDLE), sample(IDLE, {**IDLE, "procs": [7]}), "busy"),
    ],
)
def test_the_release_table(
    before: dict[str, Any] | None, after: dict[str, Any] | None, state: str
) -> None:
    r = released(before, after)
    assert r.state == state, r.why


def test_busy_says_which_gpu_and_why() -> None:
    r = released(sample(IDLE, IDLE), sample(IDLE, {**IDLE, "procs": [4242], "used": 9 * GIB}))
    assert r.why == "gpu1 held by pid 4242"


@given(
    base=st.integers(0, 80 * GIB),
    extra=st.integers(0, SLACK_BYTES),
    total=st.integers(1 * GIB, 12 * GIB),
)
def test_memory_within_the_slack_is_ok(base: int, extra: int, total: int) -> None:
    """On a GPU of up to 12 GiB the slack is 256 MiB (2 % is less): up to it is ok, over is busy."""
    g = {"procs": [], "total": total}
    assert released(sample({**g, "used": base}), sample({**g, "used": base + extra})).state == "ok"
    over = released(sample({**g, "used": base}), sample({**g, "used": base + SLACK_BYTES + 1}))
    assert over.state == "busy"
