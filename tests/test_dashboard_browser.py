"""The dashboard page in a real headless Chromium (Debian's `chromium`), driven by Playwright.

Set RUNBUS_DASHBOARD_SCREENSHOT=docs/dashboard.png to refresh the README's screenshot.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
import redis

from tests.conftest import missing_server
from tests.helpers import run_cli, xadd_event
from tests.test_dashboard_api import HOSTILE, RANKS, RUN, seed_hostile, seed_run, serve

KEYS = ("grad_norm", "loss", "lr", "throughput")
LABELS = [f"rank{i}" for i in range(RANKS)]
TIMEOUT_MS = 15_000


def chromium_path() -> str:
    """Debian's Chromium (RUNBUS_TEST_CHROMIUM to use another); fails under CI=true if absent."""
    path = os.environ.get("RUNBUS_TEST_CHROMIUM") or shutil.which("chromium")
    if not path:
        missing_server("Chromium (Debian's `chromium` package)")
    return path  # type: ignore[return-value]


@pytest.fixture(scope="module")
def browser():
    path = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing_server("the playwright Python package")
        return
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def site(redis_server_url: str, tmp_path_factory) -> Iterator[tuple[str, str, str]]:
    """`runbus serve` over a store holding RUN (4 ranks) and HOSTILE: (base URL, store, Redis)."""
    store_url = f"sqlite:///{tmp_path_factory.mktemp('browser') / 'runbus.db'}"
    with redis.Redis.from_url(redis_server_url) as client:
        client.flushdb()
        seed_run(client)
        seed_hostile(client)
    # In a process of its own: Playwright's event loop owns this thread once the browser is up.
    run_cli("--store", store_url, "ingest", "--redis", redis_server_url, "--burst")
    with serve(store_url, "--redis", redis_server_url) as (url, _):
        yield url, store_url, redis_server_url


@pytest.fixture
def page(browser, site):
    context = browser.new_context(viewport={"width": 1440, "height": 1000}, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    try:
        yield page
        # A CSP violation or a script error shows up here: the page must have none.
        assert problems == []
    finally:
        context.close()


def test_runs_list_shows_states_and_refreshes_live(page, site):
    url, store_url, redis_url = site
    page.goto(url)
    page.wait_for_selector(f"tr.run-row[data-run='{RUN}']")
    row = page.locator(f"tr.run-row[data-run='{RUN}']")
    assert row.locator(".badge").inner_text() == "finished"
    assert row.locator(".chip").all_inner_texts() == LABELS
    assert page.locator(f"tr.run-row[data-run='{HOSTILE}'] .badge.state-running").count() == 1
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, "late-run", "rank0", "start", 1, 1, {"primary": True})
    run_cli("--store", store_url, "ingest", "--redis", redis_url, "--burst")
    page.wait_for_selector("tr.run-row[data-run='late-run'] .badge.state-running")  # no reload
    page.click(f"tr.run-row[data-run='{RUN}'] a.run-link")
    page.wait_for_selector("#metrics .chart")
    assert page.url.endswith(f"#/run/{RUN}")


def test_run_page_has_a_chart_per_key_with_a_line_per_label(page, site, tmp_path):
    url = site[0]
    page.goto(f"{url}#/run/{RUN}")
    page.wait_for_function(
        "() => document.querySelectorAll('#metrics .chart path.line').length === 16"
        " && document.querySelectorAll('#system .chart').length >= 4"
    )
    charts = page.locator("#metrics .chart")
    assert charts.evaluate_all("charts => charts.map(c => c.dataset.key)") == list(KEYS)
    for key in KEYS:
        lines = page.locator(f"#metrics .chart[data-key='{key}'] path.line")
        assert lines.evaluate_all("paths => paths.map(p => p.dataset.label)") == LABELS
    gpu = page.locator("#system .chart[data-key='gpu.util'] path.line")
    assert gpu.evaluate_all("paths => paths.map(p => p.dataset.label)") == LABELS
    assert page.locator(".run-header .badge").inner_text() == "finished"
    assert page.locator("#labels tbody tr").count() == RANKS
    assert page.locator("#labels tr[data-label='rank1'] td.warn").first.inner_text() == "2"  # the gap
    assert "0.0003" in page.locator("#config tr", has_text="optimizer.lr").inner_text()

    page.screenshot(path=str(tmp_path / "run.png"), full_page=True)
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    target = os.environ.get("RUNBUS_DASHBOARD_SCREENSHOT")
    if target:
        page.locator("#metrics .chart[data-key='loss'] .hover-target").hover(position={"x": 300, "y": 80})
        logs = page.locator("#logs").bounding_box()
        height = logs["y"] + logs["height"] + 20
        page.screenshot(path=target, clip={"x": 0, "y": 0, "width": 1440, "height": height}, full_page=True)

    # Hover: a tooltip with one value per label.
    page.locator("#metrics .chart[data-key='loss'] .hover-target").hover(position={"x": 200, "y": 60})
    tooltip = page.locator("#metrics .chart[data-key='loss'] .tooltip")
    tooltip.wait_for(state="visible")
    assert tooltip.locator(".tooltip-name").all_inner_texts() == LABELS
    assert all(float(v) > 0 for v in tooltip.locator(".tooltip-value").all_inner_texts())

    # The legend hides a label on every chart, and shows it again.
    page.click("#metrics .chart[data-key='loss'] .legend-item[data-label='rank1']")
    page.wait_for_function("() => document.querySelectorAll('#metrics path.line').length === 12")
    assert page.locator("path.line[data-label='rank1']").count() == 0
    assert page.locator(".legend-item.off[data-label='rank1']").count() >= len(KEYS)
    page.click("#metrics .chart[data-key='lr'] .legend-item[data-label='rank1']")
    page.wait_for_function("() => document.querySelectorAll('#metrics path.line').length === 16")


def test_logs_filter_by_label_and_level(page, site):
    page.goto(f"{site[0]}#/run/{RUN}")
    page.wait_for_selector("#log-list .log-row")
    rows = page.locator("#log-list .log-row")
    assert set(rows.evaluate_all("rows => rows.map(r => r.dataset.label)")) == set(LABELS)
    page.select_option("#log-label", "rank3")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#log-list .log-row')].every(r => r.dataset.label === 'rank3')"
    )
    assert page.locator("#log-list .log-row").count() == 6 + 5 + 1  # INFO, DEBUG, ERROR
    page.select_option("#log-level", "WARNING")
    page.wait_for_function("() => document.querySelectorAll('#log-list .log-row').length === 1")
    row = page.locator("#log-list .log-row")
    assert row.locator(".log-level").inner_text() == "ERROR"
    text = row.locator(".log-text").text_content()
    assert text == "NCCL watchdog: collective 1812 slow on rank 3\n  retrying"  # kept on two lines
    page.select_option("#log-label", "")
    page.fill("#log-grep", "checkpoint")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#log-list .log-row')].map(r => r.dataset.label).join() === "
        "'rank0'"
    )


def test_strings_from_the_bus_stay_text(page, site):
    page.goto(f"{site[0]}#/run/{HOSTILE}")
    page.wait_for_selector("#log-list .log-row")
    page.wait_for_selector("#metrics .chart path.line")
    texts = page.locator("#log-list .log-text").all_text_contents()
    assert texts == [
        "<script>window.__pwned = 'log'</script>",
        "<img src=x onerror=\"window.__pwned='img'\">",
    ]
    title = page.locator("#metrics .chart .chart-title").first.text_content()
    assert title == "<img src=x onerror=\"window.__pwned='metric'\">"
    assert page.locator("#config td").first.text_content() == "<script>window.__pwned = 'config'</script>"
    assert page.evaluate("window.__pwned") is None
    assert page.evaluate("document.querySelectorAll('script').length") == 1
    assert page.locator("main img").count() == 0


def test_logs_follow_shows_new_lines(page, site):
    url, store_url, redis_url = site
    page.goto(f"{url}#/run/{HOSTILE}")
    page.wait_for_selector("#log-list .log-row")
    page.check("#log-follow")
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(
            client,
            HOSTILE,
            "rank1",
            "log",
            1,
            6,
            {"stream": "stdout", "level": "INFO", "text": "a line written after the page opened"},
        )
    run_cli("--store", store_url, "ingest", "--redis", redis_url, "--burst")
    last = page.locator("#log-list .log-row").last
    last.locator(".log-text", has_text="a line written after the page opened").wait_for()
