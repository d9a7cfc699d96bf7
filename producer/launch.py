"""`runbus run [options] -- COMMAND ...`: run a training command, under any launcher, as one run.

    runbus run -- torchrun --nproc-per-node 2 train.py
    srun runbus run -- python train.py
    runbus run -- python train.py

The command's environment gets, for every process it starts:

- RUNBUS_RUN_ID: the job's run id, fixed before anything starts: `--run-id`; else the id the
  environment already shares between the job's processes (RUNBUS_RUN_ID, torchrun's
  TORCHELASTIC_RUN_ID, SLURM's job and step ids: under `srun runbus run` every task runs its own
  `runbus run`, and they agree); else torchrun's `--rdzv-id` in the command (each node's
  `runbus run` sees the same; a uuid4 as `torchrun-<its first 12 hex digits>`, as the ranks
  would read it: launchers.rendezvous_run_id); else a fresh one, `run-<UTC time>-<8 random
  characters>` (runbus.wire.new_run_id). One `runbus run` prints it on stderr (the one of rank
  0, SLURM task 0, torchrun node 0, or with no rank), with the run's dashboard address when
  RUNBUS_DASHBOARD_URL is set.
- RUNBUS_REDIS_URL: `--redis` (before or after `run`), else as it was, else the default;
  RUNBUS_CONSOLE: `--console`, when given.
- PYTHONPATH with runbus's sitecustomize first (producer/boot/): each rank's console, fd-level
  writes included, is captured from its interpreter's start (runbus.producer.bootstrap).

Then `runbus run` execs the command: the command runs as this very process, so signals (Ctrl-C,
SIGTERM from srun or a scheduler) reach it directly, and its exit status (a signal's included) is
`runbus run`'s. A command that cannot be found exits 127, one that cannot be run 126, as in a
shell.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from runbus import config
from runbus.cli import add_redis_option, name_argument
from runbus.errors import CommandError
from runbus.producer import banner, environment, launchers
from runbus.producer.console import MODES
from runbus.terminal import printable
from runbus.wire import check_name, new_run_id

BOOT_DIR = Path(__file__).resolve().with_name("boot")
# Launcher rank variables of the `runbus run` processes of one job: only rank 0 (or none) prints.
WRAPPER_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
TORCHRUN_SCRIPTS = frozenset({"torchrun"})
TORCHRUN_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})
# torchrun's options that take no value (every other option takes one).
TORCHRUN_FLAGS = frozenset(
    {"--standalone", "--no-python", "-m", "--module", "--run-path", "--virtual-local-rank", "--use-env", "-h"}
)

NOT_FOUND, NOT_EXECUTABLE = 127, 126


def add_run(parser: argparse.ArgumentParser) -> None:
    parser.usage = "runbus run [--run-id ID] [--console MODE] [--redis URL] -- COMMAND [ARG ...]"
    parser.add_argument(
        "--run-id",
        type=name_argument,
        metavar="ID",
        help="the run's id (default: the id the launcher shares, torchrun's --rdzv-id, or a new one)",
    )
    parser.add_argument(
        "--console",
        choices=MODES,
        metavar="MODE",
        help=f"each rank's console: primary (every line stored; the primary shows all of it, the "
        "other ranks their errors), all (every rank shows all, prefixed), off (not captured); "
        f"default {config.CONSOLE_ENV}, else primary",
    )
    add_redis_option(parser, "where every rank logs")
    # Not `command`: the router names the chosen runbus command so.
    parser.add_argument("command_line", nargs=argparse.REMAINDER, metavar="COMMAND", help="what to run")
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    command = list(args.command_line)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise CommandError("no command to run: runbus run [options] -- COMMAND [ARG ...]")
    env = dict(os.environ)
    run_id = job_run_id(args.run_id, env, command)
    env.update(command_env(run_id, env, redis_url=args.redis, console=args.console))
    program = shutil.which(command[0], path=env.get("PATH"))
    if program is None:
        print(f"runbus: command not found: {printable(command[0])}", file=sys.stderr)
        return NOT_FOUND
    if announces(env, command):
        print(announcement(run_id, env), file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(program, command, env)  # noqa: S606 - the user's command, as a shell would run it
    except OSError as exc:
        print(f"runbus: cannot run {printable(command[0])}: {exc.strerror}", file=sys.stderr)
        return NOT_EXECUTABLE
    raise AssertionError("unreachable: execve returned")


# -- the run id ----------------------------------------------------------------------------------


def job_run_id(given: str | None, env: Mapping[str, str], command: Sequence[str]) -> str:
    """The run id for the whole job: `given`, the shared one, torchrun's --rdzv-id, or new."""
    if given:
        return given
    shared = environment.shared_run_id(env)
    if shared:
        return check_name("run id (from the environment)", shared)
    rendezvous = torchrun_option(command, "rdzv-id")
    if rendezvous and rendezvous != "none":
        return check_name("run id (torchrun's --rdzv-id)", launchers.rendezvous_run_id(rendezvous))
    return new_run_id()


def torchrun_option(command: Sequence[str], name: str) -> str | None:
    """The value of torchrun's `--NAME` (or `--NAME_WITH_UNDERSCORES`) when `command` runs
    torchrun, else None."""
    args = _torchrun_args(command)
    if args is None:
        return None
    spellings = {f"--{name}", f"--{name.replace('-', '_')}"}
    index = 0
    while index < len(args):
        arg = args[index]
        if not arg.startswith("-") or arg == "--":  # the training script: what follows is its own
            return None
        option, equals, value = arg.partition("=")
        if option in spellings:
            if equals:
                return value
            return args[index + 1] if index + 1 < len(args) else None
        index += 1 if equals or arg.replace("_", "-") in TORCHRUN_FLAGS else 2
    return None


def _torchrun_args(command: Sequence[str]) -> list[str] | None:
    if not command:
        return None
    if os.path.basename(command[0]) in TORCHRUN_SCRIPTS:
        return list(command[1:])
    if os.path.basename(command[0]).startswith("python"):
        for index, arg in enumerate(command[1:], start=1):
            if arg == "-m" and index + 1 < len(command) and command[index + 1] in TORCHRUN_MODULES:
                return list(command[index + 2 :])
            if not arg.startswith("-"):
                return None
    return None


# -- the command's environment and the announcement ----------------------------------------------


def command_env(
    run_id: str, env: Mapping[str, str], redis_url: str | None = None, console: str | None = None
) -> dict[str, str]:
    """The variables `runbus run` sets for its command (it runs as this process: `os.getpid()`)."""
    paths = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    boot = str(BOOT_DIR)
    added = {
        config.RUN_ID_ENV: run_id,
        config.LAUNCH_ENV: str(os.getpid()),
        "PYTHONPATH": os.pathsep.join([boot, *(entry for entry in paths if entry != boot)]),
    }
    if redis_url:
        added[config.REDIS_URL_ENV] = redis_url
    if console:
        added[config.CONSOLE_ENV] = console
    return added


def announces(env: Mapping[str, str], command: Sequence[str]) -> bool:
    """Whether this `runbus run` prints the run id: the one of rank 0, or with no rank."""
    for name in WRAPPER_RANK_VARIABLES:
        value = env.get(name, "").strip()
        if value and value != "0":
            return False
    node_rank = torchrun_option(command, "node-rank")
    return node_rank in (None, "0")


def announcement(run_id: str, env: Mapping[str, str]) -> str:
    """The one line `runbus run` prints: the run id, and its dashboard page where there is one."""
    return banner.run_line(run_id, env=env)
