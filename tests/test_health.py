"""Health with real processes: 4 ranks under gloo on CPU, a live `runbus ingest`, faults injected
(a rank blocked in Python, blocked in a C call, SIGSTOPped, SIGKILLed, Redis away during a hang),
the first rank to go of a run that failed (SIGKILLed or exiting under gloo, the others failing
after it) and the pauses that must not raise an alarm (a checkpoint on every rank, the start-up,
a finished run)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import missing_package
from tests.helpers import ingest_command, read_store, run_cli, wait_for
from tests.rank_processes import ranks_running
from tests.test_pipeline import store_opened

try:
    import torch  # noqa: F401
except ImportError:
    missing_package("torch")

WORLD = 4
FAULT_STEP = 20
STALL_AFTER = 3.0  # the detector's floor in these tests (10 s by default)

RANK = textwrap.dedent(
    """
    import os, select, signal, sys, time
    import torch, torch.distributed as dist
    import runbus

    fault, culprit = os.environ["FAULT"], int(os.environ["CULPRIT"])
    collective = fault != "sigkill"
    if collective:
        dist.init_process_group("gloo")
    run = runbus.init(system_interval=None, hardware=False, git=False, console="all", heartbeat_interval=1.0)
    rank = run.identity.rank

    def load_batch(step):
        if fault == "loader" and rank == culprit and step == int(os.environ["FAULT_STEP"]):
            print(f"rank {rank} reading shard {step}", flush=True)
            time.sleep(3600)
        return torch.ones(4) * step

    def wait_for_peer(step):
        # A C call that lets go of the GIL and never returns: nobody writes this pipe.
        if fault == "cblock" and rank == culprit and step == int(os.environ["FAULT_STEP"]):
            print(f"rank {rank} waiting for its peer at step {step}", flush=True)
            quiet, _ = os.pipe()
            select.select([quiet], [], [])

    def save_checkpoint(step):
        time.sleep(float(os.environ["PAUSE"]))

    # A collective loop runs a number of steps (a rank that left it early would fail the others'
    # all_reduce); without collectives each rank runs a while.
    step, steps, deadline = 0, int(os.environ["STEPS"]), time.monotonic() + float(os.environ["SECONDS"])
    while step < steps and (collective or time.monotonic() < deadline):
        batch = load_batch(step)
        wait_for_peer(step)
        if fault in ("kill-in-gloo", "exit") and rank == culprit:
            print(f"rank {rank} at step {step}", flush=True)
        if step == int(os.environ["FAULT_STEP"]) and rank == culprit:
            if fault == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if fault in ("sigkill", "kill-in-gloo"):
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "exit":
                sys.exit(3)
        if fault == "checkpoint" and step == int(os.environ["FAULT_STEP"]):
            save_checkpoint(step)
        if collective:
            dist.all_reduce(batch)
        run.log({"loss": float(batch.sum())}, step=step)
        step += 1
        time.sleep(0.05)
    run.finish()
    """
)


@contextlib.contextmanager
def live_ingester(redis_url: str, store_url: str, alerts: Path, workers: int = 1) -> Iterator[Path]:
    """A live `runbus ingest` (of `workers` workers) with a 3 s stall floor, its alerts appended
    to `alerts` (returned)."""
    worker = subprocess.Popen(
        ingest_command(
            redis_url,
            store_url,
            "--stall-after",
            str(STALL_AFTER),
            "--on-alert",
            f"cat >> {alerts}; echo >> {alerts}",
            "--workers",
            str(workers),
        ),
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for("the worker to open its store", lambda: store_opened(store_url) or worker.poll() is not None)
    try:
        yield alerts
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
        assert worker.returncode == 0, err


@pytest.fixture(params=[1])
def ingester(
    redis_url: str, store_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Path]:
    """live_ingester on the tests' Redis, of `request.param` workers."""
    with live_ingester(redis_url, store_url, tmp_path / "alerts.jsonl", request.param) as alerts:
        yield alerts


def job(
    redis_url: str,
    run_id: str,
    fault: str,
    culprit: int = 2,
    seconds: float = 120.0,
    pause: float = 0,
    steps: int = 1_000_000,
) -> contextlib.AbstractContextManager[list[subprocess.Popen[bytes]]]:
    """The job's WORLD ranks running RANK while the block runs, `culprit` doing what `fault`
    says at FAULT_STEP."""
    env = {
        "RUNBUS_REDIS_URL": redis_url,
        "RUNBUS_RUN_ID": run_id,
        "FAULT": fault,
        "CULPRIT": str(culprit),
        "FAULT_STEP": str(FAULT_STEP),
        "SECONDS": str(seconds),
        "PAUSE": str(pause),
        "STEPS": str(steps),
        "RUNBUS_QUIET": "1",
    }
    return ranks_running(RANK, WORLD, env)


def health(store_url: str, run_id: str) -> dict | None:
    try:
        return read_store(store_url, "health", run_id)
    except Exception:  # the run's table rows are being written: not yet
        return None


def health_is(store_url: str, run_id: str, state: str) -> dict | None:
    found = health(store_url, run_id)
    return found if found is not None and found["state"] == state else None


def stalled_with_a_culprit(store_url: str, run_id: str) -> dict:
    """The run's verdict once it is stalled and names a culprit (within 60 s)."""
    return wait_for(
        "the run to be stalled with a culprit",
        lambda: (h := health_is(store_url, run_id, "stalled")) and h["culprits"] and h,
        timeout=60,
    )


def alerts_of(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("ingester", [2], indirect=True)  # two workers judge; one alerts
def test_a_rank_blocked_in_its_data_loader_is_the_culprit(redis_url, store_url, ingester):
    with job(redis_url, "hang-loader", "loader"):
        found = stalled_with_a_culprit(store_url, "hang-loader")
        culprit = found["culprits"][0]
        assert culprit["label"] == "rank2" and "data loader" in culprit["reason"]
        assert "load_batch" in [frame["function"] for frame in culprit["stack"]]
        assert culprit["last_lines"][-1] == "rank 2 reading shard 20"
        assert sorted(w["label"] for w in found["waiting"]) == ["rank0", "rank1", "rank3"]
        assert {w["in"] for w in found["waiting"]} == {"all_reduce"}
        assert [c["label"] for c in found["culprits"]] == ["rank2"]
        # The waiting ranks' beats say they have been inside all_reduce since the hang began (the
        # producer times torch.distributed's calls), the culprit's that it is in none.
        assert all(abs(w["for_s"] - culprit["step_age"]) < 3 for w in found["waiting"])
        [run] = [r for r in read_store(store_url, "health_inputs") if r.run_id == "hang-loader"]
        beats = {v.label: v.beat for v in run.labels}
        assert beats["rank2"]["collective"] is None and beats["rank2"]["collective_s"] is None
        assert {beats[r]["collective"] for r in ("rank0", "rank1", "rank3")} == {"all_reduce"}
        assert all(beats[r]["collective_s"] > 1.0 for r in ("rank0", "rank1", "rank3"))
        # torch's flight recorder counts each rank's collectives: the waiting ranks queued the
        # all_reduce the culprit never reached.
        queued = {label: beat["groups"]["0"][0] for label, beat in beats.items()}
        assert queued["rank0"] == queued["rank1"] == queued["rank3"] == queued["rank2"] + 1
        # Named within the floor and a few seconds of the hang's start (its last step).
        assert STALL_AFTER < culprit["step_age"] < STALL_AFTER + 5
        alert = wait_for("the alert", lambda: alerts_of(ingester))[0]
        assert alert["run"] == "hang-loader" and alert["state"] == "stalled"
        assert alert["culprits"][0]["label"] == "rank2"
        # Both workers judge the run every second: once each has done so twice more, still one alert.
        wait_for(
            "more verdicts",
            lambda: (
                (h := health(store_url, "hang-loader"))
                and h["culprits"][0]["step_age"] > culprit["step_age"] + 2.5
            ),
        )
        assert len(alerts_of(ingester)) == 1
        shown = run_cli("--store", store_url, "show", "hang-loader").stdout
        assert shown.splitlines()[0].startswith("health   stalled since ")
        assert "rank2 in a data loader (load_batch)" in shown.splitlines()[0]
        document = json.loads(run_cli("--store", store_url, "show", "hang-loader", "--json").stdout)
        assert document["health"]["culprits"][0]["label"] == "rank2"


def test_a_sigstopped_rank_is_the_culprit(redis_url, store_url, ingester):
    with job(redis_url, "hang-stop", "sigstop", culprit=1):
        found = stalled_with_a_culprit(store_url, "hang-stop")
        assert [c["label"] for c in found["culprits"]] == ["rank1"]
        assert "stopped" in found["culprits"][0]["reason"]
        assert sorted(w["label"] for w in found["waiting"]) == ["rank0", "rank2", "rank3"]


def test_a_sigkilled_rank_is_dead_while_the_others_go_on(redis_url, store_url, ingester):
    with job(redis_url, "dead-rank", "sigkill", culprit=3, seconds=30):
        found = wait_for(
            "the run to have a dead rank", lambda: health_is(store_url, "dead-rank", "dead"), timeout=60
        )
        assert [c["label"] for c in found["culprits"]] == ["rank3"]
        assert "gone" in found["culprits"][0]["reason"]
        # The alert command runs after the verdict is stored: its line comes a moment later.
        alerts = wait_for("the dead rank's alert", lambda: alerts_of(ingester), timeout=30)
        assert alerts[0]["state"] == "dead"


def test_a_checkpoint_on_every_rank_and_the_finish_raise_no_alarm(redis_url, store_url, ingester):
    with job(redis_url, "checkpoint", "checkpoint", pause=STALL_AFTER + 4, steps=2 * FAULT_STEP) as ranks:
        paused = wait_for(
            "the pause to be seen",
            lambda: (h := health_is(store_url, "checkpoint", "ok")) and "paused" in (h["note"] or "") and h,
            timeout=60,
        )
        assert "save_checkpoint" in paused["note"]
        assert [p.wait(60) for p in ranks] == [0] * WORLD
        wait_for(
            "the finished run's health",
            lambda: (h := health_is(store_url, "checkpoint", "ok")) and "finished" in (h["note"] or ""),
        )
        assert alerts_of(ingester) == []


def test_a_rank_blocked_in_a_c_call_is_the_culprit(redis_url, store_url, ingester):
    with job(redis_url, "hang-select", "cblock", culprit=1):
        found = stalled_with_a_culprit(store_url, "hang-select")
        # Its heartbeats go on (select lets go of the GIL): it is named by where it stands.
        assert [c["label"] for c in found["culprits"]] == ["rank1"]
        culprit = found["culprits"][0]
        assert culprit["reason"] == "in Python (wait_for_peer)"
        assert culprit["stack"][-1]["function"] == "wait_for_peer"
        assert culprit["silent_s"] < 3
        assert culprit["last_lines"][-1] == "rank 1 waiting for its peer at step 20"
        assert sorted(w["label"] for w in found["waiting"]) == ["rank0", "rank2", "rank3"]


def test_the_culprit_is_named_again_once_redis_is_back_after_an_outage_during_the_hang(
    local_redis, store_url, tmp_path
):
    with (
        live_ingester(local_redis.url, store_url, tmp_path / "alerts.jsonl") as alerts,
        job(local_redis.url, "hang-outage", "loader") as ranks,
    ):
        stalled_with_a_culprit(store_url, "hang-outage")
        local_redis.kill()
        # Nothing reaches the store: every label falls silent, as the detector then says.
        wait_for("the run to be silent", lambda: health_is(store_url, "hang-outage", "silent"), 30)
        local_redis.start()
        # Right after, a rank whose producer has not reconnected yet may be named for its
        # silence beside the culprit (the culprit too, until its own beat comes back): the
        # verdict settles on the culprit alone, in its data loader.
        found = wait_for(
            "the culprit named again, alone, in its data loader",
            lambda: (
                (h := health_is(store_url, "hang-outage", "stalled"))
                and [c["label"] for c in h["culprits"]] == ["rank2"]
                and "data loader" in h["culprits"][0]["reason"]
                and h
            ),
            timeout=60,
        )
        assert sorted(w["label"] for w in found["waiting"]) == ["rank0", "rank1", "rank3"]
        assert all(rank.poll() is None for rank in ranks)  # the outage killed no rank

        def states() -> list[tuple[str, list[str]]]:
            return [(a["state"], sorted(c["label"] for c in a["culprits"])) for a in alerts_of(alerts)]

        # Each alert's command runs after its verdict is stored: the last line comes a moment later.
        wait_for("the last alert", lambda: states() and states()[-1] == ("stalled", ["rank2"]), timeout=30)
        assert states()[0] == ("stalled", ["rank2"])
        assert ("silent", ["rank0", "rank1", "rank2", "rank3"]) in states()


@pytest.mark.parametrize(
    ("fault", "code", "how"),
    [("kill-in-gloo", -signal.SIGKILL, "killed: no finish"), ("exit", 3, "exited with code 3")],
)
def test_the_rank_that_went_first_is_named_once_the_others_failed_after_it(
    redis_url, store_url, ingester, fault, code, how
):
    """Under gloo the others' all_reduce fails as soon as rank 2 is gone: the run ends failed
    before rank 2 could be seen falling silent, and the post-mortem names it."""
    run_id = f"first-{fault}"
    with job(redis_url, run_id, fault) as ranks:
        assert [p.wait(60) for p in ranks] == [1, 1, code, 1]
        found = wait_for("the post-mortem", lambda: health_is(store_url, run_id, "crashed"), timeout=60)
        [culprit] = found["culprits"]
        assert culprit["label"] == "rank2" and culprit["reason"].startswith(how)
        assert culprit["reason"].endswith("before any other rank failed")
        # What it printed last before it went (a SIGKILL loses what its shipper had not sent yet).
        assert culprit["last_lines"][-1].startswith("rank 2 at step ")
        if fault == "exit":
            assert culprit["last_lines"][-1] == f"rank 2 at step {FAULT_STEP}"
        assert culprit["stack"] and culprit["stack"][0]["file"] == "<string>"
        followers = found["followers"]
        assert sorted(f["label"] for f in followers) == ["rank0", "rank1", "rank3"]
        assert {(f["state"], f["exit_code"]) for f in followers} == {("failed", 1)}
        assert all(f["after_s"] > 0 for f in followers) and found["ended"]
        # Recorded once: one alert, and the run is no longer judged.
        wait_for(
            "the crash alert", lambda: [a for a in alerts_of(ingester) if a["state"] == "crashed"], timeout=30
        )
        [alert] = [a for a in alerts_of(ingester) if a["state"] == "crashed"]
        assert alert["run"] == run_id and alert["culprits"][0]["label"] == "rank2"
        shown = run_cli("--store", store_url, "show", run_id).stdout.splitlines()[0]
        assert shown.startswith("health   crashed since ") and f"rank2 {how}" in shown
        assert "after it: rank" in shown
        document = json.loads(run_cli("--store", store_url, "show", run_id, "--json").stdout)
        assert document["health"]["culprits"][0]["label"] == "rank2"
        assert len(document["health"]["followers"]) == 3
