"""Every integration refuses a bad runbus.init() argument when it is built, not when a rank first
logs (minutes later, on every rank at once), and builds without touching Redis."""

from __future__ import annotations

import os

import pytest

from runbus.errors import InvalidName
from runbus.integrations.accelerate import RunbusTracker
from runbus.integrations.lightning import RunbusLogger
from runbus.integrations.transformers import RunbusCallback
from runbus.producer import check_arguments

INTEGRATIONS = [RunbusLogger, RunbusCallback, RunbusTracker]
BAD = [
    ({"sytem_interval": 5}, TypeError, "unknown option"),
    ({"max_buffer_events": 0}, ValueError, "max_buffer_events"),
    ({"console": "loud"}, ValueError, "console"),
    ({"name": " padded "}, ValueError, "name"),
    ({"tags": ["ok", "not ok"]}, InvalidName, "tag"),
    ({"label": "rank 0"}, InvalidName, "label"),
    ({"resume": "sometimes"}, ValueError, "resume"),
]


@pytest.fixture(autouse=True)
def environment_kept():
    """RunbusLogger exports the run id it makes up (for the ranks it launches): not to the tests
    that run after these in this process."""
    kept = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(kept)


@pytest.mark.parametrize("integration", INTEGRATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("arguments", "error", "match"), BAD, ids=[next(iter(b[0])) for b in BAD])
def test_a_bad_argument_is_refused_when_the_integration_is_built(integration, arguments, error, match):
    with pytest.raises(error, match=match):
        check_arguments(**arguments)
    with pytest.raises(error, match=match):
        integration(**arguments)


@pytest.mark.parametrize("integration", INTEGRATIONS, ids=lambda c: c.__name__)
def test_good_arguments_build_without_redis(integration):
    # No Redis answers at this address: building must not need it.
    integration(name="baseline", tags=["ddp"], redis_url="redis://127.0.0.1:1/0", system_interval=None)


def test_the_typed_options_are_the_options_init_takes():
    # InitOptions is what editors and type checkers know of init(**options): the same names as
    # the ones init() accepts at run time, each with a type.
    from runbus import producer

    typed = set(producer.InitOptions.__annotations__)
    assert typed == producer._RUN_OPTIONS | producer._SHIPPER_OPTIONS | producer._DESCRIBE_OPTIONS
    # Where a type admits None, None is accepted as the default.
    for name in ("system_interval", "gpu_device_ids", "lease_ttl", "git", "spool_dir"):
        assert "None" in str(producer.InitOptions.__annotations__[name])
        check_arguments(**{name: None})
