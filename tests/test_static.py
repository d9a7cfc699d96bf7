"""Static checks inside the test command: types (mypy, pyright), import contracts (import-linter), lint.

Each runs from the repository root as a developer runs it: runbus/producer and the others are
committed links to the top-level folders, so every tool finds runbus.* there. Their settings
are in pyproject.toml. The type checks take minutes: `-m "not typecheck"` leaves them out.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "pyproject.toml")


def package_files() -> list[str]:
    """Every module of the package, through the links under runbus/ to the top-level folders."""
    walk = os.walk(ROOT / "runbus", followlinks=True)
    return [os.path.join(folder, name) for folder, _, names in walk for name in names if name.endswith(".py")]


def test_runbus_links_each_folder_pyproject_installs_under_it() -> None:
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in folders.items():
        link = ROOT.joinpath(*package.split("."))
        if package != "runbus":  # a link git keeps, relative, so a clone anywhere resolves it
            assert link.is_symlink() and os.readlink(link) == f"../{folder}", link
        assert link.resolve() == (ROOT / folder).resolve() and (link / "__init__.py").is_file()


def run(tool: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *tool],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd), "MYPY_CACHE_DIR": str(ROOT / ".mypy_cache")},
    )


# The type checkers take minutes on a loaded 2-core machine: their subprocess limit (300 s), not
# the suite's 120 s per test, decides.
@pytest.mark.typecheck
@pytest.mark.timeout(320)
def test_types_check_with_zero_errors() -> None:
    result = run(["-m", "mypy", "--config-file", CONFIG, "-p", "runbus"], ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
    # Every module, producer/boot/ included (mypy counts the data folders as packages too).
    checked = re.search(r"in (\d+) source files", result.stdout)
    assert checked and int(checked[1]) >= len(package_files()), result.stdout


@pytest.mark.typecheck
@pytest.mark.timeout(320)
def test_pyright_finds_every_module_with_zero_errors() -> None:
    # The environment this test runs in (its PATH here names no virtual environment).
    result = run(["-m", "pyright", "--pythonpath", sys.executable, "--outputjson"], ROOT)
    summary = json.loads(result.stdout)["summary"]
    assert summary["errorCount"] == 0, result.stdout
    assert summary["filesAnalyzed"] == len(package_files()), result.stdout


def test_imports_run_one_way() -> None:
    lint_imports = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"
    result = run(["-c", lint_imports, "--config", CONFIG, "--no-cache"], ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = len(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"])
    assert contracts >= 6 and f"Contracts: {contracts} kept, 0 broken" in result.stdout
    assert f"Analyzed {len(package_files())} files" in result.stdout, result.stdout


def test_the_code_passes_the_linter() -> None:
    result = run(["-m", "ruff", "check", "--no-cache", str(ROOT)], ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
