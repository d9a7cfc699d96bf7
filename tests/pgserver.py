"""A PostgreSQL server for tests, and the fixtures that give each test a database of its own.

The server is, in order of preference: RUNBUS_TEST_POSTGRES_DSN; a testcontainers PostgreSQL when
a Docker engine answers; a throwaway cluster (`initdb` + `pg_ctl`) on a free loopback port.
"""

from __future__ import annotations

import asyncio
import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import asyncpg

from runbus.ingester.localredis import free_port

UNPRIVILEGED_USER = "nobody"


class PostgresNotFound(RuntimeError):
    """No initdb/pg_ctl binaries, or no way to run them as a user other than root."""


def find_postgres_bin(name: str) -> str:
    """Path of a PostgreSQL server program: from PATH, else a Debian-style versioned bindir."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda path: int(path.split("/")[4]) if path.split("/")[4].isdigit() else 0,
    )
    if candidates:
        return candidates[-1]
    raise PostgresNotFound(
        f"no {name} found: install PostgreSQL (apt-get install postgresql) or point "
        "RUNBUS_TEST_POSTGRES_DSN at a running server"
    )


def as_unprivileged(user: str) -> list[str]:
    """The command prefix that runs a program as `user` (PostgreSQL refuses to run as root)."""
    runuser, setpriv = shutil.which("runuser"), shutil.which("setpriv")
    if runuser:
        return [runuser, "-u", user, "--"]
    if setpriv:
        entry = pwd.getpwnam(user)
        return [
            setpriv,
            f"--reuid={entry.pw_uid}",
            f"--regid={entry.pw_gid}",
            "--clear-groups",
            "--",
        ]
    raise PostgresNotFound("running as root, and neither runuser nor setpriv is on PATH")


def scratch() -> str | None:
    """A RAM-backed temp dir when there is one with room, else None (the default temp dir).

    CREATE DATABASE writes a few hundred files; on a busy ext4 /tmp that alone took 0.3 s.
    """
    shm = "/dev/shm"
    try:
        if os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1 << 30:
            return shm
    except OSError:
        pass
    return None


@dataclass
class LocalPostgres:
    """One throwaway cluster in its own temp dir, listening on 127.0.0.1 only; trust auth."""

    port: int = field(default_factory=free_port)
    directory: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="runbus-pg-", dir=scratch()))
    superuser: str = "postgres"

    @property
    def dsn(self) -> str:
        return f"postgresql://{self.superuser}@127.0.0.1:{self.port}/postgres"

    @property
    def data(self) -> str:
        return os.path.join(self.directory, "data")

    def _prefix(self) -> list[str]:
        if os.geteuid() != 0:
            return []
        try:
            entry = pwd.getpwnam(UNPRIVILEGED_USER)
        except KeyError:
            raise PostgresNotFound(f"running as root and there is no {UNPRIVILEGED_USER!r} user") from None
        os.chown(self.directory, entry.pw_uid, entry.pw_gid)
        return as_unprivileged(UNPRIVILEGED_USER)

    def _run(self, *args: str, timeout: float) -> None:
        result = subprocess.run(
            [*self._prefix(), *args],
            cwd=self.directory,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{os.path.basename(args[0])} exited {result.returncode}: {result.stderr[-2000:]}{self.log()}"
            )

    def start(self, timeout: float = 60.0) -> LocalPostgres:
        """initdb (once), then start the server and wait until it accepts connections."""
        initdb, pg_ctl = find_postgres_bin("initdb"), find_postgres_bin("pg_ctl")
        self._prefix()  # fail early, before initdb, if there is no way to drop root
        if not os.path.exists(self.data):
            self._run(
                initdb,
                "-D", self.data,
                "-U", self.superuser,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-locale",
                "--no-sync",
                timeout=timeout,
            )  # fmt: skip
            with open(os.path.join(self.data, "postgresql.conf"), "a") as conf:
                conf.write(
                    "listen_addresses = '127.0.0.1'\n"
                    f"unix_socket_directories = '{self.directory}'\n"
                    # A test cluster's data is thrown away: durability only costs time.
                    "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
                )
        self._run(
            pg_ctl, "start", "-D", self.data, "-w", "-t", str(int(timeout)),
            "-l", os.path.join(self.directory, "postgres.log"),
            "-o", f"-p {self.port}",
            timeout=timeout + 5,
        )  # fmt: skip
        return self

    def log(self) -> str:
        try:
            with open(os.path.join(self.directory, "postgres.log")) as handle:
                return handle.read()[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server (fast shutdown: open sessions are ended)."""
        if not os.path.exists(os.path.join(self.data, "postmaster.pid")):
            return
        pg_ctl = find_postgres_bin("pg_ctl")
        self._run(pg_ctl, "stop", "-D", self.data, "-m", "fast", "-w", timeout=60)

    def cleanup(self) -> None:
        """Stop and remove the cluster's directory."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    async def password_user(self, user: str, password: str) -> str:
        """Create login role `user` whose TCP logins must give `password` (scram-sha-256, for
        that role alone: the others keep trust auth); the DSN of `user` without a password."""
        con = await asyncpg.connect(self.dsn)
        try:
            literal = await con.fetchval("SELECT quote_literal($1::text)", password)
            await con.execute(f'CREATE ROLE "{user}" LOGIN PASSWORD {literal}')
            await asyncio.to_thread(self._check_password_first, user)
            await con.execute("SELECT pg_reload_conf()")
        finally:
            await con.close()
        dsn = f"postgresql://{user}@127.0.0.1:{self.port}/postgres"
        # The reload is a signal: wait until a login without the password is refused.
        async with asyncio.timeout(10):
            while True:
                try:
                    probe = await asyncpg.connect(dsn, password="not-" + password)
                except asyncpg.InvalidPasswordError:
                    return dsn
                await probe.close()
                await asyncio.sleep(0.05)

    def _check_password_first(self, user: str) -> None:
        """A scram-sha-256 rule for `user` at the top of pg_hba.conf: the first match decides."""
        hba = os.path.join(self.data, "pg_hba.conf")
        with open(hba) as handle:
            rules = handle.read()
        with open(hba, "w") as handle:
            handle.write(f"host all {user} 127.0.0.1/32 scram-sha-256\n{rules}")

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()


def with_database(dsn: str, name: str) -> str:
    """`dsn` naming database `name` instead of its own."""
    return urlsplit(dsn)._replace(path=f"/{name}").geturl()


async def create_database(dsn: str) -> str:
    """Create an empty database with a random name on the server of `dsn`; return its URL."""
    name = f"runbus_test_{secrets.token_hex(6)}"
    con = await asyncpg.connect(dsn)
    try:
        await con.execute(f'CREATE DATABASE "{name}"')
    finally:
        await con.close()
    return with_database(dsn, name)


async def drop_database(dsn: str, url: str) -> None:
    """Drop the database of `url` (created by create_database), ending its sessions."""
    name = urlsplit(url).path.lstrip("/")
    con = await asyncpg.connect(dsn)
    try:
        await con.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await con.close()


async def public_tables(url: str) -> list[str]:
    """The tables in the public schema of the database at `url`, sorted."""
    con = await asyncpg.connect(url)
    try:
        rows = await con.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        )
    finally:
        await con.close()
    return sorted(row["table_name"] for row in rows)
