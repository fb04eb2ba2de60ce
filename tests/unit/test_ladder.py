"""The ladder, exhaustively (every tick-class sequence up to length 12) and by properties."""

from __future__ import annotations

import itertools

import pytest
from gce_watchdog.daemon import ladder
from gce_watchdog.daemon.ladder import (
    Climb,
    Hold,
    LadderState,
    Observation,
    ProbeVerdict,
    Recovered,
    Shutdown,
    TickClass,
    WouldShutdown,
    classify,
    step,
)
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

OK, FAIL, UNK = ProbeVerdict.OK, ProbeVerdict.FAIL, ProbeVerdict.UNKNOWN
# One representative observation per tick class (classify is tested on all 9 pairs below).
REP = {
    TickClass.BOTH_FAIL: Observation(FAIL, FAIL),
    TickClass.ANY_OK: Observation(OK, FAIL),
    TickClass.INCONCLUSIVE: Observation(UNK, FAIL),
}


@pytest.mark.parametrize(
    ("md", "eg", "want"),
    [
        (OK, OK, TickClass.ANY_OK),
        (OK, FAIL, TickClass.ANY_OK),
        (FAIL, OK, TickClass.ANY_OK),
        (OK, UNK, TickClass.ANY_OK),
        (UNK, OK, TickClass.ANY_OK),
        (FAIL, FAIL, TickClass.BOTH_FAIL),
        (FAIL, UNK, TickClass.INCONCLUSIVE),
        (UNK, FAIL, TickClass.INCONCLUSIVE),
        (UNK, UNK, TickClass.INCONCLUSIVE),
    ],
)
def test_classify_all_nine_pairs(md: ProbeVerdict, eg: ProbeVerdict, want: TickClass) -> None:
    assert classify(md, eg) is want


def _exhaustive(threshold: int, depth: int) -> int:
    """DFS over every sequence of tick classes up to ``depth``, checking each step against an
    independent reference model. Returns the number of steps checked."""
    checked = 0
    classes = list(REP)

    def walk(state: LadderState, streak: int, fired: bool, d: int) -> None:
        nonlocal checked
        if d == depth:
            return
        for cls in classes:
            new, actions = step(state, REP[cls], threshold)
            checked += 1
            # reference model: a streak of both-fail ticks since the last passing tick
            if fired:
                assert actions == (Hold(state.rung, "decided"),)
                assert new == state
                walk(new, streak, True, d + 1)
                continue
            if cls is TickClass.ANY_OK:
                n_streak = 0
            elif cls is TickClass.BOTH_FAIL:
                n_streak = streak + 1
            else:
                n_streak = streak
            shut = [a for a in actions if isinstance(a, Shutdown)]
            want_fire = n_streak >= threshold and cls is TickClass.BOTH_FAIL
            assert bool(shut) == want_fire, (state, cls, actions)
            assert new.rung == min(n_streak, threshold)
            if cls is TickClass.ANY_OK:
                assert actions == ((Recovered(streak),) if streak else ())
            if cls is TickClass.BOTH_FAIL:
                assert actions[0] == Climb(new.rung, threshold)
            if cls is TickClass.INCONCLUSIVE:
                assert actions == (Hold(state.rung, "inconclusive"),)
            walk(new, n_streak, want_fire, d + 1)

    walk(LadderState(), 0, False, 0)
    return checked


@pytest.mark.parametrize("threshold", [1, 2, 3, 10])
def test_exhaustive_up_to_length_12(threshold: int) -> None:
    # 3 + 9 + ... + 3^12 = 797,160 steps per threshold, each checked against the reference model.
    assert _exhaustive(threshold, 12) == sum(3**k for k in range(1, 13))


def test_exactly_threshold_both_fail_ticks_fire_once() -> None:
    s = LadderState()
    fired_at = []
    for i in range(1, 25):
        s, acts = step(s, Observation(FAIL, FAIL), 10)
        if any(isinstance(a, Shutdown) for a in acts):
            fired_at.append(i)
    assert fired_at == [10]


def test_nine_then_recover_resets_without_shutdown() -> None:
    s = LadderState()
    for _ in range(9):
        s, acts = step(s, Observation(FAIL, FAIL), 10)
        assert not any(isinstance(a, Shutdown) for a in acts)
    s, acts = step(s, Observation(FAIL, OK), 10)
    assert acts == (Recovered(9),) and s == LadderState()


def test_grace_holds_instead_of_climbing() -> None:
    s, acts = step(LadderState(rung=3), Observation(FAIL, FAIL, in_grace=True), 10)
    assert s.rung == 3 and acts == (Hold(3, "grace"),)


def test_disarmed_warns_once_then_fires_when_rearmed() -> None:
    s = LadderState()
    warns = 0
    for _ in range(15):
        s, acts = step(s, Observation(FAIL, FAIL, armed=False), 10)
        warns += sum(isinstance(a, WouldShutdown) for a in acts)
        assert not any(isinstance(a, Shutdown) for a in acts)
    assert warns == 1 and s.rung == 10
    s, acts = step(s, Observation(FAIL, FAIL, armed=True), 10)
    assert Shutdown(10, 10) in acts and s.fired


def test_broken_invariants_raise() -> None:
    with pytest.raises(ValueError):
        step(LadderState(), Observation(OK, OK), 0)
    with pytest.raises(ValueError):
        step(LadderState(rung=11), Observation(OK, OK), 10)


verdicts = st.sampled_from([OK, FAIL, UNK])
observations = st.builds(Observation, verdicts, verdicts, st.booleans(), st.booleans())


@given(st.lists(observations, max_size=60), st.integers(1, 12))
def test_properties(obs: list[Observation], threshold: int) -> None:
    s = LadderState()
    streak = 0  # both-fail, non-grace ticks since the last passing tick
    shutdowns = 0
    for o in obs:
        s, acts = step(s, o, threshold)
        cls = classify(o.metadata, o.egress)
        if not s.fired or any(isinstance(a, Shutdown) for a in acts):
            if cls is TickClass.ANY_OK:
                streak = 0
            elif cls is TickClass.BOTH_FAIL and not o.in_grace:
                streak += 1
        n = sum(isinstance(a, Shutdown) for a in acts)
        if n:
            # never a shutdown without `threshold` both-fail ticks since the last pass, armed
            assert streak >= threshold and o.armed and cls is TickClass.BOTH_FAIL
        shutdowns += n
        assert 0 <= s.rung <= threshold
    assert shutdowns <= 1  # never two
    # always one when threshold armed, non-grace both-fail ticks happen in a row
    if not s.fired:
        run = 0
        for o in obs:
            both = classify(o.metadata, o.egress) is TickClass.BOTH_FAIL
            run = run + 1 if both and not o.in_grace and o.armed else 0
            assert run < threshold


def test_step_is_pure_same_input_same_output() -> None:
    for st_, o in itertools.product(
        [LadderState(), LadderState(rung=4), LadderState(rung=10, warned=True)],
        [Observation(a, b) for a in ProbeVerdict for b in ProbeVerdict],
    ):
        assert step(st_, o, 10) == step(st_, o, 10)
    assert ladder.step.__module__ == "gce_watchdog.daemon.ladder"
