"""The page's JavaScript checked like the rest: node's own test runner over the unit tests of its
pure modules (tests/js/*.test.mjs, importing the files the browser loads), and tsc over every
module that carries `// @ts-check` (jsconfig.json). Node comes from the system
(Debian's `nodejs`); TypeScript from `npm ci` (package.json pins it). Missing either fails under
CI=true, else skips with the reason.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tests.conftest import missing_server

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "dashboard" / "static"
UNIT_TESTS = sorted((ROOT / "tests" / "js").glob("*.test.mjs"))
TSC = ROOT / "node_modules" / ".bin" / "tsc"


def node() -> str:
    path = shutil.which("node")
    if not path:
        missing_server("node (Debian's `nodejs` package)")
    return path  # type: ignore[return-value]


def page_modules() -> list[Path]:
    """The page's own modules: app.js and js/*.js (the vendored uPlot is not ours to check)."""
    return [STATIC / "app.js", *sorted((STATIC / "js").glob("*.js"))]


def test_the_pure_modules_pass_their_unit_tests() -> None:
    assert len(UNIT_TESTS) >= 4, UNIT_TESTS
    # The TAP reporter, whose `# pass N` is the same on every node since 18.15 (newer ones print
    # another report by default).
    result = subprocess.run(
        [node(), "--test", "--test-reporter=tap", *map(str, UNIT_TESTS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    passed = re.search(r"^# pass (\d+)$", report, re.MULTILINE)
    assert passed and int(passed.group(1)) >= 20, report
    assert re.search(r"^# fail 0$", report, re.MULTILINE), report


def test_every_page_module_opts_into_the_type_check() -> None:
    unchecked = [p.name for p in page_modules() if not p.read_text().startswith("// @ts-check\n")]
    assert not unchecked, f"these modules lack a first line `// @ts-check`: {unchecked}"


def test_the_page_type_checks_with_zero_errors() -> None:
    node_path = node()
    if not TSC.is_file():
        missing_server("TypeScript (`npm ci` at the repository root installs the pinned tsc)")
    result = subprocess.run(
        [node_path, str(TSC), "--noEmit", "-p", str(ROOT / "jsconfig.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "error TS" not in result.stdout
