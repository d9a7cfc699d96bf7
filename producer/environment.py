"""Where a rank learns its run id, label, primary flag and world size: arguments, then env.

Under torchrun nothing needs passing: TORCHELASTIC_RUN_ID names the run, RANK the label, and
rank 0 is the primary. RUNBUS_* variables override torchrun's. A label given as an argument
(a child process's own label) is not the primary unless primary=True says so.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from runbus import config
from runbus.wire import check_name, new_run_id


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


# resume=: "never" (a new job does not continue a finished run), "allow", "must" (the run must exist).
RESUME_MODES = ("never", "allow", "must")


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


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


def resolve(
    run_id: str | None = None,
    label: str | None = None,
    primary: bool | None = None,
    redis_url: str | None = None,
    env: Mapping[str, str] | None = None,
    resume: str | None = None,
) -> Identity:
    """The Identity from explicit arguments, then RUNBUS_* and torchrun variables, then defaults.

    primary defaults to True only for rank 0 (or no RANK) under the label the environment gives
    it (RUNBUS_LABEL, else `rank0`): a process that names its own label, such as a child of rank
    0 with `label="rank0-loader"`, is a worker label unless it passes primary=True.

    Raises ValueError with the reason for an invalid name or resume mode, or when several ranks
    could not agree on a run id (WORLD_SIZE > 1 and no id given nor found).
    """
    env = os.environ if env is None else env
    rank, world_size = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
    if rank is None:
        rank, torch_world = _torch_rank_and_size()
        world_size = world_size if world_size is not None else torch_world
    if run_id is None:
        run_id = env.get(config.RUN_ID_ENV) or None
    if run_id is None:
        elastic = env.get("TORCHELASTIC_RUN_ID")
        run_id = elastic if elastic and elastic != "none" else None
    if run_id is None:
        if world_size is not None and world_size > 1:
            raise ValueError(
                "no run id: with WORLD_SIZE > 1 every rank must name the same run. Pass "
                "run_id=, set RUNBUS_RUN_ID, or launch with torchrun --rdzv-id"
            )
        run_id = new_run_id()
    check_name("run id", run_id)
    launcher_label = env.get(config.LABEL_ENV) or f"rank{rank if rank is not None else 0}"
    if label is None:
        label = launcher_label
    check_name("label", label)
    if primary is None:
        primary = (rank or 0) == 0 and label == launcher_label
    resume = check_resume(resume if resume is not None else env.get(config.RESUME_ENV) or "never")
    return Identity(
        run_id=run_id,
        label=label,
        primary=bool(primary),
        rank=rank,
        local_rank=_int_env(env, "LOCAL_RANK"),
        world_size=world_size,
        restart_count=_int_env(env, "TORCHELASTIC_RESTART_COUNT") or 0,
        redis_url=redis_url or config.redis_url(env),
        resume=resume,
    )
