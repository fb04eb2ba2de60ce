"""The metadata trust rule (issue 35 item 6; daemon/mdtrust.py): properties over every input."""

from __future__ import annotations

import pytest
from gce_watchdog.daemon import mdtrust
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.pure

CP = "https://www.googleapis.com/auth/cloud-platform"
RW = "https://www.googleapis.com/auth/compute"
RO = "https://www.googleapis.com/auth/compute.readonly"
OTHER = ["https://www.googleapis.com/auth/logging.write", RO, "x"]
scopes = st.one_of(st.none(), st.lists(st.sampled_from([CP, RW, *OTHER]), max_size=5))
held = st.one_of(
    st.none(), st.lists(st.sampled_from([mdtrust.SET_METADATA, "compute.instances.get"]))
)


@given(scopes, held)
def test_the_local_word_always_trusts(s: list[str] | None, h: list[str] | None) -> None:
    assert mdtrust.decide(True, s, h) == mdtrust.decide(True, None, None)
    assert mdtrust.decide(True, s, h).why == mdtrust.TRUST_LOCAL
    assert mdtrust.not_checked(True).trusted


@given(scopes, held)
def test_trusted_only_when_the_account_cannot_write(
    s: list[str] | None, h: list[str] | None
) -> None:
    t = mdtrust.decide(False, s, h)
    can_write_scope = s is not None and (CP in s or RW in s)
    if s is None:
        assert (t.trusted, t.why) == (False, mdtrust.SCOPES_UNKNOWN)  # fail closed
    elif not can_write_scope:
        assert t.trusted  # the permission check does not matter then
        assert not mdtrust.needs_permission_check(False, s)
    elif h is None:
        assert (t.trusted, t.why) == (False, mdtrust.PERMISSION_UNKNOWN)  # fail closed
    else:
        assert mdtrust.needs_permission_check(False, s)
        assert t.trusted == (mdtrust.SET_METADATA not in h)
    # granting the permission never makes metadata more trusted
    more = mdtrust.decide(False, s, [*(h or []), mdtrust.SET_METADATA])
    assert not (more.trusted and not t.trusted)
    assert t.detail and t.why


def test_each_answer_and_the_state_before_a_check() -> None:
    assert mdtrust.decide(False, [], None).why == mdtrust.NO_SERVICE_ACCOUNT
    assert mdtrust.decide(False, [RO], None).why == mdtrust.NO_WRITE_SCOPE
    no = mdtrust.decide(False, [CP], ["compute.instances.get"])
    assert (no.trusted, no.why) == (True, mdtrust.NO_PERMISSION)
    can = mdtrust.decide(False, [RO, RW], [mdtrust.SET_METADATA])
    assert (can.trusted, can.why) == (False, mdtrust.CAN_WRITE) and "compute" in can.detail
    first = mdtrust.not_checked(False)
    assert (first.trusted, first.why) == (False, mdtrust.NOT_CHECKED)
