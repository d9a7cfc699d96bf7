"""How runbus connects to Redis: a URL names a single server or a cluster.

`redis://`, `rediss://` and `unix://` URLs are redis-py's own and name one server.
`redis+cluster://[user:password@]host:port[,host:port…][?option=value]` (`rediss+cluster://` for
TLS) names a Redis Cluster by one or more of its nodes; the client learns the others from them.
Every key of a run carries the run as a hash tag (`runbus:{RUN}:…`, see runbus.wire), so one
run's keys share a slot while different runs spread over the shards.

redis-py is imported inside the functions: `import producer` must stay cheap.
"""

from __future__ import annotations

import functools
from typing import Any

from runbus.config import safe_url

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
DEFAULT_PORT = 6379


def is_cluster(url: str) -> bool:
    """Whether `url` names a Redis Cluster (`redis+cluster://`, `rediss+cluster://`)."""
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def cluster_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """Split a cluster URL into a redis-py URL of its first node (credentials, TLS and query
    options kept) and the (host, port) of every node it names.

    Raises ValueError for a URL that is not a cluster URL, names no node, or selects a database
    other than 0 (a cluster has only database 0).
    """
    scheme, sep, rest = url.partition("://")
    base = CLUSTER_SCHEMES.get(scheme.lower())
    if not sep or base is None:
        raise ValueError(f"not a Redis Cluster URL (redis+cluster://host:port,…): {safe_url(url)!r}")
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    userinfo, at, hosts = netloc.rpartition("@")
    path = tail.partition("?")[0]
    if path not in ("", "/", "/0"):
        raise ValueError(f"a Redis Cluster has only database 0, not {path.lstrip('/')!r}: {safe_url(url)!r}")
    nodes = [_host_port(item, url) for item in hosts.split(",") if item]
    if not nodes:
        raise ValueError(f"a Redis Cluster URL names at least one node as host:port: {safe_url(url)!r}")
    first = hosts.split(",")[0]
    return f"{base}://{userinfo}{at}{first}{tail}", nodes


def _host_port(item: str, url: str) -> tuple[str, int]:
    if item.startswith("["):  # [IPv6]:port
        host, _, port = item[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, colon, port = item.rpartition(":")
        if not colon:
            host, port = item, ""
    try:
        return host, int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"bad port in {item!r} of {safe_url(url)!r}") from None


def sync_client(url: str, **options: Any):
    """A blocking redis-py client: `redis.Redis`, or `redis.cluster.RedisCluster` for a cluster
    URL. `options` (timeouts and the like) go to every connection.

    A cluster client connects at once: when no node answers it raises redis.ConnectionError,
    as a single server's first command would.
    """
    import redis

    if not is_cluster(url):
        return redis.Redis.from_url(url, **options)
    from redis.cluster import ClusterNode, RedisCluster
    from redis.exceptions import RedisClusterException

    first, nodes = cluster_nodes(url)
    try:
        client = RedisCluster(url=first, startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]], **options)
    except RedisClusterException as exc:
        if not _unreachable(exc):
            raise
        raise redis.ConnectionError(str(exc)) from exc
    _unreachable_as_connection_error(client.nodes_manager)
    return client


def async_client(url: str, **options: Any):
    """An asyncio redis-py client: `redis.asyncio.Redis`, or `redis.asyncio.cluster.RedisCluster`
    for a cluster URL (it connects on its first command). Close it with `await client.aclose()`.
    """
    from redis.asyncio import Redis

    if not is_cluster(url):
        client = Redis.from_url(url, **options)
        pool = client.connection_pool
        pool.connection_class = _packing_with_hiredis(pool.connection_class)
        return client
    from redis.asyncio.cluster import ClusterNode

    first, nodes = cluster_nodes(url)
    return _async_cluster_class().from_url(
        first, startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]], **options
    )


def _unreachable(exc: Exception) -> bool:
    return "cannot be connected" in str(exc)


def _unreachable_as_connection_error(nodes_manager: Any) -> None:
    """redis-py says "Redis Cluster cannot be connected" (no node answers) with a
    RedisClusterException, which is no RedisError; runbus retries outages on ConnectionError, so
    the blocking client's node map, which every command and pipeline refreshes through, raises that.
    """
    import redis
    from redis.exceptions import RedisClusterException

    initialize = nodes_manager.initialize

    @functools.wraps(initialize)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return initialize(*args, **kwargs)
        except RedisClusterException as exc:
            if not _unreachable(exc):
                raise
            raise redis.ConnectionError(str(exc)) from exc

    nodes_manager.initialize = checked


@functools.cache
def _async_cluster_class() -> type:
    from redis.asyncio.cluster import RedisCluster
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisClusterException

    class Cluster(RedisCluster):
        """redis-py's asyncio RedisCluster, raising ConnectionError when no node answers (see
        _unreachable_as_connection_error): every command and pipeline (re)connects through
        initialize()."""

        async def initialize(self, *args: Any, **kwargs: Any) -> Cluster:
            try:
                return await super().initialize(*args, **kwargs)
            except RedisClusterException as exc:
                if not _unreachable(exc):
                    raise
                raise RedisConnectionError(str(exc)) from exc

    return Cluster


@functools.cache
def _packing_with_hiredis(base: type) -> type:
    """`base` (an asyncio connection class) packing commands with hiredis, in C, as redis-py's
    blocking connections already do. Its asyncio ones pack in Python, at about 0.6 µs an
    argument: an ingester pays that per event, acknowledging a thousand entries per XACK."""
    try:
        import hiredis
    except ImportError:
        return base
    from redis.exceptions import DataError

    class HiredisPacking(base):
        def pack_command(self, *args: Any) -> list[bytes]:
            # As redis-py does: a command named with a space ("CONFIG GET") is sent as two words.
            if isinstance(args[0], str):
                args = (*args[0].encode().split(), *args[1:])
            elif b" " in args[0]:
                args = (*args[0].split(), *args[1:])
            try:
                return [hiredis.pack_command(args)]
            except TypeError:
                pass
            args = tuple(bytes(a) if isinstance(a, bytearray | memoryview) else a for a in args)
            try:
                return [hiredis.pack_command(args)]
            except TypeError as exc:
                raise DataError(str(exc)) from exc

    HiredisPacking.__name__ = HiredisPacking.__qualname__ = base.__name__
    return HiredisPacking
