"""The installed layout of runbus, built as a tree of links, for tools that read files statically.

pyproject.toml installs producer/ as runbus.producer (and so on) with setuptools' package-dir.
Python's import system follows that mapping in an editable install, but mypy and import-linter
walk folders: they are pointed at this tree instead, whose runbus/ holds every subpackage where
a wheel puts it. Files are symbolic links, so error messages name the real files once resolved.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Each installed package -> the folder its files come from, as pyproject.toml says."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: root / folder for name, folder in config["package-dir"].items()}


def installed_tree(dest: Path, root: Path = ROOT) -> Path:
    """Build the installed layout under `dest` (python files and py.typed, linked); return `dest`."""
    for package, source in package_dirs(root).items():
        target = dest.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for path in sorted(source.iterdir()):
            if path.is_file() and (path.suffix in (".py", ".pyi") or path.name == "py.typed"):
                link = target / path.name
                if not link.exists():
                    os.symlink(path, link)
    return dest
