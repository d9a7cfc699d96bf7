"""Producer memory while Redis is unreachable: 1M events must stay within the configured bound.

The run points at a closed port; `log()` keeps accepting, the shipper encodes into a bounded
memory buffer and counts what it must drop. Reports RSS growth against `max_buffer_bytes`.

    python bench/memory.py [--events 1000000] [--max-buffer-mb 64]
"""

from __future__ import annotations

import argparse
import gc
import logging
import time

import psutil
from common import emit

from runbus.ingester.localredis import free_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--max-buffer-mb", type=int, default=64)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    import runbus

    process = psutil.Process()
    gc.collect()
    rss_before = process.memory_info().rss
    run = runbus.init(
        run_id="bench-memory",
        label="rank0",
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        system_interval=None,
        hardware=False,
        console="off",
        max_buffer_bytes=args.max_buffer_mb << 20,
        finish_timeout=0.1,
    )
    peak = rss_before
    started = time.perf_counter()
    for step in range(args.events):
        run.log({"loss": 0.5, "lr": 1e-4}, step=step)
        if step % 50_000 == 0:
            peak = max(peak, process.memory_info().rss)
    log_s = time.perf_counter() - started
    while run._outbox:  # let the shipper encode what is queued
        time.sleep(0.05)
    peak = max(peak, process.memory_info().rss)
    held, dropped = run.buffered, run.dropped
    run.finish()
    growth_mb = (peak - rss_before) / 2**20
    # The bound: the encoded backlog, plus the queue in front of it at ~0.5 KiB per event.
    bound_mb = args.max_buffer_mb + run.options.max_buffer_events * 512 / 2**20
    emit(
        "memory",
        {
            "events": args.events,
            "max_buffer_mb": args.max_buffer_mb,
            "bound_mb": round(bound_mb, 1),
            "rss_growth_mb": round(growth_mb, 1),
            "within_bound": growth_mb <= bound_mb,
            "held_events": held,
            "dropped_events": dropped,
            "log_s": round(log_s, 2),
        },
    )


if __name__ == "__main__":
    main()
