"""Identity under every launcher: which run and label a process is, with nothing configured.

resolve() is read against each launcher's own variables (recorded from the real launchers where
this machine has them: torchrun, `accelerate launch`, Lightning, Open MPI's mpirun, MPICH's
mpiexec; SLURM's and DeepSpeed's as their sources set them), nested launchers and the cases that
must raise rather than guess. Then real jobs: a gloo process group agreeing on an id, torchrun,
accelerate, mpirun and Lightning running the examples, the primary's one stderr line, a Run
refusing pickling, and a run id exported to the processes init() starts.
"""

from __future__ import annotations

import copy
import io
import json
import multiprocessing
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import orjson
import pytest
import redis

import runbus
from runbus import config, wire
from runbus.errors import IdentityUnknown
from runbus.ingester.localredis import free_port
from runbus.producer import banner, environment, launch, launchers
from runbus.producer.environment import resolve, shared_run_id
from tests.conftest import missing_server
from tests.helpers import QUIET as QUIET_RUN

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "launchers" / "train.py"
LIGHTNING_TRAIN = ROOT / "examples" / "launchers" / "lightning_train.py"
BIN = Path(sys.executable).parent
QUIET = {**QUIET_RUN, "quiet": True}

# Every variable a launcher sets that identity reads: the tests start from an environment without any.
LAUNCHER_PREFIXES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_",
    "ROLE_",
    "TORCHELASTIC_",
    "MASTER_",
    "SLURM_",
    "OMPI_",
    "PMI_",
    "PMIX_",
    "MPI_LOCAL",
    "I_MPI_",
    "CROSS_",
    "LOCAL_SIZE",
    "ACCELERATE_",
    "RUNBUS_",
)


def clean_env(**env: str) -> dict[str, str]:
    """os.environ without any launcher's or runbus's variables, plus `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    return {**base, **env}


@pytest.fixture
def no_launcher(monkeypatch):
    """This process's environment without any launcher's or runbus's variables (and without a
    run id a failed test's init() exported, afterwards)."""
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    yield
    for name in (config.RUN_ID_ENV, config.RUN_ID_FROM_ENV):
        os.environ.pop(name, None)


def start_events(redis_url: str, run_id: str) -> dict[str, dict]:
    """label -> the data of its start event, for every label of `run_id` in Redis."""
    client = redis.Redis.from_url(redis_url)
    try:
        found = {}
        for key in client.scan_iter(match=wire.stream_key(run_id, "*"), _type="STREAM"):
            event = wire.decode_entry(key.decode(), client.xrange(key, count=1)[0][1])
            assert event.kind == "start"
            found[event.label] = event.data
        return found
    finally:
        client.close()


def identities(stdout: str) -> list[dict]:
    """The JSON identity lines the examples print with --print-json."""
    return [json.loads(found) for found in re.findall(r'\{"run_id"[^}]*\}', stdout)]  # lines may interleave


def banners(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("runbus: run ")]


# -- what each launcher's variables say ---------------------------------------------------------

# Recorded from `accelerate launch --multi_gpu --num_processes 2` on this CPU machine (rank 1).
ACCELERATE = {
    "ACCELERATE_MIXED_PRECISION": "no",
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "RANK": "1",
    "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_gyg26rmp/none_0m6ufrf6/attempt_0/1/error.json",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_RUN_ID": "none",
    "WORLD_SIZE": "2",
}
# Recorded from Open MPI 4.1's `mpirun -np 2` (rank 1).
OPEN_MPI = {
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_MCA_ess_base_jobid": "1590362113",
    "OMPI_MCA_orte_hnp_uri": "1590362112.0;tcp://192.0.2.2:60209",
    "OMPI_MCA_orte_precondition_transports": "3671338bcf0b9290-e665079e3e67819e",
    "PMIX_NAMESPACE": "1590362113",
    "PMIX_RANK": "1",
}
# Recorded from MPICH 4's `mpiexec.hydra -n 2` (rank 1): nothing names the job.
MPICH = {"MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1", "PMI_FD": "8", "PMI_RANK": "1", "PMI_SIZE": "2"}
# DeepSpeed's launcher (deepspeed/launcher/launch.py) on 2 nodes of 2 GPUs, node 1's first rank.
DEEPSPEED = {
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "WORLD_SIZE": "4",
    "CROSS_RANK": "1",
    "CROSS_SIZE": "2",
    "LOCAL_SIZE": "2",
    "RANK": "2",
    "LOCAL_RANK": "0",
}
# Recorded from Lightning 2.6 `Trainer(strategy="ddp", devices=2, accelerator="cpu")`: the rank it
# starts re-runs the script with these (and the main process's exported RUNBUS_RUN_ID).
LIGHTNING_DDP_RANK1 = {"LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0", "MASTER_PORT": "34987"}
# A task of `srun -N 2 --ntasks-per-node 4` (srun's env_array_for_step and slurmstepd's variables).
SLURM_TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
}
# An sbatch script: the batch step, one process, though the allocation holds 8 tasks.
SLURM_BATCH = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8"}


def summary(ident: environment.Identity) -> tuple:
    return (ident.run_id, ident.label, ident.primary, ident.rank, ident.local_rank, ident.world_size)


def test_torchrun_with_a_rendezvous_id():
    env = {
        "TORCHELASTIC_RUN_ID": "job42",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "GROUP_WORLD_SIZE": "4",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    ident = resolve(env=env)
    assert summary(ident) == ("job42", "rank3", False, 3, 1, 8)
    assert (ident.restart_count, ident.launcher, ident.run_id_from) == (2, "torchrun", "torchrun")
    assert resolve(env={**env, "RANK": "0"}).primary is True
    # A rendezvous id a run id cannot hold becomes one, alike in every rank.
    assert resolve(env={**env, "TORCHELASTIC_RUN_ID": "team:a/job 7"}).run_id == "team-a-job-7"


def test_a_single_node_torchrun_without_an_id_is_named_by_its_agent():
    rank1 = resolve(env=ACCELERATE)
    rank0 = resolve(
        env={
            **ACCELERATE,
            "RANK": "0",
            "LOCAL_RANK": "0",
            "TORCHELASTIC_ERROR_FILE": ("/tmp/torchelastic_gyg26rmp/none_0m6ufrf6/attempt_0/0/error.json"),
        }
    )
    assert rank0.run_id == rank1.run_id and rank1.run_id.startswith("torchrun-")
    assert (rank0.label, rank0.primary, rank1.label, rank1.primary) == ("rank0", True, "rank1", False)
    assert rank1.launcher == "accelerate"
    # The same agent's restart continues the run; another agent (another job) is another run.
    restarted = {
        **ACCELERATE,
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_ERROR_FILE": ("/tmp/torchelastic_gyg26rmp/none_0m6ufrf6/attempt_1/1/error.json"),
    }
    assert (resolve(env=restarted).run_id, resolve(env=restarted).restart_count) == (rank1.run_id, 1)
    other = {**ACCELERATE, "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_x/none_abc/attempt_0/1/error.json"}
    assert resolve(env=other).run_id != rank1.run_id
    # A path of another shape is no agent's: no guess.
    odd = {**ACCELERATE, "TORCHELASTIC_ERROR_FILE": "/tmp/somewhere/error.json"}
    with pytest.raises(IdentityUnknown, match="no run id"):
        resolve(env=odd)


def test_a_multi_node_torchrun_without_an_id_cannot_name_its_run():
    env = {**ACCELERATE, "GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "4"}
    with pytest.raises(IdentityUnknown, match="no run id") as raised:
        resolve(env=env)
    for way_out in ("RUNBUS_RUN_ID", "--rdzv-id", "runbus run", "init_process_group"):
        assert way_out in str(raised.value)
    assert shared_run_id(env) is None
    assert resolve(env={**env, "RUNBUS_RUN_ID": "mine"}).run_id == "mine"


def test_deepspeed_names_no_run():
    with pytest.raises(IdentityUnknown, match=r"rank 2 of 4 \(deepspeed\)"):
        resolve(env=DEEPSPEED)
    ident = resolve(env={**DEEPSPEED, "RUNBUS_RUN_ID": "ds"})
    assert summary(ident) == ("ds", "rank2", False, 2, 0, 4)
    assert ident.launcher == "deepspeed"


def test_lightning_ranks():
    ident = resolve(env={**LIGHTNING_DDP_RANK1, "RUNBUS_RUN_ID": "lit"})
    assert summary(ident) == ("lit", "rank1", False, 1, 1, 2)
    assert ident.launcher == "lightning"
    # ddp_spawn / ddp_fork ranks have LOCAL_RANK only (and a process group, read first).
    assert resolve(env={"LOCAL_RANK": "1", "RUNBUS_RUN_ID": "lit"}).label == "rank1"
    # Node 1: its global rank needs the processes per node.
    node1 = {"LOCAL_RANK": "1", "NODE_RANK": "1", "WORLD_SIZE": "4", "RUNBUS_RUN_ID": "lit"}
    with pytest.raises(IdentityUnknown, match="NODE_RANK=1") as raised:
        resolve(env=node1)
    assert "RUNBUS_LABEL" in str(raised.value) and "runbus run" in str(raised.value)
    assert summary(resolve(env={**node1, "LOCAL_WORLD_SIZE": "2"})) == ("lit", "rank3", False, 3, 1, 4)
    named = resolve(env={**node1, "RUNBUS_LABEL": "node1-gpu1"})
    assert (named.label, named.rank, named.primary) == ("node1-gpu1", None, False)
    # Lightning's main process before it starts the node's ranks: local rank 0 of its node.
    with pytest.raises(IdentityUnknown, match="NODE_RANK=1"):
        resolve(env={"NODE_RANK": "1"})
    main = resolve(env={"NODE_RANK": "0"})
    assert (main.label, main.primary, main.run_id_from) == ("rank0", True, "new")


def test_slurm_steps():
    ident = resolve(env=SLURM_TASK)
    assert summary(ident) == ("slurm-4242.0", "rank5", False, 5, 1, 8)
    assert (ident.launcher, ident.run_id_from, ident.restart_count) == ("slurm", "slurm", 0)
    # Two steps of one job are two runs; an array task is its own job; a requeued job continues.
    assert resolve(env={**SLURM_TASK, "SLURM_STEP_ID": "1"}).run_id == "slurm-4242.1"
    array = {**SLURM_TASK, "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2"}
    assert resolve(env=array).run_id == "slurm-4240_2.0"
    requeued = resolve(env={**SLURM_TASK, "SLURM_RESTART_COUNT": "1"})
    assert (requeued.run_id, requeued.restart_count) == ("slurm-4242.0", 1)


@pytest.mark.parametrize("step", [None, "4294967291", "4294967290", "4294967292"])
def test_an_sbatch_script_is_one_process_of_its_own(step):
    # The batch step (no SLURM_STEP_ID, or the batch / interactive / extern pseudo-steps) runs one
    # process: SLURM_PROCID=0 of SLURM_NTASKS=8 does not make it rank 0 of 8.
    env = dict(SLURM_BATCH) if step is None else {**SLURM_BATCH, "SLURM_STEP_ID": step}
    ident = resolve(env=env)
    assert (ident.label, ident.primary, ident.world_size, ident.launcher, ident.run_id_from) == (
        "rank0",
        True,
        None,
        "none",
        "new",
    )
    assert shared_run_id(env) is None


def test_torchrun_inside_srun():
    # srun starts one torchrun agent per node: RANK is torchrun's, the run is the step's.
    env = {
        **SLURM_TASK,
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "GROUP_WORLD_SIZE": "2",
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
    }
    ident = resolve(env=env)
    assert summary(ident) == ("slurm-4242.0", "rank5", False, 5, 1, 8)
    assert (ident.launcher, ident.run_id_from) == ("torchrun+slurm", "slurm")
    # A rendezvous id is the innermost id.
    assert resolve(env={**env, "TORCHELASTIC_RUN_ID": "rdzv"}).run_id == "rdzv"
    # Two single-node torchrun jobs in one two-task step are two runs: each agent names its own.
    single = {**ACCELERATE, **{k: v for k, v in env.items() if k.startswith("SLURM_")}}
    assert resolve(env=single).run_id == resolve(env=ACCELERATE).run_id
    # Agents that are not the step's tasks one for one give no id at all.
    with pytest.raises(IdentityUnknown):
        resolve(env={**env, "GROUP_WORLD_SIZE": "4", "WORLD_SIZE": "16"})


def test_lightning_variables_that_repeat_an_outer_launchers_are_its():
    # `export LOCAL_RANK=$SLURM_LOCALID NODE_RANK=$SLURM_NODEID` in an srun wrapper: SLURM's rank.
    mirrored = {**SLURM_TASK, "LOCAL_RANK": "1", "NODE_RANK": "1"}
    ident = resolve(env=mirrored)
    assert (ident.run_id, ident.label, ident.launcher) == ("slurm-4242.0", "rank5", "slurm")
    # Lightning's own rank inside a one-task step (srun --job-name interactive): LOCAL_RANK is its.
    one_task = {**SLURM_TASK, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "1"}
    child = resolve(env={**one_task, "LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"})
    assert (child.run_id, child.label, child.launcher) == ("slurm-4242.0", "rank1", "lightning+slurm")


def test_open_mpi():
    ident = resolve(env=OPEN_MPI)
    assert re.fullmatch(r"openmpi-1590362113-[0-9a-f]{8}", ident.run_id)
    assert summary(ident)[1:] == ("rank1", False, 1, 1, 2)
    assert ident.launcher == "openmpi"
    rank0 = {**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "PMIX_RANK": "0"}
    assert resolve(env=rank0).run_id == ident.run_id
    # A later job that got the same job number is told apart by mpirun's per-job key.
    later = {**OPEN_MPI, "OMPI_MCA_orte_precondition_transports": "00-11"}
    assert resolve(env=later).run_id != ident.run_id


def test_mpich_and_intel_mpi_name_no_run():
    with pytest.raises(IdentityUnknown, match=r"rank 1 of 2 \(mpich\)"):
        resolve(env=MPICH)
    with pytest.raises(IdentityUnknown, match="intel-mpi"):
        resolve(env={**MPICH, "I_MPI_ROOT": "/opt/intel/mpi"})
    assert summary(resolve(env={**MPICH, "RUNBUS_RUN_ID": "m"})) == ("m", "rank1", False, 1, 1, 2)
    # Under srun (its PMI plugin sets PMI_RANK) the step names the run.
    under_srun = resolve(env={**MPICH, **SLURM_TASK, "PMI_RANK": "5", "PMI_SIZE": "8"})
    assert (under_srun.run_id, under_srun.label, under_srun.launcher) == (
        "slurm-4242.0",
        "rank5",
        "mpich+slurm",
    )


def test_runbus_variables_and_arguments_override_every_launcher():
    env = {**SLURM_TASK, "RUNBUS_RUN_ID": "mine", "RUNBUS_LABEL": "trainer"}
    ident = resolve(env=env)
    assert (ident.run_id, ident.label, ident.rank, ident.run_id_from) == (
        "mine",
        "trainer",
        5,
        "RUNBUS_RUN_ID",
    )
    assert resolve(run_id="arg", label="x", env=env).run_id == "arg"
    assert resolve(env={**OPEN_MPI, "RUNBUS_RUN_ID": "mine"}).run_id == "mine"
    assert shared_run_id({**OPEN_MPI, "RUNBUS_RUN_ID": "mine"}) == "mine"


def test_several_processes_and_no_rank_is_an_error_not_a_guess():
    with pytest.raises(IdentityUnknown, match="which one this is"):
        resolve(env={"WORLD_SIZE": "4", "RUNBUS_RUN_ID": "r"})
    alone = resolve(env={"WORLD_SIZE": "1"})
    assert (alone.label, alone.primary) == ("rank0", True)
    with pytest.raises(IdentityUnknown, match="no run id"):
        resolve(env={"RANK": "1"})  # rank 1 of an unknown world: not a run of its own


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"RANK": "zero"}, "RANK"),
        ({**SLURM_TASK, "SLURM_PROCID": "x"}, "SLURM_PROCID"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_SIZE": "2.0"}, "OMPI_COMM_WORLD_SIZE"),
        ({"LOCAL_RANK": "-"}, "LOCAL_RANK"),
    ],
)
def test_a_variable_that_is_no_integer_is_named(env, name):
    with pytest.raises(ValueError, match=name):
        resolve(env=env)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"RUNBUS_RUN_ID": "given"}, "given"),
        ({"TORCHELASTIC_RUN_ID": "rdzv", "RANK": "0"}, "rdzv"),
        (SLURM_TASK, "slurm-4242.0"),
        (SLURM_BATCH, None),
        (MPICH, None),
        (DEEPSPEED, None),
        (LIGHTNING_DDP_RANK1, None),
    ],
)
def test_shared_run_id(env, expected):
    assert shared_run_id(env) == expected


def test_launcher_ids_are_valid_run_ids():
    assert launchers.launcher_id("slurm", "7_1.0") == "slurm-7_1.0"
    assert launchers.launcher_id("openmpi", "prterun-host-12@1") == "openmpi-prterun-host-12-1"
    assert launchers.launcher_id("", "..x") == "x"
    assert re.fullmatch(r"id-[0-9a-f]{12}", launchers.launcher_id("", "???"))
    wire.check_name("run id", launchers.launcher_id("openmpi", "é" * 300))


# -- agreeing through a process group -----------------------------------------------------------

GLOO_RANK = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    import runbus
    from runbus.producer import environment
    rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    environment.AGREE_TIMEOUT = 3.0
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    options = dict(system_interval=None, console="off", hardware=False)
    if mode == "silent-rank0" and rank == 0:
        dist.barrier()
        sys.exit(0)
    try:
        ids = []
        for _ in range(2):  # a job's second run is another run, agreed the same way
            with runbus.init(**options) as run:
                ident = run.identity
                ids.append([ident.run_id, ident.label, ident.rank, ident.world_size, ident.run_id_from])
        print(json.dumps(ids), flush=True)
    except runbus.IdentityUnknown as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
    dist.barrier()
    """
)


def gloo_job(redis_url: str, mode: str) -> list[str]:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GLOO_RANK, str(rank), port, mode],
            env=clean_env(RUNBUS_REDIS_URL=redis_url),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    return [out for out, _ in outputs]


def test_ranks_of_a_gloo_process_group_agree_on_a_run_id(redis_url):
    rank0, rank1 = (json.loads(out) for out in gloo_job(redis_url, "both"))
    for first, second in zip(rank0, rank1, strict=True):
        assert first[0] == second[0]
        assert (first[1:], second[1:]) == (
            ["rank0", 0, 2, "torch.distributed"],
            ["rank1", 1, 2, "torch.distributed"],
        )
    assert rank0[0][0] != rank0[1][0]
    for run_id, *_ in rank0:
        starts = start_events(redis_url, run_id)
        assert sorted(starts) == ["rank0", "rank1"]
        assert (starts["rank0"]["primary"], starts["rank1"]["primary"]) == (True, False)
        assert starts["rank1"]["launcher"] == "torch.distributed"


def test_a_rank_that_waits_in_vain_for_rank_0_says_why(redis_url):
    _, rank1 = gloo_job(redis_url, "silent-rank0")
    error = json.loads(rank1)["error"]
    assert "rank 1 of 2" in error and "waited 3s for rank 0" in error and "RUNBUS_RUN_ID" in error


# -- real launchers -----------------------------------------------------------------------------


def run_job(
    command: list[str], redis_url: str, timeout: float = 180, **env: str
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        command,
        env=clean_env(RUNBUS_REDIS_URL=redis_url, RUNBUS_CONSOLE="off", **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def assert_one_run(result: subprocess.CompletedProcess, redis_url: str, launcher: str) -> str:
    """Both ranks printed one run id, as rank0 (primary) and rank1; both streams are in Redis;
    the primary printed the one stderr line, the other rank nothing."""
    found = sorted(identities(result.stdout), key=lambda ident: ident["label"])
    assert [ident["label"] for ident in found] == ["rank0", "rank1"], result.stdout
    assert found[0]["run_id"] == found[1]["run_id"]
    assert [ident["primary"] for ident in found] == [True, False]
    assert found[1]["launcher"] == launcher
    run_id = found[0]["run_id"]
    assert sorted(start_events(redis_url, run_id)) == ["rank0", "rank1"]
    assert banners(result.stderr) == [
        f"runbus: run {run_id}, label rank0 ({found[0]['launcher']}, 2 ranks): runbus show {run_id}"
    ]
    return run_id


def test_torchrun_without_a_rendezvous_id(redis_url):
    command = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port())]
    result = run_job([*command, str(TRAIN), "--print-json", "--steps", "3"], redis_url)
    assert assert_one_run(result, redis_url, "torchrun").startswith("torchrun-")


def test_torchrun_on_one_node_names_the_run_after_its_uuid4(redis_url):
    # torch 2.13's torchrun on one node, with no port and no rendezvous given, makes itself a
    # c10d rendezvous with a fresh uuid4 id (torch.distributed.run.run): every rank reads it,
    # and the run is `torchrun-` and its first 12 hex digits.
    command = [str(BIN / "torchrun"), "--nproc-per-node", "2"]
    result = run_job([*command, str(TRAIN), "--print-json", "--steps", "3"], redis_url)
    run_id = assert_one_run(result, redis_url, "torchrun")
    assert re.fullmatch(r"torchrun-[0-9a-f]{12}", run_id), run_id


def test_a_new_run_id_is_short_readable_sorted_by_utc_time_and_unique():
    ids = [wire.new_run_id() for _ in range(100_000)]
    assert len(set(ids)) == len(ids)
    for made in ids[:100]:
        assert re.fullmatch(r"run-\d{8}-\d{6}-[0-9a-hjkmnp-tv-z]{8}", made), made
        assert wire.check_name("run id", made) == made
    # UTC, whatever the time zone; later ids sort after earlier ones.
    assert wire.new_run_id(0.0).startswith("run-19700101-000000-")
    assert wire.new_run_id(1_795_000_000.0) > wire.new_run_id(1_794_999_999.0)


def test_a_uuid4_rendezvous_id_is_shortened_alike_on_every_rank():
    made = str(uuid.uuid4())
    short = f"torchrun-{made[:8]}{made[9:13]}"
    assert launchers.rendezvous_run_id(made) == short
    ranks = [
        resolve(env={"TORCHELASTIC_RUN_ID": made, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)})
        for r in range(2)
    ]
    assert [r.run_id for r in ranks] == [short, short] and [r.run_id_from for r in ranks] == ["torchrun"] * 2
    # `runbus run -- torchrun --rdzv-id UUID` names the run as its ranks would.
    assert launch.job_run_id(None, {}, ["torchrun", "--rdzv-id", made, "train.py"]) == short
    # Not a uuid4 (a user's own id, another version, upper case): as given.
    for given in ("myjob", str(uuid.uuid1()), made.upper(), made.replace("-", "")):
        assert launchers.rendezvous_run_id(given) == given


def test_accelerate_launch(redis_url):
    command = [
        str(BIN / "accelerate"),
        "launch",
        "--multi_gpu",  # accelerate's torchrun launcher, gloo on this CPU machine
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
    ]
    result = run_job([*command, str(TRAIN), "--print-json", "--steps", "3"], redis_url)
    assert_one_run(result, redis_url, "accelerate")


def test_open_mpi_mpirun(redis_url):
    if shutil.which("mpirun.openmpi") is None:
        missing_server("Open MPI's mpirun (Debian's openmpi-bin)")
    port = str(free_port())
    command = ["mpirun.openmpi", "-np", "2", "--oversubscribe", "-x", "MASTER_PORT", "-x", "RUNBUS_REDIS_URL"]
    command += ["-x", "RUNBUS_CONSOLE"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    result = run_job(
        [*command, sys.executable, str(TRAIN), "--print-json", "--steps", "3"], redis_url, MASTER_PORT=port
    )
    assert assert_one_run(result, redis_url, "openmpi").startswith("openmpi-")


def test_mpich_mpiexec_agrees_through_the_process_group(redis_url):
    if shutil.which("mpiexec.hydra") is None:
        missing_server("MPICH's mpiexec.hydra (Debian's mpich)")
    command = ["mpiexec.hydra", "-n", "2", sys.executable, str(TRAIN), "--print-json", "--steps", "3"]
    result = run_job(command, redis_url, MASTER_PORT=str(free_port()))
    run_id = assert_one_run(result, redis_url, "mpich")
    assert {ident["run_id_from"] for ident in identities(result.stdout)} == {"torch.distributed"}
    assert run_id.startswith("run-")


@pytest.mark.parametrize(
    ("strategy", "where", "run_id_from"),
    [
        ("ddp", "top", {"new", "RUNBUS_RUN_ID"}),
        ("ddp", "setup", {"torch.distributed"}),
        ("ddp_spawn", "setup", {"torch.distributed"}),
    ],
)
def test_lightning_ranks_land_in_one_run(redis_url, strategy, where, run_id_from):
    # Plain runbus.init(), no RUNBUS_* variable: at the top of the script (Lightning's ddp ranks
    # re-run it with the main process's exported run id) or in the LightningModule's setup().
    command = [sys.executable, str(LIGHTNING_TRAIN), "--strategy", strategy, "--init", where, "--print-json"]
    result = run_job(command, redis_url, timeout=120)
    found = identities(result.stdout)
    assert {ident["run_id_from"] for ident in found} == run_id_from
    run_id = found[0]["run_id"]
    assert {ident["run_id"] for ident in found} == {run_id}
    starts = start_events(redis_url, run_id)
    assert sorted(starts) == ["rank0", "rank1"]
    assert (starts["rank0"]["primary"], starts["rank1"]["primary"]) == (True, False)
    assert len(banners(result.stderr)) == 1


# -- the primary's line -------------------------------------------------------------------------


def test_a_plain_script_prints_its_run_first_on_stderr(redis_url):
    script = (
        "import runbus, sys; run = runbus.init(system_interval=None); print('hello', file=sys.stderr); "
        "run.finish()"
    )
    result = run_job([sys.executable, "-c", script], redis_url)
    first, *rest = result.stderr.splitlines()
    match = re.fullmatch(r"runbus: run (run-[\w-]+), label rank0: runbus show \1", first)
    assert match, first
    assert "hello" in rest
    quiet = run_job([sys.executable, "-c", script], redis_url, RUNBUS_QUIET="1")
    assert banners(quiet.stderr) == []
    # Not a torch import among init()'s costs.
    probe = (
        "import sys, runbus; runbus.init(system_interval=None, quiet=True).finish(); "
        "print('torch' in sys.modules)"
    )
    assert run_job([sys.executable, "-c", probe], redis_url).stdout.strip() == "False"


def test_the_line_names_the_dashboard_page_without_secrets(redis_url, no_launcher, monkeypatch, capsys):
    monkeypatch.setenv(
        "RUNBUS_DASHBOARD_URL", "https://viewer:hunter2@dash.example/?token=s3cret-token\x1b[2J"
    )
    run = runbus.init(run_id="banner-dash", redis_url=redis_url, **{**QUIET, "quiet": None})
    try:
        again = runbus.init(run_id="banner-dash", redis_url=redis_url, **{**QUIET, "quiet": None})
        assert again is run
    finally:
        run.finish()
    lines = banners(capsys.readouterr().err)
    assert len(lines) == 1  # once per init() that starts a Run
    line = lines[0]
    assert "hunter2" not in line and "s3cret-token" not in line and "\x1b" not in line
    assert line.startswith("runbus: run banner-dash, label rank0: runbus show banner-dash | https://viewer:")
    assert line.endswith("#/run/banner-dash")


def test_quiet_and_other_ranks_print_nothing(redis_url, no_launcher, monkeypatch, capsys):
    with runbus.init(run_id="banner-quiet", redis_url=redis_url, **QUIET):
        pass
    monkeypatch.setenv("RUNBUS_QUIET", "1")
    with runbus.init(run_id="banner-quiet-env", redis_url=redis_url, **{**QUIET, "quiet": None}):
        pass
    monkeypatch.delenv("RUNBUS_QUIET")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with runbus.init(run_id="banner-rank1", redis_url=redis_url, **{**QUIET, "quiet": None}) as run:
        assert run.label == "rank1"
    assert banners(capsys.readouterr().err) == []
    monkeypatch.setenv("RUNBUS_QUIET", "sometimes")
    with pytest.raises(ValueError, match="RUNBUS_QUIET"):
        runbus.init(run_id="banner-bad", redis_url=redis_url, **{**QUIET, "quiet": None})


def test_a_closed_stderr_does_not_stop_a_run():
    ident = resolve(run_id="r", env={})
    closed = io.StringIO()
    closed.close()
    banner.announce(ident, quiet=False, stream=closed)
    assert banner.banner(ident) == "runbus: run r, label rank0: runbus show r"


# -- pickling -----------------------------------------------------------------------------------


def _log_as(handle):
    with handle.init(system_interval=None, console="off", hardware=False) as run:
        run.log({"x": 1.0})


def test_a_run_is_never_pickled(redis_url, no_launcher):
    with runbus.init(run_id="no-pickle", redis_url=redis_url, **QUIET) as run:
        with pytest.raises(TypeError, match=r'run\.child\("rank0-worker"\)') as raised:
            pickle.dumps(run)
        assert "no-pickle" in str(raised.value)
        process = multiprocessing.get_context("spawn").Process(target=_log_as, args=(run,))
        with pytest.raises(TypeError, match="cannot be pickled"):
            process.start()
        # Within the process a copy is the same writer (a model that holds its Run, deep-copied).
        assert copy.deepcopy({"run": run})["run"] is run and copy.copy(run) is run
        # The handle made for that goes.
        child = multiprocessing.get_context("spawn").Process(target=_log_as, args=(run.child("rank0-w"),))
        child.start()
        child.join(60)
        assert child.exitcode == 0
    assert sorted(start_events(redis_url, "no-pickle")) == ["rank0", "rank0-w"]


# -- a new run id, exported ---------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, runbus
    try:
        with runbus.init(system_interval=None, console="off", hardware=False) as run:
            print(json.dumps({"run_id": run.run_id, "label": run.label}))
    except runbus.LabelInUse as exc:
        print(json.dumps({"error": str(exc)}))
    """
)


def test_a_new_run_id_is_exported_to_the_processes_init_starts(redis_url, no_launcher):
    run = runbus.init(redis_url=redis_url, **QUIET)
    try:
        assert run.identity.run_id_from == "new"
        assert os.environ[config.RUN_ID_ENV] == run.run_id
        assert os.environ[config.RUN_ID_FROM_ENV] == str(os.getpid())

        def child(**env: str) -> dict:
            # A child inherits this process's environment, as Lightning's ranks do.
            out = subprocess.run(
                [sys.executable, "-c", CHILD],
                env={**os.environ, "RUNBUS_REDIS_URL": redis_url, **env},
                capture_output=True,
                text=True,
                timeout=60,
            )
            return orjson.loads(out.stdout)

        # A rank Lightning starts (LOCAL_RANK, WORLD_SIZE) joins the run.
        assert child(LOCAL_RANK="1", NODE_RANK="0", WORLD_SIZE="2") == {
            "run_id": run.run_id,
            "label": "rank1",
        }
        # A process that is no rank would be a second writer of rank0: refused, saying what to do.
        error = child()["error"]
        assert "rank0" in error and f"process {os.getpid()}" in error and 'run.child("rank0-worker")' in error
    finally:
        run.finish()
    # Once finished, the run is no longer handed down, and the next init() starts another.
    assert config.RUN_ID_ENV not in os.environ and config.RUN_ID_FROM_ENV not in os.environ
    with runbus.init(redis_url=redis_url, **QUIET) as second:
        assert second.run_id != run.run_id
    assert config.RUN_ID_ENV not in os.environ


def test_an_id_from_the_environment_is_not_exported_again(redis_url, no_launcher, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    with runbus.init(redis_url=redis_url, **QUIET) as run:
        assert (run.run_id, run.identity.run_id_from) == ("slurm-77.3", "slurm")
        assert config.RUN_ID_ENV not in os.environ


def test_label_in_use_without_an_exported_id_is_unchanged(redis_url, no_launcher):
    with runbus.init(run_id="plain-in-use", redis_url=redis_url, **QUIET):
        out = subprocess.run(
            [sys.executable, "-c", CHILD],
            env=clean_env(RUNBUS_REDIS_URL=redis_url, RUNBUS_RUN_ID="plain-in-use"),
            capture_output=True,
            text=True,
            timeout=60,
        )
    error = orjson.loads(out.stdout)["error"]
    assert "in use by" in error and "exported" not in error
