"""lib/health.py's answer, pure: 200 until the last progress is older than the stall."""

from __future__ import annotations

import pytest
from gce_watchdog.lib.health import health_answer
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure


def test_the_answer_is_200_until_the_last_progress_is_older_than_the_stall() -> None:
    assert health_answer(0.0, 60.0)[0] == 200
    assert health_answer(60.0, 60.0)[0] == 200
    code, body = health_answer(60.5, 60.0)
    assert code == 503 and body["status"] == "stalled" and body["last_progress_s"] == 60.5


@given(st.floats(0, 1e6), st.floats(0.001, 1e6))
def test_healthy_exactly_while_within_the_stall(age: float, stall: float) -> None:
    code, body = health_answer(age, stall)
    assert (code == 200) == (age <= stall) and body["stall_s"] == stall
