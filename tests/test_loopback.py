"""The loopback guard both servers use (runbus/loopback.py), attacked with rebinding-style Hosts."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from runbus.loopback import REFUSAL, is_loopback, loopback_requests_only

LOOPBACK = (
    "127.0.0.1",
    "127.8.0.1",
    "::1",
    "[::1]",
    "localhost",
    "LocalHost",
    " localhost ",
    "ip6-localhost",
)
# Names an attacker controls, or addresses that are not loopback only.
NOT_LOOPBACK = (
    "",
    "0.0.0.0",
    "::",
    "192.168.1.5",
    "attacker.example",
    "localhost.attacker.example",
    "127.0.0.1.nip.io",
    "127.0.0.1@attacker.example",
    "[127.0.0.1]x",
)


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_names_and_addresses(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", NOT_LOOPBACK)
def test_anything_else_is_not_loopback(host):
    assert not is_loopback(host)


async def test_the_guard_answers_only_requests_addressed_to_loopback():
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application(middlewares=[loopback_requests_only()])
    app.router.add_get("/", hello)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        for host in ("localhost:8080", "127.0.0.1", "[::1]:9100"):
            response = await client.get("/", headers={"Host": host})
            assert response.status == 200 and await response.text() == "hello", host
        for host in ("attacker.example", "127.0.0.1.nip.io:9100", "localhost.attacker.example:80"):
            response = await client.get("/", headers={"Host": host})
            assert response.status == 403 and REFUSAL in await response.text(), host
