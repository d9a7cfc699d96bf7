"""How runbus connects to Redis (a URL names a single server or a cluster), and the replies it reads.

`redis://`, `rediss://` and `unix://` URLs are redis-py's own and name one server.
`redis+cluster://[user:password@]host:port[,host:port…][?option=value]` (`rediss+cluster://` for
TLS) names a Redis Cluster by one or more of its nodes; the client learns the others from them.
Every key of a run carries the run as a hash tag (`runbus:{RUN}:…`, see runbus.wire), so one
run's keys share a slot while different runs spread over the shards.

redis-py is imported inside the functions: `import runbus` must stay cheap.

runbus's clients never set decode_responses, and speak RESP2: keys, fields and values come back
as bytes. redis-py types its replies for every setting (bytes or str, RESP2 or RESP3 shapes);
`stream_entries`, `read_streams`, `pending_entries` and `reply_text` give them the shape runbus's
clients read.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict, TypeVar, cast

from runbus.config import safe_url
from runbus.errors import AccessDenied
from runbus.redact import redact_text, url_secrets

if TYPE_CHECKING:
    import redis
    import redis.asyncio
    import redis.asyncio.cluster
    import redis.cluster
    from redis.asyncio.connection import AbstractConnection
    from redis.typing import StreamRangeResponse, XPendingRangeResponse, XReadResponse

    # What sync_client and async_client return.
    SyncClient: TypeAlias = redis.Redis | redis.cluster.RedisCluster
    AsyncClient: TypeAlias = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster

StreamEntry: TypeAlias = tuple[bytes, dict[bytes, bytes]]
"""One entry of a stream as runbus's clients read it: (entry id, {field: value})."""


class PendingEntry(TypedDict):
    """One entry of an XPENDING range (redis-py's xpending_range) as runbus's clients read it."""

    message_id: bytes
    consumer: bytes
    time_since_delivered: int  # milliseconds
    times_delivered: int


E = TypeVar("E", bound=BaseException)


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


def sync_client(url: str, **options: Any) -> SyncClient:
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
        # redis-py leaves ClusterNode.__init__ unannotated.
        startup = [ClusterNode(h, p) for h, p in nodes[1:]]  # type: ignore[no-untyped-call]
        client = RedisCluster(url=first, startup_nodes=startup, **options)
    except RedisClusterException as exc:
        if not _unreachable(exc):
            raise
        raise redis.ConnectionError(str(exc)) from exc
    _unreachable_as_connection_error(client.nodes_manager)
    return client


def async_client(url: str, **options: Any) -> AsyncClient:
    """An asyncio redis-py client: `redis.asyncio.Redis`, or `redis.asyncio.cluster.RedisCluster`
    for a cluster URL (it connects on its first command). Close it with `await client.aclose()`.
    """
    from redis.asyncio import Redis

    if not is_cluster(url):
        client = Redis.from_url(url, **options)
        pool = client.connection_pool
        # A class is hashable; mypy does not see it through functools.cache (python/mypy#11470).
        pool.connection_class = _packing_with_hiredis(pool.connection_class)  # type: ignore[arg-type]
        return client
    from redis.asyncio.cluster import ClusterNode

    first, nodes = cluster_nodes(url)
    return _async_cluster_class().from_url(
        first, startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]], **options
    )


def stream_entries(reply: StreamRangeResponse | None) -> list[StreamEntry]:
    """An XRANGE or XREVRANGE reply as runbus's clients read it (bytes; see the module doc).

    redis-py also allows (id, None) for an entry deleted while pending, which only XREADGROUP's
    history and XCLAIM return, never a range.
    """
    return cast("list[StreamEntry]", reply or [])


def read_streams(reply: XReadResponse) -> list[tuple[bytes, list[StreamEntry]]]:
    """An XREAD reply as runbus's clients read it (RESP2, bytes): [(stream key, its entries)]."""
    # RESP2 gives each stream as a two-item list [key, entries].
    return [(key, entries) for key, entries in cast("list[list[Any]]", reply or [])]


def pending_entries(reply: XPendingRangeResponse) -> list[PendingEntry]:
    """An XPENDING range reply (xpending_range) as runbus's clients read it (bytes)."""
    return cast("list[PendingEntry]", reply)


def reply_text(reply: bytes | str) -> str:
    """A key or value of a reply as text (runbus's clients read bytes: UTF-8, strict)."""
    return reply.decode() if isinstance(reply, bytes) else reply


def access_denied(exc: BaseException, url: str) -> AccessDenied | None:
    """`exc` as an AccessDenied when it says Redis refused runbus's credentials or rights, or
    that its TLS certificate is not trusted: retrying cannot help. None for anything else.

    A wrong password comes as redis-py's AuthenticationError, a ConnectionError: it must be told
    apart before an outage is retried. An untrusted certificate comes as a ConnectionError too,
    raised while handling ssl's SSLCertVerificationError.
    """
    import ssl

    from redis.exceptions import AuthenticationError, AuthenticationWrongNumberOfArgsError, NoPermissionError

    where = f"Redis at {safe_url(url)}"
    said = redact_text(str(exc), url_secrets(url))
    if isinstance(exc, AuthenticationError | AuthenticationWrongNumberOfArgsError):
        if safe_url(url) == url:  # nothing masked: no password given
            return AccessDenied(
                f"{where} needs a password ({said}): give it in the Redis URL, "
                "redis://[USER]:PASSWORD@HOST:PORT/DB"
            )
        return AccessDenied(
            f"{where} refused the credentials ({said}): fix the user or password in the Redis URL"
        )
    if isinstance(exc, NoPermissionError):
        return AccessDenied(f"{where} does not let this user run a command runbus needs ({said})")
    certificate = _caused_by(exc, ssl.SSLCertVerificationError)
    if certificate is not None:
        return AccessDenied(
            f"{where}: its TLS certificate is not trusted ({certificate.verify_message or certificate}): "
            "trust its authority (?ssl_ca_certs=PATH) or connect by the name the certificate holds"
        )
    return None


def _caused_by(exc: BaseException, kind: type[E]) -> E | None:
    """The first exception of `kind` in `exc`'s chain of causes and contexts, or None."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, kind):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


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
def _async_cluster_class() -> type[redis.asyncio.cluster.RedisCluster]:
    from redis.asyncio.cluster import RedisCluster
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisClusterException

    class Cluster(RedisCluster):
        """redis-py's asyncio RedisCluster, raising ConnectionError when no node answers (see
        _unreachable_as_connection_error): every command and pipeline (re)connects through
        initialize()."""

        async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
            try:
                return await super().initialize(*args, **kwargs)
            except RedisClusterException as exc:
                if not _unreachable(exc):
                    raise
                raise RedisConnectionError(str(exc)) from exc

    return Cluster


@functools.cache
def _packing_with_hiredis(base: type[AbstractConnection]) -> type[AbstractConnection]:
    """`base` (an asyncio connection class) packing commands with hiredis, in C, as redis-py's
    blocking connections already do. Its asyncio ones pack in Python, at about 0.6 µs an
    argument: an ingester pays that per event, acknowledging a thousand entries per XACK."""
    try:
        import hiredis
    except ImportError:
        return base
    from redis.exceptions import DataError

    # The base is the pool's connection class, known at run time only: mypy cannot check it.
    class HiredisPacking(base):  # type: ignore[misc, valid-type]
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
