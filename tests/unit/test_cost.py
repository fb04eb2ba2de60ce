"""What it cost (poller/cost.py): synthetic timelines against hand computations, a job with two
failovers summing its boots without double counting, the GPU table, and the union properties."""

from __future__ import annotations

import pytest
from gce_watchdog.poller.cost import (
    CATEGORIES,
    BootFacts,
    Cost,
    boot_cost,
    boot_facts,
    boot_intervals,
    gpu_count,
    job_cost,
    measure,
    union,
    with_deletion,
)
from gce_watchdog.wire.protocol import Event
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

T0 = 1_700_000_000.0  # seconds; every timeline below is T0 + a few hand-picked offsets


def ev(name: str, at_s: float, boot: str = "b1", seq: int = 0, **fields: str) -> Event:
    return Event(name, boot, seq, int((T0 + at_s) * 1000), tuple(fields.items()))


# --- hand-computed timelines ---------------------------------------------------------------


def test_a_clean_finish_is_all_useful_but_the_tail() -> None:
    # start at 0, progress until 3000 s, result at 3600 s, last line (exit) at 3610 s; the API
    # says TERMINATED at 3640 s; reaped (deleted) at 3700 s. a2-highgpu-1g: 1 GPU.
    lines = [
        ev("start", 0),
        ev("progress", 3000, step="9000"),
        ev("result", 3600, status="ok"),
        ev("exit", 3610, rc="0"),
    ]
    f = boot_facts("i-1", lines, stopped=T0 + 3640, gpus=gpu_count("a2-highgpu-1g"))
    assert f is not None
    c = boot_cost(with_deletion(f, T0 + 3700))
    assert c == Cost(billed=3640, useful=3600, ladder=0, linger=0, zombie=60, gpu=3640)


def test_a_wedge_has_ladder_linger_and_zombie() -> None:
    # progress until 1000 s; rungs fail from 1200 s (after a healthy rung 0 at 1170 s); shutdown
    # decided at 1290 s; the linger repeats it until 1350 s; TERMINATED at 1360 s; deleted at
    # 1500 s. a3-highgpu-8g: 8 GPUs.
    lines = [
        ev("start", 0),
        ev("progress", 1000, step="10"),
        ev("tick", 1170, rung="0/4"),
        ev("tick", 1200, rung="1/4"),
        ev("tick", 1230, rung="2/4"),
        ev("tick", 1260, rung="3/4"),
        ev("shutdown", 1290, rung="4/4"),
        ev("shutdown", 1320, rep="1"),
        ev("shutdown", 1350, rep="2"),
    ]
    f = boot_facts("i-1", lines, stopped=T0 + 1360, gpus=gpu_count("a3-highgpu-8g"))
    assert f is not None
    assert (f.ladder_start, f.final, f.useful_end) == (T0 + 1200, T0 + 1290, T0 + 1000)
    c = boot_cost(with_deletion(f, T0 + 1500))
    # billed 0..1360; useful 0..1000; ladder 1200..1290; linger 1290..1360; zombie 1360..1500
    assert c == Cost(billed=1360, useful=1000, ladder=90, linger=70, zombie=140, gpu=1360 * 8)


def test_a_preempted_boot_has_no_ladder_and_its_start_is_the_apis() -> None:
    # GCE started the VM at -40 s (the agent's first line at 0); progress until 500 s; preempted
    # line at 520 s; TERMINATED at 550 s; never deleted (still there). g2-standard-24: 2 L4.
    lines = [ev("start", 0), ev("progress", 500, step="5"), ev("preempted", 520)]
    gpus = gpu_count("g2-standard-24")
    f = boot_facts("i-1", lines, started=T0 - 40, stopped=T0 + 550, gpus=gpus)
    assert f is not None
    assert boot_cost(f) == Cost(billed=590, useful=540, ladder=0, linger=0, zombie=0, gpu=1180)


def test_a_guest_clock_ahead_is_capped_by_the_readers_receipt() -> None:
    # the guest's clock runs 1000 s ahead: its lines say 0..2000 s but the reader received the
    # newest at 1100 s; no line can have been written after it was read
    lines = [ev("start", 0), ev("progress", 1500), ev("tick", 2000, rung="0/4")]
    f = boot_facts("i-1", lines, last_rx=T0 + 1100)
    assert f is not None
    assert (f.start, f.end, f.useful_end) == (T0, T0 + 1100, T0 + 1100)


def test_a_recovery_resets_the_ladder() -> None:
    lines = [
        ev("tick", 10, rung="1/4"),
        ev("tick", 20, rung="2/4"),
        ev("recovered", 30),
        ev("job_stuck", 50),
        ev("tick", 60, rung="1/4"),
    ]
    f = boot_facts("i-1", lines)
    assert f is not None and f.ladder_start == T0 + 50


def test_a_job_with_two_failovers_sums_its_boots_without_double_counting() -> None:
    # instance A boot a1: 0..1000, wedged (ladder 800..900, linger 900..1000), deleted at 1200;
    # instance B boot b1: 1100..2000 preempted (useful to 1900), deleted 2050;
    # instance C boot c1: 2100..3000 clean (useful to 2990), deleted 3010. 1 GPU each.
    a1 = BootFacts("A", "a1", T0, T0 + 1000, T0 + 700, T0 + 800, T0 + 900, T0 + 1200, gpus=1)
    b1 = BootFacts("B", "b1", T0 + 1100, T0 + 2000, T0 + 1900, None, None, T0 + 2050, gpus=1)
    c1 = BootFacts("C", "c1", T0 + 2100, T0 + 3000, T0 + 2990, None, None, T0 + 3010, gpus=1)
    want = Cost(
        billed=1000 + 900 + 900,
        useful=700 + 800 + 890,
        ladder=100,
        linger=100,
        zombie=200 + 50 + 10,
        gpu=1000 + 900 + 900,
    )
    assert job_cost([a1, b1, c1]) == want
    # A's VM overlaps B's (A is off at 1000, B on at 1100: no overlap) and two machines billed
    # at once add up; the same boot recorded twice (two pollers, two sources) adds nothing
    assert job_cost([a1, b1, c1, a1, c1]) == want
    assert job_cost([a1, b1, c1]) == boot_cost(a1) + boot_cost(b1) + boot_cost(c1)


def test_two_records_of_one_boot_merge_as_a_union() -> None:
    # one poller saw the boot until 600 s, another (later) until 1000 s: 1000 s, not 1600 s
    early = BootFacts("A", "a1", T0, T0 + 600, gpus=2)
    late = BootFacts("A", "a1", T0, T0 + 1000, gpus=2)
    assert job_cost([early, late]) == Cost(billed=1000, gpu=2000)


# --- the GPU table -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("machine_type", "want"),
    [
        ("a2-highgpu-1g", 1),
        ("a2-megagpu-16g", 16),
        ("a2-ultragpu-8g", 8),
        ("a3-highgpu-8g", 8),
        ("a3-megagpu-8g", 8),
        ("a4-highgpu-8g", 8),
        ("g2-standard-4", 1),
        ("g2-standard-48", 4),
        ("zones/us-central1-a/machineTypes/a3-highgpu-4g", 4),
        ("n1-standard-8", 0),
        ("e2-medium", 0),
        ("", 0),
    ],
)
def test_the_machine_types_gpus(machine_type: str, want: int) -> None:
    assert gpu_count(machine_type) == want


def test_guest_accelerators_win() -> None:
    accel = [{"acceleratorType": "zones/z/acceleratorTypes/nvidia-tesla-t4", "acceleratorCount": 2}]
    assert gpu_count("n1-standard-8", accel) == 2
    assert gpu_count("a2-highgpu-1g", [{"acceleratorCount": 1}, {"acceleratorCount": 1}]) == 2


def test_facts_round_trip_through_json() -> None:
    f = BootFacts("A", "a1", T0, T0 + 9, T0 + 1, T0 + 2, T0 + 3, T0 + 4, 8, "a3-highgpu-8g")
    assert BootFacts.from_json(f.to_json()) == f
    assert BootFacts.from_json({**f.to_json(), "new": 1}) == f


# --- properties ----------------------------------------------------------------------------

offsets = st.floats(min_value=0, max_value=100_000, allow_nan=False)
maybe = st.one_of(st.none(), offsets)


@st.composite
def facts(draw: st.DrawFn, instances: tuple[str, ...] = ("A", "B", "C")) -> BootFacts:
    start = draw(offsets)
    end = T0 + start + draw(offsets)
    useful, ladder, final = (None if x is None else T0 + x for x in (draw(maybe) for _ in "123"))
    deleted = draw(maybe)
    return BootFacts(
        draw(st.sampled_from(instances)),
        draw(st.sampled_from(("b1", "b2"))),
        T0 + start,
        end,
        useful,
        ladder,
        final,
        None if deleted is None else end + deleted,
        draw(st.integers(0, 16)),
    )


@given(st.lists(st.tuples(offsets, offsets)))
def test_the_measure_is_the_measure_of_the_union(spans: list[tuple[float, float]]) -> None:
    ivs = [(T0 + a, T0 + a + b) for a, b in spans]
    u = union(ivs)
    assert all(a < b for a, b in u)
    assert all(u[i][1] < u[i + 1][0] for i in range(len(u) - 1))  # disjoint, sorted
    assert measure(ivs) == pytest.approx(sum(b - a for a, b in u))
    # every point of an input is covered by the union, and the union is no larger than the sum
    assert all(any(c <= a and b <= d for c, d in u) for a, b in ivs if b > a)
    assert measure(ivs) <= sum(b - a for a, b in ivs) + 1e-6


@given(facts())
def test_each_category_is_within_billed(f: BootFacts) -> None:
    c = boot_cost(f)
    for cat in ("useful", "ladder", "linger"):
        assert 0 <= getattr(c, cat) <= c.billed + 1e-6
    assert c.ladder + c.linger <= c.billed + 1e-6  # the decision splits them: never overlap
    assert c.gpu == pytest.approx(c.billed * f.gpus)
    iv = boot_intervals(f)
    total = measure(iv["billed"] + iv["zombie"])
    assert total == pytest.approx(c.billed + c.zombie)  # billed and zombie never overlap


@given(st.lists(facts(), min_size=1, max_size=8))
def test_a_job_is_the_union_per_instance(boots: list[BootFacts]) -> None:
    c = job_cost(boots)
    instances = {b.instance for b in boots}

    def per_instance(*cats: str) -> float:
        return sum(
            measure(
                iv
                for b in boots
                if b.instance == i
                for cat in cats
                for iv in boot_intervals(b)[cat]
            )
            for i in instances
        )

    for cat in ("billed", "useful", "ladder", "linger"):
        assert getattr(c, cat) == pytest.approx(per_instance(cat))
    # billed and zombie never share a second: together, the measure of their union
    assert c.billed + c.zombie == pytest.approx(per_instance("billed", "zombie"))
    for cat in CATEGORIES:
        # never more than the boots' own sum (equal when nothing overlaps)
        assert getattr(c, cat) <= sum(getattr(boot_cost(b), cat) for b in boots) + 1e-3
    assert job_cost(boots + boots) == c  # a boot recorded twice adds nothing
    assert c.gpu <= sum(boot_cost(b).gpu for b in boots) + 1e-3
