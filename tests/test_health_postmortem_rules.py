"""The post-mortem rule (storage/postmortem.py) without servers: which label of a run that ended
badly went first, and when nobody is named."""

from __future__ import annotations

from runbus.storage.health import CRASHED, ENDED_KEY, OK, HealthSettings, LabelVitals
from runbus.storage.postmortem import judge_ended

NOW = 1_800_000_000.0
SETTINGS = HealthSettings(floor=10.0)
KILLED_AT = NOW - 30.0
TRAIN = ["train.py", 10, "<module>", "main()"]
STEP = ["train.py", 20, "main", "loss = model(batch)"]


def label(name, state="failed", at=KILLED_AT + 0.2, code=1, heard=20.0, every=1.0, step=40) -> LabelVitals:
    """A label that ended `state` at `at` (its finish's ts, or its last event's without one),
    last heard of `heard` seconds ago, its last beat at step `step`."""
    beat = {"step": step, "step_age": 0.1, "every": every, "stack": [TRAIN, STEP], "host": "n1", "pid": 7}
    finished = state in ("finished", "failed")
    return LabelVitals(
        name,
        beat,
        NOW - heard,
        NOW - heard,
        state=state,
        exit_code=code if finished else None,
        state_ts=at if state != "running" else None,
        last_ts=at,
    )


def killed(name="rank2", heard=20.0, at=KILLED_AT, every=1.0) -> LabelVitals:
    """A label SIGKILLed: no finish, still `running` in the store (or crashed below)."""
    return label(name, "running", at, heard=heard, every=every)


def test_a_sigkilled_rank_whose_peers_then_fail_is_named_first_with_its_followers():
    labels = [
        label("rank0", at=KILLED_AT + 0.3),
        label("rank1"),
        killed(),
        label("rank3", at=KILLED_AT + 0.25),
    ]
    verdict = judge_ended("failed", labels, NOW, SETTINGS)
    assert verdict.state == CRASHED and verdict.ended and verdict.key == ENDED_KEY
    [culprit] = verdict.culprits
    assert culprit["label"] == "rank2" and culprit["ended_at"] == KILLED_AT and culprit["state"] == "running"
    assert culprit["reason"].startswith("killed: no finish, last heard at ")
    assert culprit["reason"].endswith(", 0.2 s before any other rank failed")
    assert culprit["stack"][-1]["function"] == "main" and culprit["pid"] == 7
    followers = [(f["label"], f["state"], f["exit_code"], f["after_s"]) for f in verdict.followers]
    assert followers == [
        ("rank1", "failed", 1, 0.2),
        ("rank3", "failed", 1, 0.25),
        ("rank0", "failed", 1, 0.3),
    ]
    # Marked crashed by the ingester's silence (--crash-after) changes nothing but the words.
    crashed = label("rank2", "crashed", KILLED_AT)
    again = judge_ended("failed", [*labels[:2], crashed, labels[3]], NOW, SETTINGS)
    assert again.culprits[0]["label"] == "rank2" and again.culprits[0]["reason"].startswith(
        "crashed: no exit"
    )


def test_nothing_is_recorded_while_a_rank_without_a_finish_may_still_run():
    # Its last event came 1 s ago (3 s of silence make it gone): its end is not known yet.
    labels = [label("rank0", heard=1.0), killed(heard=1.0), label("rank1", heard=1.0)]
    assert judge_ended("failed", labels, NOW, SETTINGS).settling
    assert not judge_ended("failed", labels, NOW + 3.0, SETTINGS).settling


def test_a_survivor_still_beating_is_left_out_once_the_ends_are_old():
    survivor = label("rank3", "running", NOW - 0.5, heard=0.5)
    labels = [label("rank0", heard=2.0), label("rank1", code=3, at=KILLED_AT, heard=2.0), survivor]
    assert judge_ended("failed", labels, NOW, SETTINGS).settling  # rank3's finish may be on its way
    verdict = judge_ended(
        "failed", [*labels[:2], label("rank3", "running", NOW, heard=0.0)], NOW + 2, SETTINGS
    )
    assert verdict.culprits[0]["label"] == "rank1"
    assert [f["label"] for f in verdict.followers] == ["rank0"]


def test_a_rank_that_exited_with_a_code_first_is_named():
    labels = [
        label("rank0", at=KILLED_AT + 0.5),
        label("rank1", code=3, at=KILLED_AT),
        label("rank2", at=KILLED_AT + 0.6),
    ]
    [culprit] = judge_ended("failed", labels, NOW, SETTINGS).culprits
    assert culprit["label"] == "rank1" and culprit["exit_code"] == 3
    assert (
        culprit["reason"].startswith("exited with code 3 at ")
        and "0.5 s before any other" in culprit["reason"]
    )
    # A keeper's stored end of a killed process (128 + the signal) says so.
    labels[1] = label("rank1", code=137, at=KILLED_AT)
    assert (
        judge_ended("failed", labels, NOW, SETTINGS)
        .culprits[0]["reason"]
        .startswith("killed by signal 9 (exit code 137) at ")
    )


def test_what_names_nobody():
    # Every rank finished normally.
    finished = [label(f"rank{i}", "finished", KILLED_AT + i, code=0) for i in range(4)]
    verdict = judge_ended("finished", finished, NOW, SETTINGS)
    assert verdict.state == OK and verdict.culprits == [] and verdict.key == ENDED_KEY
    # A finished run whose pool worker was terminated (SIGTERM: 143) before the ranks finished.
    worker = label("rank0-worker", "failed", KILLED_AT - 5, code=143, step=None)
    assert judge_ended("finished", [*finished, worker], NOW, SETTINGS).culprits == []
    # Every rank killed together (the job cancelled from outside): their last events lie within
    # a heartbeat interval of each other, so none went first.
    together = [killed(f"rank{i}", heard=40.0, at=KILLED_AT + i * 0.3, every=10.0) for i in range(3)]
    crashed = judge_ended("crashed", together, NOW, SETTINGS)
    assert crashed.state == CRASHED and crashed.culprits == [] and "killed together" in (crashed.note or "")
    # A run of one label: nobody to name it against.
    alone = judge_ended("failed", [label("rank0")], NOW, SETTINGS)
    assert alone.state == OK and alone.culprits == [] and alone.note == "the run has failed"


def test_a_rank_killed_while_the_others_went_on_to_finish_is_named():
    finished = [label(f"rank{i}", "finished", NOW - 2, code=0) for i in range(3)]
    verdict = judge_ended("finished", [*finished, killed("rank3", at=KILLED_AT - 60)], NOW, SETTINGS)
    assert verdict.state == CRASHED and verdict.culprits[0]["label"] == "rank3"
    assert verdict.culprits[0]["reason"].endswith("88.0 s before any other rank finished")
