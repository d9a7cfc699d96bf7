"""The producer's record of the torch.distributed collective a rank is inside (producer/collectives.py):
wrapped once a process group exists, never importing torch, switched off by RUNBUS_COLLECTIVES=0.
A beat that carries it while a peer hangs: tests/test_health.py (the data loader hang)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from runbus.ingester.localredis import free_port
from runbus.producer import collectives

PROBE = textwrap.dedent(
    """
    import json, sys
    from runbus.producer import collectives
    assert collectives.beat_fields() == {} and "torch" not in sys.modules  # never imports torch
    import torch, torch.distributed as dist
    assert collectives.beat_fields() == {}  # no process group yet: not wrapped, asked again later
    dist.init_process_group("gloo", rank=0, world_size=1)
    fields = collectives.beat_fields()
    t = torch.ones(2)
    dist.all_reduce(t)
    original = getattr(dist.all_reduce, collectives.WRAPPED, None)
    print(json.dumps({"fields": fields, "wrapped": original is not None, "sum": t.tolist()}))
    dist.destroy_process_group()
    """
)


def probe(**env: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_the_collectives_are_wrapped_once_a_process_group_exists_and_not_when_switched_off():
    pytest.importorskip("torch")
    on = probe()
    assert on == {"fields": {"collective": None, "collective_s": None}, "wrapped": True, "sum": [1.0, 1.0]}
    off = probe(RUNBUS_COLLECTIVES="0")
    assert off == {"fields": {}, "wrapped": False, "sum": [1.0, 1.0]}


def test_the_outermost_collective_is_kept_and_left_when_it_raises():
    seen: list[tuple[str, float] | None] = []

    def inner() -> None:
        seen.append(collectives._entered)

    def outer() -> None:
        seen.append(collectives._entered)
        wrapped_inner()

    def fails() -> None:
        raise RuntimeError("the peer closed the connection")

    wrapped_inner = collectives._wrapper("all_gather", inner, lambda: False)
    collectives._wrapper("all_gather_object", outer, lambda: False)()
    assert [s and s[0] for s in seen] == ["all_gather_object", "all_gather_object"]
    assert collectives._entered is None
    with pytest.raises(RuntimeError):
        collectives._wrapper("all_reduce", fails, lambda: False)()
    assert collectives._entered is None
    # Being traced by torch.compile, the wrapper only forwards the call.
    seen.clear()
    collectives._wrapper("all_reduce", inner, lambda: True)()
    assert seen == [None]
