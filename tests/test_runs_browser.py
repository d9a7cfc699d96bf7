"""The runs list of a store with 2,000 runs in a real headless Chromium: every run found by a
search or reached page by page, filtered, sorted, the count that of every match (issue #23)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import run_seeds as seeds
from tests.test_dashboard_api import serve
from tests.test_dashboard_browser import CSP_LISTENER, TIMEOUT_MS, browser, page  # noqa: F401 (fixtures)

RUNS = 2000
SEEDED = RUNS - 1  # and one run with a hostile name, in the middle of them by start time
HOSTILE = "odd-run"
HOSTILE_NAME = "50%_off <img src=x onerror=\"window.__pwned='runs'\">"


@pytest.fixture(scope="module")
def many_site(tmp_path_factory) -> Iterator[str]:
    """`runbus serve` over a store of RUNS runs, written straight through the store (seconds,
    where ingesting them through Redis would take minutes): its base URL."""
    store_url = f"sqlite:///{tmp_path_factory.mktemp('many-runs') / 'runbus.db'}"
    middle = seeds.T0 + 1000.5 * seeds.EVERY
    hostile = seeds.special_events(HOSTILE, middle, HOSTILE_NAME, ["<b>tag</b>"], {"model": "odd"})
    seeds.seed_url_now(store_url, SEEDED, hostile)
    with serve(store_url) as (url, _):
        yield url


@pytest.fixture
def context(browser):  # noqa: F811 (the module's browser fixture)
    """A browser context in UTC, so that the date filters' days are the seeds' days."""
    context = browser.new_context(viewport={"width": 1440, "height": 1000}, timezone_id="UTC")
    context.add_init_script(CSP_LISTENER)
    try:
        yield context
    finally:
        context.close()


def wait_text(tab, selector: str, text: str) -> None:
    tab.wait_for_function(
        "([s, t]) => document.querySelector(s) && document.querySelector(s).textContent === t",
        arg=[selector, text],
    )


def shown(tab) -> list[str]:
    return tab.locator("tr.run-row").evaluate_all("rows => rows.map(r => r.dataset.run)")


def span(first: int, last: int) -> str:
    """The pager's text for runs `first` to `last` (an en dash between them) of 2,000."""
    return f"{first:,}\u2013{last:,} of 2,000"


def newest(n: int, skip: int = 0) -> list[str]:
    """The ids of the seeded runs, newest first: n of them after `skip`."""
    return [seeds.run_id(SEEDED - 1 - i) for i in range(skip, skip + n)]


def test_the_page_lists_and_finds_any_of_2000_runs(page, many_site):  # noqa: F811
    page.goto(many_site)
    wait_text(page, "#runs-total", "2,000 runs")
    wait_text(page, "#runs-range", span(1, 50))
    assert shown(page) == newest(50)
    # An old run, found by a part of its id in any case.
    page.fill("#runs-search", "UN-00007")
    wait_text(page, "#runs-total", "1 run matches")
    assert shown(page) == [seeds.run_id(7)]
    page.click(f"tr.run-row[data-run='{seeds.run_id(7)}'] a.run-link")
    page.wait_for_url(f"**#/run/{seeds.run_id(7)}")
    page.go_back()  # the list as it was left: the search in the address
    wait_text(page, "#runs-total", "1 run matches")
    assert page.input_value("#runs-search") == "UN-00007"
    # By name, % and _ as typed; the hostile name stays text.
    page.fill("#runs-search", "50%_")
    wait_text(page, "#runs-total", "1 run matches")
    assert page.locator(f"tr.run-row[data-run='{HOSTILE}'] .run-name").text_content() == HOSTILE_NAME
    assert page.locator(f"tr.run-row[data-run='{HOSTILE}'] .chip.tag").text_content() == "<b>tag</b>"
    page.fill("#runs-search", "no such run")
    wait_text(page, "#runs-total", "0 runs match")
    assert page.locator("#runs-empty").text_content() == "No runs match."
    # Cleared: the last page holds the oldest runs.
    page.fill("#runs-search", "")
    wait_text(page, "#runs-total", "2,000 runs")
    page.click("#runs-last")
    wait_text(page, "#runs-range", span(1_951, 2_000))
    assert shown(page) == [seeds.run_id(i) for i in range(49, -1, -1)]
    assert page.is_disabled("#runs-next") and page.is_disabled("#runs-last")
    page.click("#runs-prev")
    wait_text(page, "#runs-range", span(1_901, 1_950))
    page.click("#runs-first")
    wait_text(page, "#runs-range", span(1, 50))
    assert page.is_disabled("#runs-prev")
    assert page.evaluate("window.__pwned") is None and page.locator("main img").count() == 0


def test_filters_and_sorting_from_the_page_and_the_address(page, many_site):  # noqa: F811
    page.goto(many_site)
    wait_text(page, "#runs-total", "2,000 runs")
    page.select_option("#runs-state", "failed")
    failed = len([i for i in range(SEEDED) if i % 3 == 1])
    wait_text(page, "#runs-total", f"{failed:,} runs match")
    page.select_option("#runs-state", "")
    # Runs started on 2 January 2026 (UTC): 24 to 47.
    page.fill("#runs-since", "2026-01-02")
    page.fill("#runs-until", "2026-01-02")
    wait_text(page, "#runs-total", "24 runs match")
    assert shown(page) == [seeds.run_id(i) for i in range(47, 23, -1)]
    page.fill("#runs-since", "")
    page.fill("#runs-until", "")
    wait_text(page, "#runs-total", "2,000 runs")
    # By id, A to Z (odd-run before run-…), then Z to A.
    page.click("th[data-sort='id'] button")
    page.wait_for_function("() => document.querySelector('tr.run-row').dataset.run === 'odd-run'")
    assert page.get_attribute("th[data-sort='id']", "aria-sort") == "ascending"
    assert shown(page)[1:3] == [seeds.run_id(0), seeds.run_id(1)]
    page.click("th[data-sort='id'] button")
    page.wait_for_function(
        f"() => document.querySelector('tr.run-row').dataset.run === '{seeds.run_id(SEEDED - 1)}'"
    )
    assert page.get_attribute("th[data-sort='id']", "aria-sort") == "descending"
    # The address holds the question: a reload (or a link) shows the same list.
    page.click("#runs-next")
    wait_text(page, "#runs-range", span(51, 100))
    assert "sort=id" in page.url and "offset=50" in page.url
    page.reload()
    wait_text(page, "#runs-range", span(51, 100))
    assert shown(page)[0] == seeds.run_id(SEEDED - 51)
    page.goto(many_site + "#/?q=trial%2042&state=finished&sort=started&order=asc")
    wait_text(page, "#runs-total", "7 runs match")
    assert shown(page) == [seeds.run_id(i) for i in (42, 342, 642, 942, 1242, 1542, 1842)]
    # What an address written by hand holds that the API would refuse is left out, not a 400.
    page.goto(many_site + "#/?q=run-0000&sort=color&order=up&limit=7&offset=-1&state=paused")
    wait_text(page, "#runs-total", "10 runs match")
    assert shown(page) == [seeds.run_id(i) for i in range(9, -1, -1)]


def test_every_run_is_reached_page_by_page(page, many_site):  # noqa: F811
    page.goto(many_site)
    page.select_option("#runs-limit", "200")
    wait_text(page, "#runs-range", span(1, 200))
    reached: list[str] = []
    for offset in range(0, RUNS, 200):
        wait_text(page, "#runs-range", span(offset + 1, offset + 200))
        reached += shown(page)
        if offset + 200 < RUNS:
            page.click("#runs-next")
    assert page.is_disabled("#runs-next")
    assert len(reached) == RUNS and set(reached) == {*map(seeds.run_id, range(SEEDED)), HOSTILE}


def test_a_question_the_api_refuses_says_why(context, many_site):
    tab = context.new_page()  # not the `page` fixture: this page's one 400 is what it tests
    tab.set_default_timeout(TIMEOUT_MS)
    tab.goto(many_site + "#/?since=whenever")
    tab.wait_for_selector("#runs-empty:not([hidden])")
    assert (
        tab.locator("#runs-empty").text_content().startswith("Cannot list these runs: not a time: 'whenever'")
    )
    assert shown(tab) == []
    tab.fill("#runs-since", "2026-01-02")  # a date from the page replaces it
    wait_text(tab, "#runs-total", f"{SEEDED - 24 + 1:,} runs match")  # runs 24 on, and the hostile one
    assert tab.locator("#runs-empty").is_hidden() and shown(tab)[0] == seeds.run_id(SEEDED - 1)
