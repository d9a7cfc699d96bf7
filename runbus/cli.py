"""The `runbus` command: it routes each sub-command to the package that drives it.

ROUTES maps a command to its help and to a "module:function" that adds the command's arguments to
its parser and names its handler (`parser.set_defaults(handler=...)`). A module is imported only
once its command is chosen: `runbus --help` imports none of the four packages, `runbus runs`
imports storage alone. What every command shares lives here: the `--store` and `--redis` options
(given before or after the command; the command's value wins), logging (configured here and
nowhere else), and how an expected error ends: one `runbus: ...` line on stderr and a non-zero
exit, never a traceback. Every log line and error line goes through `runbus.redact.redact_text`
(URL passwords and the secrets of the --store and --redis URLs masked, even inside a driver's
error text) and `runbus.terminal.printable`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, NoReturn

import runbus
from runbus import config, wire
from runbus.errors import InvalidName, RunbusError
from runbus.redact import redact_text, url_secrets
from runbus.terminal import printable

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Route(NamedTuple):
    """Where a command lives, and what `runbus --help` says of it without importing it."""

    help: str
    arguments: str  # "module:function(parser)": adds the arguments, sets `handler`
    log_level: str = "WARNING"


ROUTES: dict[str, Route] = {
    "ingest": Route("consume the streams into the store", "runbus.ingester.cli:add_ingest", "INFO"),
    "dead": Route("list (or replay) dead-lettered entries", "runbus.ingester.cli:add_dead"),
    "runs": Route("list runs", "runbus.query.cli:add_runs"),
    "show": Route("one run: state, labels, counts", "runbus.query.cli:add_show"),
    "watch": Route("follow a run's health live, a line per change", "runbus.query.watch:add_watch"),
    "metrics": Route("a run's metric values", "runbus.query.cli:add_metrics"),
    "logs": Route("a run's log lines, every label", "runbus.query.cli:add_logs"),
    "export": Route("a run's metrics, logs or system samples as files", "runbus.query.export:add_export"),
    "demo": Route("a small multi-rank job logged into one run", "runbus.ingester.cli:add_demo", "INFO"),
    "serve": Route("the web dashboard and its JSON API", "runbus.dashboard.cli:add_serve"),
    "tail": Route("follow every rank's log lines live, from the streams", "runbus.dashboard.cli:add_tail"),
    "run": Route("run a training command (any launcher) as one run", "runbus.producer.launch:add_run"),
    "sync": Route(
        "ship runs logged while Redis was away (spool files) to Redis", "runbus.producer.sync:add_sync"
    ),
}


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error ending as every other error does: one `runbus:` line (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"runbus: {message} (`{self.prog} --help` shows the usage)\n")


class SafeFormatter(logging.Formatter):
    """Log lines with secrets masked (by shape, and the `known` ones) and terminal controls shown."""

    def __init__(self, fmt: str, known: Iterable[str] = ()) -> None:
        super().__init__(fmt)
        self.known = tuple(known)

    def format(self, record: logging.LogRecord) -> str:
        return printable(redact_text(super().format(record), self.known))


def configure_logging(level: str, process: str | None = None, known: Iterable[str] = ()) -> None:
    """Log to stderr, through SafeFormatter (`known`: secrets to mask wherever they show); a
    worker process of `ingest --workers N` puts its consumer name first."""
    prefix = f"[{process.replace('%', '%%')}] " if process else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter(prefix + LOG_FORMAT, known))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def known_secrets(args: argparse.Namespace) -> list[str]:
    """The secrets of the command's --store and --redis URLs, to mask in every line it writes."""
    return [s for name in ("store", "redis") for s in url_secrets(str(getattr(args, name, "") or ""))]


# -- what the command modules share --------------------------------------------------------------


def _shown(url: str) -> str:
    """A default URL for a help text: no password, and no '%' for argparse to format."""
    return config.safe_url(url).replace("%", "%%")


def add_store_option(parser: argparse.ArgumentParser) -> None:
    """`--store URL` after the command; without it, `runbus --store URL` or the default holds."""
    parser.add_argument(
        "--store",
        default=argparse.SUPPRESS,
        metavar="URL",
        help=f"store URL ({config.STORE_ENV}; default {_shown(config.default_store_url())})",
    )


def add_redis_option(parser: argparse.ArgumentParser, what: str = "") -> None:
    """`--redis URL` after the command; without it, `runbus --redis URL` or the default holds."""
    parser.add_argument(
        "--redis",
        default=argparse.SUPPRESS,
        metavar="URL",
        help=f"Redis URL{', ' + what if what else ''} "
        f"({config.REDIS_URL_ENV}; default {_shown(config.redis_url())})",
    )


def level_argument(text: str) -> str:
    """An argparse type: a log level name, upper-cased."""
    if text.upper() not in wire.LEVELS:
        raise argparse.ArgumentTypeError(f"unknown level {text!r}: use one of {', '.join(wire.LEVELS)}")
    return text.upper()


def name_argument(text: str) -> str:
    """An argparse type: a run id or label the wire contract allows."""
    try:
        return wire.check_name("name", text)
    except InvalidName as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# -- the parser ----------------------------------------------------------------------------------


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown level {text!r}: use one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def _function(target: str) -> Callable[[argparse.ArgumentParser], None]:
    module, _, name = target.partition(":")
    adder: Callable[[argparse.ArgumentParser], None] = getattr(importlib.import_module(module), name)
    return adder


def build_parser(command: str | None = None) -> Parser:
    """The `runbus` parser: every command listed with its help, and `command`'s own arguments
    (importing its module only); the other commands are placeholders."""
    parser = Parser(prog="runbus", description="Log every rank of a distributed training job into one run.")
    parser.add_argument("--version", action="version", version=f"runbus {runbus.__version__}")
    parser.add_argument(
        "--store",
        default=config.default_store_url(),
        metavar="URL",
        help=f"store URL ({config.STORE_ENV}; default {_shown(config.default_store_url())})",
    )
    parser.add_argument(
        "--redis",
        default=config.redis_url(),
        metavar="URL",
        help="Redis URL, redis+cluster://host:port,... for a cluster "
        f"({config.REDIS_URL_ENV}; default {_shown(config.redis_url())})",
    )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=None,
        metavar="LEVEL",
        help="logging level (default INFO for ingest and demo, else WARNING)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for name, route in ROUTES.items():
        if name == command:
            _function(route.arguments)(commands.add_parser(name, help=route.help, description=route.help))
        else:
            commands.add_parser(name, help=route.help, add_help=False)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a command line: first which command it names, then that command's arguments."""
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen, _ = build_parser().parse_known_args(argv)
    return build_parser(chosen.command).parse_args(argv)


# -- running a command ---------------------------------------------------------------------------


def _expected_errors() -> tuple[type[BaseException], ...]:
    """The errors a command reports as one line. Redis's are among them only once a command has
    imported redis: the router never imports it (a cheap start), and without it none can arise."""
    errors: tuple[type[BaseException], ...] = (RunbusError, ValueError)
    redis_errors = sys.modules.get("redis.exceptions")
    if redis_errors is not None:
        errors += (redis_errors.RedisError, redis_errors.RedisClusterException)
    return errors


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(lines) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.log_level = args.log_level or ROUTES[args.command].log_level
    known = known_secrets(args)
    configure_logging(args.log_level, known=known)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        code = handler(args)
        sys.stdout.flush()  # a reader that left shows here, inside the try, not at exit
        return code
    except BrokenPipeError:
        # `runbus runs | head -1`: the reader left, so do we, quietly. stdout's flush at exit would
        # fail again, hence devnull in its place, as Python's documentation advises.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the CLI's last stop: expected errors in a line, a bug as a traceback
        if isinstance(exc, _expected_errors()):
            print(f"runbus: {printable(redact_text(_one_line(exc), known))}", file=sys.stderr)
            return 1
        # A bug: its traceback as Python prints it (and its exit status, 1), but with no secret.
        print(
            printable(redact_text("".join(traceback.format_exception(exc)), known)), file=sys.stderr, end=""
        )
        return 1
