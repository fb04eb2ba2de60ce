"""The report tells states apart (issue 39, item 5): one word per verdict class, and the HTML
page gives each its own colour. The browser's view: tests/integration/test_report_browser.py."""

from __future__ import annotations

import pytest
from gce_watchdog.report import html
from gce_watchdog.report.model import VERDICT_WORDS, verdict_class
from kit.reports import report_of

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("cls", sorted(VERDICT_WORDS))
def test_each_class_is_told_by_its_word_and_colour(cls: str) -> None:
    r = report_of(cls)
    assert verdict_class(r) == cls, r.verdict
    page = html.render(r, None)
    assert (
        f'<p class="verdict v-{cls}" id="verdict"><span class="badge">{VERDICT_WORDS[cls]}' in page
    )
    others = [w for c, w in VERDICT_WORDS.items() if c != cls]
    assert not any(f'class="badge">{w}<' in page for w in others)


def test_words_and_colours_are_one_per_class() -> None:
    assert set(html.COLOURS) == set(html.TINTS) == set(VERDICT_WORDS)
    assert len(set(VERDICT_WORDS.values())) == len(VERDICT_WORDS)
    assert len(set(html.COLOURS.values())) == len(html.COLOURS)
    assert len(set(html.TINTS.values())) == len(html.TINTS)


def test_a_dry_run_at_10_of_10_is_not_healthy_and_never_a_failover() -> None:
    r = report_of("dry-run")
    assert r.verdict.kind.value == "healthy" and not r.verdict.failover
    assert verdict_class(r) == "dry-run"
