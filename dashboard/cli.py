"""`runbus serve` and `runbus tail`: the dashboard's commands, routed here by runbus.cli."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

from runbus import config, wire
from runbus.cli import add_redis_option, add_store_option, level_argument, name_argument


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {port}")
    return port


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"seconds must be above 0, got {text}")
    return seconds


def add_serve(parser: argparse.ArgumentParser) -> None:
    add_store_option(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=_port, default=8080, help="port (default %(default)s; 0 picks one)")
    parser.add_argument(
        "--token",
        default=None,
        help=f"require this token on every request ({config.API_TOKEN_ENV}); needed off loopback",
    )
    parser.add_argument(
        "--idle-timeout",
        type=_seconds,
        default=config.HTTP_IDLE_TIMEOUT,
        help="close a connection that has not sent a whole request head within this many seconds "
        "of opening or of its last response (default %(default)s)",
    )
    add_redis_option(parser, "optional: only for the dead-letter counts")
    parser.set_defaults(handler=cmd_serve)


def add_tail(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", type=name_argument)
    add_redis_option(parser, "read with XREAD, never through the consumer group")
    add_store_option(parser)
    parser.add_argument("--label", action="append", type=name_argument, help="only this label (repeatable)")
    parser.add_argument(
        "--level", type=level_argument, help="at least this level (DEBUG, INFO, WARNING, ERROR)"
    )
    parser.add_argument("--from-start", action="store_true", help="print the run's history first")
    parser.add_argument(
        "--wait",
        action="store_true",
        help="wait for a run that has not started yet (without it, a run found neither in Redis "
        "nor in the store is an error)",
    )
    parser.add_argument("--no-color", action="store_true", help="no colours, even on a terminal")
    parser.set_defaults(handler=cmd_tail)


async def _serve(app: Any, host: str, port: int, store: str, guarded: bool, idle_timeout: float) -> int:
    from aiohttp import web

    from runbus.dashboard.security import AccessLogger

    # aiohttp's keep-alive timer runs from a connection's opening too: it bounds a request head
    # that never arrives whole, which nothing else does.
    runner = web.AppRunner(
        app, access_log_class=AccessLogger, handle_signals=False, keepalive_timeout=idle_timeout
    )
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

    token = args.token or config.api_token()
    security.check_binding(args.host, token)
    app = create_app(args.store, redis_url=args.redis or None, token=token)
    try:
        return asyncio.run(
            _serve(
                app,
                args.host,
                args.port,
                config.safe_url(args.store),
                guarded=token is not None,
                idle_timeout=args.idle_timeout,
            )
        )
    except OSError as exc:
        print(f"runbus: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1


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
        store_url=args.store,
        wait=args.wait,
    )
    return tail(settings)
