"""Who may talk to `runbus serve`: loopback by default, a bearer token otherwise; strict headers.

With a token every request needs it, as `Authorization: Bearer TOKEN`, as `?token=TOKEN` (how a
browser opens the page), or as the HttpOnly cookie a valid `?token=` sets so the page's own
scripts and styles load. Without a token the server listens on loopback only and answers only
requests addressed to a loopback name (runbus/loopback.py), so a web page elsewhere cannot reach it
by DNS rebinding.
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.typedefs import Handler, Middleware

from runbus.config import API_TOKEN_ENV
from runbus.errors import TokenRequired
from runbus.loopback import is_loopback, loopback_requests_only, refuse_in_text

TOKEN_ENV = API_TOKEN_ENV
COOKIE = "runbus_token"

# The page loads its own script, style and icon, and fetches its own API: nothing else, ever.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'none'"
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


def check_binding(host: str, token: str | None) -> None:
    """Raise TokenRequired unless `host` is loopback or a token guards the server."""
    if not token and not is_loopback(host):
        raise TokenRequired(
            f"refusing to listen on {host} without a token: anyone who can reach it could read "
            f"every run. Pass --token TOKEN (or set {TOKEN_ENV}); every request must then carry it"
        )


def token_matches(given: str | None, token: str) -> bool:
    """Constant-time comparison, so timing tells nothing about the token."""
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def _bearer(request: web.Request) -> str | None:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def _refuse(request: web.Request, status: int, reason: str) -> web.Response:
    if request.path.startswith("/api/"):
        return web.json_response({"error": reason}, status=status)
    return refuse_in_text(request, status, reason)


def auth_middleware(token: str | None) -> Middleware:
    """The token check when a token is set, else the loopback Host check."""
    if token is None:
        return loopback_requests_only(_refuse)

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        from_query = request.query.get("token")
        if token_matches(_bearer(request), token) or token_matches(request.cookies.get(COOKIE), token):
            return await handler(request)
        if token_matches(from_query, token):
            response = await handler(request)
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", path="/")
            return response
        response = _refuse(
            request, 401, "a token is required: send 'Authorization: Bearer TOKEN' or open /?token=TOKEN"
        )
        response.headers["WWW-Authenticate"] = 'Bearer realm="runbus"'
        return response

    return authenticate


@web.middleware
async def security_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every response, errors included, carries the strict headers."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            exc.headers.update(HEADERS)
            raise
        response = _refuse(request, exc.status, exc.reason)
    response.headers.update(HEADERS)
    if request.path.startswith("/api/"):
        response.headers["Cache-Control"] = "no-store"
    return response


class AccessLogger(AbstractAccessLogger):
    """One line per request: method, path without its query (where a token may ride), status."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info("%s %s %d %.1f ms", request.method, request.path, response.status, time * 1000)

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)
