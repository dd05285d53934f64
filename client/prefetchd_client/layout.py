"""Where a job lives, and the names of everything in its directory.

The daemon and the client share this module, so a trainer started with the same
environment finds a job by its name alone::

    <root>/<job>/
      manifest.json      plan summary the client needs (written once the daemon serves)
      daemon.lock        flock held by the daemon for its whole life
      daemon.sock        ZeroMQ ipc endpoint (a TCP job has none: the manifest names its endpoint)
      daemon.log
      progress/rank-<r>  "<epoch> <step>": the next batch rank r will read
      batches/           finished batches, e<epoch>-s<step>-r<rank>.batch
      tmp/               batches being written
      retired/           consumed batches a client may still map (freed once unmapped)
      trainers/rank-<r>  flock held (shared) by every live loader of rank r

root is the ``root`` argument, else ``$PREFETCHD_ROOT``, else ``/dev/shm/prefetchd-<uid>``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT_ENV = "PREFETCHD_ROOT"
MANIFEST = "manifest.json"
LOCK = "daemon.lock"
SOCKET = "daemon.sock"
LOG = "daemon.log"
PROGRESS_DIR = "progress"
BATCH_DIR = "batches"
TMP_DIR = "tmp"
TRAINERS_DIR = "trainers"
RETIRED_DIR = "retired"

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_BATCH_NAME = re.compile(r"^e(\d{6})-s(\d{8})-r(\d{4})\.batch$")
_PROGRESS_NAME = re.compile(r"^rank-(\d{1,4})$")


def default_root() -> Path:
    return Path(f"/dev/shm/prefetchd-{os.getuid()}")


def resolve_root(root: str | os.PathLike | None = None) -> Path:
    if root:
        return Path(root)
    env = os.environ.get(ROOT_ENV)
    return Path(env) if env else default_root()


def check_job_name(name: str) -> str:
    """Job names become directory names: keep them to one safe path component."""
    if not isinstance(name, str) or not _JOB_NAME.match(name):
        raise ValueError(
            f"invalid job name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class JobPaths:
    dir: Path

    @classmethod
    def of(cls, job: str, root: str | os.PathLike | None = None) -> JobPaths:
        return cls(resolve_root(root) / check_job_name(job))

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def manifest(self) -> Path:
        return self.dir / MANIFEST

    @property
    def lock(self) -> Path:
        return self.dir / LOCK

    @property
    def socket(self) -> Path:
        return self.dir / SOCKET

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.socket}"

    @property
    def log(self) -> Path:
        return self.dir / LOG

    @property
    def progress_dir(self) -> Path:
        return self.dir / PROGRESS_DIR

    @property
    def batch_dir(self) -> Path:
        return self.dir / BATCH_DIR

    @property
    def tmp_dir(self) -> Path:
        return self.dir / TMP_DIR

    def batch(self, epoch: int, step: int, rank: int) -> Path:
        return self.batch_dir / batch_name(epoch, step, rank)

    @property
    def retired_dir(self) -> Path:
        return self.dir / RETIRED_DIR

    @property
    def trainers_dir(self) -> Path:
        return self.dir / TRAINERS_DIR

    def trainer_lock(self, rank: int) -> Path:
        return self.trainers_dir / f"rank-{rank}"

    def progress(self, rank: int) -> Path:
        return self.progress_dir / f"rank-{rank}"


def batch_name(epoch: int, step: int, rank: int) -> str:
    return f"e{epoch:06d}-s{step:08d}-r{rank:04d}.batch"


def parse_batch_name(name: str) -> tuple[int, int, int] | None:
    """(epoch, step, rank) of a batch file name, or None for anything else."""
    m = _BATCH_NAME.match(name)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def parse_progress_name(name: str) -> int | None:
    m = _PROGRESS_NAME.match(name)
    return int(m[1]) if m else None


def parse_progress(text: str) -> tuple[int, int]:
    """Parse "<epoch> <step>"; raises ValueError on anything else."""
    parts = text.split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"expected '<epoch> <step>' (two non-negative integers), got {text[:40]!r}")
    return int(parts[0]), int(parts[1])


def write_progress(path: Path, epoch: int, step: int) -> None:
    """Write a progress file atomically: a reader sees the old or the new position, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{epoch} {step}\n".encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def daemon_alive(paths: JobPaths) -> bool:
    """True while some process holds the job's lock, i.e. its daemon runs.

    The daemon holds an exclusive flock for its whole life; the kernel drops it when the
    process dies, however it dies, so a shared non-blocking probe tells live from dead.
    """
    try:
        fd = os.open(paths.lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def hold_trainer_lock(paths: JobPaths, rank: int) -> int | None:
    """Take a shared flock that says "a trainer of this rank is alive"; returns the fd to keep.

    The kernel drops it when the process dies, however it dies, so the daemon can tell a
    trainer that is gone from one that is only paused. None if the job has no such folder.
    """
    try:
        fd = os.open(paths.trainer_lock(rank), os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def trainer_state(paths: JobPaths, rank: int) -> str:
    """ "alive" (some loader holds the rank's lock), "gone" (one did, none does) or "never"."""
    try:
        fd = os.open(paths.trainer_lock(rank), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return "never"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return "alive"
        raise
    else:
        return "gone"
    finally:
        os.close(fd)  # closing drops our probe's lock too


def read_manifest(paths: JobPaths) -> dict:
    """The manifest as a dict; FileNotFoundError when the job is not serving."""
    with open(paths.manifest, "rb") as f:
        data = f.read(1 << 20)
    manifest = json.loads(data)
    if not isinstance(manifest, dict):
        raise ValueError(f"{paths.manifest} is not a JSON object")
    return manifest
