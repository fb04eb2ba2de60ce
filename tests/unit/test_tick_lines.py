"""The words of a tick (daemon/tick.py: tick_lines), a pure function, checked exhaustively.

Every ladder input up to threshold 3 (every state, both verdicts, grace, armed) is stepped through
the real ladder, and the lines ``tick_lines`` returns are compared with ``said_before``: the text
``Agent.tick_once`` wrote inline before it was split out (kept here as the oracle, so a change in
what the operator reads fails this test). A table pins each tick text word for word.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest
from gce_watchdog.daemon import ladder
from gce_watchdog.daemon.ladder import LadderState, Observation, ProbeVerdict
from gce_watchdog.daemon.tick import Line, ProbeResult, TickResult, tick_lines, tick_text
from gce_watchdog.wire import vocab

pytestmark = pytest.mark.pure

V = list(ProbeVerdict)


def _pf(r: ProbeResult) -> str:
    return vocab.encode_probe(r.verdict.value, r.reason, r.latency_ms)


def said_before(
    res: TickResult,
    state: LadderState,
    actions: Sequence[ladder.Action],
    thr: int,
    streak: int,
    every: int,
    ticks: int,
    dropped: int,
    why: str,
    rehearsing: bool,
    phase: str,
) -> tuple[int, list[tuple[str, dict[str, Any], str, bool]], str]:
    """The body of tick_once before the split (emit calls recorded, rehearse left out)."""
    out: list[tuple[str, dict[str, Any], str, bool]] = []
    rung = vocab.encode_rung(state.rung, thr)
    healthy = res.metadata.verdict is ProbeVerdict.OK and res.egress.verdict is ProbeVerdict.OK
    drop = {"drop": dropped} if dropped else {}
    for a in actions:
        if isinstance(a, ladder.Recovered):
            out.append(
                (
                    vocab.RECOVERED,
                    {
                        "from": a.from_rung,
                        "rung": rung,
                        "md": res.metadata.verdict,
                        "eg": res.egress.verdict,
                    },
                    f"reachability restored after {a.from_rung}/{thr}",
                    False,
                )
            )
    if not healthy or state.rung > 0:
        streak = 0
        both = any(isinstance(a, ladder.Climb) for a in actions)
        grace = any(isinstance(a, ladder.Hold) and a.why == "grace" for a in actions)
        if both:
            text = f"BOTH reachability probes FAILED ({state.rung}/{thr})"
        elif grace:
            text = "BOTH reachability probes FAILED (boot grace, not counted)"
        elif state.fired:
            text = f"shutdown already decided ({state.rung}/{thr})"
        else:
            text = "one reachability probe failed, ladder holds"
        out.append(
            (
                vocab.TICK,
                {
                    "rung": rung,
                    "md": _pf(res.metadata),
                    "eg": _pf(res.egress),
                    "dns": res.dns,
                    "ph": phase,
                    **drop,
                },
                text,
                False,
            )
        )
    else:
        streak += 1
        if streak % every == 0:
            out.append(
                (
                    vocab.HEARTBEAT,
                    {
                        "rung": rung,
                        "ph": phase,
                        "ticks": ticks,
                        "dns": res.dns,
                        "mdl": res.metadata.latency_ms,
                        "egl": res.egress.latency_ms,
                        "drop": dropped,
                    },
                    "",
                    False,
                )
            )
    md, eg = res.metadata.verdict.value, res.egress.verdict.value
    status = f"rung {rung}, metadata {md}, egress {eg}"
    for a in actions:
        if isinstance(a, ladder.WouldShutdown) and not rehearsing:
            out.append(
                (
                    vocab.WOULD_SHUTDOWN,
                    {"rung": rung, "why": why or "disarmed"},
                    f"disarmed: would shut down ({rung})",
                    True,
                )
            )
    return streak, out, status


def _flat(lines: Sequence[Line]) -> list[tuple[str, dict[str, Any], str, bool]]:
    return [(ln.event, dict(ln.fields), ln.text, ln.sync) for ln in lines]


def _steps() -> list[tuple[int, LadderState, Observation]]:
    out = []
    for thr in (1, 2, 3):
        for rung, fired, warned, md, eg, grace, armed in itertools.product(
            range(thr + 1), (False, True), (False, True), V, V, (False, True), (False, True)
        ):
            out.append((thr, LadderState(rung, fired, warned), Observation(md, eg, grace, armed)))
    return out


def test_every_tick_outcome_says_what_it_said_before() -> None:
    stepped = 0
    outcomes = set()
    for i, (thr, prev, obs) in enumerate(_steps()):
        try:
            state, actions = ladder.step(prev, obs, thr)
        except ValueError:
            continue  # a state the ladder refuses (a broken invariant) is never reached
        stepped += 1
        md = ProbeResult(obs.metadata, "ok" if obs.metadata is ProbeVerdict.OK else "timeout", 7)
        eg = ProbeResult(obs.egress, "x", 9, detail="d")
        res = TickResult(md, eg, ("ok", "fail", "-")[i % 3])
        for streak, every, rehearsing in itertools.product((0, 1, 2, 5), (1, 2, 3), (False, True)):
            dropped, why = (i + streak) % 2 * 3, ("", "disarmed by file")[every % 2]
            reads: list[int] = []

            def phase() -> str:
                reads.append(1)
                return "running"

            got = tick_lines(
                res,
                state,
                actions,
                thr,
                streak=streak,
                heartbeat_every=every,
                ticks=i,
                dropped=dropped,
                why=why,
                rehearsing=rehearsing,
                phase=phase,
            )
            want = said_before(
                res, state, actions, thr, streak, every, i, dropped, why, rehearsing, "running"
            )
            assert (got.streak, _flat(got.lines + got.would), got.status) == want
            # the phase is read once for a line that carries it, never otherwise
            assert len(reads) == sum(ln.event in (vocab.TICK, vocab.HEARTBEAT) for ln in got.lines)
            outcomes.add(tuple(ln.event for ln in got.lines + got.would))
    assert stepped > 500
    # every kind of outcome was met: quiet, heartbeat, tick, recovery, would-shut-down
    assert {(), (vocab.HEARTBEAT,), (vocab.TICK,), (vocab.RECOVERED, vocab.TICK)} <= outcomes
    assert any(vocab.WOULD_SHUTDOWN in o for o in outcomes)
    assert any(o[:1] == (vocab.RECOVERED,) and vocab.TICK not in o for o in outcomes)


@pytest.mark.parametrize(
    ("state", "actions", "text"),
    [
        (LadderState(2), [ladder.Climb(2, 3)], "BOTH reachability probes FAILED (2/3)"),
        (
            LadderState(0),
            [ladder.Hold(0, "grace")],
            "BOTH reachability probes FAILED (boot grace, not counted)",
        ),
        (LadderState(3, fired=True), [ladder.Hold(3, "decided")], "shutdown already decided (3/3)"),
        (
            LadderState(1),
            [ladder.Hold(1, "inconclusive")],
            "one reachability probe failed, ladder holds",
        ),
        (
            LadderState(3, fired=True),
            [ladder.Climb(3, 3), ladder.Shutdown(3, 3)],
            "BOTH reachability probes FAILED (3/3)",
        ),
    ],
)
def test_tick_text_word_for_word(
    state: LadderState, actions: list[ladder.Action], text: str
) -> None:
    assert tick_text(state, actions, 3) == text
