"""The dashboard's HTTP side: JSON routes over the store, and the page's static files.

Every route is a GET and answers JSON; a bad query parameter is a 400 and an unknown run a 404,
each with `{"error": REASON}`. RUN is a run's id or a unique prefix of it (an ambiguous one is a
404 naming a few runs). Non-finite numbers are written as the CLI writes them: "NaN",
"Infinity", "-Infinity".

- `/api/runs?q=TEXT&state=S&since=T&until=T&tag=T&label=L&config=KEY=VALUE&sort=started&order=desc`
  `&limit=100&offset=0`: a page of the runs that match (storage/runlist.py: `q` found in a run's
  id, name, tags or labels; `state`, `tag`, `label`, `config` each given as often as wanted;
  `since` and `until` bound its start, seconds since the epoch or ISO 8601), with labels (state,
  primary) and counts, and `total`: how many match
- `/api/compare/config?run=RUN&run=RUN...` (up to 16): the config keys (flattened, dotted) whose
  redacted values differ between the runs, with each run's value and the runs that lack the key
- `/api/runs/RUN`: one run: labels with their life (`life`: 1, then 2 after a restart, …; the raw
  lease epoch as `lease_epoch`) and gaps (`missing`) and what each set, counts, name, tags,
  config and summary (merged, with `set_by`: the label of each value), dead letters
- `/api/runs/RUN/health`: the run's health (docs/health.md): state, since, culprits, waiting
- `/api/runs/RUN/metrics`: the metric keys
- `/api/runs/RUN/metrics/series?key=K&label=L&points=2000`: one series per label (see downsample)
- `/api/runs/RUN/metrics/keys?prefix=P&q=TEXT&offset=0&limit=100`: metric keys, paged and searched
- `/api/runs/RUN/metrics/envelope?key=K&x=step&start=&end=&points=1500&outliers=3&lines=16&label=L`:
  the key's band across labels and its outlying labels' lines, from the rollups (envelopes.py);
  each `label=` (up to 64) adds that label's line (none for a label without values in view);
  `non_finite`: each label's first NaN or inf in view (storage/anomalies.py), lines or not
- `/api/runs/RUN/stragglers?key=K` or `?time_key=K`, `&start=&end=&buckets=32&offset=0&limit=2048`:
  step times per label and step bucket, the labels slowest first
- `/api/runs/RUN/anomalies`: each label's first NaN or inf of each key, and where it left the
  cross-rank band, by step (storage/anomalies.py, storage/outliers.py)
- `/api/runs/RUN/labels?offset=0&limit=1000`: each label's host, rank, hardware, command line and git state
- `/api/runs/RUN/system?key=K&label=L&points=2000`: system samples, per key, one series per label
- `/api/runs/RUN/system/keys`: the system figures (keys, GPU indices together) and their keys
- `/api/runs/RUN/system/envelope?key=FIGURE&host=H&start=&end=&points=1500&outliers=3&lines=16`:
  a figure's band across labels and GPUs (or one host's) and its lines over ts, from the rollups
- `/api/runs/RUN/logs?label=L&level=WARNING&grep=TEXT&limit=500&offset=0`: log lines, paged
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from runbus import storage, wire
from runbus.dashboard import configdiff, downsample, envelopes, security
from runbus.dashboard.deadletters import DeadLetters
from runbus.errors import AccessDenied, AmbiguousRun, BadQuery, InvalidName, StoreRejected
from runbus.query import documents
from runbus.storage import anomalies, base, lookup, outliers, runlist, system_charts
from runbus.storage.rules import natural_key

STATIC = Path(str(resources.files("runbus.dashboard") / "static"))
DEFAULT_RUNS = 100
MAX_RUNS = 1000
DEFAULT_LOG_LINES = 500
MAX_LOG_LINES = 5000
MAX_OFFSET = 1 << 40
MAX_GREP = 1000
DEFAULT_KEYS = 100
MAX_KEYS = 1000
MAX_SEARCH = 256
MAX_KEY = 256  # the longest metric name the wire takes
MAX_HOST = 256
DEFAULT_LABELS = 1000
MAX_LABELS = 100_000
DEFAULT_STRAGGLERS = 2048
MAX_COMPARED = 16  # runs whose configs one request compares (the page compares up to 8)

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


def _label_name(label: str) -> str:
    try:
        return wire.check_name("label", label)
    except InvalidName as exc:
        raise BadParameter(str(exc)) from None


def _label(request: web.Request) -> str | None:
    label = request.query.get("label")
    if label is None or label == "":
        return None
    return _label_name(label)


def _labels(request: web.Request, most: int) -> list[str]:
    """The labels named by `label=`, given up to `most` times (empty ones ignored)."""
    given = [label for label in request.query.getall("label", []) if label]
    if len(given) > most:
        raise BadParameter(f"label must be given at most {most} times, got {len(given)}")
    return [_label_name(label) for label in given]


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


async def _run_id(request: web.Request) -> str:
    """The id of the run the URL names: its id, or a unique prefix of it (storage.lookup); as
    given where no run has it, for the route's own 404."""
    return await _resolved(request, request.match_info["run"])


async def _resolved(request: web.Request, text: str) -> str:
    """The id of the run `text` names (its id or a unique prefix), else `text` itself."""
    try:
        given = wire.check_name("run id", text)
    except InvalidName as exc:
        raise BadParameter(str(exc)) from None
    try:
        return await lookup.run_id_of(request.app[STORE], given) or given
    except AmbiguousRun as exc:
        raise web.HTTPNotFound(reason=str(exc)) from None


async def _known_run(request: web.Request) -> storage.RunSummary:
    run_id = await _run_id(request)
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
        "lease_epoch": label.epoch,
        "life": label.life,
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
        **documents.label_metadata(label),
    }


def _series(
    points: Sequence[storage.Point], limit: int, x_of: Callable[[storage.Point], float | int]
) -> list[dict[str, Any]]:
    by_label: dict[str, list[storage.Point]] = {}
    for point in points:
        by_label.setdefault(point.label, []).append(point)
    series = []
    for label in sorted(by_label, key=natural_key):
        mine = by_label[label]
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


def _run_query(request: web.Request) -> runlist.RunQuery:
    """The runs list's question from `request`'s parameters (see the module's docstring)."""
    query = request.query
    try:
        return runlist.run_query(
            search=_text(request, "q", runlist.MAX_SEARCH),
            states=query.getall("state", []),
            since=_text(request, "since"),
            until=_text(request, "until"),
            tags=query.getall("tag", []),
            labels=query.getall("label", []),
            config=query.getall("config", []),
            sort=_text(request, "sort"),
            order=_text(request, "order"),
            limit=_integer(request, "limit", DEFAULT_RUNS, 1, MAX_RUNS),
            offset=_integer(request, "offset", 0, 0, MAX_OFFSET),
        )
    except BadQuery as exc:
        raise BadParameter(str(exc)) from None


async def runs(request: web.Request) -> web.Response:
    query = _run_query(request)
    page = await request.app[STORE].run_page(query, labels=True)
    listed = []
    for run in page.runs:
        document = documents.run_head(run)
        labels = sorted(page.labels.get(run.run_id, []), key=lambda lab: natural_key(lab.label))
        document["labels"] = [
            {"label": lab.label, "primary": lab.primary, "state": lab.state} for lab in labels
        ]
        listed.append(document)
    offset = page.offset
    following = offset + len(listed)
    return _json(
        {
            "runs": listed,
            "total": page.total,
            "limit": page.limit,
            "offset": offset,
            "next_offset": following if following < page.total else None,
            "sort": query.sort,
            "order": "desc" if query.descending else "asc",
        }
    )


async def run(request: web.Request) -> web.Response:
    summary = await _known_run(request)
    document = documents.run_head(summary)
    document["labels"] = [_label_document(lab) for lab in summary.labels]
    document["gaps"] = sum(lab.missing for lab in summary.labels)
    document.update(documents.run_metadata(summary))
    document["primary_refused"] = documents.refused_primaries(summary)
    document["dead_letters"] = await request.app[DEAD_LETTERS].counts(summary.run_id)
    return _json(document)


async def health(request: web.Request) -> web.Response:
    from runbus.query.health import read_health

    summary = await _known_run(request)
    return _json({"run_id": summary.run_id, **await read_health(request.app[STORE], summary)})


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


async def system_keys(request: web.Request) -> web.Response:
    summary = await _known_run(request)
    found = system_charts.figures(await request.app[STORE].system_keys(summary.run_id))
    return _json(
        {
            "run_id": summary.run_id,
            "keys": list(found),
            "figures": [{"key": figure, "keys": keys} for figure, keys in found.items()],
        }
    )


async def system_envelope(request: web.Request) -> web.Response:
    run_id = await _run_id(request)
    key = _text(request, "key", MAX_KEY)
    if not key:
        raise BadParameter("key is required")
    host = _text(request, "host", MAX_HOST)
    start, end, points, outliers, lines = _chart_view(request)
    store = request.app[STORE]
    found = await system_charts.system_envelope(store, run_id, key, host, start, end, points, outliers, lines)
    if found is None:
        on_host = "" if host is None else f" on host {host!r}"
        raise await _unknown(request, f"system figure {key!r}{on_host}")
    return _json(envelopes.envelope_document(found))


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
            "lines": [documents.log_document(line) for line in documents.shown_log_lines(page)],
        }
    )


def _text(request: web.Request, name: str, most: int = MAX_SEARCH) -> str | None:
    text = request.query.get(name) or None
    if text is not None and len(text) > most:
        raise BadParameter(f"{name} must be at most {most} characters")
    return text


def _x_bound(request: web.Request, name: str) -> float | None:
    text = request.query.get(name)
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        raise BadParameter(f"{name} must be a number, got {text[:40]!r}") from None
    if not math.isfinite(value) or abs(value) > 2.0**63:
        raise BadParameter(f"{name} must be a finite number within 2**63, got {text[:40]!r}")
    return value


def _chart_view(request: web.Request) -> tuple[float | None, float | None, int, int, int]:
    """An envelope's view: start, end, points, outliers and lines, each checked."""
    start, end = _x_bound(request, "start"), _x_bound(request, "end")
    if start is not None and end is not None and end < start:
        raise BadParameter("end must not be before start")
    points = _integer(request, "points", base.DEFAULT_POINTS, downsample.MIN_POINTS, base.MAX_POINTS)
    outliers = _integer(request, "outliers", base.DEFAULT_OUTLIERS, 0, base.MAX_OUTLIERS)
    lines = _integer(request, "lines", base.ALL_LINES_UP_TO, 0, base.MAX_LINES_UP_TO)
    return start, end, points, outliers, lines


async def _unknown(request: web.Request, what: str) -> web.HTTPNotFound:
    """404 for a run that does not exist, else for `what` the run does not have."""
    run_id = await _run_id(request)
    if await request.app[STORE].run(run_id) is None:
        return web.HTTPNotFound(reason=f"unknown run {run_id!r}")
    return web.HTTPNotFound(reason=f"run {run_id!r} has no {what}")


async def key_page(request: web.Request) -> web.Response:
    run_id = await _run_id(request)
    prefix, contains = _text(request, "prefix"), _text(request, "q")
    limit = _integer(request, "limit", DEFAULT_KEYS, 1, MAX_KEYS)
    offset = _integer(request, "offset", 0, 0, MAX_OFFSET)
    page = await request.app[STORE].key_page(run_id, prefix, contains, offset, limit)
    if page.total == 0 and await request.app[STORE].run(run_id) is None:
        raise web.HTTPNotFound(reason=f"unknown run {run_id!r}")
    return _json(
        {
            "run_id": run_id,
            "total": page.total,
            "offset": offset,
            "limit": limit,
            "next_offset": offset + len(page.keys) if offset + len(page.keys) < page.total else None,
            "keys": page.keys,
        }
    )


async def envelope(request: web.Request) -> web.Response:
    run_id = await _run_id(request)
    key = _text(request, "key", MAX_KEY)
    if not key:
        raise BadParameter("key is required")
    x = request.query.get("x") or None
    if x not in (None, "step", "ts"):
        raise BadParameter(f"x must be step or ts, got {x[:40]!r}")
    start, end, points, outliers, lines = _chart_view(request)
    shown = _labels(request, base.MAX_SHOWN)
    found = await request.app[STORE].envelope(
        run_id,
        key,
        "step" if x == "step" else "ts" if x == "ts" else None,
        start,
        end,
        points,
        outliers,
        lines,
        shown,
    )
    if found is None:
        raise await _unknown(request, f"metric {key!r}")
    return _json(envelopes.envelope_document(found, await _non_finite_in_view(request, found)))


# The labels an envelope names as NaN or inf at most: those that went first (the band counts all).
MAX_NON_FINITE_MARKS = 32


async def _non_finite_in_view(request: web.Request, found: base.Envelope) -> list[anomalies.Anomaly]:
    """Each label's first NaN or inf in the envelope's view, whatever its label count: the band
    counts them but names no label, and only some labels are lines."""
    on_steps = found.x == "step"
    first = await anomalies.first_non_finite(
        request.app[STORE],
        found.run_id,
        found.key,
        None if not on_steps or found.start is None else math.ceil(found.start),
        None if not on_steps or found.end is None else math.floor(found.end),
        MAX_NON_FINITE_MARKS,
    )
    if on_steps:
        return first
    return [a for a in first if (found.start or -math.inf) <= a.ts <= (found.end or math.inf)]


async def stragglers(request: web.Request) -> web.Response:
    run_id = await _run_id(request)
    key, time_key = _text(request, "key", MAX_KEY), _text(request, "time_key", MAX_KEY)
    if bool(key) == bool(time_key):
        raise BadParameter("give key (step times from when it was logged) or time_key (a key of step times)")
    start, end = _x_bound(request, "start"), _x_bound(request, "end")
    buckets = _integer(request, "buckets", base.DEFAULT_HEAT_BUCKETS, 1, base.MAX_HEAT_BUCKETS)
    limit = _integer(request, "limit", DEFAULT_STRAGGLERS, 1, MAX_LABELS)
    offset = _integer(request, "offset", 0, 0, MAX_OFFSET)
    name = time_key or key or ""
    found = await request.app[STORE].stragglers(
        run_id,
        name,
        time_key=bool(time_key),
        start=None if start is None else math.ceil(start),
        end=None if end is None else math.floor(end),
        buckets=buckets,
    )
    if found is None:
        raise await _unknown(request, f"metric {name!r}")
    return _json(envelopes.stragglers_document(found, offset, limit))


async def non_finite(request: web.Request) -> web.Response:
    summary = await _known_run(request)
    found = await outliers.every_anomaly(request.app[STORE], summary.run_id)
    return _json({"run_id": summary.run_id, "anomalies": [documents.anomaly_document(a) for a in found]})


async def labels(request: web.Request) -> web.Response:
    run_id = await _run_id(request)
    limit = _integer(request, "limit", DEFAULT_LABELS, 1, MAX_LABELS)
    offset = _integer(request, "offset", 0, 0, MAX_OFFSET)
    starts = await request.app[STORE].label_starts(run_id)
    if not starts and await request.app[STORE].run(run_id) is None:
        raise web.HTTPNotFound(reason=f"unknown run {run_id!r}")
    return _json(envelopes.labels_document(run_id, starts, offset, limit))


async def compare_config(request: web.Request) -> web.Response:
    given = list(dict.fromkeys(run for run in request.query.getall("run", []) if run))
    if not 1 <= len(given) <= MAX_COMPARED:
        raise BadParameter(f"run must be given 1 to {MAX_COMPARED} times, got {len(given)}")
    configs: dict[str, dict[str, Any] | None] = {}
    for text in given:
        run_id = await _resolved(request, text)
        summary = await request.app[STORE].run(run_id)
        if summary is None:
            raise web.HTTPNotFound(reason=f"unknown run {run_id!r}")
        configs[summary.run_id] = summary.config
    return _json(configdiff.config_diff(configs))


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


# -- the application -----------------------------------------------------------------------------


@web.middleware
async def api_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
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
    app.router.add_get("/api/compare/config", compare_config)
    app.router.add_get("/api/runs/{run}", run)
    app.router.add_get("/api/runs/{run}/health", health)
    app.router.add_get("/api/runs/{run}/metrics", metric_keys)
    app.router.add_get("/api/runs/{run}/metrics/series", metric_series)
    app.router.add_get("/api/runs/{run}/metrics/keys", key_page)
    app.router.add_get("/api/runs/{run}/metrics/envelope", envelope)
    app.router.add_get("/api/runs/{run}/stragglers", stragglers)
    app.router.add_get("/api/runs/{run}/anomalies", non_finite)
    app.router.add_get("/api/runs/{run}/labels", labels)
    app.router.add_get("/api/runs/{run}/system", system)
    app.router.add_get("/api/runs/{run}/system/keys", system_keys)
    app.router.add_get("/api/runs/{run}/system/envelope", system_envelope)
    app.router.add_get("/api/runs/{run}/logs", logs)
    app.router.add_static("/static/", STATIC, show_index=False, follow_symlinks=False)
    return app
