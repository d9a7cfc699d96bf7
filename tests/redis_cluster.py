"""A throwaway three-master Redis Cluster on loopback ports, started from redis-server binaries."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from runbus.ingester.localredis import LocalRedis, RedisServerNotFound, free_port
from tests.conftest import missing_server

# Redis Cluster's bus listens on the client port + 10000.
BUS_OFFSET = 10_000


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free loopback port whose cluster bus port is free too."""
    while True:
        port = free_port()
        if port + BUS_OFFSET < 65536 and _port_free(port + BUS_OFFSET):
            return port


def find_redis_cli() -> str:
    """redis-cli next to redis-server, else from PATH."""
    from runbus.ingester.localredis import find_redis_server

    beside = os.path.join(os.path.dirname(find_redis_server()), "redis-cli")
    found = beside if os.access(beside, os.X_OK) else shutil.which("redis-cli")
    if not found:
        raise RedisServerNotFound("no redis-cli found to create a cluster with")
    return found


@dataclass
class LocalCluster:
    """`masters` redis-server processes joined by `redis-cli --cluster create`, no replicas."""

    masters: int = 3
    nodes: list[LocalRedis] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The runbus URL naming every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def start(self, timeout: float = 20.0) -> LocalCluster:
        cli = find_redis_cli()
        try:
            for _ in range(self.masters):
                node = LocalRedis(port=cluster_port())
                node.extra_args = (
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    os.path.join(node.directory, f"nodes-{node.port}.conf"),
                    "--cluster-node-timeout",
                    "5000",
                )
                self.nodes.append(node)
                node.start()
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            created = subprocess.run(
                [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if created.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}\n{created.stderr}")
            self._wait_ok(cli, timeout)
        except BaseException:
            self.cleanup()
            raise
        return self

    def _wait_ok(self, cli: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        waiting = list(self.nodes)
        while waiting:
            port = str(waiting[0].port)
            info = subprocess.run(
                [cli, "-p", port, "cluster", "info"], capture_output=True, text=True, timeout=5
            ).stdout
            if "cluster_state:ok" in info:
                waiting.pop(0)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {timeout}s on port {waiting[0].port}:\n{info}")
            time.sleep(0.05)

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
        self.nodes.clear()


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A `redis+cluster://` URL of a fresh three-master cluster for this session."""
    try:
        cluster = LocalCluster().start()
    except RedisServerNotFound:
        missing_server("redis-server and redis-cli (for a Redis Cluster)")
        return
    try:
        yield cluster.url
    finally:
        cluster.cleanup()
