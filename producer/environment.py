"""Who this process is within its run: its run id, label, rank and primary flag, without configuration.

Each comes from the first of these that gives it:
- the arguments of runbus.init(), then RUNBUS_RUN_ID / RUNBUS_LABEL / RUNBUS_RESUME;
- the rank: torch.distributed once the script has built a process group, else the innermost
  launcher's variables (runbus.producer.launchers: torchrun, accelerate, DeepSpeed, Lightning,
  Open MPI, MPICH / Intel MPI, SLURM);
- the run id: the launcher's own id for the job (`shared_run_id`); else, for several ranks in a
  process group, the id rank 0 makes and gives the others through the group's store; else, for a
  single process, a new one, which init() exports to RUNBUS_RUN_ID so that the processes it
  starts afterwards (Lightning's ranks) join its run.
Several ranks with no way to agree on an id, or a rank the variables cannot tell, raise
IdentityUnknown with the ways out: never a guess that could put two ranks under one label.

The label is `rank{N}`; rank 0 (or a single process) is the primary. A label given as an argument
(a child process's own) is not the primary unless primary=True says so.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from runbus import config
from runbus.errors import IdentityUnknown
from runbus.producer import launchers
from runbus.wire import check_name, new_run_id

# How long a rank waits for rank 0 to put the run id in the process group's store.
AGREE_TIMEOUT = 120.0
# The store key of the n-th agreement of this process: every rank counts its own init() calls
# that agree through the store, so that a job's second run is not taken for its first.
AGREED_KEY = "runbus/run_id/{}"
_agreements = itertools.count()

HINT = (
    "set RUNBUS_RUN_ID to one id for every rank (or pass run_id=), launch with torchrun --rdzv-id, "
    "or start the job under `runbus run -- ...`, which names the run for every process it starts"
)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who this process is within its run."""

    run_id: str
    label: str
    primary: bool
    rank: int | None
    local_rank: int | None
    world_size: int | None
    restart_count: int
    redis_url: str
    resume: str = "never"  # one of RESUME_MODES: what to do when the run already exists
    launcher: str = "none"  # the launchers found, innermost first, joined by '+': "torchrun+slurm"
    run_id_from: str = "argument"  # "argument", RUNBUS_RUN_ID, a launcher's name, "torch.distributed", "new"


# resume=: "never" (a new job does not continue a finished run), "allow", "must" (the run must exist).
RESUME_MODES = ("never", "allow", "must")


@dataclass(frozen=True, slots=True)
class _Place:
    """Where this process stands among the job's processes."""

    rank: int | None
    local_rank: int | None
    world_size: int | None
    launcher: str
    unknown_rank: str | None = None  # why the rank cannot be told
    in_group: bool = False  # rank and world size are a torch.distributed process group's


def _torch_rank_and_size() -> tuple[int | None, int | None]:
    # Only if the training script already imported torch and built a process group: never import
    # torch ourselves, it costs seconds.
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None, None
    return dist.get_rank(), dist.get_world_size()


def check_resume(resume: object) -> str:
    """`resume` if it is one of RESUME_MODES, else ValueError saying which are."""
    if resume not in RESUME_MODES:
        raise ValueError(f"resume must be one of {', '.join(map(repr, RESUME_MODES))}, not {resume!r}")
    return str(resume)


def shared_run_id(env: Mapping[str, str] | None = None) -> str | None:
    """The run id every process of this job reads alike from its environment alone: RUNBUS_RUN_ID,
    else the launcher's (torchrun's rendezvous id or single-node agent, SLURM's job step, Open
    MPI's job); None when there is none (MPICH, DeepSpeed, Lightning, plain multi-node torchrun)."""
    env = os.environ if env is None else env
    given = env.get(config.RUN_ID_ENV)
    if given:
        return given
    found = launchers.launcher_run_id(launchers.read_launchers(env), env)
    return None if found is None else found[0]


def _place(views: list[launchers.LauncherView]) -> _Place:
    names = "+".join(view.name for view in views)
    local_rank = next((view.local_rank for view in views if view.local_rank is not None), None)
    group_rank, group_size = _torch_rank_and_size()
    if group_rank is not None:
        return _Place(group_rank, local_rank, group_size, names or "torch.distributed", in_group=True)
    for view in views:
        if view.rank is not None or view.unknown_rank is not None:
            return _Place(view.rank, view.local_rank, view.world_size, names, view.unknown_rank)
    world = max((view.world_size for view in views if view.world_size is not None), default=None)
    unknown = None
    if world is not None and world > 1:
        unknown = f"{names} says there are {world} processes, but no variable says which one this is"
    return _Place(None, local_rank, world, names or "none", unknown)


def resolve(
    run_id: str | None = None,
    label: str | None = None,
    primary: bool | None = None,
    redis_url: str | None = None,
    env: Mapping[str, str] | None = None,
    resume: str | None = None,
) -> Identity:
    """The Identity from explicit arguments, then RUNBUS_* variables, the launcher's variables and
    torch.distributed, then defaults (see the module docstring).

    primary defaults to True only for rank 0 (or a single process) under the label the environment
    gives it (RUNBUS_LABEL, else `rank0`): a process that names its own label, such as a child of
    rank 0 with `label="rank0-loader"`, is a worker label unless it passes primary=True.

    Raises InvalidName / ValueError for an invalid name, resume mode or variable, and
    IdentityUnknown when this process cannot tell its rank or several ranks cannot agree on a
    run id.
    """
    env = os.environ if env is None else env
    views = launchers.read_launchers(env)
    place = _place(views)
    launcher_label = env.get(config.LABEL_ENV) or (f"rank{place.rank}" if place.rank is not None else None)
    if label is None:
        if launcher_label is None and place.unknown_rank is not None:
            raise IdentityUnknown(
                f"cannot tell which rank this process is: {place.unknown_rank}. Call runbus.init() once "
                "torch.distributed's process group exists (with Lightning: in the LightningModule's "
                "setup()), set RUNBUS_LABEL (or pass label=) to a label of its own for each process, "
                "or start the job under `runbus run -- ...`"
            )
        label = launcher_label or "rank0"
    check_name("label", label)
    run_id, run_id_from = _run_id(run_id, env, views, place)
    check_name("run id", run_id)
    if primary is None:
        rank_zero = place.rank == 0 or (place.rank is None and place.unknown_rank is None)
        primary = rank_zero and label == (launcher_label or "rank0")
    resume = check_resume(resume if resume is not None else env.get(config.RESUME_ENV) or "never")
    return Identity(
        run_id=run_id,
        label=label,
        primary=bool(primary),
        rank=place.rank,
        local_rank=place.local_rank,
        world_size=place.world_size,
        restart_count=max((view.restart_count for view in views), default=0),
        redis_url=redis_url or config.redis_url(env),
        resume=resume,
        launcher=place.launcher,
        run_id_from=run_id_from,
    )


def _run_id(
    run_id: str | None, env: Mapping[str, str], views: list[launchers.LauncherView], place: _Place
) -> tuple[str, str]:
    """The run id and where it came from."""
    if run_id is not None:
        return run_id, "argument"
    given = env.get(config.RUN_ID_ENV)
    if given:
        return given, config.RUN_ID_ENV
    found = launchers.launcher_run_id(views, env)
    if found is not None:
        return found
    several = (place.world_size or 1) > 1 or (place.rank or 0) > 0 or place.unknown_rank is not None
    if not several:
        return new_run_id(), "new"
    where = f"rank {place.rank}" if place.rank is not None else "one of several processes"
    if place.world_size is not None:
        where += f" of {place.world_size}"
    if place.in_group:
        return _agree_in_group(place.rank or 0, where), "torch.distributed"
    raise IdentityUnknown(
        f"no run id: this process is {where} ({place.launcher}), its launcher names no run that every "
        "rank shares, and there is no torch.distributed process group to agree on one through. Call "
        f"runbus.init() after init_process_group (the ranks then agree through it), or {HINT}"
    )


def _agree_in_group(rank: int, where: str) -> str:
    """The run id of this process group: rank 0 makes one (or finds the one an earlier attempt of
    an elastic job made, in torchrun's agent store) and the others wait for it."""
    from datetime import timedelta

    dist = sys.modules["torch.distributed"]
    key = AGREED_KEY.format(next(_agreements))
    try:
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            return bytes(store.compare_set(key, "", new_run_id())).decode()
        store.wait([key], timedelta(seconds=AGREE_TIMEOUT))
        return bytes(store.get(key)).decode()
    except (RuntimeError, AttributeError, ValueError) as exc:  # DistStoreError: a timeout, a lost store
        raise IdentityUnknown(
            f"no run id: this process is {where} and waited {AGREE_TIMEOUT:.0f}s for rank 0 to put one "
            f"in the process group's store ({type(exc).__name__}: {str(exc)[:200]}). Every rank calls "
            f"runbus.init() once the group exists, or: {HINT}"
        ) from None


def export_run_id(identity: Identity, env: os._Environ[str] | dict[str, str] | None = None) -> None:
    """Make a run id this process made or learned from its process group the one the processes it
    starts afterwards inherit (Lightning's ranks, which re-run the script, join its run), beside
    RUNBUS_RUN_ID_FROM naming this process. An id from the arguments or the environment is not
    exported: the children read it where this process did."""
    if identity.run_id_from not in ("new", "torch.distributed"):
        return
    env = os.environ if env is None else env
    env[config.RUN_ID_ENV] = identity.run_id
    env[config.RUN_ID_FROM_ENV] = str(os.getpid())


def withdraw_run_id(run_id: str, env: os._Environ[str] | dict[str, str] | None = None) -> None:
    """Undo export_run_id once the run has finished here, so that the next runbus.init() in this
    process (a sweep's next trial) or a process started afterwards begins a run of its own."""
    env = os.environ if env is None else env
    if env.get(config.RUN_ID_ENV) == run_id and env.get(config.RUN_ID_FROM_ENV) == str(os.getpid()):
        env.pop(config.RUN_ID_ENV, None)
        env.pop(config.RUN_ID_FROM_ENV, None)


def inherited_from(identity: Identity, env: Mapping[str, str] | None = None) -> int | None:
    """The pid of the process whose exported run id this process took, or None."""
    env = os.environ if env is None else env
    owner = env.get(config.RUN_ID_FROM_ENV, "")
    if identity.run_id_from != config.RUN_ID_ENV or not owner.isdigit() or int(owner) == os.getpid():
        return None
    return int(owner)
