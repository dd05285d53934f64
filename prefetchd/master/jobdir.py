"""The job directory on disk: create it safely, lock it, sweep it, remove it, and leave in it
why the daemon stopped (stopped.json).

The lock is an exclusive ``flock`` on ``daemon.lock`` held for the daemon's whole life:
the kernel releases it however the daemon dies, so a stale directory never blocks a new
start, and a second daemon for a running job backs off without touching anything.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path

from prefetchd.errors import JobError, UserError, to_json
from prefetchd_client.errors import UnsafeFolder
from prefetchd_client.folders import DIR_FLAGS, check_folders_above, open_private_dir
from prefetchd_client.layout import LOCK, STOPPED, JobPaths
from prefetchd_client.manifest import read_manifest

log = logging.getLogger("prefetchd")


def ensure_private_dir(path: Path, what: str, *, dir_fd: int | None = None) -> int:
    """Create ``path`` as 0700, or accept it only if it is ours, a real folder and not open to
    others; a descriptor of it (the caller closes it) to work relative to. With ``dir_fd``,
    ``path.name`` is created and opened relative to that folder.

    /dev/shm is world-writable: a folder that someone else created in advance (or a symlink
    planted there) would let them read or replace batches. The check is the client's, the one
    every entry point runs (prefetchd_client.folders.open_private_dir).
    """
    try:
        os.mkdir(path.name if dir_fd is not None else path, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        pass
    except OSError as exc:  # no permission (--root /sys/kernel), a parent that is not there (/proc/x)
        raise JobError(
            f"cannot create the {what} {path}: {exc.strerror}; choose another --root or PREFETCHD_ROOT"
        ) from None
    try:  # the folders above were checked by JobDir.acquire before anything was made
        return open_private_dir(path, what, dir_fd=dir_fd)
    except UnsafeFolder as exc:
        raise JobError(str(exc)) from None


class JobDir:
    """Owns one job directory while the daemon holds its lock."""

    def __init__(self, paths: JobPaths):
        self.paths = paths
        self._lock_fd = -1
        # What a failed start may remove: the folder, if this start created it (note_existing),
        # else only the entries that are new or replaced since prepare looked (_found; None:
        # it did not look, so this start made nothing there).
        self.created = False
        self.root_created = False
        self._found: dict[str, tuple[int, int]] | None = None

    def note_existing(self) -> None:
        """Before acquire: whether the job folder is already there (a killed daemon's warm
        buffer, say), which a failed start must then keep."""
        self.created = not os.path.lexists(self.paths.dir)
        self.root_created = not os.path.lexists(self.paths.dir.parent)

    def acquire(self) -> None:
        """Create and lock the job directory; JobError (touching nothing) if a daemon holds it."""
        root = self.paths.dir.parent
        try:
            check_folders_above(root, "job root")  # before anything is made there
        except UnsafeFolder as exc:
            raise JobError(str(exc)) from None
        try:
            root.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a regular file on the way, no permission, ...
            raise JobError(
                f"cannot create the folder of the job root {root}: {exc.strerror} ({exc.filename}); "
                "choose another --root or PREFETCHD_ROOT"
            ) from None
        root_fd = ensure_private_dir(root, "job root")
        try:  # relative to the checked root: the folder locked is the folder checked
            dir_fd = ensure_private_dir(self.paths.dir, "job folder", dir_fd=root_fd)
        finally:
            os.close(root_fd)
        try:
            fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                try:
                    pid = read_manifest(self.paths, dir_fd=dir_fd).get("pid", "?")
                except (OSError, ValueError):
                    pid = "?"
                raise JobError(
                    f"job {self.paths.name!r} is already running (daemon pid {pid}, {self.paths.dir}); "
                    f"use it, stop it with `prefetchd stop {self.paths.name}`, or pick another --name"
                ) from None
        finally:
            os.close(dir_fd)
        self._lock_fd = fd

    def prepare(self) -> None:
        """Sub-folders ready; a dead daemon's leftovers swept: its half-written files, socket,
        manifest and stopped.json (why it stopped, no longer true of this start). Finished
        batches stay: the new master validates them and keeps what it can use. What the folder
        holds is noted first, so that a failed start removes only what it made."""
        self._found = _entry_identities(self.paths.dir)
        for leftover in (self.paths.manifest, self.paths.socket, self.paths.stopped):
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
        """Delete the job folder, or all of it but ``keep``; relative to descriptors opened
        without following symlinks, so nothing outside the folder can be deleted."""
        kept = {p.name for p in keep}
        self._remove_in_folder(whole=not kept, entries=lambda dir_fd: _names_but(dir_fd, kept))

    def remove_what_this_start_made(self, failure: UserError | None = None) -> None:
        """After a failed start: a job folder this start created goes whole. In one that was
        there, the entries this start made or replaced go (manifest, socket, producer.json,
        index/, tmp/ with its workers' files); the log (it says why), the lock, and batches/,
        retired/, progress/ and trainers/ (a warm buffer, trainers' reports) stay, as does
        anything this start left as it found it. A folder that stays is left ``failure`` in
        stopped.json: a trainer waiting on the job, and `prefetchd status`, read why."""
        self._remove_in_folder(whole=self.created, entries=self._made_by_this_start)
        if failure is not None and not self.created:
            self.write_stopped(failure)
        if self.root_created:
            try:
                os.rmdir(self.paths.dir.parent)  # only while empty: another job may have come meanwhile
            except OSError:
                pass

    def _remove_in_folder(self, *, whole: bool, entries) -> None:
        """The folder (``whole``), or the ``entries(dir_fd)`` it names in it. A root or folder
        that is gone, or is a symlink now, is not ours to delete in: nothing is."""
        try:
            root_fd = os.open(self.paths.dir.parent, DIR_FLAGS)
        except OSError:
            return
        try:
            if whole:
                shutil.rmtree(self.paths.name, ignore_errors=True, dir_fd=root_fd)
                return
            dir_fd = os.open(self.paths.name, DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            return
        finally:
            os.close(root_fd)
        try:
            for name in entries(dir_fd):
                if not _remove_quietly(os.unlink, name, dir_fd):
                    shutil.rmtree(name, ignore_errors=True, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def _made_by_this_start(self, dir_fd: int) -> list[str]:
        if self._found is None:  # prepare did not look: this start made nothing here
            return []
        paths = self.paths
        kept = {paths.log.name, paths.lock.name}
        data = {p.name for p in (paths.batch_dir, paths.retired_dir, paths.progress_dir, paths.trainers_dir)}
        made = []
        for name, identity in _entry_identities(dir_fd).items():
            if name in kept or self._found.get(name) == identity:
                continue
            if name in data:
                if name not in self._found:  # made by this start: gone if still empty
                    _remove_quietly(os.rmdir, name, dir_fd)
                continue
            made.append(name)
        return made

    def write_stopped(self, error: UserError) -> bool:
        """Leave ``error`` (errors.to_json, plus ``stopped_at``) in stopped.json: atomically
        (a reader sees all of it or none), 0600, relative to the job folder opened without
        following symlinks. Called with the lock held, so it never lands in a newer daemon's
        folder. Whether it was written; never raises: a file it cannot write (a full tmpfs) is
        logged, and must not hide why the daemon stopped."""
        data = json.dumps({**to_json(error), "stopped_at": round(time.time(), 3)}).encode()
        tmp = f".{STOPPED}.tmp"
        try:
            root_fd = os.open(self.paths.dir.parent, DIR_FLAGS)
            try:
                dir_fd = os.open(self.paths.name, DIR_FLAGS, dir_fd=root_fd)
            finally:
                os.close(root_fd)
        except OSError as exc:
            log.warning("could not leave why the daemon stopped in %s: %s", self.paths.stopped, exc)
            return False
        try:
            _remove_quietly(os.unlink, tmp, dir_fd)  # O_EXCL below: never write through a planted file
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, STOPPED, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            _remove_quietly(os.unlink, tmp, dir_fd)
            log.warning("could not leave why the daemon stopped in %s: %s", self.paths.stopped, exc)
            return False
        finally:
            os.close(dir_fd)
        return True

    def release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _entry_identities(folder: Path | int) -> dict[str, tuple[int, int]]:
    """Name -> (inode, mtime in ns) of each entry of ``folder`` (a path or a descriptor), not
    following symlinks: an entry replaced (a new inode) or rewritten (a new mtime) differs."""
    found = {}
    with os.scandir(folder) as entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            found[entry.name] = (st.st_ino, st.st_mtime_ns)
    return found


def _names_but(dir_fd: int, kept: set[str]) -> list[str]:
    return [name for name in os.listdir(dir_fd) if name not in kept]


def _remove_quietly(remove, name: str, dir_fd: int) -> bool:
    """``remove(name, dir_fd=dir_fd)``; False when it failed (a folder given to unlink, a
    folder not empty given to rmdir, an entry gone already)."""
    try:
        remove(name, dir_fd=dir_fd)
    except OSError:
        return False
    return True
