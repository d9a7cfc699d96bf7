"""Cost per console line of keeping secrets out of the store: runbus.redact's line redaction alone,
and a `print()` under `runbus.init()` (in-process capture, to /dev/null) with it and without it.

Line by line, on lines a training job prints (metrics as NAME=VALUE, a progress bar, logging and
warning lines, a traceback) and on lines holding secrets: `redact_text` (every pattern, as configs
are redacted), `redact_line` (every NAME=VALUE pair read only where a secret word stands whole)
and a stream's `LineRedactor` (what the shipper calls for each log event). Then a child process
prints LINES lines under init() with stdout on /dev/null, once as shipped and once with the
shipper's redaction switched off (the cost before lines were redacted), alternating, the median of
3 each: µs per print() on the printing thread, and CPU µs per line of the whole process (the
shipper's thread included) until finish() has shipped every line.

    python bench/redact.py [--lines 200000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time

from common import ROOT, emit, median, private_redis

from runbus.redact import LineRedactor, redact_line, redact_text

TYPICAL = [
    "epoch 3 step 1200 loss=0.2345 lr=1e-4 grad_norm=1.23 tokens/s=48211",
    "Epoch 3:  42%|████▏     | 420/1000 [01:12<01:40,  5.79it/s, loss=0.234, v_num=7]",
    "INFO:train:saved checkpoint to /ckpt/step_1200.pt in 2.31 s",
    "/usr/lib/python3/site-packages/torch/nn/modules/module.py:1511: UserWarning: deprecated",
    '  File "/work/train.py", line 88, in <module>',
    "[rank3]:[W reducer.cpp:1360] Warning: find_unused_parameters=True was specified",
    "validation accuracy 0.8123 (best 0.8150 at epoch 2)",
    "hello world",
]
SECRET = [
    "psycopg.OperationalError: connection to postgresql://alice:s3cret@db:5432/x failed",
    "redis://:hunter2pw@h Authorization: Bearer abc.def.ghi password=pw-in-log-42",
    "using api_key=sk-proj-abcdef0123456789ABCDEF for the eval",
]
ROUNDS = 5


def per_line_us(redacted, lines: list[str], repeat: int) -> float:
    """Median over ROUNDS of µs per line of `redacted(line)` over `lines`, `repeat` times."""
    rounds = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(repeat):
            for line in lines:
                redacted(line)
        rounds.append((time.perf_counter() - t0) / (repeat * len(lines)) * 1e6)
    return round(median(rounds), 3)


def functions(repeat: int) -> dict:
    results = {}
    for name, lines in (("typical", TYPICAL), ("with_secrets", SECRET)):
        results[name] = {
            "redact_text_us": per_line_us(redact_text, lines, repeat),
            "redact_line_us": per_line_us(redact_line, lines, repeat),
            "line_redactor_us": per_line_us(LineRedactor(), lines, repeat),
        }
    return results


# µs per print() of the typical lines under init(); argv[2] "off" replaces the redaction by `str`.
PRINTS = textwrap.dedent(
    """
    import json, os, sys, time
    import runbus
    lines, mode, typical = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    run = runbus.init(redis_url=os.environ["BENCH_REDIS"], system_interval=None, hardware=False,
                      max_buffer_events=lines + 1000)
    if mode == "off":
        run._shipper._redacted_log = lambda data: data
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(lines):
        print(typical[i % len(typical)])
    took = time.perf_counter() - t0
    run.finish()
    cpu = time.process_time() - cpu0
    sys.stderr.write(json.dumps([took / lines * 1e6, cpu / lines * 1e6]) + "\\n")
    """
)


def prints(redis_url: str, lines: int) -> dict:
    import json

    env = {**os.environ, "BENCH_REDIS": redis_url, "PYTHONPATH": ROOT}
    taken: dict[str, list[list[float]]] = {"on": [], "off": []}
    for _ in range(3):
        for mode in ("off", "on"):
            with open(os.devnull, "w") as devnull:
                result = subprocess.run(
                    [sys.executable, "-c", PRINTS, str(lines), mode, json.dumps(TYPICAL)],
                    stdout=devnull,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                    check=True,
                )
            taken[mode].append(json.loads(result.stderr.strip().splitlines()[-1]))
    return {
        f"{what}_{mode}": round(median([pair[index] for pair in taken[mode]]), 3)
        for index, what in enumerate(("print_us", "cpu_us_per_line"))
        for mode in ("off", "on")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    args = parser.parse_args()
    results = {"per_line": functions(max(1, args.lines // 50))}
    with private_redis() as redis_url:
        results["print_under_init"] = {"lines": args.lines, **prints(redis_url, args.lines)}
    emit("redact", results)


if __name__ == "__main__":
    main()
