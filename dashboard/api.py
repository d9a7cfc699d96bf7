"""The dashboard's HTTP side: JSON routes over the store, and the page's static files.

Every route is a GET and answers JSON; a bad query parameter is a 400 and an unknown run a 404,
each with `{"error": REASON}`. Non-finite numbers are written as the CLI writes them: "NaN",
"Infinity", "-Infinity".

- `/api/runs?limit=100&offset=0`: runs, newest first, with labels (state, primary) and counts
- `/api/runs/RUN`: one run: labels with epochs and gaps (`missing`), counts, config, dead letters
- `/api/runs/RUN/metrics`: the metric keys
- `/api/runs/RUN/metrics/series?key=K&label=L&points=2000`: one series per label (see downsample)
- `/api/runs/RUN/system?key=K&label=L&points=2000`: system samples, per key, one series per label
- `/api/runs/RUN/logs?label=L&level=WARNING&grep=TEXT&limit=500&offset=0`: log lines, paged
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from runbus import storage, wire
from runbus.dashboard import downsample, security
from runbus.dashboard.deadletters import DeadLetters
from runbus.errors import AccessDenied, InvalidName, StoreRejected
from runbus.storage import documents

STATIC = Path(str(resources.files("runbus.dashboard") / "static"))
DEFAULT_RUNS = 100
MAX_RUNS = 1000
DEFAULT_LOG_LINES = 500
MAX_LOG_LINES = 5000
MAX_OFFSET = 1 << 40
MAX_GREP = 1000

STORE: web.AppKey[storage.Store] = web.AppKey("store", storage.Store)
DEAD_LETTERS: web.AppKey[DeadLetters] = web.AppKey("dead_letters", DeadLetters)


class BadParameter(Exception):
    """A query parameter the API refuses; its message is the 400's reason."""


def _json(document: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(document), status=status, content_type="application/json")


def _error(status: int, reason: str) -> web.Response:
    return _json({"error": reason}, status)


def _integer(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise BadParameter(f"{name} must be an integer, got {text[:40]!r}") from None
    if not low <= value <= high:
        raise BadParameter(f"{name} must be between {low} and {high}, got {value}")
    return value


def _label(request: web.Request) -> str | None:
    label = request.query.get("label")
    if label is None or label == "":
        return None
    try:
        return wire.check_name("label", label)
    except InvalidName as exc:
        raise BadParameter(str(exc)) from None


def _level(request: web.Request) -> str | None:
    level = request.query.get("level")
    if level is None or level == "":
        return None
    if level.upper() not in wire.LEVELS:
        raise BadParameter(f"level must be one of {', '.join(wire.LEVELS)}, got {level[:40]!r}")
    return level.upper()


def _points(request: web.Request) -> int:
    return _integer(
        request, "points", downsample.DEFAULT_POINTS, downsample.MIN_POINTS, downsample.MAX_POINTS
    )


def _run_id(request: web.Request) -> str:
    try:
        return wire.check_name("run id", request.match_info["run"])
    except InvalidName as exc:
        raise BadParameter(str(exc)) from None


async def _known_run(request: web.Request) -> storage.RunSummary:
    run_id = _run_id(request)
    run = await request.app[STORE].run(run_id)
    if run is None:
        raise web.HTTPNotFound(reason=f"unknown run {run_id!r}")
    return run


def _label_document(label: storage.LabelSummary) -> dict[str, Any]:
    start = label.start or {}
    return {
        "label": label.label,
        "primary": label.primary,
        "state": label.state,
        "exit_code": label.exit_code,
        "epoch": label.epoch,
        "last_seq": label.last_seq,
        "events": label.events,
        "missing": label.missing,
        "first_ts": label.first_ts,
        "last_ts": label.last_ts,
        "primary_refused_ts": label.primary_refused_ts,
        "host": start.get("host"),
        "rank": start.get("rank"),
        "world_size": start.get("world_size"),
        "restart_count": start.get("restart_count"),
    }


def _series(
    points: Sequence[storage.Point], limit: int, x_of: Callable[[storage.Point], float | int]
) -> list[dict[str, Any]]:
    by_label: dict[str, list[storage.Point]] = {}
    for point in points:
        by_label.setdefault(point.label, []).append(point)
    series = []
    for label, mine in sorted(by_label.items()):
        mine.sort(key=lambda p: (x_of(p), p.epoch, p.seq))
        rows = downsample.downsample([x_of(p) for p in mine], [p.value for p in mine], limit)
        series.append(
            {"label": label, "count": len(mine), "downsampled": len(rows) < len(mine), "data": rows}
        )
    return series


def _step(point: storage.Point) -> int:
    """A point's step, as the x of a chart whose points all have one."""
    if point.step is None:
        raise ValueError(f"{point.key} of {point.label} has a point without a step")
    return point.step


# -- routes ------------------------------------------------------------------------------------


async def runs(request: web.Request) -> web.Response:
    limit = _integer(request, "limit", DEFAULT_RUNS, 1, MAX_RUNS)
    offset = _integer(request, "offset", 0, 0, MAX_OFFSET)
    store = request.app[STORE]
    page = (await store.runs())[offset : offset + limit]
    listed = []
    for summary in page:
        run = await store.run(summary.run_id) or summary
        document = documents.run_head(run)
        document["labels"] = [
            {"label": lab.label, "primary": lab.primary, "state": lab.state} for lab in run.labels
        ]
        listed.append(document)
    return _json({"runs": listed, "limit": limit, "offset": offset})


async def run(request: web.Request) -> web.Response:
    summary = await _known_run(request)
    document = documents.run_head(summary)
    document["labels"] = [_label_document(lab) for lab in summary.labels]
    document["gaps"] = sum(lab.missing for lab in summary.labels)
    document["config"] = documents.config_document(summary.config)
    document["primary_refused"] = documents.refused_primaries(summary)
    document["dead_letters"] = await request.app[DEAD_LETTERS].counts(summary.run_id)
    return _json(document)


async def metric_keys(request: web.Request) -> web.Response:
    summary = await _known_run(request)
    return _json({"run_id": summary.run_id, "keys": await request.app[STORE].metric_keys(summary.run_id)})


async def metric_series(request: web.Request) -> web.Response:
    key = request.query.get("key")
    if not key:
        raise BadParameter("key is required")
    label, limit = _label(request), _points(request)
    summary = await _known_run(request)
    points = await request.app[STORE].metrics(summary.run_id, key=key, label=label)
    # One x axis per chart: steps when every point has one, else the time it was logged.
    by_step = all(p.step is not None for p in points)
    return _json(
        {
            "run_id": summary.run_id,
            "key": key,
            "x": "step" if by_step else "ts",
            "points": limit,
            "columns": downsample.COLUMNS,
            "series": _series(points, limit, _step if by_step else (lambda p: p.ts)),
        }
    )


async def system(request: web.Request) -> web.Response:
    key = request.query.get("key") or None
    label, limit = _label(request), _points(request)
    summary = await _known_run(request)
    points = await request.app[STORE].system(summary.run_id, key=key, label=label)
    by_key: dict[str, list[storage.Point]] = {}
    for point in points:
        by_key.setdefault(point.key, []).append(point)
    return _json(
        {
            "run_id": summary.run_id,
            "x": "ts",
            "points": limit,
            "columns": downsample.COLUMNS,
            "keys": [
                {"key": name, "series": _series(mine, limit, lambda p: p.ts)}
                for name, mine in sorted(by_key.items())
            ],
        }
    )


async def logs(request: web.Request) -> web.Response:
    label, level = _label(request), _level(request)
    grep = request.query.get("grep") or None
    if grep is not None and len(grep) > MAX_GREP:
        raise BadParameter(f"grep must be at most {MAX_GREP} characters")
    limit = _integer(request, "limit", DEFAULT_LOG_LINES, 1, MAX_LOG_LINES)
    offset = _integer(request, "offset", 0, 0, MAX_OFFSET)
    summary = await _known_run(request)
    # One line more than asked tells whether another page follows.
    lines = await request.app[STORE].logs(
        summary.run_id, label=label, level=level, grep=grep, limit=limit + 1, offset=offset
    )
    page = lines[:limit]
    return _json(
        {
            "run_id": summary.run_id,
            "limit": limit,
            "offset": offset,
            "next_offset": offset + len(page),
            "more": len(lines) > limit,
            "lines": [documents.log_document(line) for line in page],
        }
    )


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


# -- the application -----------------------------------------------------------------------------


@web.middleware
async def api_errors(request: web.Request, handler: security.Handler) -> web.StreamResponse:
    """400 for bad parameters (or ones the store refuses), JSON bodies for the API's errors, 503
    when the store fails or refuses access."""
    try:
        return await handler(request)
    except BadParameter as exc:
        return _error(400, str(exc))
    except StoreRejected as exc:
        return _error(400, str(exc))
    except (storage.StoreError, AccessDenied) as exc:
        return _error(503, f"store unavailable: {exc}")
    except web.HTTPException as exc:
        if request.path.startswith("/api/") and exc.status >= 400:
            return _error(exc.status, exc.reason)
        raise


def create_app(store_url: str, redis_url: str | None = None, token: str | None = None) -> web.Application:
    """The dashboard application; the store is opened at start-up and closed at clean-up.

    The dashboard only reads: a store that does not exist yet is StoreMissing at start-up, and
    nothing is created.
    """
    store = storage.open_store(store_url, create=False)
    app = web.Application(
        middlewares=[security.security_headers, security.auth_middleware(token), api_errors]
    )
    app[STORE] = store
    app[DEAD_LETTERS] = DeadLetters(redis_url)

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        await store.connect()
        try:
            yield
        finally:
            await app[DEAD_LETTERS].close()
            await store.close()

    app.cleanup_ctx.append(lifetime)
    app.router.add_get("/", index)
    app.router.add_get("/api/runs", runs)
    app.router.add_get("/api/runs/{run}", run)
    app.router.add_get("/api/runs/{run}/metrics", metric_keys)
    app.router.add_get("/api/runs/{run}/metrics/series", metric_series)
    app.router.add_get("/api/runs/{run}/system", system)
    app.router.add_get("/api/runs/{run}/logs", logs)
    app.router.add_static("/static/", STATIC, show_index=False, follow_symlinks=False)
    return app
