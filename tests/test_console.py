"""Console capture: stdout, stderr and logging records become log events; the echo rule by mode."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

import runbus
from runbus.producer.console import MAX_LINE_CHARS, LineLevels, clean_text
from tests.helpers import ingest, read_store, run_cli


def stored(redis_url, store_url, run_id, label=None):
    ingest(redis_url, store_url)
    lines = read_store(store_url, "logs", run_id, label=label)
    return [(line.stream, line.level, line.text) for line in lines]


def capture(redis_url, run_id, label="rank0", **kw):
    return runbus.init(
        run_id=run_id,
        label=label,
        redis_url=redis_url,
        system_interval=None,
        hardware=False,
        quiet=True,
        **kw,
    )


def test_lines_partial_lines_and_levels(redis_url, store_url, capsys):
    original = sys.stdout
    run = capture(redis_url, "lines")
    assert sys.stdout is not original and sys.stdout.encoding == original.encoding
    print("hello")
    print("part", end="", flush=True)  # a flush does not cut the line
    print(" whole")
    print("two\nlines")
    print()
    sys.stderr.write("careful\n")
    print("Error: disk full")
    print("no newline at the end", end="")
    run.finish()
    assert sys.stdout is original
    assert stored(redis_url, store_url, "lines") == [
        ("stdout", "INFO", "hello"),
        ("stdout", "INFO", "part whole"),
        ("stdout", "INFO", "two"),
        ("stdout", "INFO", "lines"),
        ("stdout", "INFO", ""),
        ("stderr", "WARNING", "careful"),
        ("stdout", "ERROR", "Error: disk full"),
        ("stdout", "INFO", "no newline at the end"),
    ]
    out, err = capsys.readouterr()  # a single process echoes everything, unchanged
    assert out == "hello\npart whole\ntwo\nlines\n\nError: disk full\nno newline at the end"
    assert err == "careful\n"


def test_progress_bars_long_lines_and_binary_junk(redis_url, store_url, capfd):
    with capture(redis_url, "junk"):
        for percent in (0, 50, 100):
            sys.stderr.write(f"\r{percent}%|{'#' * (percent // 10)}|")
            sys.stderr.flush()
        sys.stderr.write("\n")
        sys.stdout.write("windows line\r\n")
        print("x" * (2 * MAX_LINE_CHARS + 10))
        sys.stdout.buffer.write(b"caf\xc3")  # a UTF-8 sequence split across writes
        sys.stdout.buffer.write(b"\xa9 \xff\xfe junk\n")
        sys.stdout.flush()
        print("lone \udcff surrogate, nul \x00 byte")
        with pytest.raises(TypeError, match="must be str"):
            sys.stdout.write(b"bytes to the text layer")
    lines = stored(redis_url, store_url, "junk")
    assert lines[0] == ("stderr", "WARNING", "100%|##########|")
    assert lines[1] == ("stdout", "INFO", "windows line")
    assert [len(text) for _, _, text in lines[2:5]] == [MAX_LINE_CHARS, MAX_LINE_CHARS, 10]
    assert lines[5] == ("stdout", "INFO", "café \ufffd\ufffd junk")
    # NUL is kept by the producer; a store may replace it (PostgreSQL text cannot hold it).
    assert lines[6][2] in (
        "lone \ufffd\ufffd\ufffd surrogate, nul \x00 byte",
        "lone \ufffd\ufffd\ufffd surrogate, nul \ufffd byte",
    )
    assert len(lines) == 7
    out, err = capfd.readouterr()
    assert "\r50%|#####|\r100%" in err
    assert "café" in out


def test_empty_writes_make_no_lines(redis_url, store_url):
    with capture(redis_url, "empty"):
        sys.stdout.write("")
        sys.stderr.write("")
        print("one", end="")
        sys.stdout.write("")
        print()
    assert stored(redis_url, store_url, "empty") == [("stdout", "INFO", "one")]


def test_logging_records_are_shipped_once_with_their_level(redis_url, store_url):
    logger = logging.getLogger("tests.console")
    factory = logging.getLogRecordFactory()
    stream_handler = None
    try:
        with capture(redis_url, "records") as run:
            stream_handler = logging.StreamHandler(sys.stderr)  # prints through the tee
            logger.addHandler(stream_handler)
            logger.warning("a warning record")
            logger.error("an error record")
            logging.getLogger("runbus.producer").warning("about shipping: never stored")
            own = run.logging_handler()
            logger.addHandler(own)
            logger.error("shipped by the user's handler")  # and not a second time by the capture
            logger.removeHandler(own)
    finally:
        if stream_handler is not None:
            logger.removeHandler(stream_handler)
    assert stored(redis_url, store_url, "records") == [
        ("logging", "WARNING", "a warning record"),
        ("logging", "ERROR", "an error record"),
        ("logging", "ERROR", "shipped by the user's handler"),
    ]
    assert logging.getLogRecordFactory() is factory


def test_one_capture_per_process_and_off(redis_url, store_url):
    first = capture(redis_url, "owner", "rank0")
    second = capture(redis_url, "owner", "rank1", primary=False)
    print("belongs to rank0")
    second.finish()
    first.finish()
    with capture(redis_url, "owner", "rank2", primary=False, console="off"):
        print("not captured")
    assert stored(redis_url, store_url, "owner") == [("stdout", "INFO", "belongs to rank0")]
    with pytest.raises(ValueError, match="console must be one of"):
        capture(redis_url, "owner", "rank3", console="loud")


def test_a_with_block_stores_its_traceback(redis_url, store_url):
    with pytest.raises(ZeroDivisionError), capture(redis_url, "tb"):
        1 / 0  # noqa: B018
    lines = stored(redis_url, store_url, "tb")
    assert {level for _, level, _ in lines} == {"ERROR"}
    assert lines[0][2] == "Traceback (most recent call last):"
    assert lines[-1][2] == "ZeroDivisionError: division by zero"


def test_line_levels():
    stderr = LineLevels("WARNING")
    block = [
        "starting",
        "UserWarning: this is deprecated",
        "Traceback (most recent call last):",
        '  File "train.py", line 3, in <module>',
        "    1 / 0",
        "ZeroDivisionError: division by zero",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        '  File "train.py", line 5, in <module>',
        "torch.OutOfMemoryError: CUDA out of memory",
        "after the traceback",
        "[rank3]: Traceback (most recent call last):",
        '[rank3]:   File "train.py", line 5, in <module>',
        "[rank3]: RuntimeError: NCCL timeout",
        "train.py: error: unrecognized arguments: --lr",
        "2026-01-01 ERROR something broke",
        "KeyboardInterrupt",
        "error rate 0.1, Errors are fine here",
    ]
    levels = [stderr.level(line) for line in block]
    assert levels == ["WARNING", "WARNING"] + ["ERROR"] * 4 + ["WARNING"] + ["ERROR"] * 5 + ["WARNING"] + [
        "ERROR"
    ] * 6 + ["WARNING"]
    assert LineLevels("INFO").level("loss 0.25") == "INFO"
    # What C and C++ print as a process dies (stored through `runbus run`'s fd capture).
    dying = [
        "terminate called after throwing an instance of 'c10::DistBackendError'",
        "  what():  [Rank 1] Watchdog caught collective operation timeout",
        "Aborted (core dumped)",
        "Segmentation fault",
    ]
    assert [LineLevels("WARNING").level(line) for line in dying] == ["ERROR"] * 4
    assert LineLevels("INFO").level("so what(): nothing") == "INFO"
    assert clean_text("ok \udcff") == "ok \ufffd\ufffd\ufffd"


RANK = textwrap.dedent(
    """
    import logging, os, sys, runbus
    run = runbus.init(system_interval=None, hardware=False)
    print("hello from", run.label)
    sys.stderr.write("a stderr warning\\n")
    logging.getLogger("train").warning("a warning record")
    logging.getLogger("train").error("an error record")
    sys.stdout.flush(), sys.stderr.flush()  # or the child would print the parent's buffered text
    if os.fork() == 0:
        print("from a forked child", flush=True)
        os._exit(0)
    os.wait()
    print("partial", end="", flush=True)
    raise ValueError("rank failed")
    """
)


def run_rank(redis_url, run_id, rank, console):
    env = {
        **os.environ,
        "RUNBUS_REDIS_URL": redis_url,
        "RUNBUS_RUN_ID": run_id,
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "RUNBUS_CONSOLE": console,
        "RUNBUS_QUIET": "1",  # the primary's runbus line is not the console under test
    }
    result = subprocess.run([sys.executable, "-c", RANK], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    return result.stdout, result.stderr


RAISE_LINE = RANK.splitlines().index('raise ValueError("rank failed")') + 1
STORED = [
    ("stdout", "INFO", "hello from rank1"),
    ("stderr", "WARNING", "a stderr warning"),
    ("logging", "WARNING", "a warning record"),
    ("logging", "ERROR", "an error record"),
    ("stderr", "ERROR", "Traceback (most recent call last):"),
    ("stderr", "ERROR", f'  File "<string>", line {RAISE_LINE}, in <module>'),
    ("stderr", "ERROR", "ValueError: rank failed"),
    ("stdout", "INFO", "partial"),  # a partial line is stored when the capture stops, at exit
]


def test_primary_mode_echoes_only_errors_of_other_ranks(redis_url, store_url):
    out, err = run_rank(redis_url, "echo-primary", 1, "primary")
    assert out == "from a forked child\n"  # a forked child echoes but does not capture
    assert err == (
        "[rank1] an error record\n"
        "[rank1] Traceback (most recent call last):\n"
        f'[rank1]   File "<string>", line {RAISE_LINE}, in <module>\n'
        "[rank1] ValueError: rank failed\n"
    )
    assert stored(redis_url, store_url, "echo-primary") == STORED
    state = read_store(store_url, "run", "echo-primary").labels[0]
    assert (state.state, state.exit_code, state.missing) == ("failed", 1, 0)

    logs = run_cli("--store", store_url, "logs", "echo-primary", "--level", "ERROR").stdout.splitlines()
    assert len(logs) == 4 and all(line.startswith("rank1 | ") for line in logs)
    assert logs[-1].endswith("ERROR   ValueError: rank failed")
    grep = run_cli("--store", store_url, "logs", "echo-primary", "--label", "rank1", "--grep", "hello").stdout
    assert grep.rstrip().endswith("INFO    hello from rank1")


def test_the_primary_echoes_unchanged(redis_url, store_url):
    out, err = run_rank(redis_url, "echo-rank0", 0, "primary")
    assert out == "hello from rank0\nfrom a forked child\npartial"
    assert err.startswith("a stderr warning\na warning record\nan error record\nTraceback")


def test_all_mode_prefixes_every_line(redis_url, store_url):
    out, err = run_rank(redis_url, "echo-all", 1, "all")
    assert out == "[rank1] hello from rank1\nfrom a forked child\n[rank1] partial"
    assert err.startswith("[rank1] a stderr warning\n[rank1] a warning record\n[rank1] an error record\n")
    assert err.endswith("[rank1] ValueError: rank failed\n")
    assert stored(redis_url, store_url, "echo-all") == STORED


def test_off_captures_nothing(redis_url, store_url):
    out, err = run_rank(redis_url, "echo-off", 1, "off")
    assert out == "hello from rank1\nfrom a forked child\npartial"
    assert "a warning record" in err and "ValueError: rank failed" in err
    assert stored(redis_url, store_url, "echo-off") == []


CONFIGURED_LATE = textwrap.dedent(
    """
    import logging, runbus
    run = runbus.init(run_id="late", label="rank0", system_interval=None, hardware=False, quiet=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s")
    logging.getLogger("train").info("configured after init")
    try:
        1 / 0
    except ZeroDivisionError:
        logging.getLogger("train").exception("step failed")
    run.finish()
    logging.getLogger("train").warning("after finish")
    """
)


def test_logging_configured_after_init(redis_url, store_url):
    env = {**os.environ, "RUNBUS_REDIS_URL": redis_url}
    result = subprocess.run(
        [sys.executable, "-c", CONFIGURED_LATE],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stderr.startswith("INFO:train:configured after init\nERROR:train:step failed\nTraceback")
    assert result.stderr.endswith("WARNING:train:after finish\n")
    lines = stored(redis_url, store_url, "late")
    assert [(stream, level, text.splitlines()[0]) for stream, level, text in lines] == [
        ("logging", "INFO", "configured after init"),
        ("logging", "ERROR", "step failed"),
    ]
    assert lines[1][2].endswith("ZeroDivisionError: division by zero")
