"""The job directory on disk: create it safely, lock it, sweep it, remove it.

The lock is an exclusive ``flock`` on ``daemon.lock`` held for the daemon's whole life:
the kernel releases it however the daemon dies, so a stale directory never blocks a new
start, and a second daemon for a running job backs off without touching anything.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
from pathlib import Path

from prefetchd_client.layout import JobPaths, read_manifest

from .errors import JobError


def ensure_private_dir(path: Path, what: str) -> None:
    """Create ``path`` as 0700, or accept it only if it is ours, a real folder and not open to others.

    /dev/shm is world-writable: a folder that someone else created in advance (or a symlink
    planted there) would let them read or replace batches.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise JobError(f"{what} {path} is a symlink or not a folder; remove it or choose another --root")
    if st.st_uid != os.getuid():
        raise JobError(f"{what} {path} belongs to uid {st.st_uid}, not you; remove it or choose another --root")
    if st.st_mode & 0o022:
        raise JobError(f"{what} {path} is writable by others (mode {st.st_mode & 0o777:o}); chmod 700 it")


class JobDir:
    """Owns one job directory while the daemon holds its lock."""

    def __init__(self, paths: JobPaths):
        self.paths = paths
        self._lock_fd = -1

    def acquire(self) -> None:
        """Create and lock the job directory; JobError (touching nothing) if a daemon holds it."""
        root = self.paths.dir.parent
        root.parent.mkdir(parents=True, exist_ok=True)
        ensure_private_dir(root, "job root")
        ensure_private_dir(self.paths.dir, "job directory")
        fd = os.open(self.paths.lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            try:
                pid = read_manifest(self.paths).get("pid", "?")
            except (OSError, ValueError):
                pid = "?"
            raise JobError(
                f"job {self.paths.name!r} is already running (daemon pid {pid}, {self.paths.dir}); "
                f"use it, stop it with `prefetchd stop {self.paths.name}`, or pick another --name"
            ) from None
        self._lock_fd = fd

    def prepare(self) -> None:
        """Sub-folders ready; a dead daemon's leftovers swept: its half-written files, socket and
        manifest. Finished batches stay: the new master validates them and keeps what it can use."""
        for leftover in (self.paths.manifest, self.paths.socket):
            leftover.unlink(missing_ok=True)
        for folder in (self.paths.tmp_dir, self.paths.dir / "index"):
            shutil.rmtree(folder, ignore_errors=True)
        for folder in (
            self.paths.progress_dir,
            self.paths.batch_dir,
            self.paths.tmp_dir,
            self.paths.trainers_dir,
            self.paths.retired_dir,
        ):
            folder.mkdir(mode=0o700, exist_ok=True)

    def remove(self, keep: list[Path] = ()) -> None:
        if not keep:
            shutil.rmtree(self.paths.dir, ignore_errors=True)
            return
        for entry in self.paths.dir.iterdir():
            if entry in keep:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
