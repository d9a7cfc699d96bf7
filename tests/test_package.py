"""Packaging: the wheel installs one name, `runbus`, and runbus runs beside a user's own modules.

Real builds and real installs: a wheel built from the package folders alone (what the Dockerfile
copies), installed into a fresh virtual environment, and the test suite's own editable install,
each run from directories that hold a user's `producer.py`, `storage.py`, `ingester/` and
`dashboard/` (the names runbus's subpackages had before they moved under `runbus.`).
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest

import runbus

ROOT = Path(__file__).resolve().parents[1]

# The top-level names runbus's subpackages had; nothing may import or provide them now.
OLD_NAMES = ("producer", "ingester", "storage", "dashboard")
# What `import runbus` must not pull in: a training script pays for every import.
HEAVY = ("redis", "asyncio", "torch", "pynvml", "psutil", "pandas", "numpy")
DIST_INFO = f"runbus-{runbus.__version__}.dist-info"
SOME_MODULES = (
    "runbus.producer.run",
    "runbus.storage.sqlite",
    "runbus.query.notebook",
    "runbus.ingester.worker",
    "runbus.dashboard.api",
)

# Imports every runbus module it can find from the packages named in argv[1], then reports which
# files they came from, and which old names (argv[2]) were asked for, are in sys.modules, and
# could be found at all.
IMPORT_EVERYTHING = """
import importlib, importlib.util, json, pkgutil, sys
old = json.loads(sys.argv[2])
class Watch:  # sees every import of an old name, even one whose ImportError runbus would swallow
    asked = []
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in old:
            cls.asked.append(name)
sys.meta_path.insert(0, Watch)
import runbus
runbus.init, runbus.Run
def fail(name):
    raise ImportError(f"walking runbus: {name} did not import")
imported = set()
for package in json.loads(sys.argv[1]):
    module = importlib.import_module(package)
    imported.add(package)
    for info in pkgutil.walk_packages(module.__path__, package + ".", onerror=fail):
        if not info.name.endswith(".__main__"):  # runbus.__main__ runs the command
            importlib.import_module(info.name)
            imported.add(info.name)
asked = sorted(set(Watch.asked))
print(json.dumps({
    "imported": sorted(imported),
    "files": {name: getattr(sys.modules[name], "__file__", None)
              for name in sorted(sys.modules) if name.partition(".")[0] == "runbus"},
    "old_asked": asked,
    "old_loaded": sorted(name for name in sys.modules if name.partition(".")[0] in old),
    "old_findable": [name for name in old if importlib.util.find_spec(name) is not None],
}))
"""

# `import runbus` alone, every public name read, then the heavy modules that came with it.
IMPORT_RUNBUS_ALONE = """
import json, sys
import runbus
runbus.init, runbus.Run
for name in runbus.__all__:
    getattr(runbus, name)
print(json.dumps({"file": runbus.__file__,
                  "heavy": sorted(set(json.loads(sys.argv[1])) & set(sys.modules))}))
"""


def run(
    argv: list[str | Path], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command to completion; its output in the failure message when it fails."""
    result = subprocess.run(
        [str(arg) for arg in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def users_project(path: Path) -> Path:
    """A user's directory with its own producer.py, storage.py, ingester/ and dashboard/: importing
    any of them leaves a marker file beside it and raises, so neither a caught exception nor a
    background thread can hide the import."""
    for relative in ("producer.py", "storage.py", "ingester/__init__.py", "dashboard/__init__.py"):
        name = relative.split("/")[0].removesuffix(".py")
        module = path / relative
        module.parent.mkdir(parents=True, exist_ok=True)
        module.write_text(
            "import pathlib\n"
            f"pathlib.Path({str(path)!r}, 'imported-{name}').touch()\n"
            f"print('the user\\'s {name} was imported', file=__import__('sys').stderr)\n"
            f"raise RuntimeError('the user\\'s {name} was imported instead of runbus.{name}')\n"
        )
    return path


def imported_user_modules(project: Path) -> list[str]:
    return sorted(marker.name.removeprefix("imported-") for marker in project.glob("imported-*"))


def user_env(tmp_path: Path, project: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a user's shell: the project (if any) on PYTHONPATH as well as the current
    directory, so console scripts see its modules too; runbus's data directory under tmp_path."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONHOME", "PYTHONSTARTUP", "RUNBUS_STORE")
    }
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg-data")
    if project is not None:
        env["PYTHONPATH"] = str(project)
    env.update(extra)
    return env


def package_dirs() -> dict[str, Path]:
    """Each installed package -> the folder its files come from, as pyproject.toml says."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in config["package-dir"].items()}


def top_packages() -> list[str]:
    """The packages pyproject.toml maps to folders: runbus and its four subpackages."""
    return sorted(package_dirs())


def source_modules() -> set[str]:
    """Every module a wheel must hold, from the package folders, less the one that runs the command."""
    names = set()
    for file in source_files():
        if file.endswith(".py"):
            name = file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            names.add(name)
    return names - {"runbus.__main__"}


def source_files() -> set[str]:
    """Every file a wheel must hold under runbus/, from the package folders as they are on disk."""
    files = set()
    for package, folder in package_dirs().items():
        for path in folder.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                files.add("/".join([*package.split("."), *path.relative_to(folder).parts]))
    return files


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built, without build isolation, from a copy of what the Dockerfile copies: the
    build needs nothing else from the repository, and no stale build/ folder can leak into it."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for folder in package_dirs().values():
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        # runbus/'s links to the other folders stay links, as Docker's COPY keeps them.
        shutil.copytree(folder, source / folder.relative_to(ROOT), symlinks=True, ignore=ignore)
    dist = tmp_path_factory.mktemp("dist")
    built = run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, source])
    output = built.stdout + built.stderr
    # setuptools' complaints about the configuration (a folder left out, a deprecated key).
    assert "Warning" not in output and "WARNING" not in output, output
    (path,) = dist.glob("*.whl")
    return path


@pytest.fixture(scope="module")
def wheel_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed (no index, no dependencies).

    runbus's dependencies then come from the test suite's environment, named by a path in a .pth
    file (`venv --system-site-packages` would show the base interpreter's packages, not this
    virtual environment's). A bare path does not run the .pth files there, so the suite's editable
    runbus, which one of them installs, stays out of sight; and the path is added after the
    install, so pip never sees that runbus as one to replace.
    """
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel])
    (site_packages(venv) / "runbus-test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv


def site_packages(venv: Path) -> Path:
    (path,) = (venv / "lib").glob("python3*/site-packages")
    return path


# -- the wheel's contents ---------------------------------------------------------------------


def test_the_wheel_installs_one_top_level_package_runbus(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        if f"{DIST_INFO}/top_level.txt" in names:  # setuptools writes it; the wheel format does not ask
            assert archive.read(f"{DIST_INFO}/top_level.txt").decode().split() == ["runbus"]
    assert {name.split("/")[0] for name in names} == {"runbus", DIST_INFO}
    packaged = {name for name in names if name.startswith("runbus/")}
    assert packaged == source_files()
    for package in ("producer", "ingester", "storage", "query", "dashboard"):
        assert f"runbus/{package}/__init__.py" in packaged
    assert "runbus/py.typed" in packaged
    static = {name for name in packaged if name.startswith("runbus/dashboard/static/")}
    assert "runbus/dashboard/static/index.html" in static and len(static) >= 3


def test_the_wheel_declares_the_runbus_command_python_3_11_and_typing(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        entry_points = archive.read(f"{DIST_INFO}/entry_points.txt").decode()
        metadata = HeaderParser().parsestr(archive.read(f"{DIST_INFO}/METADATA").decode())
    scripts = configparser.ConfigParser()
    scripts.read_string(entry_points)
    assert dict(scripts["console_scripts"]) == {"runbus": "runbus.cli:main"}
    assert metadata["Name"] == "runbus" and metadata["Version"] == runbus.__version__
    assert metadata["Requires-Python"] == ">=3.11"
    assert "Typing :: Typed" in metadata.get_all("Classifier", [])
    requirements = metadata.get_all("Requires-Dist", [])
    # Users take any torch from 2.1; only the dev extra pins the build the tests run.
    assert 'torch>=2.1; extra == "torch"' in requirements


# -- the wheel installed ----------------------------------------------------------------------


def test_the_installed_wheel_logs_ingests_and_shows_a_run_beside_a_users_modules(
    wheel_venv: Path, redis_url: str, tmp_path: Path
) -> None:
    project = users_project(tmp_path / "project")
    env = user_env(tmp_path, project, RUNBUS_REDIS_URL=redis_url)
    python, command = wheel_venv / "bin" / "python", wheel_venv / "bin" / "runbus"
    log_a_run = (
        "import runbus\n"
        "runbus.init, runbus.Run\n"
        "with runbus.init(run_id='from-the-wheel', label='rank0', system_interval=None, hardware=False)"
        " as run:\n"
        "    run.log({'loss': 0.5}, step=1)\n"
        "    print('logged', flush=True)\n"
        "import runbus.producer, runbus.storage.sqlite, runbus.ingester.worker, runbus.dashboard.api\n"
        "print(runbus.__file__)\n"
        "print(runbus.dashboard.api.STATIC)\n"
    )
    out = run([python, "-c", log_a_run], cwd=project, env=env).stdout.splitlines()
    installed = site_packages(wheel_venv)
    assert Path(out[-2]).is_relative_to(installed)
    static = Path(out[-1])
    assert static.is_relative_to(installed) and (static / "index.html").is_file()

    run([command, "ingest", "--burst"], cwd=project, env=env)
    shown = json.loads(run([command, "show", "from-the-wheel", "--json"], cwd=project, env=env).stdout)
    assert shown["state"] == "finished" and shown["counts"]["metric"] == 1
    # The default store: one per-user SQLite file, found from any directory.
    assert (tmp_path / "xdg-data" / "runbus" / "runbus.db").is_file()
    runs = json.loads(run([python, "-m", "runbus", "runs", "--json"], cwd=tmp_path, env=env).stdout)
    assert [entry["run_id"] for entry in runs] == ["from-the-wheel"]
    assert "usage: runbus" in run([command, "--help"], cwd=project, env=env).stdout
    assert imported_user_modules(project) == []


# -- both installs ----------------------------------------------------------------------------


@pytest.fixture(params=["editable", "wheel"])
def install(request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """(python, the folder runbus's files must come from) for the editable install and the wheel."""
    if request.param == "editable":
        return Path(sys.executable), ROOT
    venv = request.getfixturevalue("wheel_venv")
    return venv / "bin" / "python", site_packages(venv)


def test_no_old_top_level_name_is_imported_or_importable(install: tuple[Path, Path], tmp_path: Path) -> None:
    # Started outside the repository, so its root (which holds producer/ and the others) is not
    # on sys.path: an `import producer` left anywhere in runbus fails here, and a shim would show.
    python, origin = install
    result = run(
        [python, "-c", IMPORT_EVERYTHING, json.dumps(top_packages()), json.dumps(OLD_NAMES)],
        cwd=tmp_path,
        env=user_env(tmp_path),
    )
    report = json.loads(result.stdout)
    assert report["old_asked"] == []
    assert set(report["imported"]) == source_modules()
    assert set(SOME_MODULES) <= set(report["imported"])
    assert report["old_loaded"] == []
    assert report["old_findable"] == []
    for name, file in report["files"].items():
        assert file is not None and Path(file).is_relative_to(origin), (name, file)


def test_import_runbus_reads_every_public_name_without_heavy_imports(
    install: tuple[Path, Path], tmp_path: Path
) -> None:
    python, origin = install
    result = run([python, "-c", IMPORT_RUNBUS_ALONE, json.dumps(HEAVY)], cwd=tmp_path, env=user_env(tmp_path))
    report = json.loads(result.stdout)
    assert Path(report["file"]).is_relative_to(origin)
    assert report["heavy"] == []


def test_the_runbus_command_and_python_m_runbus_run_beside_a_users_modules(
    install: tuple[Path, Path], tmp_path: Path
) -> None:
    python, _ = install
    project = users_project(tmp_path / "project")
    env = user_env(tmp_path, project)
    helps: list[list[str | Path]] = [[python.parent / "runbus", "--help"], [python, "-m", "runbus", "--help"]]
    for argv in helps:
        assert "usage: runbus" in run(argv, cwd=project, env=env).stdout
    assert imported_user_modules(project) == []


def test_runbus_version_prints_the_installed_version(install: tuple[Path, Path], tmp_path: Path) -> None:
    python, _ = install
    project = users_project(tmp_path / "project")
    result = run([python.parent / "runbus", "--version"], cwd=project, env=user_env(tmp_path, project))
    assert runbus.__version__ in result.stdout
    assert imported_user_modules(project) == []


# -- the editable install, from where users start it ------------------------------------------


@pytest.mark.parametrize("where", ["a users project", "examples", "the repository root"])
def test_the_editable_install_imports_runbus_from_its_folders(where: str, tmp_path: Path) -> None:
    project = users_project(tmp_path / "project")
    cwd = {"a users project": project, "examples": ROOT / "examples", "the repository root": ROOT}[where]
    result = run(
        [sys.executable, "-c", IMPORT_EVERYTHING, json.dumps(top_packages()), json.dumps(OLD_NAMES)],
        cwd=cwd,
        env=user_env(tmp_path, project),
    )
    assert imported_user_modules(project) == []
    report = json.loads(result.stdout)
    assert report["old_asked"] == [] and report["old_loaded"] == []
    folders = package_dirs()
    for package in top_packages():
        # Found through runbus/'s link to the folder or through the editable finder: one module.
        assert Path(report["files"][package]).resolve() == (folders[package] / "__init__.py").resolve()
    python = Path(sys.executable)
    helps: list[list[str | Path]] = [[python.parent / "runbus", "--help"], [python, "-m", "runbus", "--help"]]
    for argv in helps:
        assert "usage: runbus" in run(argv, cwd=cwd, env=user_env(tmp_path, project)).stdout
    assert imported_user_modules(project) == []


# -- the docs ---------------------------------------------------------------------------------

OLD = "|".join(OLD_NAMES)
# How a doc would use an old name: `import producer`, `from storage.rules import …`,
# `producer.init(…)` or `storage.rules` (not `runbus.producer.init(…)`), `python -m ingester`.
OLD_USES = (
    rf"\bimport ({OLD})\b",
    rf"\bfrom ({OLD})[\w.]* import\b",
    rf"(?<![\w./-])({OLD})\.(?!(py|png|md|db)\b)[A-Za-z_]\w*",  # a file name is fine
    rf"\bpython -m ({OLD})\b",
)


def doc_files() -> list[Path]:
    """The README, docs/, the README of every folder (bench/ …), examples/, the Docker files."""
    files = [ROOT / "README.md", ROOT / "Dockerfile", ROOT / "docker-compose.yml"]
    folder_readmes = [path for path in ROOT.glob("*/README.md") if not path.parent.name.startswith(".")]
    return (
        files + sorted(ROOT.glob("docs/*.md")) + sorted(folder_readmes) + sorted(ROOT.glob("examples/*.py"))
    )


def test_the_docs_and_examples_use_the_runbus_names() -> None:
    found = []
    for path in doc_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            line = re.sub(r"\bfrom runbus[\w.]* import [\w, ]+", "", line)  # runbus's own names
            if any(re.search(pattern, line) for pattern in OLD_USES):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)


def test_the_python_in_the_docs_compiles() -> None:
    for path in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]:
        for number, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S), 1):
            compile(block, f"{path.name}, python block {number}", "exec")
