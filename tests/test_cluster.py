"""Redis Cluster: runs spread over three masters, ingested once; dead letters and scans across shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import runbus
from runbus import wire
from runbus.ingester import maintenance
from runbus.ingester.localredis import free_port
from runbus.ingester.worker import read_chunks, streams_per_read
from runbus.redis import async_client, cluster_nodes, is_cluster, sync_client
from tests.helpers import ingest, read_store, run_cli, xadd_event
from tests.redis_cluster import redis_cluster_url  # noqa: F401

# One process per run, both labels in it (each Run has its own shipper thread).
RUN = textwrap.dedent(
    """
    import sys, runbus
    run_id, steps = sys.argv[1], int(sys.argv[2])
    runs = [
        runbus.init(run_id=run_id, label=f"rank{r}", primary=r == 0, system_interval=None, hardware=False)
        for r in range(2)
    ]
    for step in range(steps):
        for r, run in enumerate(runs):
            run.log({"loss": 1.0 / (step + 1) + r}, step=step)
    for run in runs:
        run.log_text(f"{run.identity.label} done")
    assert all([run.finish() for run in reversed(runs)]), "finish did not ship everything"
    """
)
# Chosen so that their slots fall on every master of a three-master cluster.
RUNS = [f"cl-{i}" for i in range(6)]


@pytest.fixture
def cluster_url(redis_cluster_url: str) -> str:  # noqa: F811 (the imported fixture)
    """The session's cluster, every master emptied first."""
    client = sync_client(redis_cluster_url)
    try:
        client.flushall(target_nodes=client.PRIMARIES)
    finally:
        client.close()
    return redis_cluster_url


def test_cluster_urls():
    assert is_cluster("redis+cluster://a:1") and is_cluster("REDISS+CLUSTER://a:1")
    assert not is_cluster("redis://a:1/0") and not is_cluster("unix:///tmp/redis.sock")
    first, nodes = cluster_nodes("rediss+cluster://u:p%40w@h1:7000,[::1]:7001,h3/0?ssl_cert_reqs=none")
    assert first == "rediss://u:p%40w@h1:7000/0?ssl_cert_reqs=none"
    assert nodes == [("h1", 7000), ("::1", 7001), ("h3", 6379)]
    with pytest.raises(ValueError, match="only database 0"):
        cluster_nodes("redis+cluster://h1:7000/2")
    with pytest.raises(ValueError, match="bad port"):
        cluster_nodes("redis+cluster://h1:x")
    with pytest.raises(ValueError, match="at least one node"):
        cluster_nodes("redis+cluster://")


def test_read_chunks_keep_each_call_in_one_slot():
    streams = [wire.stream_key(run, f"rank{r}") for run in RUNS for r in range(3)]
    assert read_chunks(streams, 4096) == [streams]
    by_slot = read_chunks(streams, 4096, by_slot=True)
    per_run = [streams[i : i + 3] for i in range(0, len(streams), 3)]
    assert sorted(map(sorted, by_slot)) == sorted(map(sorted, per_run))
    # A read brings at most READ_ENTRIES entries: the larger the batch, the fewer streams a call.
    for batch_size, per_call in ((4096, 64), (1000, 262), (10, 26214), (1_000_000, 1)):
        assert streams_per_read(batch_size) == per_call
    many = [wire.stream_key("big", f"rank{r}") for r in range(65)]
    assert [len(chunk) for chunk in read_chunks(many, 4096, by_slot=True)] == [64, 1]


def test_runs_spread_over_shards_are_ingested_once(cluster_url, store_url):
    steps = 30
    env = {**os.environ, "RUNBUS_REDIS_URL": cluster_url, "RUNBUS_CONSOLE": "off"}
    processes = [subprocess.Popen([sys.executable, "-c", RUN, run, str(steps)], env=env) for run in RUNS]
    assert [p.wait(60) for p in processes] == [0] * len(RUNS)

    client = sync_client(cluster_url)
    try:
        masters = {client.get_node_from_key(wire.stream_key(run, "rank0")).name for run in RUNS}
        assert len(masters) >= 2, masters
        # Every key of a run shares its slot: the run is their hash tag.
        for run in RUNS:
            keys = list(client.scan_iter(match=f"runbus:{{{run}}}:*"))
            assert len(keys) >= 4 and len({client.keyslot(key) for key in keys}) == 1  # streams, epochs
        # By hand, on two other shards than each other, neither in the registry: a stream with a
        # bad entry, and one with a good one; plus a bad entry in a producer's stream.
        bad, by_hand = wire.stream_key("hand-bad", "rank0"), wire.stream_key("by-hand", "rank0")
        assert client.get_node_from_key(bad).name != client.get_node_from_key(by_hand).name
        fields = wire.encode_fields("bogus", "hand-bad", "rank0", 1, 1, 1000.0, b"{}", None)
        client.xadd(bad, fields)
        xadd_event(client, "by-hand", "rank0", "metric", 1, 1, {"loss": 0.5}, step=0)
        mismatch = wire.encode_fields("log", "cl-3", "rank1", 1, 99, 1.0, b"{}", None)
        client.xadd(wire.stream_key("cl-2", "rank1"), mismatch)
        registered = {m.decode() for m in client.smembers(wire.REGISTRY_KEY)}
        assert registered == {wire.stream_key(run, f"rank{r}") for run in RUNS for r in range(2)}
    finally:
        client.close()

    started = time.monotonic()
    stats = ingest(cluster_url, store_url)
    assert time.monotonic() - started < 20
    assert stats.dead_lettered == 2 and stats.duplicates == 0

    stored = 0
    for run_id in RUNS:
        run = read_store(store_url, "run", run_id)
        assert run.state == "finished" and run.primary == "rank0" and run.exit_code == 0
        assert run.counts == {"metric": 2 * steps, "log": 2, "system": 0}
        assert [lab.label for lab in run.labels] == ["rank0", "rank1"]
        for lab in run.labels:
            assert lab.state == "finished" and lab.missing == 0 and lab.events == lab.last_seq
            stored += lab.events
        points = read_store(store_url, "metrics", run_id, key="loss", label="rank1")
        assert [p.value for p in points] == [1.0 / (s + 1) + 1 for s in range(steps)]
    assert [p.value for p in read_store(store_url, "metrics", "by-hand")] == [0.5]
    assert stats.stored == stored + 1
    # Everything was acknowledged on every shard: a second pass finds nothing.
    assert ingest(cluster_url, store_url).entries == 0

    listed = json.loads(run_cli("dead", "--json", "--redis", cluster_url).stdout)
    reasons = {letter["source_stream"]: letter["reason"] for letter in listed}
    assert reasons.keys() == {bad, wire.stream_key("cl-2", "rank1")}
    assert "unknown kind 'bogus'" in reasons[bad]
    assert "do not match key" in reasons[wire.stream_key("cl-2", "rank1")]


async def test_maintenance_on_a_shard(cluster_url):
    key, group = wire.stream_key("maint", "rank0"), "maintained"
    client = async_client(cluster_url)
    try:
        entry = await client.xadd(key, {"v": "1"})
        await client.sadd(wire.REGISTRY_KEY, key)
        await client.xgroup_create(key, group, id="0")
        await client.xreadgroup(group, "me", {key: ">"})
        await client.xack(key, group, entry)
        assert await maintenance.trim(client, key, 0) >= 0
        assert await maintenance.release_consumer(client, key, group, "me")
        await client.xdel(key, entry)
        assert await maintenance.remove_if_empty(client, key, 0)
        assert not await client.exists(key) and not await client.sismember(wire.REGISTRY_KEY, key)
    finally:
        await client.aclose()


def test_producer_rides_out_a_cluster_that_does_not_answer():
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    started = time.monotonic()
    run = runbus.init(
        run_id="nocluster",
        label="rank0",
        redis_url=url,
        system_interval=None,
        hardware=False,
        finish_timeout=0.5,
        max_backoff=0.1,
        console="off",
    )
    assert time.monotonic() - started < 2
    run.log({"loss": 1.0})
    assert run.finish() is False  # buffered, never shipped, and the shipper thread did not die


def test_worker_cli_reads_a_cluster_entry(cluster_url, store_url):
    client = sync_client(cluster_url)
    try:
        xadd_event(client, "cli-run", "rank0", "start", 1, 1, {"primary": True})
        xadd_event(client, "cli-run", "rank0", "finish", 1, 2, {"exit_code": 0})
    finally:
        client.close()
    run_cli("--store", store_url, "ingest", "--redis", cluster_url, "--burst")
    assert read_store(store_url, "run", "cli-run").state == "finished"
