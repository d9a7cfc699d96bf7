"""The `runbus serve` and `runbus tail` commands, added to the `runbus` parser by runbus.cli."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

from runbus import wire
from runbus.config import DEFAULT_REDIS_URL, safe_url
from runbus.errors import InvalidName, TokenRequired


def _redis_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--redis",
        default=os.environ.get("RUNBUS_REDIS_URL", DEFAULT_REDIS_URL),
        help=f"Redis URL, {what} (RUNBUS_REDIS_URL; default %(default)s)",
    )


def _level(text: str) -> str:
    if text.upper() not in wire.LEVELS:
        raise argparse.ArgumentTypeError(f"unknown level {text!r}: use one of {', '.join(wire.LEVELS)}")
    return text.upper()


def _name(text: str) -> str:
    try:
        return wire.check_name("name", text)
    except InvalidName as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_commands(commands: Any) -> None:
    """Add `serve` and `tail` to the `runbus` sub-command parsers."""
    serve = commands.add_parser("serve", help="the web dashboard and its JSON API")
    # SUPPRESS: `runbus --store URL serve` keeps working, the sub-command's value wins if given.
    serve.add_argument("--store", default=argparse.SUPPRESS, help="store URL (as `runbus --store`)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    serve.add_argument("--port", type=int, default=8080, help="port (default %(default)s; 0 picks one)")
    serve.add_argument(
        "--token",
        default=None,
        help="require this token on every request (RUNBUS_API_TOKEN); needed off loopback",
    )
    _redis_option(serve, "optional: only for the dead-letter counts")

    tail = commands.add_parser("tail", help="follow every rank's log lines live, from the streams")
    tail.add_argument("run", type=_name)
    _redis_option(tail, "read with XREAD, never through the consumer group")
    tail.add_argument("--label", action="append", type=_name, help="only this label (repeatable)")
    tail.add_argument("--level", type=_level, help="at least this level (DEBUG, INFO, WARNING, ERROR)")
    tail.add_argument("--from-start", action="store_true", help="print the run's history first")
    tail.add_argument("--no-color", action="store_true", help="no colours, even on a terminal")


async def _serve(app: Any, host: str, port: int, store: str, guarded: bool) -> int:
    from aiohttp import web

    from runbus.dashboard.security import AccessLogger

    runner = web.AppRunner(app, access_log_class=AccessLogger, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1]
        shown = f"[{host}]" if ":" in host else host
        print(f"runbus: dashboard at http://{shown}:{bound}/ (store {store}); Ctrl-C stops", flush=True)
        if guarded:
            # The token itself is never printed or logged.
            print(f"runbus: requests need the token: open http://{shown}:{bound}/?token=TOKEN", flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from runbus.dashboard import security
    from runbus.dashboard.api import create_app

    token = args.token or os.environ.get(security.TOKEN_ENV) or None
    try:
        security.check_binding(args.host, token)
    except TokenRequired as exc:
        print(f"runbus: {exc}", file=sys.stderr)
        return 1
    app = create_app(args.store, redis_url=args.redis or None, token=token)
    try:
        return asyncio.run(_serve(app, args.host, args.port, safe_url(args.store), guarded=token is not None))
    except OSError as exc:
        print(f"runbus: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def cmd_tail(args: argparse.Namespace) -> int:
    from runbus.dashboard.tail import TailSettings, tail

    color = not args.no_color and not os.environ.get("NO_COLOR") and sys.stdout.isatty()
    settings = TailSettings(
        redis_url=args.redis,
        run_id=args.run,
        labels=frozenset(args.label) if args.label else None,
        min_level=wire.level_number(args.level) if args.level else 0,
        from_start=args.from_start,
        color=color,
    )
    try:
        return tail(settings)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `runbus tail RUN | head`: the reader left, so do we, quietly (stdout's flush at exit
        # would fail again, hence devnull in its place, as Python's docs advise).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
