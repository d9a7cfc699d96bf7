"""The git state of the working directory in a label's start event: clean, dirty, detached, no
repository, no git, a git that hangs, a remote URL holding a token, RUNBUS_GIT=0; from a real
git in a throwaway repository through a real Redis and ingester to `runbus show` and the API."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import orjson
import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer

import runbus
from runbus import wire
from runbus.dashboard.api import create_app
from runbus.producer import gitstate
from runbus.redact import MARKER, safe_remote
from tests.helpers import QUIET, get_json, ingest, run_cli, wait_for, xadd_event
from tests.test_secrets import redis_contents, store_contents

TOKEN = "Tk9pZ3VtYmVsbGF2aXN0YTQy"  # no known prefix: only its place in the URL gives it away
REMOTE = f"https://someone:{TOKEN}@github.com/acme/train.git"
SHOWN_REMOTE = "https://***@github.com/acme/train.git"


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(("git", *args), cwd=repo, check=True, capture_output=True, text=True, timeout=60)
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository on `main` with one commit of two tracked files."""
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.email", "t@example.com")
    git(path, "config", "user.name", "t")
    (path / "train.py").write_text("print('train')\n")
    (path / "README").write_text("readme\n")
    git(path, "add", ".")
    git(path, "commit", "-q", "-m", "first")
    return path


def test_a_clean_repository_then_untracked_changed_staged_and_detached(repo: Path):
    head = git(repo, "rev-parse", "HEAD")
    assert gitstate.describe(str(repo)) == {"commit": head, "branch": "main", "dirty": False}
    (repo / "notes.txt").write_text("untracked\n")  # untracked files are not looked at
    assert gitstate.describe(str(repo)) == {"commit": head, "branch": "main", "dirty": False}
    (repo / "train.py").write_text("print('changed')\n")
    assert gitstate.describe(str(repo)) == {"commit": head, "branch": "main", "dirty": True}
    git(repo, "add", "train.py")  # staged, not committed: still dirty
    assert gitstate.describe(str(repo)) == {"commit": head, "branch": "main", "dirty": True}
    git(repo, "commit", "-q", "-m", "second")
    second = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "--detach", head)
    assert gitstate.describe(str(repo)) == {"commit": head, "branch": None, "dirty": False}
    (repo / "sub").mkdir()
    assert gitstate.describe(str(repo / "sub")) == {"commit": head, "branch": None, "dirty": False}
    git(repo, "checkout", "-q", "-b", "feature/x", second)
    found = gitstate.describe(str(repo))
    assert found == {"commit": second, "branch": "feature/x", "dirty": False} and len(second) == 40


def test_no_repository_no_commit_and_no_git_record_nothing(tmp_path: Path, repo: Path, monkeypatch):
    plain = tmp_path / "plain"
    plain.mkdir()
    assert gitstate.describe(str(plain)) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    git(empty, "init", "-q")
    assert gitstate.describe(str(empty)) is None
    assert gitstate.describe(str(tmp_path / "gone")) is None  # a working directory since removed
    monkeypatch.setenv("PATH", str(plain))  # no git binary on it
    assert gitstate.describe(str(repo)) is None


@pytest.fixture
def hanging_git(tmp_path: Path) -> Path:
    """A `git` that never answers, and leaves a child of its own holding the pipe open."""
    return fake_git(tmp_path / "bin", "sleep 300 &\nsleep 300")


def fake_git(bin_dir: Path, script: str) -> Path:
    """A folder holding a `git` that runs this shell script: put first on PATH."""
    bin_dir.mkdir()
    fake = bin_dir / "git"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def test_a_git_that_hangs_is_killed_with_its_children_at_the_deadline(repo: Path, hanging_git, monkeypatch):
    monkeypatch.setenv("PATH", f"{hanging_git}{os.pathsep}{os.environ['PATH']}")
    began = time.monotonic()
    assert gitstate.describe(str(repo), deadline=0.5) is None
    # Not a speed figure: a describe that waited on the sleepers would take 300 s.
    assert time.monotonic() - began < 60


def test_a_status_that_hangs_leaves_dirty_unknown(repo: Path, tmp_path: Path, monkeypatch):
    real = shutil.which("git")
    script = f'case "$1" in status) sleep 300 & sleep 300;; *) exec {real} "$@";; esac'
    slow = fake_git(tmp_path / "slow", script)
    monkeypatch.setenv("PATH", f"{slow}{os.pathsep}{os.environ['PATH']}")
    found = gitstate.describe(str(repo), deadline=5)
    assert found == {"commit": git(repo, "rev-parse", "HEAD"), "branch": "main", "dirty": None}


def test_remote_urls_keep_no_credentials():
    assert safe_remote(REMOTE) == SHOWN_REMOTE
    assert safe_remote(f"https://{TOKEN}@gitlab.example.com/x.git") == "https://***@gitlab.example.com/x.git"
    assert safe_remote(f"http://oauth2:{TOKEN}@h:8080/x.git?a=1") == "http://***@h:8080/x.git?a=1"
    assert safe_remote(f"https://h/x.git?private_token={TOKEN}") == f"https://h/x.git?private_token={MARKER}"
    for kept in ("git@github.com:acme/train.git", "ssh://git@github.com/acme/train.git", "/srv/git/x.git"):
        assert safe_remote(kept) == kept
    assert safe_remote(f"ssh://git:{TOKEN}@h/x.git") == f"ssh://git:{MARKER}@h/x.git"


def start_data(redis_url: str, run_id: str, label: str = "rank0") -> dict:
    with redis.Redis.from_url(redis_url) as client:
        entries = client.xrange(wire.stream_key(run_id, label))
    [start] = [orjson.loads(fields[b"data"]) for _, fields in entries if fields[b"kind"] == b"start"]
    return start


def run_in(path: Path, monkeypatch, redis_url: str, run_id: str, label: str = "rank0", **options) -> None:
    """One label's Run, started and finished with `path` as the working directory."""
    monkeypatch.chdir(path)
    run = runbus.init(run_id=run_id, label=label, redis_url=redis_url, **{**QUIET, **options})
    run.log({"loss": 1.0}, step=0)
    assert run.finish() is True


def labels_api(store_url: str, run_id: str) -> dict:
    async def get() -> dict:
        async with TestClient(TestServer(create_app(store_url))) as client:
            document: dict = await get_json(client, f"/api/runs/{run_id}/labels")
            return document

    return asyncio.run(get())


@pytest.fixture(params=["sqlite", "postgres"])
def any_store(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("store_url" if request.param == "sqlite" else "postgres_url")


def test_git_state_reaches_show_and_the_api_and_the_token_nothing(
    redis_url, any_store, repo, tmp_path, monkeypatch
):
    git(repo, "remote", "add", "origin", REMOTE)
    head = git(repo, "rev-parse", "HEAD")
    (repo / "train.py").write_text("print('edited')\n")
    run_in(repo, monkeypatch, redis_url, "git-e2e", "rank0")
    git(repo, "checkout", "-q", "--", "train.py")
    git(repo, "checkout", "-q", "--detach")
    run_in(repo, monkeypatch, redis_url, "git-e2e", "rank1")
    plain = tmp_path / "elsewhere"
    plain.mkdir()
    run_in(plain, monkeypatch, redis_url, "git-e2e", "rank2")

    dirty = {"commit": head, "branch": "main", "dirty": True, "remote": SHOWN_REMOTE}
    detached = {**dirty, "branch": None, "dirty": False}
    assert start_data(redis_url, "git-e2e", "rank0")["git"] == dirty
    assert start_data(redis_url, "git-e2e", "rank1")["git"] == detached
    assert "git" not in start_data(redis_url, "git-e2e", "rank2")
    assert TOKEN not in redis_contents(redis_url)

    ingest(redis_url, any_store)
    assert TOKEN not in store_contents(any_store)
    doc = json.loads(run_cli("--store", any_store, "show", "git-e2e", "--json").stdout)
    assert [lab["git"] for lab in doc["labels"]] == [dirty, detached, None]
    shown = run_cli("--store", any_store, "show", "git-e2e").stdout
    assert f"git      {head[:7]} on main, dirty, origin {SHOWN_REMOTE}  (rank0)\n" in shown
    assert f"git      {head[:7]} detached, clean, origin {SHOWN_REMOTE}  (rank1)\n" in shown
    labels = labels_api(any_store, "git-e2e")["labels"]
    assert [lab["git"] for lab in labels] == [dirty, detached, None]
    assert TOKEN not in shown + json.dumps(doc) + json.dumps(labels)


def test_runbus_git_0_and_git_false_record_none(redis_url, repo, monkeypatch):
    monkeypatch.setenv("RUNBUS_GIT", "0")
    run_in(repo, monkeypatch, redis_url, "git-off", "rank0")
    monkeypatch.setenv("RUNBUS_GIT", "")  # empty: as unset
    run_in(repo, monkeypatch, redis_url, "git-off", "rank1", git=False)
    run_in(repo, monkeypatch, redis_url, "git-off", "rank2")
    for label in ("rank0", "rank1"):
        assert "git" not in start_data(redis_url, "git-off", label)
    assert start_data(redis_url, "git-off", "rank2")["git"]["branch"] == "main"
    monkeypatch.setenv("RUNBUS_GIT", "maybe")
    with pytest.raises(ValueError, match="RUNBUS_GIT='maybe' is not one of"):
        runbus.init(run_id="git-off", label="rank3", redis_url=redis_url, **QUIET)


def test_a_git_that_hangs_holds_up_neither_init_nor_the_start(redis_url, repo, hanging_git, monkeypatch):
    monkeypatch.setenv("PATH", f"{hanging_git}{os.pathsep}{os.environ['PATH']}")
    run_in(repo, monkeypatch, redis_url, "git-hangs")
    start = start_data(redis_url, "git-hangs")
    assert "git" not in start and start["primary"] is True


def test_init_returns_while_git_is_still_being_asked(redis_url, repo, tmp_path, monkeypatch):
    # A git that waits for a gate this test opens only once init() has returned: had init()
    # waited on git, git would be killed at the deadline and the start would hold no git.
    gate, asked = tmp_path / "gate", tmp_path / "asked"
    real = shutil.which("git")
    wait = f'touch {asked}\nwhile [ ! -f {gate} ]; do sleep 0.05; done\nexec {real} "$@"'
    bin_dir = fake_git(tmp_path / "gated", wait)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(gitstate, "DEADLINE", 100.0)
    monkeypatch.chdir(repo)
    run = runbus.init(run_id="git-gated", label="rank0", redis_url=redis_url, **QUIET)
    run.log({"loss": 1.0}, step=0)
    wait_for("the courier to ask git", asked.exists)
    gate.touch()
    assert run.finish() is True
    assert start_data(redis_url, "git-gated")["git"]["commit"] == git(repo, "rev-parse", "HEAD")


def test_a_start_written_by_hand_is_shown_redacted(redis_url, store_url):
    hostile = {"commit": "\x1b[2J" + "a" * 40, "branch": "hf_" + TOKEN * 2, "dirty": "yes", "remote": REMOTE}
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, "git-hand", "rank0", "start", 1, 1, {"primary": True, "git": hostile})
    ingest(redis_url, store_url)
    expected = {"commit": "\x1b[2J" + "a" * 40, "branch": MARKER, "dirty": None, "remote": SHOWN_REMOTE}
    [lab] = json.loads(run_cli("--store", store_url, "show", "git-hand", "--json").stdout)["labels"]
    assert lab["git"] == expected
    shown = run_cli("--store", store_url, "show", "git-hand").stdout
    assert "\x1b" not in shown and TOKEN not in shown and "detached" not in shown
    assert labels_api(store_url, "git-hand")["labels"][0]["git"] == expected
