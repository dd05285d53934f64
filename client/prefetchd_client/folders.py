"""Folders and files a peer could plant: the one check every entry point runs.

/dev/shm is writable by every user and the default root's name is predictable: another
user can create <root> or <root>/<job> first, or plant a symlink there, before this user's
first job. Whatever is found there is trusted only if it is a real folder, this user's, and
writable by nobody else; then nobody else can add, swap or remove what is inside it either.
Files in it are read with ``read_regular_file``: no symlink, no FIFO, bounded.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import UnsafeFolder
from .layout import ROOT_ENV, JobPaths

# A folder is opened as a folder, never through a symlink: O_NOFOLLOW fails on one (ENOTDIR
# with O_DIRECTORY, ELOOP without), so what was checked is what is used afterwards.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never blocks open()
_WRITABLE_BY_OTHERS = 0o022


# -- whose folder: the one check every entry point runs ---------------------------------------
#
# /dev/shm is writable by every user and the default root's name is predictable: another
# user can create <root> or <root>/<job> first, or plant a symlink there, before this user's
# first job. Whatever is found there is trusted only if it is a real folder, this user's, and
# writable by nobody else; then nobody else can add, swap or remove what is inside it either.


def open_private_dir(path: Path, what: str, *, dir_fd: int | None = None) -> int:
    """A descriptor of the folder ``path``, opened without following a symlink and proven
    this user's own and writable by nobody else; UnsafeFolder otherwise, FileNotFoundError
    when it does not exist. With ``dir_fd`` only ``path.name`` is opened, relative to it.

    Work relative to the descriptor (``dir_fd=``) afterwards: a check of a path is worth
    nothing once the path can name something else. Opened by its whole path (no ``dir_fd``),
    every folder above it must be safe too (``check_folders_above``).
    """
    if dir_fd is None:
        check_folders_above(path, what)
    try:
        fd = os.open(path.name if dir_fd is not None else path, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        try:
            st = os.lstat(path.name if dir_fd is not None else path, dir_fd=dir_fd)
        except OSError:  # gone again, or a component above it is not a folder
            raise UnsafeFolder(f"{what} {path} is not a folder; {_fix_for(path, what, None)}") from None
        raise UnsafeFolder(_refusal(path, what, st)) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & _WRITABLE_BY_OTHERS:
            raise UnsafeFolder(_refusal(path, what, st))
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_folders_above(path: Path, what: str) -> None:
    """UnsafeFolder unless nobody else can rename a folder above ``path``: each one, as
    written and as symlinks resolve, belongs to root or to this user and is writable by no
    one else, or is sticky (/tmp, /dev/shm: there nobody renames what is not theirs).

    Otherwise the folder checked could be renamed away after the check and another user's
    put in its place (a root under a shared project folder): the loader would then read their
    batches and report to their socket, `verify` import their code.
    """
    uid = os.getuid()
    written = Path(os.path.abspath(path)).parent
    resolved = Path(os.path.realpath(written))
    for folder in dict.fromkeys([*written.parents, written, *resolved.parents, resolved]):
        try:
            st = os.lstat(folder)
        except OSError:
            continue  # not there (yet): whoever creates it is checked when it is used
        owner_ok = st.st_uid in (0, uid)
        open_to_others = stat.S_ISDIR(st.st_mode) and st.st_mode & _WRITABLE_BY_OTHERS and not st.st_mode & stat.S_ISVTX
        if not owner_ok or open_to_others:
            who = f"uid {st.st_uid}" if not owner_ok else f"mode {stat.S_IMODE(st.st_mode):o}, not sticky"
            raise UnsafeFolder(
                f"{what} {path} lies under {folder} ({who}), which another user can change: they could swap "
                f"the {what} for their own after it is checked. Use a root whose folders above only you or "
                f"root can change (the default /dev/shm/prefetchd-<uid> is one): --root DIR or {ROOT_ENV}=DIR"
            )


def _refusal(path: Path, what: str, st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        problem = f"is a symlink (of uid {st.st_uid})"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not you (uid {os.getuid()})"
    else:
        mode = stat.S_IMODE(st.st_mode)
        return f"{what} {path} is writable by others (mode {mode:o}); run chmod go-w {path}"
    return f"{what} {path} {problem}: nothing in it is used; {_fix_for(path, what, st)}"


def _fix_for(path: Path, what: str, st: os.stat_result | None) -> str:
    """What this user can do: another user's entry in the sticky /dev/shm cannot be removed
    by anyone but its owner or an administrator, so "remove it" would be advice that fails."""
    if st is not None and st.st_uid == os.getuid() and what == "job root":
        return f"remove it (rm {path}) or use another root: --root DIR or {ROOT_ENV}=DIR"
    if st is not None and st.st_uid == os.getuid():
        return f"remove it (rm {path}) or use another job name"
    return (
        f"use a root folder of your own, the same for the daemon and its trainers: `prefetchd ... --root DIR` "
        f"or {ROOT_ENV}=DIR (PrefetchLoader(root=DIR)), or ask an administrator to remove {path}"
    )


@dataclass
class OpenJob:
    """A job's root and job folder, opened without following symlinks and checked
    (``open_job``): read, probe and delete relative to ``root_fd`` and ``dir_fd``."""

    paths: JobPaths
    root_fd: int
    dir_fd: int

    def remove(self) -> None:
        """Delete the job folder, relative to the checked root: rmtree with ``dir_fd`` never
        follows a symlink, so nothing outside the folder that was checked can be deleted."""
        shutil.rmtree(self.paths.name, ignore_errors=True, dir_fd=self.root_fd)

    def close(self) -> None:
        for fd in (self.dir_fd, self.root_fd):
            if fd >= 0:
                os.close(fd)
        self.root_fd = self.dir_fd = -1

    def __enter__(self) -> OpenJob:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_job(paths: JobPaths) -> OpenJob:
    """The job's root and folder, checked (see ``open_private_dir``): UnsafeFolder when either
    is not this user's private folder, FileNotFoundError when either does not exist."""
    root_fd = open_private_dir(paths.dir.parent, "job root")
    try:
        dir_fd = open_private_dir(paths.dir, "job folder", dir_fd=root_fd)
    except BaseException:
        os.close(root_fd)
        raise
    return OpenJob(paths, root_fd, dir_fd)


def read_regular_file(path: str | os.PathLike, max_bytes: int, *, dir_fd: int | None = None) -> bytes:
    """The bytes of a file a peer could have planted: opened without following a symlink or
    blocking on a FIFO, and only a regular file of at most ``max_bytes``. FileNotFoundError
    when it is absent; ValueError saying why for the rest; other OSErrors (EMFILE) as raised."""
    try:
        fd = os.open(path, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symlink, which no daemon writes or reads") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ValueError(f"{path} is longer than {max_bytes} bytes")
    return data
