"""The health rules (storage/health.py) without servers, the producer's step progress, and the
store's compare and set of verdicts on both backends (one recorder per change)."""

from __future__ import annotations

import json
import threading

import pytest

from runbus.producer.vitals import Progress, thread_stack
from runbus.query.health import health_lines
from runbus.storage.beats import RunVitals
from runbus.storage.health import (
    DEAD,
    GPU_WORK,
    OK,
    SILENT,
    STALLED,
    HealthSettings,
    LabelVitals,
    judge,
)
from runbus.wire import Event

NOW = 1_800_000_000.0
SETTINGS = HealthSettings(floor=10.0)
TRAIN = ["train.py", 10, "<module>", "main()"]
C10D = "/x/torch/distributed/distributed_c10d.py"
ALL_REDUCE = [["train.py", 20, "main", "dist.all_reduce(t)"], [C10D, 1, "all_reduce", ""]]
LOADER = [["train.py", 18, "main", "batch = next(it)"], ["loader.py", 5, "load_batch", "time.sleep(9)"]]
SAVE = [["train.py", 22, "main", "save(model)"], ["train.py", 40, "save_checkpoint", "torch.save(m, f)"]]


def rank(label, step=40, age=20.0, stalled=True, stack=None, seen=1.0, process=None) -> LabelVitals:
    """A label whose last beat was stored `seen` seconds ago, saying its step is `age` old."""
    beat = {"step": step, "step_age": age, "step_s": 0.1, "stalled": stalled, "every": 10.0}
    beat["stack"] = [TRAIN, *(stack if stack is not None else ALL_REDUCE)]
    return LabelVitals(label, beat, NOW - seen, NOW - seen, process)


def test_a_rank_in_its_data_loader_is_the_culprit_and_the_others_wait():
    verdict = judge("running", [rank("rank0"), rank("rank1", stack=LOADER), rank("rank2")], NOW, SETTINGS)
    assert verdict.state == STALLED
    assert [(c["label"], c["reason"]) for c in verdict.culprits] == [
        ("rank1", "in a data loader (load_batch)")
    ]
    waiting = [(w["label"], w["in"]) for w in verdict.waiting]
    assert waiting == [("rank0", "all_reduce"), ("rank2", "all_reduce")]
    assert verdict.culprits[0]["stack"][-1]["function"] == "load_batch"


def test_a_label_that_never_steps_is_neither_culprit_nor_waiting():
    child = LabelVitals("rank0-loader", {"every": 10.0, "stack": LOADER}, NOW - 1, NOW - 1)
    verdict = judge("running", [rank("rank0"), rank("rank1", stack=LOADER), child], NOW, SETTINGS)
    assert [c["label"] for c in verdict.culprits] == ["rank1"]
    assert [w["label"] for w in verdict.waiting] == ["rank0"]


def test_a_rank_silent_before_its_first_beat_is_the_culprit_of_a_stall():
    # Stopped a few seconds in, before its first heartbeat: its events were stored, no beat.
    early = LabelVitals("rank1", None, None, NOW - 30.0, "stopped")
    verdict = judge("running", [rank("rank0"), early, rank("rank2")], NOW, SETTINGS)
    assert verdict.state == STALLED
    assert [c["label"] for c in verdict.culprits] == ["rank1"] and "stopped" in verdict.culprits[0]["reason"]
    assert [w["label"] for w in verdict.waiting] == ["rank0", "rank2"]


def test_a_rank_a_step_behind_is_the_culprit():
    verdict = judge("running", [rank("rank0"), rank("rank1", step=39), rank("rank2")], NOW, SETTINGS)
    reasons = [(c["label"], c["reason"]) for c in verdict.culprits]
    assert reasons == [("rank1", "behind: at step 39, others at 40")]


def test_a_silent_rank_during_a_stall_is_the_culprit_with_its_process_state():
    silent = rank("rank2", age=0.5, stalled=False, seen=40.0, process="stopped")
    verdict = judge("running", [rank("rank0"), rank("rank1"), silent], NOW, SETTINGS)
    assert verdict.state == STALLED
    assert verdict.culprits[0]["label"] == "rank2" and "stopped" in verdict.culprits[0]["reason"]


def test_a_rank_in_another_collective_is_the_culprit():
    barrier = [["train.py", 30, "main", ""], ["/x/torch/distributed/distributed_c10d.py", 2, "barrier", ""]]
    verdict = judge("running", [rank("rank0"), rank("rank1", stack=barrier), rank("rank2")], NOW, SETTINGS)
    assert verdict.culprits[0]["reason"] == "in barrier while the others are in all_reduce"


def test_a_beat_that_says_it_is_inside_a_collective_waits_whatever_its_stack():
    # The producer timed its all_reduce (runbus.producer.collectives): 12 s inside at its last beat,
    # stored a second ago; its stack alone (a C extension's frames, no torch file) says nothing.
    inside = rank("rank0", stack=[["ext.py", 3, "step", "ext.sync(t)"]])
    inside.beat.update(collective="all_reduce", collective_s=12.0)  # type: ignore[union-attr]
    outside = rank("rank1", stack=LOADER)
    outside.beat.update(collective=None, collective_s=None)  # type: ignore[union-attr]
    verdict = judge("running", [inside, outside, rank("rank2")], NOW, SETTINGS)
    assert [c["label"] for c in verdict.culprits] == ["rank1"]
    assert [(w["label"], w["in"], w["for_s"]) for w in verdict.waiting] == [
        ("rank0", "all_reduce", 13.0),
        ("rank2", "all_reduce", None),  # named by its stack: not timed
    ]
    # A rank in another collective by its beat stands apart as one by its stack does.
    inside.beat["collective"] = "barrier"  # type: ignore[index]
    verdict = judge("running", [inside, rank("rank1"), rank("rank2")], NOW, SETTINGS)
    assert verdict.culprits[0]["reason"] == "in barrier while the others are in all_reduce"


def test_ranks_whose_logged_values_wait_for_their_gpu_wait_in_gpu_work():
    # Under NCCL a collective runs on the GPU: the waiting ranks' Python went on to a `.item()`
    # (no collective in their stacks), but their beats say the values they logged have waited
    # 12 s for their GPU (runbus.producer.devicevalues). rank1 sits in its data loader.
    item = [["train.py", 33, "main", "print(loss.item())"]]

    def on_gpu(label: str, waited: float) -> LabelVitals:
        vitals = rank(label, stack=item)
        vitals.beat["gpu_wait_s"] = waited  # type: ignore[index]
        return vitals

    verdict = judge(
        "running", [on_gpu("rank0", 12.0), rank("rank1", stack=LOADER), on_gpu("rank2", 11.0)], NOW, SETTINGS
    )
    assert verdict.state == STALLED
    assert [(c["label"], c["reason"]) for c in verdict.culprits] == [
        ("rank1", "in a data loader (load_batch)")
    ]
    assert [(w["label"], w["in"], w["for_s"]) for w in verdict.waiting] == [
        ("rank0", GPU_WORK, 13.0),
        ("rank2", GPU_WORK, 12.0),
    ]
    # Every rank waiting for its GPU (one rank's kernel never ends): a stall, never a pause.
    verdict = judge("running", [on_gpu(f"rank{i}", 12.0) for i in range(3)], NOW, SETTINGS)
    assert (verdict.state, verdict.culprits) == (STALLED, [])
    assert verdict.note and verdict.note.startswith("no label stands apart")
    # The same stacks with the GPU done: every rank at one place, a pause (an evaluation, say).
    verdict = judge("running", [rank(f"rank{i}", stack=item) for i in range(3)], NOW, SETTINGS)
    assert verdict.state == OK and verdict.note and verdict.note.startswith("paused")


def test_when_every_rank_waits_in_gpu_work_the_flight_recorder_names_the_odd_one():
    # NCCL with TORCH_NCCL_ENABLE_TIMING=1: every rank's values wait for its GPU, every stack at
    # the same `.item()`, every rank queued collectives up to 144 (they run ahead of their GPUs).
    # Ranks 0, 1 and 3 started collective 127 of group 0 on their GPU, where they wait for rank2,
    # whose GPU is in a kernel that never ends (as measured on an H200: queued 144, started and
    # completed 126).
    item = [["train.py", 33, "main", "print(loss.item())"]]

    def waiting(label: str, groups: dict) -> LabelVitals:
        vitals = rank(label, stack=item)
        vitals.beat.update(gpu_wait_s=12.0, groups=groups)  # type: ignore[union-attr]
        return vitals

    started = {"0": [144, 127, 126], "1": [7, -1, 7]}
    labels = [waiting("rank0", started), waiting("rank1", started), waiting("rank3", started)]
    hung = waiting("rank2", {"0": [144, 126, 126], "1": [7, -1, 7]})
    verdict = judge("running", [*labels, hung], NOW, SETTINGS)
    assert verdict.state == STALLED
    assert [(c["label"], c["reason"]) for c in verdict.culprits] == [
        (
            "rank2",
            "its GPU started collective 126 of group 0, the others' 127 "
            "(a kernel before the next that does not end?)",
        )
    ]
    assert [w["label"] for w in verdict.waiting] == ["rank0", "rank1", "rank3"]
    # A rank that never queued the collective the others wait in (it waits in an earlier one).
    verdict = judge("running", [*labels, waiting("rank2", {"0": [143, 126, 126]})], NOW, SETTINGS)
    assert [(c["label"], c["reason"]) for c in verdict.culprits] == [
        ("rank2", "queued collective 143 of group 0, the others 144")
    ]
    # Without NCCL's timing (started -1 everywhere) and all alike: no label stands apart.
    alike = {"0": [144, -1, 126]}
    verdict = judge("running", [waiting(f"rank{i}", alike) for i in range(4)], NOW, SETTINGS)
    assert (verdict.state, verdict.culprits) == (STALLED, [])
    # A beat whose groups are not as the producer writes them is left out of it.
    verdict = judge("running", [*labels, waiting("rank2", {"0": "41"})], NOW, SETTINGS)
    assert (verdict.state, verdict.culprits) == (STALLED, [])


def test_ranks_leaving_a_pause_one_by_one_are_no_stall_until_the_first_waited_a_stall_long():
    # Every rank evaluated for 15 s (past the 10 s threshold); three have just finished and wait
    # in the all_reduce after it, timed by their beats, while rank3 still evaluates.
    evaluating = [["train.py", 30, "main", "evaluate(model)"], ["train.py", 50, "evaluate", "m(x)"]]

    def waiting(label: str, inside_s: float) -> LabelVitals:
        vitals = rank(label, age=15.0)
        vitals.beat.update(collective="all_reduce", collective_s=inside_s)  # type: ignore[union-attr]
        return vitals

    late = rank("rank3", age=15.0, stack=evaluating)
    late.beat.update(collective=None, collective_s=None)  # type: ignore[union-attr]
    labels = [waiting("rank0", 2.0), waiting("rank1", 1.0), waiting("rank2", 0.5), late]
    verdict = judge("running", labels, NOW, SETTINGS)
    assert verdict.state == OK and "rank3" in (verdict.note or "") and "all_reduce" in (verdict.note or "")
    # Once the first has waited as long as a stall takes, the one still outside holds the job.
    labels[0] = waiting("rank0", 9.5)  # 10.5 s by now: its beat was stored a second ago
    verdict = judge("running", labels, NOW, SETTINGS)
    assert verdict.state == STALLED and [c["label"] for c in verdict.culprits] == ["rank3"]
    assert verdict.culprits[0]["reason"] == "in Python (evaluate)"


def test_a_silent_rank_while_the_others_step_is_dead():
    going = [rank(f"rank{i}", age=0.1, stalled=False) for i in range(3)]
    gone = rank("rank3", age=0.1, stalled=False, seen=60.0, process="gone")
    verdict = judge("running", [*going, gone], NOW, SETTINGS)
    assert verdict.state == DEAD and verdict.culprits[0]["label"] == "rank3"
    assert "gone" in verdict.culprits[0]["reason"]


def test_what_must_not_raise_an_alarm():
    # Every rank saving a checkpoint at the same place.
    paused = judge("running", [rank(f"rank{i}", stack=SAVE) for i in range(4)], NOW, SETTINGS)
    assert paused.state == OK and "save_checkpoint" in (paused.note or "")
    # Every rank evaluating in one function of the job's, one caught inside torch's forward.
    evaluating = [
        ["train.py", 30, "main", "evaluate(model)"],
        ["train.py", 50, "evaluate", "time.sleep(0.05)"],
    ]
    forward = [*evaluating[:1], ["train.py", 49, "evaluate", "model(x)"]]
    forward.append(
        ["/v/lib/python3.11/site-packages/torch/nn/modules/linear.py", 125, "forward", "F.linear(x)"]
    )
    labels = [rank(f"rank{i}", stack=evaluating) for i in range(3)] + [rank("rank3", stack=forward)]
    paused = judge("running", labels, NOW, SETTINGS)
    assert paused.state == OK and "paused: every label in evaluate" in (paused.note or "")
    # The start-up: beats, no step yet.
    starting = LabelVitals("rank0", {"every": 10.0, "stack": [TRAIN]}, NOW - 1, NOW - 1)
    assert judge("running", [starting, starting], NOW, SETTINGS).state == OK
    # Below the threshold, a stall beat is no stall.
    early = [rank("rank0", age=5.0), rank("rank1", age=5.0, stack=LOADER)]
    assert judge("running", early, NOW, SETTINGS).state == OK
    # An ended run.
    ended = judge("finished", [rank("rank0", stack=LOADER)], NOW, SETTINGS)
    assert ended.state == OK and ended.key == "ok:ended"


def test_the_threshold_is_learnt_from_the_step_times():
    slow = [rank(f"rank{i}", age=30.0) for i in range(2)]
    for vitals in slow:
        vitals.beat["step_s"] = 8.0  # type: ignore[index]
    verdict = judge("running", slow, NOW, SETTINGS)
    assert verdict.state == OK and verdict.threshold == 40.0


def test_every_label_silent_is_its_own_state():
    verdict = judge("running", [rank("rank0", seen=100.0), rank("rank1", seen=100.0)], NOW, SETTINGS)
    assert verdict.state == SILENT and len(verdict.culprits) == 2


def test_a_stall_beat_is_due_once_and_again_when_the_step_moves_on():
    progress = Progress()
    for step in range(5):
        progress.saw(step, 100.0 + step * 0.1)
    assert progress.step_time() == pytest.approx(0.1)
    assert not progress.beat_due(100.5)
    assert progress.beat_due(102.0) and not progress.beat_due(103.0)
    report = progress.report(103.0)
    assert report == {"step": 4, "step_age": 2.6, "step_s": pytest.approx(0.1), "stalled": True}
    progress.saw(5, 103.5)
    assert progress.beat_due(103.5) and not progress.beat_due(103.6)


def test_the_health_line_says_how_far_the_band_is_checked_where_the_run_has_one():
    line = {"state": "anomaly", "anomalies": [{"label": "rank3", "key": "loss", "step": 250, "kind": "nan"}]}
    assert health_lines({**line, "band_to": 127})[0] == (
        "health   anomaly: rank3 went nan in loss at step 250 first; cross-rank band checked to step 127"
    )
    # The slowest rank's second bucket still open: no step checked yet, said beside an anomaly.
    assert health_lines({**line, "band_to": -129})[0].endswith("first; cross-rank band not checked yet")
    assert health_lines({"state": "ok", "band_to": -129}) == ["health   ok"]
    # No band (fewer than four labels), or a value no detector writes: nothing said.
    for band_to in (None, True, 3.5, "7\x1b[2J"):
        assert health_lines({"state": "ok", "band_to": band_to}) == ["health   ok"]


def test_a_stack_is_read_from_another_thread_cut_and_redacted():
    ready, done = threading.Event(), threading.Event()

    def wait_here_with_a_secret():
        ready.set()
        done.wait(len("hf_abcdefghijklmnopqrstuvwxyz0123456789"))

    thread = threading.Thread(target=wait_here_with_a_secret)
    thread.start()
    ready.wait(10)
    try:
        stack = thread_stack(thread.ident, limit=3)
    finally:
        done.set()
        thread.join()
    assert len(stack) == 3
    assert [frame[2] for frame in stack] == ["wait_here_with_a_secret", "wait", "wait"]
    assert stack[0][3] == 'done.wait(len("***"))' and "hf_abc" not in repr(stack)
    assert thread_stack(None) == []


async def test_one_recorder_per_change(store):
    beats = [Event("cas", "rank0", "start", 1, 1, NOW, {"primary": True})]
    await store.write(beats)
    await store.save_beats([Event("cas", "rank0", "heartbeat", 1, 2, NOW, {"step": 1, "every": 1.0})])
    await store.save_beats([Event("cas", "rank0", "heartbeat", 1, 1, NOW, {"step": 0})])  # older: kept out
    [run] = [r for r in await store.health_inputs() if r.run_id == "cas"]
    assert run.labels[0].beat == {"step": 1, "every": 1.0} and run.health_key is None
    doc = {"state": "stalled", "since": NOW, "culprits": [], "waiting": []}
    # Two detectors read the same state: the first records the change, the second finds it done.
    assert await store.record_health(run, "stalled", "stalled|rank0", doc, NOW)
    assert not await store.record_health(run, "stalled", "stalled|rank0", doc, NOW)
    assert await store.health("cas") == doc
    [again] = [r for r in await store.health_inputs() if r.run_id == "cas"]
    assert again.health_key == "stalled|rank0"
    assert not await store.record_health(again, "stalled", "stalled|rank0", {**doc, "note": "x"}, NOW)
    assert (await store.health("cas"))["note"] == "x"
    assert await store.record_health(again, "ok", "ok", {**doc, "state": "ok"}, NOW)
    assert not await store.record_health(again, "dead", "dead|rank0", doc, NOW)  # read before the change
    assert isinstance(again, RunVitals)


async def test_show_and_the_api_give_the_recorded_health_with_secrets_redacted(store_url):
    from aiohttp.test_utils import TestClient, TestServer

    from runbus import storage
    from runbus.dashboard.api import create_app
    from tests.helpers import get_json, run_cli

    store = storage.open_store(store_url)
    await store.connect()
    start = {"primary": True}
    await store.write(
        [Event("api", "rank0", "start", 1, 1, NOW, start), Event("new", "rank0", "start", 1, 1, NOW, start)]
    )
    [run] = [r for r in await store.health_inputs() if r.run_id == "api"]
    frame = {
        "file": "t.py",
        "line": 3,
        "function": "f",
        "code": "f('hf_abcdefghijklmnopqrstuvwxyz0123456789')",
    }
    culprit = {"label": "rank0", "reason": "in Python (f)", "stack": [frame], "last_lines": ["epoch 3"]}
    doc = {
        "state": "stalled",
        "since": NOW,
        "culprits": [culprit],
        "waiting": [],
        "note": None,
        "threshold": 10.0,
    }
    assert await store.record_health(run, "stalled", "stalled|rank0", doc, NOW)
    await store.close()
    async with TestClient(TestServer(create_app(store_url))) as client:
        served = await get_json(client, "/api/runs/api/health")
        assert (await get_json(client, "/api/runs/new/health"))["state"] == "unknown"  # never judged
        await get_json(client, "/api/runs/nope/health", status=404)
    assert served["run_id"] == "api" and served["state"] == "stalled"
    assert served["culprits"][0]["stack"][0]["code"] == "f('***')"
    shown = json.loads(run_cli("--store", store_url, "show", "api", "--json").stdout)["health"]
    assert {**shown, "run_id": "api"} == served
    text = run_cli("--store", store_url, "show", "api").stdout.splitlines()
    assert text[0].startswith("health   stalled since ") and text[0].endswith(": rank0 in Python (f)")
    assert text[1].split() == ["rank0", "t.py:3", "in", "f"] and text[2].split() == [
        "rank0",
        "|",
        "epoch",
        "3",
    ]
