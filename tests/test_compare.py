"""Runs compared: the config keys on which they differ (the dashboard's API, on SQLite and
PostgreSQL), and run colours that read as different colours."""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from runbus.dashboard.api import create_app
from runbus.storage import Store
from runbus.wire import Event

T0 = 1_700_000_000.0
COLORS = Path(__file__).parents[1] / "dashboard" / "static" / "js" / "colors.js"
BASE = {
    "model": "llama-1b",
    "optimizer": {"name": "adamw", "lr": 3e-4, "betas": [0.9, 0.95]},
    "seed": 1,
}
CONFIGS = {
    "cfg-a": BASE,
    "cfg-b": {**BASE, "optimizer": {**BASE["optimizer"], "lr": 1e-3}, "wandb_api_key": "k-123456"},
    "cfg-c": {**BASE, "optimizer": {**BASE["optimizer"], "betas": [0.9, 0.99]}, "seed": 1.0},
}


def started(run: str, config: dict) -> list[Event]:
    # Each top-level key set by its own label: the run's config is what its labels set, merged.
    return [
        Event(run, f"rank{i}", "start", 1, 1, T0, {"primary": i == 0, "config": {key: value}}, None)
        for i, (key, value) in enumerate(config.items())
    ]


async def compared(client: TestClient, runs: list[str], status: int = 200) -> dict:
    response = await client.get("/api/compare/config", params=[("run", run) for run in runs])
    body = await response.read()
    assert response.status == status, body
    return orjson.loads(body)


async def test_the_api_lists_the_config_keys_that_differ(store: Store, any_store_url: str):
    for run, config in CONFIGS.items():
        await store.write(started(run, config))
    async with TestClient(TestServer(create_app(any_store_url))) as client:
        diff = await compared(client, list(CONFIGS))
        assert diff["runs"] == list(CONFIGS)
        by_key = {row["key"]: row for row in diff["keys"]}
        assert list(by_key) == ["optimizer.betas", "optimizer.lr", "seed", "wandb_api_key"]
        assert by_key["optimizer.lr"] == {
            "key": "optimizer.lr",
            "values": {"cfg-a": 3e-4, "cfg-b": 1e-3, "cfg-c": 3e-4},
            "missing": [],
        }
        assert by_key["optimizer.betas"]["values"]["cfg-c"] == [0.9, 0.99]
        assert by_key["seed"]["values"] == {"cfg-a": 1, "cfg-b": 1, "cfg-c": 1.0}  # 1 and 1.0 differ
        # Only one run has it, and its value is never shown.
        assert by_key["wandb_api_key"] == {
            "key": "wandb_api_key",
            "values": {"cfg-b": "***"},
            "missing": ["cfg-a", "cfg-c"],
        }
        assert diff["equal"] == 2  # model, optimizer.name
        # Runs named by a unique prefix; equal configs differ nowhere.
        assert (await compared(client, ["cfg-a", "cfg-"], status=404))["error"]
        same = await compared(client, ["cfg-a"])
        assert same == {"runs": ["cfg-a"], "keys": [], "equal": 5}
        error = await compared(client, ["cfg-a", "nope"], status=404)
        assert "nope" in error["error"]
        assert "run must be given" in (await compared(client, [], status=400))["error"]


# -- colours ----------------------------------------------------------------------------------------


def lab(hex_colour: str) -> tuple[float, float, float]:
    """CIELAB (D65) of an sRGB colour."""
    rgb = [int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb)
    x = (0.4124564 * r + 0.3575761 * g + 0.1804375 * b) / 0.95047
    y = 0.2126729 * r + 0.7151522 * g + 0.0721750 * b
    z = (0.0193339 * r + 0.1191920 * g + 0.9503041 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def _mean_hue(h1: float, h2: float) -> float:
    if abs(h1 - h2) <= 180:
        return (h1 + h2) / 2
    return (h1 + h2 + 360) / 2 if h1 + h2 < 360 else (h1 + h2 - 360) / 2


def ciede2000(one: tuple[float, float, float], two: tuple[float, float, float]) -> float:
    """The CIEDE2000 colour difference (Sharma, Wu and Dalal, 2005)."""
    (l1, a1, b1), (l2, a2, b2) = one, two
    c_mean = (math.hypot(a1, b1) + math.hypot(a2, b2)) / 2
    g = 0.5 * (1 - math.sqrt(c_mean**7 / (c_mean**7 + 25**7)))
    a1, a2 = a1 * (1 + g), a2 * (1 + g)
    c1, c2 = math.hypot(a1, b1), math.hypot(a2, b2)
    h1, h2 = math.degrees(math.atan2(b1, a1)) % 360, math.degrees(math.atan2(b2, a2)) % 360
    turn = h2 - h1 if abs(h2 - h1) <= 180 else h2 - h1 - 360 if h2 > h1 else h2 - h1 + 360
    big_h = 2 * math.sqrt(c1 * c2) * math.sin(math.radians(turn / 2)) if c1 * c2 else 0.0
    l_mean, c_mean = (l1 + l2) / 2, (c1 + c2) / 2
    h_mean = _mean_hue(h1, h2) if c1 * c2 else h1 + h2
    t = (
        1
        - 0.17 * math.cos(math.radians(h_mean - 30))
        + 0.24 * math.cos(math.radians(2 * h_mean))
        + 0.32 * math.cos(math.radians(3 * h_mean + 6))
        - 0.20 * math.cos(math.radians(4 * h_mean - 63))
    )
    s_l = 1 + 0.015 * (l_mean - 50) ** 2 / math.sqrt(20 + (l_mean - 50) ** 2)
    s_c, s_h = 1 + 0.045 * c_mean, 1 + 0.015 * c_mean * t
    r_t = (
        -math.sin(math.radians(60 * math.exp(-(((h_mean - 275) / 25) ** 2))))
        * 2
        * math.sqrt(c_mean**7 / (c_mean**7 + 25**7))
    )
    dl, dc, dh = (l2 - l1) / s_l, (c2 - c1) / s_c, big_h / s_h
    return math.sqrt(dl**2 + dc**2 + dh**2 + r_t * dc * dh)


def test_ciede2000_matches_the_published_test_data():
    # Pairs 1, 7 and 17 of Sharma, Wu and Dalal's table.
    assert ciede2000((50, 2.6772, -79.7751), (50, 0, -82.7485)) == pytest.approx(2.0425, abs=1e-4)
    assert ciede2000((50, 0, 0), (50, -1, 2)) == pytest.approx(2.3669, abs=1e-4)
    assert ciede2000((50, 2.5, 0), (73, 25, -18)) == pytest.approx(27.1492, abs=1e-4)


def test_the_first_eight_run_colours_are_far_apart():
    text = COLORS.read_text()
    palette = re.search(r"const RUNS = \[([^\]]*)\]", text)
    assert palette is not None, "colors.js defines RUNS, the compared runs' colours"
    colours = re.findall(r"'(#[0-9a-fA-F]{6})'", palette.group(1))
    assert len(colours) >= 8
    closest = min(ciede2000(lab(a), lab(b)) for a, b in itertools.combinations(colours[:8], 2))
    # 2.3 is a just-noticeable difference; 20 reads as another colour at a glance, on a thin line.
    assert closest > 20
