"""The one retry delay (runbus.config.backoff): doubling up to a cap, with jitter, so that workers
or ranks that failed together do not retry together."""

from __future__ import annotations

from runbus.config import backoff


def test_delays_double_up_to_the_cap_and_are_jittered_within_bounds():
    retry = backoff(cap=5.0, base=0.1)
    for failures in range(12):
        bound = min(5.0, 0.1 * 2**failures)
        delays = [retry.compute(failures) for _ in range(200)]
        assert all(bound / 2 <= delay <= bound for delay in delays), (failures, min(delays), max(delays))
        assert len(set(delays)) > 150  # different every call: no two retriers in step


def test_workers_failing_together_wait_different_times():
    # Each worker has its own backoff object: the same failure count gives each its own delay.
    delays = [backoff(cap=5.0).compute(3) for _ in range(20)]
    assert len(set(delays)) == 20
    assert all(0.4 <= delay <= 0.8 for delay in delays)


def test_any_number_of_failures_gives_a_delay_within_the_cap():
    # redis-py's own computes 2**failures as a float: past ~1000 failures that overflowed.
    retry = backoff(cap=5.0, base=0.1)
    for failures in (1_000, 1_100, 10**6):
        assert 2.5 <= retry.compute(failures) <= 5.0


def test_the_supervisor_s_restart_delays_keep_their_bounds():
    # 0.5 s at most for the first restart, doubling to 30 s at most, each at least half its bound.
    restart = backoff(cap=30.0, base=0.5)
    assert all(0.25 <= restart.compute(0) <= 0.5 for _ in range(100))
    assert all(15.0 <= restart.compute(n) <= 30.0 for n in range(6, 40))
