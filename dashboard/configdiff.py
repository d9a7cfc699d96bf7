"""The config keys on which compared runs differ: flattened, redacted, each run's value."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from runbus.redact import redact


def flatten(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """`config` as dotted keys to leaf values, as the run page lists it: a non-empty mapping is
    walked into, anything else (a list, an empty mapping, a scalar) is a value."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Mapping[str, Any]) -> None:
        for name, item in value.items():
            key = f"{prefix}.{name}" if prefix else str(name)
            if isinstance(item, Mapping) and item:
                walk(key, item)
            else:
                out[key] = item

    walk("", config or {})
    return out


def _same(values: Sequence[Any]) -> bool:
    # By their JSON, so that 1, 1.0 and true (equal in Python) read as the different values they are.
    texts = {orjson.dumps(v, option=orjson.OPT_SORT_KEYS) + type(v).__name__.encode() for v in values}
    return len(texts) == 1


def config_diff(configs: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Any]:
    """The keys whose values differ between the runs of `configs` (run id to its config), each
    with every run's value and the runs that lack it (`missing`), in key order; and how many keys
    all the runs share with one value. Values are compared and shown redacted: two secrets read
    the same (***) whatever they hold."""
    flat = {run_id: flatten(redact(dict(config or {}))) for run_id, config in configs.items()}
    keys = sorted({key for values in flat.values() for key in values})
    differing = []
    for key in keys:
        held = [run_id for run_id, values in flat.items() if key in values]
        if len(held) == len(flat) and _same([flat[run_id][key] for run_id in held]):
            continue
        differing.append({
            "key": key,
            "values": {run_id: flat[run_id][key] for run_id in held},
            "missing": [run_id for run_id in flat if run_id not in held],
        })
    return {"runs": list(flat), "keys": differing, "equal": len(keys) - len(differing)}
