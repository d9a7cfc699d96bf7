"""The step times and the tally of lost time on arrays (storage/steptimes.py, stragglers.Tally)
against their definition written value by value (the detector's former path, kept here as the
reference), on random values: the same times, cells and seconds lost, a read at a time or in one."""

from __future__ import annotations

import math
import statistics
from itertools import pairwise

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from runbus.storage import steptimes
from runbus.storage.steptimes import Times
from runbus.storage.stragglers import Tally

# A stored value as the reference folds it: (label, epoch, seq, step, ts, value).
Value = tuple[str, int, int, int, float, float]


def reference_cells(values: list[Value], time_key: bool, shift: int) -> dict[tuple[str, int], list[float]]:
    """(label, bucket) -> [seconds, steps], a value at a time (charts' former _value_cells and
    _derived_cells)."""
    cells: dict[tuple[str, int], list[float]] = {}
    if time_key:
        for label, _, _, x, _, value in values:
            cell = cells.setdefault((label, x >> shift), [0.0, 0.0])
            if value - value == 0:
                cell[0] += value
                cell[1] += 1
        return cells
    logged: dict[tuple[str, int], dict[int, float]] = {}
    for label, epoch, _, x, ts, _ in values:
        steps = logged.setdefault((label, epoch), {})
        steps[x] = max(ts, steps.get(x, ts))
        cells.setdefault((label, x >> shift), [0.0, 0.0])
    for (label, _), steps in logged.items():
        for (before, then), (step, now) in pairwise(sorted(steps.items())):
            cell = cells.setdefault((label, step >> shift), [0.0, 0.0])
            cell[0] += max(0.0, now - then)
            cell[1] += step - before
    return cells


def reference_times(values: list[Value], time_key: bool) -> dict[str, dict[int, float]]:
    times: dict[str, dict[int, float]] = {}
    for (label, step), (amount, steps) in reference_cells(values, time_key, 0).items():
        if steps > 0:
            times.setdefault(label, {})[step] = amount / steps
    return times


class ReferenceTally:
    """Tally.count as it was: a step at a time, a label at a time."""

    def __init__(self) -> None:
        self.done = -1
        self.last: dict[str, int] = {}
        self.lost: dict[str, float] = {}

    def count(self, times: dict[str, dict[int, float]]) -> None:
        upto = min((max(steps) for steps in times.values() if steps), default=self.done)
        for step in sorted({s for steps in times.values() for s in steps if self.done < s <= upto}):
            have = {
                label: t
                for label, steps in times.items()
                if (t := steps.get(step)) is not None and t - t == 0
            }
            for label, mine in have.items():
                covered = step - self.last.get(label, -1)
                self.last[label] = step
                if len(have) < 2:
                    continue
                others = statistics.median(v for other, v in have.items() if other != label)
                self.lost[label] = self.lost.get(label, 0.0) + max(0.0, mine - others) * covered
        self.done = max(self.done, upto)


LABELS = [f"rank{i}" for i in range(5)]
# Steps, times and values that repeat now and then: ties, a step logged twice, epochs that overlap.
STEPS = st.integers(0, 40)
TIMES = st.one_of(st.sampled_from([0.1, 0.2, 0.3]), st.floats(0.0, 5.0))
VALUES = st.one_of(TIMES, st.sampled_from([math.nan, math.inf, -math.inf]))


@st.composite
def stored(draw: st.DrawFn) -> list[Value]:
    """Values in (label, epoch, seq) order, as a read returns them: steps and times rising mostly."""
    rows = draw(
        st.lists(st.tuples(st.sampled_from(LABELS), st.integers(1, 3), STEPS, TIMES, VALUES), max_size=120)
    )
    rows.sort(key=lambda r: (LABELS.index(r[0]), r[1]))
    return [(label, epoch, seq, step, ts, value) for seq, (label, epoch, step, ts, value) in enumerate(rows)]


def array_cells(values: list[Value], time_key: bool, shift: int) -> tuple[list[str], steptimes.Cells]:
    """The labels of `values` and their cells by the array path."""
    labels = sorted({v[0] for v in values}, key=LABELS.index)
    code = {name: i for i, name in enumerate(labels)}
    return labels, steptimes.cells(
        np.array([code[v[0]] for v in values], np.int32),
        np.array([v[1] for v in values], np.int64),
        np.array([v[3] for v in values], np.int64),
        np.array([v[4] for v in values], np.float64),
        np.array([v[5] for v in values], np.float64),
        time_key,
        shift,
    )


@settings(max_examples=300, deadline=None)
@given(stored(), st.booleans(), st.integers(0, 3))
def test_the_cells_and_times_are_the_definitions(values: list[Value], time_key: bool, shift: int) -> None:
    labels, cells = array_cells(values, time_key, shift)
    found = {
        (labels[c], b): [s, n]
        for c, b, s, n in zip(
            cells.label.tolist(),
            cells.bucket.tolist(),
            cells.seconds.tolist(),
            cells.steps.tolist(),
            strict=True,
        )
    }
    assert found == reference_cells(values, time_key, shift)
    assert [(c, b) for c, b in zip(cells.label.tolist(), cells.bucket.tolist(), strict=True)] == sorted(
        zip(cells.label.tolist(), cells.bucket.tolist(), strict=True)
    )
    if shift == 0:
        assert steptimes.times_of(labels, cells).by_label() == reference_times(values, time_key)


TABLE = st.dictionaries(
    st.sampled_from(LABELS),
    st.dictionaries(STEPS, st.one_of(TIMES, st.sampled_from([math.nan, math.inf])), max_size=30),
    max_size=5,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(TABLE, min_size=1, max_size=4))
def test_the_tally_counts_what_the_definition_counts_read_by_read(
    reads: list[dict[str, dict[int, float]]],
) -> None:
    tally, reference = Tally(), ReferenceTally()
    for times in reads:
        tally.count(Times.of(times))
        reference.count(times)
        assert (tally.done, tally.last, tally.lost) == (reference.done, reference.last, reference.lost)


def test_the_tally_counts_a_long_read_in_blocks_as_in_one() -> None:
    rng = np.random.default_rng(3)
    times = {
        label: {step: float(rng.uniform(0.05, 0.2)) for step in range(0, 3000, 1 + i)}
        for i, label in enumerate(LABELS)
    }
    whole = Tally()
    whole.count(Times.of(times))
    sliced = Tally()
    sliced.count(Times.of(times), block=64)
    assert (sliced.done, sliced.last, sliced.lost) == (whole.done, whole.last, whole.lost)
    reference = ReferenceTally()
    reference.count(times)
    assert whole.lost == reference.lost


@settings(max_examples=200, deadline=None)
@given(TABLE, st.integers(1, 25))
def test_each_labels_latest_steps_are_its_last_ones(times: dict[str, dict[int, float]], count: int) -> None:
    expected = {
        label: {s: steps[s] for s in sorted(steps)[-count:]} for label, steps in times.items() if steps
    }
    found = Times.of(times).latest(count).by_label()
    assert repr(found) == repr(expected)  # NaN times compare by their text
