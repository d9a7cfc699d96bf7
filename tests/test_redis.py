"""runbus.redis's reply shapes: its clients read what stream_entries, read_streams and reply_text say."""

from __future__ import annotations

from runbus.redis import async_client, pending_entries, read_streams, reply_text, stream_entries, sync_client

FIELDS = {b"kind": b"log", b"\xff\xfe": b"\x00not utf-8\xff"}


def test_the_blocking_client_reads_bytes_in_resp2_shapes(redis_url):
    client = sync_client(redis_url)
    try:
        entry_id = client.xadd("shapes", dict(FIELDS))
        client.set("shapes-text", "rank é")
        entries = stream_entries(client.xrange("shapes"))
        assert entries == [(entry_id, FIELDS)]
        assert all(isinstance(part, bytes) for key, value in entries[0][1].items() for part in (key, value))
        assert stream_entries(client.xrevrange("shapes", count=1)) == entries
        assert read_streams(client.xread({"shapes": "0-0"})) == [(b"shapes", entries)]
        assert reply_text(client.get("shapes-text")) == "rank é"
        assert reply_text("already text") == "already text"
        assert stream_entries(client.xrange("no-such-stream")) == []
        assert read_streams(client.xread({"no-such-stream": "0-0"}, block=1)) == []
    finally:
        client.close()


async def test_the_asyncio_client_reads_bytes_in_resp2_shapes(redis_url):
    client = async_client(redis_url)
    try:
        entry_id = await client.xadd("shapes", dict(FIELDS))
        entries = stream_entries(await client.xrange("shapes"))
        assert entries == [(entry_id, FIELDS)]
        assert read_streams(await client.xread({"shapes": "0-0"})) == [(b"shapes", entries)]
        assert [reply_text(m) for m in await client.smembers("no-such-set")] == []
        await client.sadd("shapes-set", "runbus:{r}:rank0")
        assert [reply_text(m) for m in await client.smembers("shapes-set")] == ["runbus:{r}:rank0"]
        await client.xgroup_create("shapes", "readers", id="0")
        await client.xreadgroup("readers", "reader-1", {"shapes": ">"})
        await client.xreadgroup("readers", "reader-1", {"shapes": "0"})  # delivered again
        pending = pending_entries(await client.xpending_range("shapes", "readers", "-", "+", 10))
        assert [(p["message_id"], p["consumer"], p["times_delivered"]) for p in pending] == [
            (entry_id, b"reader-1", 2)
        ]
        assert isinstance(pending[0]["time_since_delivered"], int)
        assert pending_entries(await client.xpending_range("shapes", "readers", "-", "+", 10, "nobody")) == []
    finally:
        await client.aclose()
