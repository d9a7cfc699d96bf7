"""Run metadata from the producer's calls to what `runbus show`, `runbus runs` and runbus.Api
say: config updates, summaries, names and tags across processes and labels, hostile values, a
Redis that is away, entries written by hand, on SQLite and PostgreSQL, against a real Redis."""

from __future__ import annotations

import argparse
import enum
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import orjson
import pytest
import redis
import torch

import runbus
from runbus import wire
from runbus.errors import InvalidName, RunFinished
from runbus.redact import MARKER
from tests.helpers import QUIET, ingest, read_store, run_cli, wait_for, xadd_event
from tests.test_secrets import store_contents

SECRET = "sekrit-key-1"
TOKEN = "hf_" + "MeTaToKeN" * 4

RANK = textwrap.dedent(
    """
    import json, os, runbus
    rank = int(os.environ["RANK"])
    run = runbus.init(
        config={"lr": 0.1, "rank": rank, "api_key": os.environ["SECRET"]},
        name="two ranks", tags=["ddp", f"r{rank}"], console="off", system_interval=None,
    )
    run.config.update({"epochs": 3, "lr": 0.2 if rank == 0 else 0.5})
    run.config["warmup"] = rank
    for step in range(5):
        run.log({"loss": 1 / (step + 1)}, step=step)
    run.summary["best_loss"] = 0.2 + rank
    run.summary.update(steps=5)
    if rank == 1:
        run.name = "the worker's name"   # any label may: the primary's wins
    finished = run.finish()
    try:
        run.summary["late"] = 1
        late = None
    except runbus.RunFinished as exc:
        late = str(exc)
    print(json.dumps({"finished": finished, "late": late, "config": dict(run.config), "tags": run.tags}))
    """
)


@pytest.fixture(params=["sqlite", "postgres"])
def any_store(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("store_url" if request.param == "sqlite" else "postgres_url")


def two_ranks(redis_url: str, run_id: str) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK],
            env={
                **os.environ,
                "RUNBUS_REDIS_URL": redis_url,
                "RUNBUS_RUN_ID": run_id,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "SECRET": SECRET,
            },
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        outputs.append(json.loads(out.splitlines()[-1]))
    return outputs


def kinds(client: redis.Redis, run_id: str, label: str) -> list[str]:
    return [fields[b"kind"].decode() for _, fields in client.xrange(wire.stream_key(run_id, label))]


def test_metadata_reaches_show_runs_and_the_api_from_two_processes(redis_url, any_store):
    outputs = two_ranks(redis_url, "meta-e2e")
    for rank, out in enumerate(outputs):
        assert out["finished"] is True
        assert out["late"] == f"run meta-e2e/rank{rank} has finished: its metadata can no longer change"
        assert out["config"]["api_key"] == MARKER and out["tags"] == ["ddp", f"r{rank}"]
    with redis.Redis.from_url(redis_url) as client:
        for label in ("rank0", "rank1"):
            written = kinds(client, "meta-e2e", label)
            assert written[-1] == "finish" and written.count("meta") == (6 if label == "rank1" else 5)
            raw = b"".join(f[b"data"] for _, f in client.xrange(wire.stream_key("meta-e2e", label)))
            assert SECRET.encode() not in raw  # redacted before it left the process
    ingest(redis_url, any_store)
    assert SECRET not in store_contents(any_store)

    doc = json.loads(run_cli("--store", any_store, "show", "meta-e2e", "--json").stdout)
    assert (doc["name"], doc["tags"]) == ("two ranks", ["ddp", "r0"])
    assert doc["config"] == {"lr": 0.2, "rank": 0, "api_key": MARKER, "epochs": 3, "warmup": 0}
    assert doc["summary"] == {"best_loss": 0.2, "steps": 5}
    assert doc["set_by"] == {
        "config": dict.fromkeys(doc["config"], "rank0"),
        "summary": {"best_loss": "rank0", "steps": "rank0"},
        "name": "rank0",
        "tags": "rank0",
    }
    rank1 = doc["labels"][1]
    assert rank1["config"] == {"lr": 0.5, "rank": 1, "api_key": MARKER, "epochs": 3, "warmup": 1}
    assert (rank1["summary"], rank1["name"], rank1["tags"]) == (
        {"best_loss": 1.2, "steps": 5},
        "the worker's name",
        ["ddp", "r1"],
    )
    assert doc["counts"] == {"metric": 10, "log": 0, "system": 0}

    shown = run_cli("--store", any_store, "show", "meta-e2e").stdout
    assert "name     two ranks  (set by rank0)" in shown and "tags     ddp, r0  (set by rank0)" in shown
    assert "  lr: 0.2  (rank0; also rank1 0.5)" in shown and "  epochs: 3  (rank0)\n" in shown
    assert "  best_loss: 0.2  (rank0; also rank1 1.2)" in shown and SECRET not in shown
    listed = run_cli("--store", any_store, "runs").stdout.splitlines()
    assert listed[0].split()[:3] == ["RUN", "NAME", "TAGS"]
    assert listed[1].startswith("meta-e2e") and "two ranks" in listed[1] and "ddp, r0" in listed[1]
    [listed_doc] = json.loads(run_cli("--store", any_store, "runs", "--json").stdout)
    assert (listed_doc["name"], listed_doc["tags"], listed_doc["summary"]) == (
        "two ranks",
        ["ddp", "r0"],
        doc["summary"],
    )

    with runbus.Api(any_store) as api:
        [row] = api.runs().itertuples(index=False)
        assert (row.name, row.tags, row.config, row.summary) == (
            "two ranks",
            ["ddp", "r0"],
            doc["config"],
            doc["summary"],
        )
        run = api.run("meta-e2e")
        assert (run.name, run.tags, run.config, run.summary) == (row.name, row.tags, row.config, row.summary)
        assert run.set_by.config["lr"] == "rank0" and run.set_by.name == "rank0"
        assert run.label_config("rank1") == rank1["config"]
        assert run.label_summary("rank1") == {"best_loss": 1.2, "steps": 5}
        with pytest.raises(KeyError, match="no label 'rank7'; its labels: rank0, rank1"):
            run.label_config("rank7")


# -- what the producer accepts ---------------------------------------------------------------------


@pytest.fixture
def live(redis_url):
    run = runbus.init(run_id="meta-live", label="rank0", redis_url=redis_url, **QUIET)
    yield run
    run.finish()


def sent(redis_url: str, run: runbus.Run) -> list[dict]:
    """The data of every meta event `run` has sent, once it has shipped everything to Redis."""
    wait_for("every event shipped", lambda: not run.buffered)
    with redis.Redis.from_url(redis_url) as client:
        return [
            orjson.loads(fields[b"data"])
            for _, fields in client.xrange(wire.stream_key(run.run_id, run.label))
            if fields[b"kind"] == b"meta"
        ]


class Colour(enum.IntEnum):
    RED = 1


def test_values_json_cannot_hold_become_plain_json(redis_url, live):
    live.config.update(
        {
            "path": Path("/data/x"),
            "ids": {3, 1, 2},
            "pair": (1, 2.5),
            "colour": Colour.RED,
            "nan": float("nan"),
            "inf": np.float64("-inf"),
            "np_int": np.int64(7),
            "scalar": torch.tensor(0.5),
            "matrix": torch.ones(2, 2),
            "big": torch.zeros(5000),
            "int_keys": {1: "one"},
            "huge_int": 2**80,
            "opaque": object,
        }
    )
    [data] = sent(redis_url, live)
    config = data["config"]
    assert config["path"] == "/data/x" and config["ids"] == [1, 2, 3] and config["pair"] == [1, 2.5]
    assert (config["colour"], config["nan"], config["inf"], config["np_int"]) == (1, "NaN", "-Infinity", 7)
    assert config["scalar"] == 0.5 and config["matrix"] == [[1.0, 1.0], [1.0, 1.0]]
    assert config["big"].startswith("tensor([0., 0.") and config["int_keys"] == {"1": "one"}
    assert config["huge_int"] == str(2**80) and config["opaque"] == "<class 'object'>"
    assert dict(live.config) == config  # what this label set, as sent
    live.summary.update({"loss": torch.tensor(float("nan"))}, acc=np.float32(0.25))
    assert sent(redis_url, live)[-1] == {"summary": {"loss": "NaN", "acc": 0.25}}
    live.config.update(argparse.Namespace(batch=32))  # an argparse.Namespace, as at init
    assert live.config["batch"] == 32


def test_bad_updates_raise_and_send_nothing(redis_url, live):
    bad = [
        (lambda: live.config.update({"": 1}), ValueError, "config key '' must have 1 to 256 characters"),
        (lambda: live.summary.update({"k" * 257: 1}), ValueError, "must have 1 to 256 characters"),
        (
            lambda: live.config.update({"x": "a" * (wire.MAX_DATA_BYTES // 2)}),
            ValueError,
            "over the limit of 524288",
        ),
        (
            lambda: live.config.update({f"k{n}": n for n in range(10_001)}),
            ValueError,
            "10001 keys, over the limit",
        ),
        (lambda: live.config.update({"text": "lone \ud800"}), ValueError, "not valid UTF-8"),
        (lambda: live.summary.update(3), TypeError, "summary must be a dict, not int"),
        (lambda: live.summary.update(argparse.Namespace(a=1)), TypeError, "summary must be a dict"),
        (lambda: live.config.__delitem__("lr"), TypeError, "cannot be removed"),
    ]
    looped: dict = {}
    looped["self"] = looped
    bad.append((lambda: live.config.update(looped), ValueError, "nests deeper than 100 levels"))
    for call, error, message in bad:
        with pytest.raises(error, match=re.escape(message)):
            call()
    with pytest.raises(AttributeError):
        live.config = {}  # type: ignore[misc]
    assert sent(redis_url, live) == [] and dict(live.config) == {} and dict(live.summary) == {}


def test_a_label_sets_at_most_max_meta_keys_in_all(redis_url, live):
    live.config.update({f"k{n}": n for n in range(wire.MAX_META_KEYS)})
    live.config.update({"k0": "again"})  # a key it set already
    with pytest.raises(ValueError, match="would hold 10001 keys from this label"):
        live.config["one more"] = 1
    assert len(live.config) == wire.MAX_META_KEYS and len(sent(redis_url, live)) == 2


def test_bad_names_and_tags_are_clear_errors(redis_url, live):
    for name, message in [
        ("", "1 to 128 characters, not 0"),
        ("n" * 129, "1 to 128 characters, not 129"),
        (" padded", "starts or ends with white space"),
        ("two\nlines", "control character U+000A"),
        ("bidi\u202eevil", "control character U+202E"),
        (5, "must be a string, not int"),
        (f"token {TOKEN}", "looks like it holds a secret"),
    ]:
        with pytest.raises(InvalidName, match=re.escape(message)):
            live.name = name
    for tags, message in [
        ("single", "tags must be a list of strings, not str"),
        (["has space"], "invalid tag 'has space'"),
        (["a,b"], "invalid tag 'a,b'"),
        ([""], "invalid tag ''"),
        ([7], "invalid tag 7"),
        (["t" * 65], "invalid tag"),
        ([f"t{n}" for n in range(33)], "at most 32 tags, not 33"),
        ([TOKEN], "looks like a secret"),
    ]:
        with pytest.raises(InvalidName, match=re.escape(message)):
            live.tags = tags
    with pytest.raises(InvalidName, match="invalid tag"):
        runbus.init(run_id="meta-bad", redis_url=redis_url, tags=["no spaces please"], **QUIET)
    with pytest.raises(ValueError, match="white space"):
        runbus.init(run_id="meta-bad", redis_url=redis_url, name="x ", **QUIET)
    assert sent(redis_url, live) == [] and (live.name, live.tags) == (None, ())
    live.set_tags(["a", "b", "a", "κ-1", "lr=3e-4"])
    live.name = "ünï ✓ (baseline)"
    assert (live.name, live.tags) == ("ünï ✓ (baseline)", ("a", "b", "κ-1", "lr=3e-4"))
    live.tags = []
    assert sent(redis_url, live) == [
        {"tags": ["a", "b", "κ-1", "lr=3e-4"]},
        {"name": "ünï ✓ (baseline)"},
        {"tags": []},
    ]


def test_secrets_in_keys_and_values_never_leave_the_process(redis_url, live):
    live.config.update(
        {
            TOKEN: 1,
            "db_password": "sekrit-2",
            "nested": {"auth_token": "sekrit-3", "url": "postgresql://u:sekrit-4@db/x"},
            "header": "Authorization: Bearer sekrit-bearer-token-5",
        }
    )
    live.summary["note"] = f"used {TOKEN}"
    data = sent(redis_url, live)
    assert data == [
        {
            "config": {
                MARKER: 1,
                "db_password": MARKER,
                "nested": {"auth_token": MARKER, "url": "postgresql://u:***@db/x"},
                "header": "Authorization: Bearer ***",
            }
        },
        {"summary": {"note": f"used {MARKER}"}},
    ]
    with redis.Redis.from_url(redis_url) as client:
        raw = repr(client.xrange(wire.stream_key("meta-live", "rank0")))
    assert "sekrit" not in raw and TOKEN not in raw


def test_after_finish_updates_raise_and_nothing_follows_the_finish(redis_url):
    with runbus.init(run_id="meta-after", redis_url=redis_url, name="n", **QUIET) as run:
        run.config["a"] = 1
    for call in (
        lambda: run.config.update({"b": 2}),
        lambda: run.summary.__setitem__("c", 3),
        lambda: setattr(run, "name", "again"),
        lambda: run.set_tags(["x"]),
    ):
        with pytest.raises(RunFinished, match="has finished: its metadata can no longer change"):
            call()
    assert dict(run.config) == {"a": 1} and run.name == "n"  # still readable
    with redis.Redis.from_url(redis_url) as client:
        assert kinds(client, "meta-after", "rank0") == ["start", "meta", "meta", "finish"]


def test_metadata_is_kept_when_the_buffers_are_full_and_redis_is_down(local_redis, store_url):
    local_redis.kill()
    run = runbus.init(
        run_id="meta-full",
        redis_url=local_redis.url,
        max_backoff=0.2,
        max_buffer_events=1,
        max_buffer_bytes=1,  # no room for anything but what is never dropped
        finish_timeout=60,
        spool_dir=False,  # nor a spool
        name="kept",
        tags=["t"],
        **QUIET,
    )
    for step in range(500):
        run.log({"loss": float(step)}, step=step)
        if step % 100 == 0:
            run.config.update({f"at{step}": step})
            run.summary["last"] = step
    assert run.dropped > 400
    local_redis.start()
    assert run.finish() is False  # metrics were dropped
    ingest(local_redis.url, store_url)
    stored = read_store(store_url, "run", "meta-full")
    assert (stored.name, stored.tags, stored.summary) == ("kept", ["t"], {"last": 400})
    assert stored.config == {f"at{step}": step for step in range(0, 500, 100)}
    label = stored.labels[0]
    assert label.missing == run.dropped and sum(g.dropped for g in label.gaps) == run.dropped


# -- entries written by hand -----------------------------------------------------------------------

GOOD = {"config": {"by": "hand"}, "summary": {"best": 0.5}, "name": "by hand", "tags": ["cli"]}
BAD_DATA = [
    b'{"config": []}',
    b'{"summary": "0.5"}',
    b'{"name": 5}',
    b'{"name": "bell\\u0007"}',
    b'{"tags": "one"}',
    b'{"tags": ["a b"]}',
    b'{"other": 1}',
    b"{}",
    b'{"config": {"k": "\xff\xfe"}}',  # not UTF-8 inside the JSON
    b"\xff\xfe",
]


def test_hand_written_meta_entries_are_stored_or_dead_lettered_with_a_reason(redis_url, any_store, decoder):
    key = wire.stream_key("meta-hand", "rank0")
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, "meta-hand", "rank0", "start", 1, 1, {"primary": True})
        xadd_event(client, "meta-hand", "rank0", "meta", 1, 2, GOOD)
        entries = []
        for seq, data in enumerate(BAD_DATA, start=3):
            fields = wire.encode_fields("meta", "meta-hand", "rank0", 1, seq, 1.7e9, data, None)
            entries.append(fields)
            client.xadd(key, fields)
        odd = wire.encode_fields("meta", "meta-hand", "rank0", 1, 99, 1.7e9, orjson.dumps(GOOD), 3)
        entries.append(odd)  # a step on a meta event
        client.xadd(key, odd)
        not_utf8_field = {**wire.encode_fields("meta", "meta-hand", "rank0", 1, 98, 1.7e9, b"{}", None)}
        not_utf8_field["label"] = b"rank0\xff"
        entries.append(not_utf8_field)
        client.xadd(key, not_utf8_field)
        stats = ingest(redis_url, any_store)
        assert (stats.stored, stats.dead_lettered) == (2, len(entries))
        reasons = [f[b"reason"].decode() for _, f in client.xrange(wire.DEAD_LETTER_KEY)]
    expected = []
    for fields in entries:
        with pytest.raises(wire.InvalidEntry) as refused:
            wire.decode_entry(
                key, {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}
            )
        expected.append(str(refused.value))
    assert reasons == expected
    assert expected[:8] == [
        "meta config must be an object",
        "meta summary must be an object",
        "meta: a run name must be a string, not int",
        "meta: run name 'bell\\x07' holds the control character U+0007",
        "meta: tags must be a list of strings, not str",
        "meta: invalid tag 'a b': must match [\\w.:/=+@-]{1,64} (1 to 64 letters, digits, '_', '.', "
        "':', '/', '=', '+', '@', '-'; no spaces or commas)",
        "meta data field 'other' is unknown: use config, summary, name, tags",
        "meta data is empty: it sets one or more of config, summary, name, tags",
    ]
    assert expected[8].startswith("data is not JSON") and expected[9].startswith("data is not JSON")
    assert expected[10:] == ["field 'step' is only for metric events, not meta", "field 'label' is not UTF-8"]
    run = read_store(any_store, "run", "meta-hand")
    assert (run.config, run.summary, run.name, run.tags) == (
        {"by": "hand"},
        {"best": 0.5},
        "by hand",
        ["cli"],
    )


def test_a_kind_an_ingester_does_not_know_is_dead_lettered(redis_url, store_url, decoder):
    """What an ingester from before `meta` does with a meta entry, shown with a kind this one
    does not know: the entry is dead-lettered, everything else of the label is stored."""
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, "meta-future", "rank0", "start", 1, 1, {"primary": True})
        xadd_event(client, "meta-future", "rank0", "meta-v2", 1, 2, {"config": {"a": 1}})
        xadd_event(client, "meta-future", "rank0", "finish", 1, 3, {"exit_code": 0})
        stats = ingest(redis_url, store_url)
        [(_, letter)] = client.xrange(wire.DEAD_LETTER_KEY)
    assert (stats.stored, stats.dead_lettered) == (2, 1)
    assert letter[b"reason"] == b"unknown kind 'meta-v2'"
    run = read_store(store_url, "run", "meta-future")
    assert (run.state, run.labels[0].missing) == ("finished", 1)


def test_numbers_from_the_producer_read_back_as_sent(redis_url, store_url):
    with runbus.init(run_id="meta-numbers", redis_url=redis_url, **QUIET) as run:
        run.summary.update(
            {"pi": math.pi, "big": 2**63 - 1, "tiny": 5e-324, "neg": -0.0, "nan": float("nan")}
        )
    ingest(redis_url, store_url)
    summary = read_store(store_url, "run", "meta-numbers").summary
    assert summary == {"pi": math.pi, "big": 2**63 - 1, "tiny": 5e-324, "neg": -0.0, "nan": "NaN"}
