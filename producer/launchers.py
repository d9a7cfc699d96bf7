"""What each launcher's environment variables say about this process: its rank, the world, a run id.

One reader per launcher. `read_launchers(env)` lists the launchers found, innermost first: the
torch variables (RANK, LOCAL_RANK, WORLD_SIZE: set by torchrun, `accelerate launch`, DeepSpeed's
launcher) are set for the Python process itself, Lightning's (LOCAL_RANK, NODE_RANK without RANK)
by its launcher of the script's own copies, and MPI's and SLURM's by launchers that may start a
torchrun in turn: the innermost says which process this is.

A launcher's shared id is one every process of the job reads alike from its own environment.
torchrun gives one in TORCHELASTIC_RUN_ID: `--rdzv-id`, shown as given; a uuid4 that torch 2.13's
torchrun makes itself with `--standalone`, and on one node with neither `--rdzv-id` nor
`--master-port` (`torchrun --nproc-per-node N train.py`), shown as `torchrun-` and its first 12
hex digits (rendezvous_run_id); or `none` on one node with `--master-port`, where its agent's log
directory (one per agent, in every rank's TORCHELASTIC_ERROR_FILE) names the job as
`torchrun-<12 hex digits of a digest>`. SLURM names a job step, Open MPI a job. MPICH, Intel MPI,
DeepSpeed and Lightning give none: their ranks agree some other way (see runbus.producer.environment).
"""

from __future__ import annotations

import hashlib
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePath

# SLURM's pseudo-steps (slurm.h): pending, extern, batch, interactive. A process in one of them was
# not started by `srun` as one task of a parallel step (an sbatch script runs in the batch step).
SLURM_PSEUDO_STEPS = frozenset({0xFFFFFFFD, 0xFFFFFFFC, 0xFFFFFFFB, 0xFFFFFFFA})
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9._-]+")
# What torchrun's own rendezvous ids look like (str(uuid.uuid4())).
_UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


@dataclass(frozen=True, slots=True)
class LauncherView:
    """What one launcher's variables say about this process (None: the launcher does not say)."""

    name: str
    rank: int | None
    local_rank: int | None
    world_size: int | None
    run_id: str | None = None  # one that every process of the job reads alike, if the launcher has one
    restart_count: int = 0
    nodes: int | None = None  # how many agents (one per node) a torchrun job has
    unknown_rank: str | None = None  # why the rank cannot be told, when it cannot


def int_env(env: Mapping[str, str], name: str) -> int | None:
    """The integer in `name`, None when unset or empty; ValueError naming it when not an integer."""
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value[:40]!r} is not an integer") from None


def launcher_id(prefix: str, *parts: str) -> str:
    """A run id from a launcher's names: characters a run id cannot hold become '-' (names of
    nothing but such characters, a digest of them)."""
    text = "-".join(part for part in (prefix, *parts) if part)
    return _NOT_IN_NAME.sub("-", text).strip("-.")[:128] or f"id-{_digest(text)}"


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def rendezvous_run_id(rdzv_id: str) -> str:
    """The run id of torchrun's rendezvous id: a uuid4 (the one torchrun makes when given none)
    as `torchrun-` and its first 12 hex digits, all random (48 bits), so that the ids people
    read and type are short and say where they came from; any other id as it is."""
    if _UUID4.fullmatch(rdzv_id):
        return f"torchrun-{rdzv_id[:8]}{rdzv_id[9:13]}"
    return rdzv_id


def torch_env(env: Mapping[str, str]) -> LauncherView | None:
    """torchrun and `accelerate launch` (TORCHELASTIC_*), DeepSpeed's launcher (CROSS_RANK), or
    any launcher that sets RANK for each process."""
    elastic = "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env
    if "RANK" not in env and not elastic:
        return None
    if elastic:
        name = "accelerate" if "ACCELERATE_MIXED_PRECISION" in env else "torchrun"
    else:
        name = "deepspeed" if "CROSS_RANK" in env else "RANK"
    rdzv_id = env.get("TORCHELASTIC_RUN_ID", "")
    return LauncherView(
        name=name,
        rank=int_env(env, "RANK"),
        local_rank=int_env(env, "LOCAL_RANK"),
        world_size=int_env(env, "WORLD_SIZE"),
        run_id=launcher_id(rendezvous_run_id(rdzv_id)) if rdzv_id and rdzv_id != "none" else None,
        restart_count=int_env(env, "TORCHELASTIC_RESTART_COUNT") or 0,
        nodes=int_env(env, "GROUP_WORLD_SIZE"),
    )


def torchrun_agent_id(env: Mapping[str, str]) -> str | None:
    """A single-node torchrun's id without a rendezvous id: its agent's log directory.

    The agent makes `<log dir>/<rdzv id>_<random>/` (tempfile.mkdtemp) and gives every rank
    `.../attempt_<n>/<local rank>/error.json` in TORCHELASTIC_ERROR_FILE: the directory is the
    agent's own and the same across restarts. With one agent (GROUP_WORLD_SIZE 1) every rank of the
    job is under it; with several, each node's differs, so there is no id.
    """
    if int_env(env, "GROUP_WORLD_SIZE") != 1:
        return None
    path = PurePath(env.get("TORCHELASTIC_ERROR_FILE") or "/")
    parts = path.parts
    local_rank = env.get("LOCAL_RANK")
    if (
        len(parts) < 5
        or parts[-1] != "error.json"
        or parts[-2] != local_rank
        or not re.fullmatch(r"attempt_\d+", parts[-3])
    ):
        return None  # not the layout described above: no guess
    return f"torchrun-{_digest(socket.gethostname(), str(path.parents[2]))}"


def lightning(env: Mapping[str, str]) -> LauncherView | None:
    """A process that Lightning's launchers started: LOCAL_RANK without RANK (ddp re-runs the script
    with LOCAL_RANK, NODE_RANK and WORLD_SIZE; ddp_spawn and ddp_fork set LOCAL_RANK only). The
    global rank is NODE_RANK times the processes per node plus LOCAL_RANK, which only node 0 can
    tell without LOCAL_WORLD_SIZE."""
    if "RANK" in env or "LOCAL_RANK" not in env:
        return None
    local_rank = int_env(env, "LOCAL_RANK") or 0
    return _lightning_view(env, local_rank, f"LOCAL_RANK={local_rank}")


def lightning_main(env: Mapping[str, str]) -> LauncherView | None:
    """A script that names its node (NODE_RANK) and is no launcher's rank: Lightning's main process
    before it starts the node's other ranks (it is local rank 0). Read last: a launcher that gives
    a rank knows better."""
    if "RANK" in env or "LOCAL_RANK" in env or "NODE_RANK" not in env:
        return None
    return _lightning_view(env, 0, "no LOCAL_RANK")


def _lightning_view(env: Mapping[str, str], local_rank: int, local: str) -> LauncherView:
    node_rank = int_env(env, "NODE_RANK") or 0
    per_node = int_env(env, "LOCAL_WORLD_SIZE")
    rank: int | None = local_rank
    unknown = None
    if node_rank > 0:
        if per_node is None:
            rank = None
            unknown = (
                f"NODE_RANK={node_rank} and {local}, without RANK or LOCAL_WORLD_SIZE, do not tell "
                "this process's global rank"
            )
        else:
            rank = node_rank * per_node + local_rank
    return LauncherView(
        name="lightning",
        rank=rank,
        local_rank=local_rank,
        world_size=int_env(env, "WORLD_SIZE"),
        unknown_rank=unknown,
    )


def world_only(env: Mapping[str, str]) -> LauncherView | None:
    """WORLD_SIZE with no rank variable beside it: several processes, but not which one this is."""
    if "WORLD_SIZE" not in env or any(name in env for name in ("RANK", "LOCAL_RANK", "NODE_RANK")):
        return None
    return LauncherView(name="WORLD_SIZE", rank=None, local_rank=None, world_size=int_env(env, "WORLD_SIZE"))


def open_mpi(env: Mapping[str, str]) -> LauncherView | None:
    """Open MPI's mpirun: OMPI_COMM_WORLD_*; the job is its PMIx namespace (or ess jobid), told
    apart from an earlier job of the same number by mpirun's per-job random key or address."""
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    job = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or ""
    salt = env.get("OMPI_MCA_orte_precondition_transports") or env.get("OMPI_MCA_orte_hnp_uri") or ""
    run_id = None
    if job:
        run_id = launcher_id("openmpi", job, _digest(salt)[:8] if salt else "")
    return LauncherView(
        name="openmpi",
        rank=int_env(env, "OMPI_COMM_WORLD_RANK"),
        local_rank=int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
        world_size=int_env(env, "OMPI_COMM_WORLD_SIZE"),
        run_id=run_id,
    )


def pmi(env: Mapping[str, str]) -> LauncherView | None:
    """MPICH's and Intel MPI's Hydra (mpiexec), or SLURM's PMI plugins: PMI_RANK and PMI_SIZE. No
    variable names the job."""
    if "PMI_RANK" not in env or "PMI_SIZE" not in env:
        return None
    return LauncherView(
        name="intel-mpi" if "I_MPI_ROOT" in env else "mpich",
        rank=int_env(env, "PMI_RANK"),
        local_rank=int_env(env, "MPI_LOCALRANKID"),
        world_size=int_env(env, "PMI_SIZE"),
    )


def slurm(env: Mapping[str, str]) -> LauncherView | None:
    """A task of an `srun` step: SLURM_PROCID of SLURM_STEP_NUM_TASKS; the job step names the run
    (`slurm-JOB.STEP`, `slurm-ARRAYJOB_TASK.STEP` in an array), so two steps of a job are two runs
    and a requeued job (SLURM_RESTART_COUNT) continues its run. An sbatch script, which SLURM runs
    as one process of the batch step, is not a task of a step."""
    job, step = env.get("SLURM_JOB_ID"), int_env(env, "SLURM_STEP_ID")
    if not job or step is None or step in SLURM_PSEUDO_STEPS or "SLURM_PROCID" not in env:
        return None
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        job = f"{array_job}_{array_task}"
    world = int_env(env, "SLURM_STEP_NUM_TASKS")
    return LauncherView(
        name="slurm",
        rank=int_env(env, "SLURM_PROCID"),
        local_rank=int_env(env, "SLURM_LOCALID"),
        world_size=world if world is not None else int_env(env, "SLURM_NTASKS"),
        run_id=launcher_id("slurm", f"{job}.{step}"),
        restart_count=int_env(env, "SLURM_RESTART_COUNT") or 0,
    )


# Innermost first: the first that tells a rank says which process this is.
READERS: tuple[Callable[[Mapping[str, str]], LauncherView | None], ...] = (
    torch_env,
    lightning,
    world_only,
    open_mpi,
    pmi,
    slurm,
    lightning_main,
)


def read_launchers(env: Mapping[str, str]) -> list[LauncherView]:
    """Every launcher whose variables `env` holds, innermost first.

    LOCAL_RANK that repeats an outer launcher's local rank (`export LOCAL_RANK=$SLURM_LOCALID` in
    an srun or mpirun wrapper) is that launcher's, not Lightning's: only Lightning's own ranks
    have a LOCAL_RANK of their own (its ranks 1, 2, ... beside an inherited SLURM_LOCALID=0).
    """
    views = [view for view in (read(env) for read in READERS) if view is not None]
    if views and views[0].name == "lightning":
        inner = views[0]
        if any(view.rank is not None and view.local_rank == inner.local_rank for view in views[1:]):
            views = views[1:]
    return views


def launcher_run_id(views: list[LauncherView], env: Mapping[str, str]) -> tuple[str, str] | None:
    """The run id the launchers give every process of this job, and the launcher it is from.

    The innermost launcher with an id gives it. A torchrun without a rendezvous id takes an outer
    launcher's id when that launcher's tasks are exactly its agents (`srun -N2 torchrun --nnodes 2`),
    else, on a single node, its agent's (two torchrun jobs in one step are two runs); else none.
    """
    for index, view in enumerate(views):
        if view.run_id is not None:
            return view.run_id, view.name
        if view.name in ("torchrun", "accelerate"):
            outer = next((v for v in views[index + 1 :] if v.run_id is not None), None)
            if outer is not None and outer.run_id is not None and outer.world_size == view.nodes:
                return outer.run_id, outer.name
            agent = torchrun_agent_id(env)
            return (agent, view.name) if agent is not None else None
    return None
