"""Servers bound to loopback answer only requests addressed to loopback (defeats DNS rebinding).

A web page on another origin can rebind its own name to 127.0.0.1 and so reach a server that
listens on loopback: the browser then sends the page's name in the Host header. Answering only
requests whose Host is a loopback name or address keeps such a page out. Both the ingester's ops
endpoints and `runbus serve` (without a token) use this guard.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
REFUSAL = "this server answers only requests addressed to loopback"

# How a server words a refusal: (request, status, reason) -> the response.
Refuse = Callable[[web.Request, int, str], web.StreamResponse]


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is loopback only."""
    host = host.strip().strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_in_text(request: web.Request, status: int, reason: str) -> web.Response:
    return web.Response(status=status, text=f"{status}: {reason}\n")


def loopback_requests_only(refuse: Refuse = refuse_in_text) -> Middleware:
    """An aiohttp middleware that answers 403 to every request not addressed to loopback."""

    @web.middleware
    async def loopback_only(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_loopback(request.url.host or ""):
            return refuse(request, 403, REFUSAL)
        return await handler(request)

    return loopback_only
