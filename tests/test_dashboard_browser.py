"""The dashboard page in a real headless Chromium (Debian's `chromium`), driven by Playwright.

Charts are canvases (uPlot): what a chart draws is read from its figure's `chart.describe()`
(the plan handed to uPlot and the data it holds), never from pixels.

Set RUNBUS_DASHBOARD_SCREENSHOTS=docs to refresh the README's screenshots (dashboard.png, the
run page of a many-label run; stragglers.png; compare.png).
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import orjson
import pytest
import redis

from runbus.terminal import printable
from tests import dashboard_seeds as seeds
from tests.conftest import missing_server
from tests.helpers import run_cli, xadd_event
from tests.test_dashboard_api import HOSTILE, HOSTILE_META, RANKS, RUN, STEPS, seed_hostile, seed_run, serve

KEYS = ("grad_norm", "loss", "lr", "throughput")
LABELS = [f"rank{i}" for i in range(RANKS)]
TIMEOUT_MS = 15_000
REFRESH_LIMIT = 24  # panels fetched per refresh at most (dashboard/static/js/panels.js)

# Every Content-Security-Policy violation, kept where the test can read it.
CSP_LISTENER = """
window.__csp = [];
document.addEventListener('securitypolicyviolation',
  (e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));
"""


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
    """`runbus serve` over a store holding RUN (4 ranks), HOSTILE and the runs of
    tests/dashboard_seeds.py: (base URL, store, Redis)."""
    store_url = f"sqlite:///{tmp_path_factory.mktemp('browser') / 'runbus.db'}"
    with redis.Redis.from_url(redis_server_url) as client:
        client.flushdb()
        seed_run(client)
        seed_hostile(client)
        seeds.seed_sweep(client)
        seeds.seed_sweep(client, seeds.SWEEP_FAST, ranks=8, rate=1.6)
        seeds.seed_stepped(client)
        seeds.seed_wide(client)
        seeds.seed_hostile_hardware(client)
    # In a process of its own: Playwright's event loop owns this thread once the browser is up.
    run_cli("--store", store_url, "ingest", "--redis", redis_server_url, "--burst")
    with serve(store_url, "--redis", redis_server_url) as (url, _):
        yield url, store_url, redis_server_url


@pytest.fixture
def context(browser):
    context = browser.new_context(
        viewport={"width": 1440, "height": 1000}, device_scale_factor=1, accept_downloads=True
    )
    context.add_init_script(CSP_LISTENER)
    try:
        yield context
    finally:
        context.close()


@pytest.fixture
def page(context):
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    page.on(
        "response",
        lambda response: (
            problems.append(f"{response.status} {response.url}") if response.status >= 400 else None
        ),
    )
    yield page
    # A CSP violation or a script error shows up here: the page must have none.
    assert problems == []
    if not page.is_closed():
        assert page.evaluate("window.__csp") == []


def chart(kind: str, key: str) -> str:
    """The selector of the chart of `key` in the card `kind` (metrics, system)."""
    quoted = key.replace("\\", "\\\\").replace('"', '\\"')
    return f'#{kind} .chart[data-key="{quoted}"]'


def drawn(page, selector: str, wait: str = "true") -> dict:
    """What the chart at `selector` draws, once it holds data and `wait` (JS over `d`) holds.
    Charts are fetched only in view: its card, then the chart, are scrolled to."""
    page.locator(selector.split(" ")[0]).scroll_into_view_if_needed()
    page.locator(selector).scroll_into_view_if_needed()
    page.wait_for_function(
        f"""() => {{
            const f = document.querySelector({orjson.dumps(selector).decode()});
            const d = f && f.chart && f.chart.u && f.chart.describe();
            return d && ({wait});
        }}"""
    )
    return page.eval_on_selector(selector, "f => f.chart.describe()")


def lines_of(description: dict) -> list[dict]:
    return [s for s in description["series"] if s["role"] == "line"]


def same_values(drawn_values: list, logged: list) -> bool:
    """The values a chart drew are those logged, to the 7 significant digits chart data carries."""
    return len(drawn_values) == len(logged) and all(
        (a is None and b is None) or (a is not None and b is not None and a == pytest.approx(b, rel=1e-6))
        for a, b in zip(drawn_values, logged, strict=True)
    )


def api_json(url: str, path: str) -> dict:
    from urllib.request import urlopen

    with urlopen(url + path.lstrip("/")) as response:
        return orjson.loads(response.read())


# -- the runs list ------------------------------------------------------------------------------


def test_runs_list_shows_states_and_refreshes_live(page, site):
    url, store_url, redis_url = site
    page.goto(url)
    page.wait_for_selector(f"tr.run-row[data-run='{RUN}']")
    row = page.locator(f"tr.run-row[data-run='{RUN}']")
    assert row.locator(".badge").inner_text() == "finished"
    assert row.locator(".chip").all_inner_texts() == LABELS
    assert page.locator(f"tr.run-row[data-run='{HOSTILE}'] .badge.state-running").count() == 1
    hostile = page.locator(f"tr.run-row[data-run='{HOSTILE}']")
    assert hostile.locator(".run-name").text_content() == HOSTILE_META["name"]
    assert hostile.locator(".chip.tag").all_text_contents() == HOSTILE_META["tags"]
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, "late-run", "rank0", "start", 1, 1, {"primary": True})
    run_cli("--store", store_url, "ingest", "--redis", redis_url, "--burst")
    page.wait_for_selector("tr.run-row[data-run='late-run'] .badge.state-running")  # no reload
    page.click(f"tr.run-row[data-run='{RUN}'] a.run-link")
    page.wait_for_selector("#metrics .chart canvas")
    assert page.url.endswith(f"#/run/{RUN}")


# -- a run with a few labels: a line each -----------------------------------------------------------


def test_run_page_has_a_chart_per_key_with_a_line_per_label(page, site):
    url = site[0]
    page.goto(f"{url}#/run/{RUN}")
    for key in KEYS:
        description = drawn(page, chart("metrics", key))
        assert [s["label"] for s in lines_of(description)] == LABELS
        assert description["xKind"] == "step" and description["rows"] >= STEPS
    assert page.locator("#metrics .chart").evaluate_all("cs => cs.map(c => c.dataset.key)") == list(KEYS)
    # The values drawn are the logged ones, point for point (NaN and infinities leave holes).
    api = api_json(url, f"/api/runs/{RUN}/metrics/series?key=grad_norm")
    grad = drawn(page, chart("metrics", "grad_norm"))
    for series, line in zip(api["series"], lines_of(grad), strict=True):
        expected = [row[1] if isinstance(row[1], float) else None for row in series["data"]]
        assert same_values(line["values"], expected)
    marks = grad["marks"]["nonFinite"]
    assert {(m["label"], m["x"], m["what"]) for m in marks} == {
        ("rank1", 200, "NaN"),
        ("rank3", 250, "Infinity"),
    }
    gpu = drawn(page, chart("system", "gpu.util"))
    assert [s["label"] for s in lines_of(gpu)] == LABELS and gpu["xKind"] == "wall"
    assert page.locator(".run-header .badge").inner_text() == "finished"
    assert page.locator("#labels tbody tr").count() == RANKS
    assert page.locator("#labels tr[data-label='rank1'] td.warn").first.inner_text() == "2"  # the gap
    assert "0.0003" in page.locator("#config tr", has_text="optimizer.lr").inner_text()

    # Hover: a tooltip with one value per label.
    page.locator(chart("metrics", "loss")).scroll_into_view_if_needed()
    page.locator(f"{chart('metrics', 'loss')} .u-over").hover(position={"x": 200, "y": 60})
    tooltip = page.locator(f"{chart('metrics', 'loss')} .tooltip")
    tooltip.wait_for(state="visible")
    assert tooltip.locator(".tooltip-name").all_inner_texts() == LABELS
    assert all(float(v) > 0 for v in tooltip.locator(".tooltip-value").all_inner_texts())

    # The legend hides a label on every chart, and shows it again.
    page.click(f"{chart('metrics', 'loss')} .legend-item[data-label='rank1']")
    for key in KEYS:
        labels = [s["label"] for s in lines_of(drawn(page, chart("metrics", key)))]
        assert labels == ["rank0", "rank2", "rank3"]
    assert page.locator(".legend-item.off[data-label='rank1']").count() >= len(KEYS)
    page.click(f"{chart('metrics', 'lr')} .legend-item[data-label='rank1']")
    assert len(lines_of(drawn(page, chart("metrics", "loss")))) == RANKS


def test_label_colours_are_the_same_on_every_load(context, page, site):
    url = site[0]

    def colours(target) -> dict[str, str]:
        target.goto(f"{url}#/run/{RUN}")
        description = drawn(target, chart("metrics", "loss"))
        table = target.locator("#labels tbody tr").evaluate_all(
            "rows => rows.map(r => [r.dataset.label,"
            " getComputedStyle(r.querySelector('.swatch')).backgroundColor])"
        )
        drawn_colours = {s["label"]: s["color"] for s in lines_of(description)}
        assert len(set(drawn_colours.values())) == RANKS  # one each
        return {"chart": drawn_colours, "table": dict(table)}

    first = colours(page)
    page.reload()
    assert colours(page) == first
    # Another tab, the labels met in another order (the sweep lists rank10 before rank2): the same.
    other = context.new_page()
    try:
        other.goto(f"{url}#/run/{seeds.SWEEP}")
        other.wait_for_selector("#labels tbody tr[data-label='rank0']")
        table = dict(
            other.locator("#labels tbody tr").evaluate_all(
                "rows => rows.map(r => [r.dataset.label,"
                " getComputedStyle(r.querySelector('.swatch')).backgroundColor])"
            )
        )
        assert {label: table[label] for label in LABELS} == first["table"]
    finally:
        other.close()
    assert colours(page) == first


def test_zoom_is_shared_by_every_chart_and_reset_by_a_double_click(page, site):
    page.goto(f"{site[0]}#/run/{RUN}")
    for key in KEYS:
        assert drawn(page, chart("metrics", key))["xRange"] == [0, STEPS - 1]
    over = page.locator(f"{chart('metrics', 'loss')} .u-over")
    box = over.bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.25, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.4, y, steps=5)
    page.mouse.move(box["x"] + box["width"] * 0.5, y, steps=5)
    page.mouse.up()
    zoomed = drawn(page, chart("metrics", "loss"), "d.xRange[1] - d.xRange[0] < 200")["xRange"]
    assert 50 < zoomed[0] < 100 and 120 < zoomed[1] < 170
    for key in KEYS:
        assert drawn(page, chart("metrics", key))["xRange"] == zoomed
    # System charts are by time: another x, left alone.
    assert (
        drawn(page, chart("system", "gpu.util"))["xRange"][1]
        - drawn(page, chart("system", "gpu.util"))["xRange"][0]
        > 500
    )
    page.locator(f"{chart('metrics', 'lr')} .u-over").dblclick()
    for key in KEYS:
        assert drawn(page, chart("metrics", key), "d.xRange[1] === 299")["xRange"] == [0, STEPS - 1]


def test_smoothing_and_log_scale_change_what_is_drawn(page, site):
    page.goto(f"{site[0]}#/run/{RUN}")
    raw = {s["label"]: s["values"] for s in lines_of(drawn(page, chart("metrics", "loss")))}
    page.eval_on_selector(
        "#smoothing", "s => { s.value = '0.9'; s.dispatchEvent(new Event('input', { bubbles: true })); }"
    )
    smooth = drawn(page, chart("metrics", "loss"), "d.series.some(s => s.role === 'raw')")
    behind = {s["label"]: s["values"] for s in smooth["series"] if s["role"] == "raw"}
    assert behind == raw  # the raw line stays, faint, behind
    faint = [s["stroke"] for s in smooth["series"] if s["role"] == "raw"]
    assert all(stroke.startswith("rgba(") and stroke.endswith(",0.22)") for stroke in faint)
    for line in lines_of(smooth):
        # TensorBoard's debiased EMA.
        last, expected = 0.0, []
        for i, value in enumerate(raw[line["label"]], start=1):
            last = last * 0.9 + 0.1 * value
            expected.append(last / (1 - 0.9**i))
        assert line["values"] == pytest.approx(expected)
    page.eval_on_selector(
        "#smoothing", "s => { s.value = '0'; s.dispatchEvent(new Event('input', { bubbles: true })); }"
    )
    assert "raw" not in {
        s["role"]
        for s in drawn(page, chart("metrics", "loss"), "!d.series.some(s => s.role === 'raw')")["series"]
    }

    assert drawn(page, chart("metrics", "grad_norm"))["distr"] == 1
    page.click(f"{chart('metrics', 'grad_norm')} .chart-log")
    logged = drawn(page, chart("metrics", "grad_norm"), "d.distr === 3")
    assert logged["log"] is True
    assert drawn(page, chart("metrics", "loss"))["distr"] == 1  # one chart's choice
    page.reload()  # kept for the next load
    assert drawn(page, chart("metrics", "grad_norm"), "d.distr === 3")["log"] is True
    page.click(f"{chart('metrics', 'grad_norm')} .chart-log")
    drawn(page, chart("metrics", "grad_norm"), "d.distr === 1")


def test_the_x_axis_by_step_wall_time_or_time_since_the_start(page, site):
    url = site[0]
    page.goto(f"{url}#/run/{RUN}")
    run = api_json(url, f"/api/runs/{RUN}")
    assert drawn(page, chart("system", "gpu.util"))["xKind"] == "wall"
    page.click("#x-mode .segment[data-mode='relative']")
    relative = drawn(page, chart("system", "gpu.util"), "d.xKind === 'relative'")
    first_sample = api_json(url, f"/api/runs/{RUN}/system?key=gpu.0.util")["keys"][0]["series"][0]["data"][0][
        0
    ]
    # System charts read rollups over ts in whole seconds: the first sample's second.
    assert relative["xRange"][0] == pytest.approx(math.floor(first_sample) - run["started_ts"])
    assert page.locator("#x-mode .segment[data-mode='relative']").get_attribute("aria-pressed") == "true"
    # Metrics logged with a step are asked for again, by time.
    loss = drawn(page, chart("metrics", "loss"), "d.xKind === 'relative'")
    assert loss["xRange"][0] == pytest.approx(2.0, abs=0.02)  # the first step, 2 s after the start
    assert [s["label"] for s in lines_of(loss)] == LABELS
    page.reload()
    assert drawn(page, chart("system", "gpu.util"), "d.xKind === 'relative'")
    page.click("#x-mode .segment[data-mode='step']")
    drawn(page, chart("system", "gpu.util"), "d.xKind === 'wall'")


def test_csv_and_png_exports(page, site):
    url = site[0]
    page.goto(f"{url}#/run/{RUN}")
    drawn(page, chart("metrics", "loss"))
    with page.expect_download() as download:
        page.click(f"{chart('metrics', 'loss')} .chart-csv")
    assert download.value.suggested_filename == "loss.csv"
    rows = list(csv.reader(io.StringIO(Path(download.value.path()).read_text())))
    assert rows[0] == ["step", *LABELS]
    api = api_json(url, f"/api/runs/{RUN}/metrics/series?key=loss")
    assert len(rows) == 1 + STEPS
    for column, series in enumerate(api["series"], start=1):
        assert same_values([float(row[column]) for row in rows[1:]], [point[1] for point in series["data"]])
    assert [int(row[0]) for row in rows[1:]] == list(range(STEPS))

    with page.expect_download() as download:
        page.click(f"{chart('metrics', 'loss')} .chart-png")
    assert download.value.suggested_filename == "loss.png"
    assert Path(download.value.path()).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- many labels, many keys --------------------------------------------------------------------------


def test_many_labels_draw_the_envelope_with_outliers_and_chosen_labels(page, site):
    url = site[0]
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url) if "/metrics/" in r.url else None)
    page.goto(f"{url}#/run/{seeds.SWEEP}")
    loss = drawn(page, chart("metrics", "train/loss"))
    roles = [s["role"] for s in loss["series"]]
    assert {"median", "p10", "p90", "min", "max"} <= set(roles)
    outliers = [s["label"] for s in lines_of(loss)]
    assert seeds.OUTLIER in outliers and len(outliers) == 3
    median = next(s for s in loss["series"] if s["role"] == "median")["values"]
    lowest = next(s for s in loss["series"] if s["role"] == "min")["values"]
    highest = next(s for s in loss["series"] if s["role"] == "max")["values"]
    assert all(lo <= m <= hi for lo, m, hi in zip(lowest, median, highest, strict=True))
    # The median at step 0, from the labels' own values.
    at_zero = sorted(seeds.sweep_metrics(rank, 0)["train/loss"] for rank in range(seeds.SWEEP_RANKS))
    assert at_zero[11] - 1e-6 <= median[0] <= at_zero[12] + 1e-6  # a median of 24 values
    assert (
        page.locator(
            f"{chart('metrics', 'train/loss')} .legend-item.outlier[data-label='{seeds.OUTLIER}']"
        ).count()
        == 1
    )

    # Any label on by a click in the labels table, on every chart; off again. Labels turned on
    # come in the chart's envelope request (one per chart, whatever their number), each in its
    # own colour, with every value it logged.
    page.click("#labels tr[data-label='rank9'] .label-toggle")
    page.click("#labels tr[data-label='rank10'] .label-toggle")
    shown = drawn(
        page,
        chart("metrics", "train/loss"),
        "['rank9', 'rank10'].every(l => d.series.some(s => s.label === l))",
    )
    assert "rank9" in [s["label"] for s in lines_of(shown)]
    asked = [
        parse_qs(urlsplit(u).query)
        for u in requests
        if "/metrics/envelope" in u and parse_qs(urlsplit(u).query)["key"] == ["train/loss"]
    ]
    assert {"rank9", "rank10"} <= set(asked[-1]["label"]) and len(asked[-1]["label"]) == 2
    assert not [u for u in requests if "/metrics/series" in u]
    rank9 = [s for s in lines_of(shown) if s["label"] == "rank9"]
    logged = [seeds.sweep_metrics(9, step)["train/loss"] for step in range(seeds.SWEEP_STEPS)]
    assert len(rank9) == 1 and same_values(rank9[0]["values"], logged)
    swatch = page.eval_on_selector(
        "#labels tr[data-label='rank9'] .swatch", "s => getComputedStyle(s).backgroundColor"
    )
    assert swatch == "rgb({}, {}, {})".format(*(int(rank9[0]["color"][i : i + 2], 16) for i in (1, 3, 5)))
    page.click("#labels tr[data-label='rank10'] .label-toggle")
    assert "rank9" in [
        s["label"]
        for s in lines_of(
            drawn(page, chart("metrics", "throughput"), "d.series.some(s => s.label === 'rank9')")
        )
    ]
    assert page.locator("#shown-labels .shown-chip[data-label='rank9']").count() == 1
    page.click("#shown-labels .shown-chip[data-label='rank9']")
    drawn(page, chart("metrics", "train/loss"), "!d.series.some(s => s.label === 'rank9')")

    # System figures: more than 16 series, an envelope too; one host: a line per label.
    cpu = drawn(page, chart("system", "proc.cpu_percent"))
    assert "median" in [s["role"] for s in cpu["series"]]
    page.select_option("#system-host", "node-1")
    one_host = drawn(page, chart("system", "proc.cpu_percent"), "!d.series.some(s => s.role === 'median')")
    assert sorted(s["label"] for s in lines_of(one_host)) == sorted(f"rank{r}" for r in range(8, 16))

    target = os.environ.get("RUNBUS_DASHBOARD_SCREENSHOTS")
    if target:
        page.select_option("#system-host", "")
        screenshot_run_page(page, Path(target) / "dashboard.png", "train/loss")


def screenshot_run_page(page, path: Path, hovered: str) -> None:
    """The run page from its top to the end of the metrics card, a tooltip on `hovered`."""
    for key in page.locator("#metrics .chart").evaluate_all("cs => cs.map(c => c.dataset.key)"):
        drawn(page, chart("metrics", key))
    bottom = page.eval_on_selector("#metrics", "m => m.getBoundingClientRect().bottom + window.scrollY")
    page.set_viewport_size({"width": 1440, "height": int(bottom) + 16})  # all of it in view
    page.evaluate("window.scrollTo(0, 0)")
    page.eval_on_selector("#labels .labels-wrap", "w => { w.scrollTop = 0; }")
    over = page.locator(f"{chart('metrics', hovered)} .u-over").bounding_box()
    page.mouse.move(over["x"] + over["width"] * 0.3, over["y"] + over["height"] * 0.4)
    page.locator(f"{chart('metrics', hovered)} .tooltip").wait_for(state="visible")
    page.screenshot(path=str(path))


def test_an_elastic_restart_is_drawn_as_two_segments_with_a_mark(page, site):
    page.goto(f"{site[0]}#/run/{seeds.SWEEP_FAST}")  # 8 labels: a line each
    loss = drawn(page, chart("metrics", "train/loss"))
    segments = [s for s in lines_of(loss) if s["label"] == seeds.RESTARTED]
    assert [s["epoch"] for s in segments] == [1, 2]
    assert len(segments[0]["values"]) == 40 and len(segments[1]["values"]) == 30  # steps 0-39, 30-59
    assert segments[0]["color"] == segments[1]["color"]
    restarts = [r for r in loss["marks"]["restarts"] if r["label"]]  # a label's, not the band's
    assert [(r["label"], r["epoch"], r["x"]) for r in restarts] == [(seeds.RESTARTED, 2, 30)]
    assert restarts[0]["text"] == f"{seeds.RESTARTED} restarted"
    # The labels table numbers a label's lives 1, 2, …, the raw lease epoch in the cell's title.
    page.locator(f"#labels tr[data-label='{seeds.RESTARTED}']").wait_for()
    heads = page.locator("#labels .labels-table thead th").all_text_contents()
    life = page.locator(f"#labels tr[data-label='{seeds.RESTARTED}'] td").nth(heads.index("Life"))
    assert (life.inner_text(), life.get_attribute("title")) == ("2", "lease epoch 2")
    assert page.locator("#labels tr[data-label='rank0'] td").nth(heads.index("Life")).inner_text() == "1"
    # By time, the restart's segment begins after the 20 s its restart took.
    page.click("#x-mode .segment[data-mode='relative']")
    by_time = drawn(page, chart("metrics", "train/loss"), "d.xKind === 'relative'")
    [restart] = [r for r in by_time["marks"]["restarts"] if r["label"]]
    assert restart["x"] == pytest.approx(1 + 40 + 20 + 1, abs=0.1)


def test_a_gap_in_a_line_is_a_hole_and_marked(page, site):
    page.goto(f"{site[0]}#/run/{seeds.SWEEP}")
    gaps = page.locator(f"#labels tr[data-label='{seeds.GAPPED}'] td.warn").first
    assert gaps.inner_text() == "16"  # the lost seqs, as the store counts them
    page.click(f"#labels tr[data-label='{seeds.GAPPED}'] .label-toggle")
    loss = drawn(page, chart("metrics", "train/loss"), f"d.series.some(s => s.label === '{seeds.GAPPED}')")
    line = next(s for s in lines_of(loss) if s["label"] == seeds.GAPPED)
    assert line["values"].count(None) == 1 and len(line["values"]) == seeds.SWEEP_STEPS - 16 + 1
    assert [(g["label"], g["x0"], g["x1"]) for g in loss["marks"]["gaps"]] == [(seeds.GAPPED, 11, 28)]


def test_series_arithmetic_on_hostile_numbers(page, site):
    """The page's own series module (envelope, EMA, gaps, label order) on NaN, infinities, one
    point, no points and unsorted labels."""
    page.goto(site[0])
    result = page.evaluate(
        """async () => {
            const s = await import('/static/js/series.js');
            const line = (label, step, y, ts = null, epoch = 1) =>
              ({ label, name: label, epoch, step, ts, y, lo: y, hi: y, downsampled: false });
            const env = s.envelopeOf([
              line('a', [0, 1, 2], [1, NaN, 3]),
              line('b', [0, 1, 2], [Infinity, 2, 5]),
              line('c', [0, 1, 2], [2, 2, -Infinity]),
            ]);
            const single = s.envelopeOf([line('a', [7], [1])]);
            const none = s.envelopeOf([]);
            return {
              env: { step: env.step, count: env.count, min: env.min, max: env.max, median: env.median },
              single: single.median, none: none.median,
              ema: s.ema([1, null, NaN, 3], 0.5),
              gaps: s.gapsIn([0, 1, 2, 3, 50, 51, 52]),
              flat: s.gapsIn([5, 5, 5, 5, 5]),
              order: ['rank10', 'rank2', 'rank1'].sort(s.byName),
            };
        }"""
    )
    env = result["env"]
    assert env["step"] == [0, 1, 2] and env["count"] == [3, 2, 3]  # NaN is no value; ±inf are
    assert env["min"] == [1, 2, -math.inf] and env["max"] == [math.inf, 2, 5]  # spikes stay seen
    assert env["median"] == [1.5, 2, 4]  # over the finite values
    assert result["single"] == [1] and result["none"] == []
    assert result["ema"] == [1, None, None, pytest.approx((0.5 * 0.5 + 0.5 * 3) / 0.75)]
    assert result["gaps"] == [4] and result["flat"] == []
    assert result["order"] == ["rank1", "rank2", "rank10"]


def test_panels_search_by_regex_in_sections_by_prefix(page, site):
    page.goto(f"{site[0]}#/run/{seeds.SWEEP}")
    page.wait_for_selector("#metrics .section")
    sections = page.locator("#metrics .section").evaluate_all("s => s.map(d => d.dataset.section)")
    assert sections == ["eval", "", "train"]
    assert page.locator("#metrics .section[data-section='train'] .chart").evaluate_all(
        "cs => cs.map(c => c.dataset.key)"
    ) == ["train/loss", "train/lr"]
    page.fill("#panel-search", "^train/")
    page.wait_for_function("() => document.querySelectorAll('#metrics .chart').length === 2")
    assert page.locator("#metrics .chart").evaluate_all("cs => cs.map(c => c.dataset.key)") == [
        "train/loss",
        "train/lr",
    ]
    page.fill("#panel-search", "LOSS|acc")  # case-insensitive
    page.wait_for_function(
        "() => [...document.querySelectorAll('#metrics .chart')].map(c => c.dataset.key).join()"
        " === 'eval/accuracy,train/loss'"
    )
    page.fill("#panel-search", "train/(")  # not a regular expression: matched as text
    page.wait_for_function("() => document.querySelectorAll('#metrics .chart').length === 0")
    assert "not a regular expression" in page.locator("#search-note").inner_text()
    assert page.locator("#metrics .empty").inner_text() == "No key matches."
    page.fill("#panel-search", "")
    page.wait_for_function("() => document.querySelectorAll('#metrics .chart').length === 4")


def test_thousands_of_keys_cost_a_bounded_number_of_requests(page, site):
    url = site[0]
    requests: list[tuple[float, str]] = []
    page.on("request", lambda r: requests.append((time.monotonic(), r.url)) if "/api/" in r.url else None)
    page.goto(f"{url}#/run/{seeds.WIDE}")
    page.wait_for_selector("#metrics .chart canvas")
    assert page.locator("#key-count").inner_text() == f"1\u201360 of {seeds.WIDE_KEYS:,} keys"
    assert page.locator("#metrics .chart").count() == 60  # one page of panels
    # Two refreshes (every 5 s) of a running run.
    page.wait_for_function(
        "() => performance.getEntriesByType('resource')"
        ".filter(e => e.name.endsWith('/api/runs/wide-keys')).length >= 3",
        timeout=20_000,
    )
    page.wait_for_timeout(500)
    charts = [u for _, u in requests if "/metrics/envelope" in u or "/metrics/series" in u]
    loaded = page.locator("#metrics .chart canvas").count()
    assert 0 < loaded <= REFRESH_LIMIT  # only panels in view were fetched
    assert len(charts) <= loaded * 3  # first view and two refreshes of those in view
    others = [u for _, u in requests if u not in charts]
    assert len(others) <= 3 * 5  # run, health, key page, logs, system per refresh

    # The next page, and a search through all 3000 keys: still one page at a time.
    page.click("#keys-next")
    page.wait_for_function(
        "() => document.querySelector('#key-count').textContent.startsWith('61\u2013120 of 3,000')"
    )
    page.fill("#panel-search", r"param004\d/")
    page.wait_for_function("() => document.querySelectorAll('#metrics .chart').length === 10")
    assert (
        page.locator("#key-count").inner_text() == "" or "10 keys" in page.locator("#key-count").inner_text()
    )


def test_the_straggler_view_names_the_slow_labels(page, site):
    url = site[0]
    page.goto(f"{url}#/run/{seeds.STEPPED}/stragglers")
    page.wait_for_selector("#straggler-table tbody tr")
    heatmap = page.locator("#straggler-heatmap")
    assert heatmap.evaluate(f"c => c.width > 300 && c.height > {seeds.STEPPED_RANKS} * 8")
    rows = page.locator("#straggler-table tbody tr")
    # Only the labels behind the median: the others, on time, are not listed.
    assert rows.evaluate_all("rows => rows.map(r => r.dataset.label)") == [seeds.SLOW_RANK, seeds.HICCUP_RANK]
    first = rows.first
    assert first.get_attribute("data-label") == seeds.SLOW_RANK
    assert first.locator(".kind").inner_text() == "chronic"
    behind = float(first.locator("td").nth(4).inner_text().rstrip("%"))
    assert 28 < behind < 32  # 1.3x the median's step time
    one_off = page.locator(f"#straggler-table tr[data-label='{seeds.HICCUP_RANK}']")
    assert one_off.locator(".kind").inner_text() == "one-off"
    # Its slow stretch, 512-767, in buckets of 32 steps (2,048 steps in at most 120 columns).
    worst = re.search(r"at steps ([\d,]+)\u2013([\d,]+)", one_off.locator("td").nth(5).inner_text())
    assert worst is not None
    first_step, last_step = (int(text.replace(",", "")) for text in worst.groups())
    assert first_step >= 512 and last_step == first_step + 31 <= 767
    assert page.locator(".tab.active").inner_text() == "Stragglers"

    target = os.environ.get("RUNBUS_DASHBOARD_SCREENSHOTS")
    if target:
        box = heatmap.bounding_box()
        row_height = (box["height"] - 28) / seeds.STEPPED_RANKS
        page.mouse.move(box["x"] + 86 + (box["width"] - 94) * 0.32, box["y"] + 3 + row_height * 6.5)
        page.locator(".heatmap-wrap .tooltip").wait_for(state="visible")
        bottom = page.eval_on_selector(
            "#stragglers", "s => s.getBoundingClientRect().bottom + window.scrollY"
        )
        page.set_viewport_size({"width": 1440, "height": int(bottom) + 16})
        page.screenshot(path=str(Path(target) / "stragglers.png"))
    # A click on a slow label shows it on the charts.
    first.click()
    page.click(".tab[data-tab='charts']")
    loss = drawn(page, chart("metrics", "loss"), f"d.series.some(s => s.label === '{seeds.SLOW_RANK}')")
    assert seeds.SLOW_RANK in [s["label"] for s in lines_of(loss)]


def test_hardware_of_every_label(page, site):
    page.goto(f"{site[0]}#/run/{seeds.SWEEP}/hardware")
    page.wait_for_selector("#hardware tbody tr")
    rows = page.locator("#hardware tbody tr")
    assert rows.count() == seeds.SWEEP_RANKS
    row = page.locator("#hardware tr[data-label='rank9']")
    assert row.locator(".hw-host").inner_text() == "node-1"
    assert row.locator("td").nth(1).inner_text() == "9"
    assert row.locator(".hw-gpus").inner_text() == "1 \u00d7 NVIDIA H100 80GB HBM3 (81,559 MB)"
    assert [row.locator("td").nth(i).inner_text() for i in (4, 5, 6, 7)] == [
        "550.54.15",
        "12.4",
        "2.5.1+cu124",
        "3.11.9",
    ]
    # The command line as the server redacted it: the token never reaches the page.
    assert row.locator(".hw-argv").inner_text() == "train.py --config configs/llama-1b.yaml --hf-token ***"
    # The git state: short commit, branch, dirty; the full commit and the remote, its token
    # hidden by the server, on hover.
    git = row.locator(".hw-git")
    assert git.inner_text() == f"{seeds.COMMIT[:7]} main dirty"
    assert git.get_attribute("title") == f"{seeds.COMMIT}\nhttps://***@github.com/acme/llama.git"
    assert page.locator("#hardware tr[data-label='rank8'] .hw-git").inner_text() == f"{seeds.COMMIT[:7]} main"
    assert seeds.SECRET not in page.content()
    # Alike hardware counted once, whichever GPU index each label has.
    groups = page.locator("#hardware-groups .hw-group")
    assert groups.count() == 1 and groups.locator(".hw-count").inner_text() == f"{seeds.SWEEP_RANKS} labels"


def test_tabs_change_within_one_run_page_and_an_unknown_run_is_not_found(context, page, site):
    url = site[0]
    page.goto(f"{url}#/run/{RUN}")
    page.wait_for_selector(".labels-table tbody tr")
    page.eval_on_selector(".run-header", "h => { h.dataset.first = 'yes'; }")
    for tab in ("stragglers", "hardware", "charts"):
        address = f"#/run/{RUN}" + ("" if tab == "charts" else "/" + tab)
        page.evaluate("hash => { location.hash = hash; }", address)
        page.wait_for_selector(f".tab.active[data-tab='{tab}'][aria-current='page']")
        shown = page.locator(".pane").evaluate_all("ps => ps.filter(p => !p.hidden).map(p => p.dataset.pane)")
        assert shown == [tab]
        # The same page, another tab: nothing was built again.
        assert page.locator(".run-header[data-first='yes']").count() == 1
    page.wait_for_selector("#straggler-key option", state="attached")  # filled when first opened
    assert page.locator("#hardware tbody tr").count() == RANKS
    # Another page: its 404s are the point here, where `page` counts any as a fault.
    other = context.new_page()
    other.goto(f"{url}#/run/no-such-run/hardware")
    other.wait_for_selector(".error-card")
    assert other.locator(".error-card h2").inner_text() == "Not found"
    assert other.locator(".error-card a").get_attribute("href") == "#/"
    other.close()


def test_labels_are_in_natural_order_in_every_list_of_the_page(page, site):
    url = site[0]
    natural = [f"rank{i}" for i in range(seeds.SWEEP_RANKS)]  # rank2 before rank10
    assert [lab["label"] for lab in api_json(url, f"/api/runs/{seeds.SWEEP}")["labels"]] == natural
    assert [lab["label"] for lab in api_json(url, f"/api/runs/{seeds.SWEEP}/labels")["labels"]] == natural
    page.goto(url)
    chips = page.locator(f"tr.run-row[data-run='{seeds.SWEEP}'] .chip:not(.more):not(.tag)")
    chips.first.wait_for()
    assert chips.all_inner_texts() == natural[:8]
    page.goto(f"{url}#/run/{seeds.SWEEP}")
    page.wait_for_selector(".labels-table tbody tr")
    rows = page.locator(".labels-table tbody tr")
    assert rows.evaluate_all("rows => rows.map(r => r.dataset.label)") == natural
    page.wait_for_function(
        "n => document.querySelectorAll('#log-label option').length === n", arg=len(natural) + 1
    )
    assert page.locator("#log-label option").evaluate_all("os => os.map(o => o.value)")[1:] == natural


def test_compare_runs_on_the_same_charts(page, site):
    url = site[0]
    runs = [RUN, seeds.SWEEP, seeds.SWEEP_FAST]
    page.goto(url)
    page.wait_for_selector(f"tr.run-row[data-run='{RUN}']")
    for run in runs:
        page.check(f"tr.run-row[data-run='{run}'] .compare-pick")
    assert page.locator("#compare").inner_text() == "Compare 3 runs"
    page.click("#compare")
    page.wait_for_url(f"**#/compare/{','.join(runs)}")
    every = drawn(
        page, chart("metrics", "throughput"), "new Set(d.series.map(s => s.name.split(' · ')[0])).size === 3"
    )
    # A median per run (per generation of a run: the sweep's restart begins a second one).
    medians = [s for s in every["series"] if s["role"] == "median"]
    assert list(dict.fromkeys(s["name"] for s in medians)) == [f"{run} · median" for run in runs]
    assert len({s["color"] for s in medians}) == 3  # a colour per run
    legend = page.locator(f"{chart('metrics', 'throughput')} .legend-static").evaluate_all(
        "s => s.map(e => e.dataset.run)"
    )
    assert legend == runs
    # A key some runs logged: those runs alone.
    assert {s["name"].split(" · ")[0] for s in drawn(page, chart("metrics", "loss"))["series"]} == {RUN}
    sweeps = drawn(
        page, chart("metrics", "train/loss"), "new Set(d.series.map(s => s.name.split(' · ')[0])).size === 2"
    )
    fast = next(s for s in sweeps["series"] if s["name"] == f"{seeds.SWEEP_FAST} · median")["values"]
    slow = next(s for s in sweeps["series"] if s["name"] == f"{seeds.SWEEP} · median")["values"]
    assert fast[30] < slow[30]  # the faster run's median loss is below the other's
    page.select_option("#compare-mode", "primary")
    primaries = drawn(page, chart("metrics", "throughput"), "!d.series.some(s => s.role === 'median')")
    assert [s["name"] for s in lines_of(primaries)] == [f"{run} · rank0" for run in runs]
    target = os.environ.get("RUNBUS_DASHBOARD_SCREENSHOTS")
    if target:
        page.select_option("#compare-mode", "envelope")
        page.fill("#panel-search", "^(train|eval)/|throughput")
        page.wait_for_function("() => document.querySelectorAll('#metrics .chart').length === 4")
        for key in ("eval/accuracy", "throughput", "train/loss", "train/lr"):
            drawn(page, chart("metrics", key), "!d.series.some(s => s.role === 'line')")
        bottom = page.eval_on_selector("#metrics", "m => m.getBoundingClientRect().bottom + window.scrollY")
        page.set_viewport_size({"width": 1440, "height": int(bottom) + 16})
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=str(Path(target) / "compare.png"))


def test_compare_lists_the_config_keys_that_differ_in_colours_far_apart(page, site):
    url = site[0]
    runs = [RUN, seeds.SWEEP, seeds.SWEEP_FAST]
    page.goto(f"{url}#/compare/{','.join(runs)}")
    page.wait_for_selector("#compare-config tr.config-diff")
    keys = page.locator("#compare-config tr.config-diff").evaluate_all("rows => rows.map(r => r.dataset.key)")
    assert {"model", "lr", "hf_token", "optimizer.lr", "optimizer.weight_decay", "data.seq_len"} <= set(keys)
    assert "optimizer.name" not in keys  # adamw in all three
    token = page.locator("#compare-config tr[data-key='hf_token']")
    assert token.locator(f"td[data-run='{seeds.SWEEP_FAST}']").inner_text() == "***"
    assert token.locator(f"td[data-run='{seeds.SWEEP}']").inner_text() == "not set"
    assert token.locator(".only-in").inner_text() == "in 1 of 3"
    assert seeds.SECRET not in page.content()
    # Each run in its own colour, the same in the legend and the table: Okabe-Ito's first three.
    legend = page.locator("#compare-runs .swatch").evaluate_all("s => s.map(e => e.style.background)")
    table = page.locator("#compare-config thead .swatch").evaluate_all("s => s.map(e => e.style.background)")
    assert legend == table == ["rgb(0, 114, 178)", "rgb(230, 159, 0)", "rgb(0, 158, 115)"]
    # Two runs alike but for their learning rate and a token: those keys alone.
    page.goto(f"{url}#/compare/{seeds.SWEEP},{seeds.SWEEP_FAST}")
    page.wait_for_function(
        "() => document.querySelectorAll('#compare-config tr.config-diff').length === 2"
        " && document.querySelector('#compare-config thead th:last-child').textContent === 'sweep-8-fast'"
    )
    keys = page.locator("#compare-config tr.config-diff").evaluate_all("rows => rows.map(r => r.dataset.key)")
    assert keys == ["hf_token", "lr"]
    assert "4 keys with one value in every run" in page.locator("#compare-config").inner_text()
    # A hostile key and value stay text.
    page.goto(f"{url}#/compare/{RUN},{HOSTILE}")
    row = page.locator("#compare-config tr[data-key='<i>k</i>']")
    assert row.locator("th").text_content().startswith("<i>k</i>")
    value = row.locator(f"td[data-run='{HOSTILE}']").text_content()
    assert value == "<script>window.__pwned = 'config2'</script>"
    assert page.evaluate("window.__pwned") is None


# -- logs, and strings from the bus ----------------------------------------------------------------


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
    texts = page.locator("#log-list .log-text").all_text_contents()
    assert texts == [
        "<script>window.__pwned = 'log'</script>",
        "<img src=x onerror=\"window.__pwned='img'\">",
    ]
    hostile_key = "<img src=x onerror=\"window.__pwned='metric'\">"
    drawn(page, chart("metrics", hostile_key))
    titles = page.locator("#metrics .chart .chart-title").all_text_contents()
    assert hostile_key in titles
    assert page.locator("#config td").first.text_content() == "<script>window.__pwned = 'config'</script>"
    # Run metadata a worker set: its name heads the page, its tags and summary are text too.
    assert page.locator(".run-title h1").text_content() == HOSTILE_META["name"]
    assert page.locator(".run-title .chip.tag").all_text_contents() == HOSTILE_META["tags"]
    [(key, value)] = HOSTILE_META["summary"].items()
    assert page.locator("#summary th").first.text_content() == key
    assert page.locator("#summary td").all_text_contents() == [value, "rank1"]
    assert page.locator("#config tr", has_text="<i>k</i>").locator("td.set-by").text_content() == "rank1"
    page.fill("#panel-search", "<img")  # searched as text, shown as text
    page.wait_for_function("() => document.querySelectorAll('#metrics .chart').length === 1")

    page.goto(f"{site[0]}#/run/{seeds.HOSTILE_HW}/hardware")
    page.wait_for_selector("#hardware tbody tr")
    assert page.locator("#hardware .hw-host").inner_text() == seeds.HOSTILE_TEXT
    assert page.locator("#hardware .hw-gpus").inner_text() == f"1 \u00d7 {seeds.HOSTILE_TEXT} (1 MB)"
    argv = page.locator("#hardware .hw-argv").inner_text()
    assert argv == f"train.py {seeds.HOSTILE_TEXT} <script>window.__pwned='argv'</script>"
    git = page.locator("#hardware .hw-git")
    assert git.inner_text() == f"{seeds.HOSTILE_TEXT[:7]} {seeds.HOSTILE_TEXT} dirty"
    assert git.get_attribute("title") == f"{seeds.HOSTILE_TEXT}\n{seeds.HOSTILE_TEXT}"
    page.click(".tab[data-tab='charts']")
    drawn(page, chart("metrics", seeds.HOSTILE_TEXT))
    with page.expect_download() as download:
        page.click(f"{chart('metrics', seeds.HOSTILE_TEXT)} .chart-csv")
    assert download.value.suggested_filename == "img_src_x_onerror_window.__pwned_hw.csv"

    assert page.evaluate("window.__pwned") is None
    assert page.evaluate("document.querySelectorAll('script').length") == 2  # uPlot and the page's
    assert page.locator("main img").count() == 0


# Bidi overrides, isolates and marks, C0 (but tab and newline), DEL and C1 controls; none that CSS
# strings rewrite (NUL, CR, LF, FF), so that the key still names its chart in a selector.
OBEYED = "\u202eevil\u2066iso\u2069\u200elrm\u200frlm\u061calm\u202a\u202c|\x1b[2J\x07\x7f\x9b31m\x85"
BIDI_RUN = "bidi-run"


def test_bidi_and_control_characters_show_as_the_terminal_shows_them(page, site):
    """A key and a log line holding characters a page would obey (U+202E makes a key read as
    another) show each as its escape, exactly as `runbus logs` prints it (runbus.terminal)."""
    url, store_url, redis_url = site
    key, text = "train/loss" + OBEYED, "a line" + OBEYED + "\n\tnext"
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, BIDI_RUN, "rank0", "start", 1, 1, {"primary": True})
        xadd_event(client, BIDI_RUN, "rank0", "metric", 1, 2, {key: 1.0}, step=1)
        xadd_event(
            client, BIDI_RUN, "rank0", "log", 1, 3, {"stream": "stdout", "level": "INFO", "text": text}
        )
        xadd_event(client, BIDI_RUN, "rank0", "finish", 1, 4, {"exit_code": 0})
    run_cli("--store", store_url, "ingest", "--redis", redis_url, "--burst")
    page.goto(f"{url}#/run/{BIDI_RUN}")
    page.wait_for_selector("#log-list .log-row")
    assert page.locator("#log-list .log-text").all_text_contents() == [printable(text)]
    drawn(page, chart("metrics", key))  # the chart's requests name the key as it is
    title = page.locator(f"{chart('metrics', key)} .chart-title")
    assert title.text_content() == printable(key)
    assert title.get_attribute("title") == printable(key)
    shown = page.evaluate("document.body.innerText")
    assert "\\u202eevil" in shown and not re.search(
        "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]", shown
    )


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


def test_all_page_scripts_are_our_own_files(site):
    """No inline script, eval or markup injection in any script the page loads."""
    static = Path(__file__).resolve().parents[1] / "dashboard" / "static"
    scripts = [static / "app.js", *sorted((static / "js").glob("*.js"))]
    for script in scripts:
        text = script.read_text()
        for banned in (
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
            "new Function",
        ):
            assert banned not in text, f"{script.name} uses {banned}"
    assert len(scripts) >= 10


# -- NaN and inf in a band's labels -----------------------------------------------------------------


def seeded_site(tmp_path_factory, writer: str) -> Iterator[str]:
    """`runbus serve` over a fresh store that dashboard_seeds' coroutine `writer` fills: its base URL."""
    store_url = f"sqlite:///{tmp_path_factory.mktemp(writer) / 'runbus.db'}"
    # In a process of its own: Playwright's event loop owns this thread once the browser is up.
    code = f"import asyncio; from tests import dashboard_seeds as s; asyncio.run(s.{writer}({store_url!r}))"
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1], timeout=300
    )
    with serve(store_url) as (url, _):
        yield url


@pytest.fixture(scope="module")
def nan_site(tmp_path_factory) -> Iterator[str]:
    """`runbus serve` over a store holding seeds.NAN_RUN alone: its base URL."""
    yield from seeded_site(tmp_path_factory, "write_nan_run")


def test_a_band_marks_the_label_that_went_nan_at_any_label_count(page, nan_site):
    # 20 labels: a band and its outliers, none of them the label that went NaN at one step.
    page.goto(f"{nan_site}#/run/{seeds.NAN_RUN}")
    loss = drawn(page, chart("metrics", "loss"), wait="d.marks.nonFinite.length >= 2")
    assert any(s["role"] == "median" for s in loss["series"])  # the envelope
    assert seeds.NAN_RANK not in {s["label"] for s in lines_of(loss)}
    marks = {(m["label"], m["x"], m["what"], m["text"]) for m in loss["marks"]["nonFinite"]}
    assert marks == {
        (seeds.NAN_RANK, seeds.NAN_STEP, "NaN", f"{seeds.NAN_RANK} NaN @{seeds.NAN_STEP}"),
        (seeds.INF_RANK, seeds.INF_STEP, "inf", f"{seeds.INF_RANK} inf @{seeds.INF_STEP}"),
    }
    doc = api_json(nan_site, f"/api/runs/{seeds.NAN_RUN}/metrics/envelope?key=loss")
    assert not doc["exact"] and sum(b[3] for s in doc["band"] for b in s["rows"]) == 1  # the band's count
    # Zoomed to steps after the NaN: only the inf is in view.
    zoomed = api_json(nan_site, f"/api/runs/{seeds.NAN_RUN}/metrics/envelope?key=loss&start=1400&end=2599")
    assert [(a["label"], a["step"], a["kind"]) for a in zoomed["non_finite"]] == [
        (seeds.INF_RANK, seeds.INF_STEP, "inf")
    ]


# -- the health banner -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def health_site(tmp_path_factory) -> Iterator[str]:
    """`runbus serve` over a store holding seeds.STALLED_RUN and seeds.HEALTHY_RUN: its base URL."""
    yield from seeded_site(tmp_path_factory, "write_health_runs")


def test_a_stalled_run_shows_a_banner_naming_the_culprit_with_its_stack_a_click_away(page, health_site):
    page.goto(f"{health_site}#/run/{seeds.STALLED_RUN}")
    banner = page.locator("#health")
    banner.wait_for(state="visible")
    assert banner.get_attribute("data-state") == "stalled"
    head = banner.locator(".health-head").inner_text()
    assert "stalled" in head and f"{seeds.HUNG_RANK} in a data loader (load_batch)" in head
    assert "5 waiting in all_reduce" in head
    # How far the band is checked, and that its NaN, after that, may yet be preceded by a band leaver.
    rank, step = seeds.NAN_AT
    assert f"{rank} nan in loss at step {step}" in head
    assert banner.locator(".health-band").inner_text() == (
        "Cross-rank band checked to step 127, before the first anomaly: a rank leaving it before the first"
        " anomaly may yet be named."
    )
    culprit = banner.locator(f'.health-culprit[data-label="{seeds.HUNG_RANK}"]')
    stack = culprit.locator(".health-stack")
    assert not stack.is_visible()  # one click away, not in the way
    culprit.locator("summary").click()
    stack.wait_for(state="visible")
    # The hostile source line is shown as the text it is, never as markup.
    assert seeds.HUNG_CODE in stack.inner_text()
    assert "/work/train.py:21 in load_batch" in stack.inner_text()
    assert culprit.locator(".health-lines").inner_text() == seeds.HUNG_LINE
    assert banner.locator("img, b").count() == 0
    assert page.evaluate("window.__pwned") is None
    # At the page's next refresh the banner is read and drawn again: what a person opened stays open.
    with page.expect_response(
        lambda r: r.url.endswith(f"/api/runs/{seeds.STALLED_RUN}/health"), timeout=TIMEOUT_MS
    ):
        pass
    page.wait_for_function("() => document.querySelector('#health .health-culprit details')?.open")
    assert stack.is_visible()


def test_a_healthy_run_shows_no_banner(page, health_site):
    page.goto(f"{health_site}#/run/{seeds.HEALTHY_RUN}")
    page.locator("#labels tbody tr").first.wait_for()
    assert page.locator("#health").count() == 1
    assert not page.locator("#health").is_visible()
    assert page.evaluate("document.querySelector('#health').dataset.state") == "ok"
