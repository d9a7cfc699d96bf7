"""Static checks inside the test command: types (mypy), import contracts (import-linter), lint.

Both mypy and import-linter read the installed layout (tests/layout.py), where producer/ is
runbus/producer/ as in a wheel; their settings are in pyproject.toml.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.layout import ROOT, installed_tree

CONFIG = str(ROOT / "pyproject.toml")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installed_tree(tmp_path_factory.mktemp("installed"))


def run(tool: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *tool],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd), "MYPY_CACHE_DIR": str(ROOT / ".mypy_cache")},
    )


@pytest.mark.typecheck  # the slowest test (~45 s): `-m "not typecheck"` skips it locally; CI runs it
def test_types_check_with_zero_errors(tree: Path) -> None:
    result = run(["-m", "mypy", "--config-file", CONFIG, "-p", "runbus"], tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


def test_imports_run_one_way(tree: Path) -> None:
    lint_imports = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"
    result = run(["-c", lint_imports, "--config", CONFIG, "--no-cache"], tree)
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = len(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"])
    assert contracts >= 6 and f"Contracts: {contracts} kept, 0 broken" in result.stdout


def test_the_code_passes_the_linter() -> None:
    result = run(["-m", "ruff", "check", "--no-cache", str(ROOT)], ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
