"""Two real local users, for the tests of what another user of the node can do.

alice is the victim, mallory another user of the same node. They are created (system users, no
home) when the tests run as root, as in CI; the fixtures that need them (``users`` in conftest)
skip the test with the reason otherwise. Each user's side runs in processes of its own.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import select
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefetchd_client.layout import default_root

ALICE, MALLORY = "pfd-alice", "pfd-mallory"
READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class User:
    """A local user whose side of a test runs in processes of its own."""

    name: str
    uid: int
    gid: int
    python: str  # an interpreter this user can run, with prefetchd importable
    env: dict

    @property
    def default_root(self) -> Path:
        return default_root(self.uid)

    def run(self, *args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **self._as_me(env))

    def popen(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            list(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **self._as_me(env)
        )

    def prefetchd(self, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return self.run(self.python, "-m", "prefetchd", *args, env=env)

    def _as_me(self, env: dict | None) -> dict:
        return dict(user=self.uid, group=self.gid, extra_groups=[], cwd="/", env={**self.env, **(env or {})})


def _user_env() -> dict:
    """A clean environment: no PREFETCHD_ROOT (the default root is the point), and the test's
    PYTHONPATH (a run against another checkout must run that checkout as every user)."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def ensure_user(name: str) -> tuple[int, int]:
    """The user's uid and gid; created (system user, no home) if it does not exist yet."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        result = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            capture_output=True,
            text=True,
        )
        if result.returncode:
            pytest.skip(f"cannot create the test user {name}: {result.stderr.strip()}")
        entry = pwd.getpwnam(name)
    return entry.pw_uid, entry.pw_gid


def _runs_prefetchd(uid: int, gid: int, python: str, env: dict) -> bool:
    probe = "import sys, prefetchd, prefetchd_client; print(sys.version)"
    as_user = dict(user=uid, group=gid, extra_groups=[], cwd="/", env=env)
    try:
        result = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, **as_user)
    except OSError:  # the interpreter cannot even be executed by that user
        return False
    return result.returncode == 0 and result.stdout.strip() == sys.version


@contextlib.contextmanager
def python_for(uid: int, gid: int):
    """An interpreter path and environment under which ``uid`` runs this very installation.

    pyenv keeps it under /root (0700) here, which other users cannot enter: then a read-only
    bind mount shows the same files elsewhere, and LD_LIBRARY_PATH its libpython (the
    interpreter's RUNPATH names the folder under /root; without it a system libpython loads).
    """
    env = _user_env()
    if _runs_prefetchd(uid, gid, sys.executable, env):
        yield sys.executable, env
        return
    mount = Path(tempfile.mkdtemp(prefix="pfd-python-", dir="/tmp"))
    mount.chmod(0o755)
    bound = subprocess.run(["mount", "--bind", "-o", "ro", sys.prefix, str(mount)], capture_output=True, text=True)
    try:
        if bound.returncode:
            pytest.skip(f"other users cannot run {sys.executable}, and it cannot be bind-mounted: {bound.stderr}")
        python = str(mount / Path(sys.executable).relative_to(sys.prefix))
        env = {**env, "LD_LIBRARY_PATH": str(mount / "lib")}
        if not _runs_prefetchd(uid, gid, python, env):
            pytest.skip(f"other users cannot run {sys.executable} with prefetchd importable")
        yield python, env
    finally:
        if bound.returncode == 0:
            subprocess.run(["umount", str(mount)], check=False)
        mount.rmdir()


def remove_path(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def read_line(proc: subprocess.Popen, timeout_s: float = READY_TIMEOUT_S) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"pid {proc.pid} wrote nothing within {timeout_s} s"
    return proc.stdout.readline().strip()


def no_traceback(result: subprocess.CompletedProcess) -> bool:
    return "Traceback" not in result.stdout + result.stderr
