"""The VM scenarios' split into shards (e2e/shards.py: assign, parse_shard): every test in
exactly one shard, the same split every time, the load balanced as LPT promises."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kit.paths import REPO

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from e2e import shards

pytestmark = pytest.mark.pure

NAMES = [*shards.COSTS, "test_not_measured_yet", "test_another_new_one"]
ids = st.lists(
    st.builds(
        lambda f, n, p: f"tests/e2e/{f}.py::{n}" + (f"[{p}]" if p else ""),
        st.sampled_from(["test_e2e_scenarios", "test_deb_chroot", "test_e2e_validate"]),
        st.sampled_from(NAMES),
        st.sampled_from(["", "deb", "wheelhouse"]),
    ),
    max_size=20,
)


@given(ids, st.integers(1, 5))
def test_every_test_is_in_exactly_one_shard_in_collection_order(nodeids: list[str], n: int) -> None:
    got = shards.assign(nodeids, n)
    assert len(got) == n
    flat = [x for s in got for x in s]
    unique = list(dict.fromkeys(nodeids))
    assert sorted(flat) == sorted(unique)
    for s in got:
        assert s == [x for x in unique if x in s]


@given(ids, st.integers(1, 5))
def test_the_split_does_not_depend_on_the_collection_order(nodeids: list[str], n: int) -> None:
    a = shards.assign(nodeids, n)
    b = shards.assign(list(reversed(nodeids)), n)
    assert [sorted(s) for s in a] == [sorted(s) for s in b]


@given(ids, st.integers(1, 5))
def test_no_shard_exceeds_the_lightest_by_more_than_one_test(nodeids: list[str], n: int) -> None:
    # LPT: a test goes to the least loaded shard, so the heaviest shard's last test was added
    # when that shard was the lightest.
    got = shards.assign(nodeids, n)
    loads = [sum(shards.cost(x) for x in s) for s in got]
    biggest = max((shards.cost(x) for x in dict.fromkeys(nodeids)), default=0.0)
    assert max(loads) - min(loads) <= biggest


def test_the_measured_tests_split_in_two_about_evenly() -> None:
    # Today's 13 VM tests (14 with deb_chroot's two bakes): neither shard gets over 55 % of it.
    nodeids = [f"tests/e2e/x.py::{n}" for n in shards.COSTS]
    nodeids.append(
        "tests/e2e/x.py::test_bake_image_into_a_tree_gives_an_agent_that_runs_there[wheelhouse]"
    )
    one, two = shards.assign(nodeids, 2)
    total = sum(shards.cost(x) for x in nodeids)
    assert max(sum(map(shards.cost, one)), sum(map(shards.cost, two))) <= 0.55 * total
    assert any("test_validate_wedge" in x for x in one), "the longest goes to the first shard"


def test_a_parameter_costs_what_its_function_costs() -> None:
    assert shards.cost("tests/e2e/t.py::test_healthy_workload_completes") == 270.0
    assert (
        shards.cost("t.py::test_bake_image_into_a_tree_gives_an_agent_that_runs_there[deb]") == 45.0
    )
    assert shards.cost("t.py::test_unknown") == shards.DEFAULT_COST


@pytest.mark.parametrize(
    ("text", "want"), [("1/2", (1, 2)), ("2/2", (2, 2)), ("1/1", (1, 1)), ("3/7", (3, 7))]
)
def test_parse_shard_takes_i_of_n(text: str, want: tuple[int, int]) -> None:
    assert shards.parse_shard(text) == want


@pytest.mark.parametrize("text", ["", "2", "0/2", "3/2", "1/0", "a/b", "1/2/3", "-1/2", " 1/2"])
def test_parse_shard_refuses_what_is_not_i_of_n(text: str) -> None:
    with pytest.raises(ValueError, match="GCEWD_E2E_SHARD"):
        shards.parse_shard(text)


def test_no_shards_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        shards.assign(["a"], 0)
