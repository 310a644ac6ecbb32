"""A CI-sized run of the hostile-input campaign (tests/campaign/run_campaign.py): 150 cases over every
category but the CLI, each in its own subprocess. No case may crash, hang or return a wrong result."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "campaign"))
import run_campaign as rc  # noqa: E402

CASES = 150


@pytest.fixture(scope="module")
def records():
    return rc.campaign(CASES, seed=0, jobs=2, timeout=60.0)


def _listing(rs):
    return "\n".join(f"#{r['index']} {r['op']} [{r['what']}]: {r['outcome']}: {r['detail']}" for r in rs)


def test_every_category_ran(records):
    ran = {r["category"] for r in records}
    assert ran == set(rc.CATEGORIES) - {"cli"} and len(records) == CASES


@pytest.mark.parametrize("category", [c for c in rc.CATEGORIES if c != "cli"])
def test_no_crash_hang_or_wrong_result(records, category):
    bad = [r for r in records if r["category"] == category and r["outcome"] in ("crash", "hang", "silently_wrong")]
    assert not bad, _listing(bad)


def test_no_crash_or_hang_anywhere(records):
    bad = [r for r in records if r["outcome"] in ("crash", "hang")]
    assert not bad, _listing(bad)
