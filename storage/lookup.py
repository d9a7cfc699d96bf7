"""A run found by its id or by a unique prefix of it: the one lookup the CLI, runbus.Api and the
dashboard share.

An exact id always wins (a run `abc` is found by `abc` even when `abcd` exists too); otherwise
the one run whose id starts with what was given; several are AmbiguousRun, naming a few.
"""

from __future__ import annotations

from runbus import wire
from runbus.errors import AmbiguousRun, InvalidName
from runbus.storage.base import Store

CANDIDATES = 5  # runs an ambiguous prefix's error names, at most


async def run_id_of(store: Store, given: str) -> str | None:
    """The id of the run `given` names (itself, or the one run it is a prefix of); None where
    no run does. A prefix of several runs' ids is AmbiguousRun."""
    try:
        wire.check_name("run id", given)
    except InvalidName:
        return None  # no run has such an id, nor one starting with it
    found = await store.run_ids(given, CANDIDATES + 1)
    if not found:
        return None
    if found[0] == given or len(found) == 1:
        # An id sorts before every longer id it starts.
        return found[0]
    shown = ", ".join(found[:CANDIDATES]) + (", ..." if len(found) > CANDIDATES else "")
    raise AmbiguousRun(f"{given!r} starts the ids of several runs: {shown}; give more of the id")
