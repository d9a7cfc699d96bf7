"""runbus run's hook at interpreter start: every Python process of the job runs this file.

`runbus run` puts this directory first on PYTHONPATH; Python imports `sitecustomize` from the
first directory that has one, so this file first runs the sitecustomize it hides (the next one on
sys.path, if any), then lets runbus.producer.bootstrap claim the process's console if it is a rank.
Nothing here may stop the process: every failure is reported in one line, or silent where runbus
is not importable (another interpreter of the job). Written for any Python 3 (types as comments):
whatever Python the job runs reads it. Only this file belongs in this directory: everything in it
is importable by every process of the job.
"""

import os
import sys


def _run_hidden_sitecustomize():  # type: () -> None
    here = os.path.dirname(os.path.abspath(__file__))
    import importlib.machinery
    import importlib.util

    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _claim_console():  # type: () -> None
    try:
        from runbus import config
    except ImportError:  # an interpreter without runbus
        return
    env = os.environ
    if not env.get(config.LAUNCH_ENV):
        return
    marker = env.get(config.CONSOLE_OWNER_ENV)
    if marker:
        # A rank's child (same rank variables): its output is the rank's. Checked here, before
        # importing runbus.producer, so that DataLoader and pool workers start as fast as before.
        # The same test as bootstrap.owned_by_another.
        owner, _, key = marker.partition(":")
        pairs = [pair.partition("=") for pair in key.split(",") if pair]
        if owner != str(os.getpid()) and all(env.get(name, "") == value for name, _, value in pairs):
            return
    from runbus.producer import bootstrap

    bootstrap.start()


if __name__ == "sitecustomize":  # not when imported as runbus.producer.boot.sitecustomize
    try:
        _run_hidden_sitecustomize()
    except Exception as exc:  # as site.py reports a failing sitecustomize
        sys.stderr.write("Error in sitecustomize: " + type(exc).__name__ + ": " + str(exc) + "\n")
    try:
        _claim_console()
    except Exception as exc:  # at interpreter start: the user's program runs whatever fails here
        sys.stderr.write(
            "runbus: console capture did not start: " + type(exc).__name__ + ": " + str(exc) + "\n"
        )
