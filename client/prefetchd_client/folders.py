"""Folders and files a peer could plant: the one check every entry point runs.

/dev/shm is writable by every user and the default root's name is predictable: another
user can create <root> or <root>/<job> first, or plant a symlink there, before this user's
first job. Whatever is found there is trusted only if it is a real folder, this user's, and
writable by nobody else; then nobody else can add, swap or remove what is inside it either.
Files in it are read with ``read_regular_file``: no symlink, no FIFO, bounded.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import UnsafeFolder
from .layout import ROOT_ENV, JobPaths, default_root

# A folder is opened as a folder, never through a symlink: O_NOFOLLOW fails on one (ENOTDIR
# with O_DIRECTORY, ELOOP without), so what was checked is what is used afterwards.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never blocks open()
_WRITABLE_BY_OTHERS = 0o022
POD_VOLUME_ENV = "PREFETCHD_POD_VOLUME"  # is_pod_volume


def is_private(st: os.stat_result) -> bool:
    """Whether what ``st`` describes is this user's and writable by nobody else: then nobody
    else can have written it, nor (a folder) add, swap or remove what is inside it."""
    return st.st_uid == os.getuid() and not st.st_mode & _WRITABLE_BY_OTHERS


# -- whose folder: the one check every entry point runs ---------------------------------------
#
# /dev/shm is writable by every user and the default root's name is predictable: another
# user can create <root> or <root>/<job> first, or plant a symlink there, before this user's
# first job. Whatever is found there is trusted only if it is a real folder, this user's, and
# writable by nobody else; then nobody else can add, swap or remove what is inside it either.


def open_private_dir(path: Path, what: str, *, dir_fd: int | None = None, fix: str | None = None) -> int:
    """A descriptor of the folder ``path``, opened without following a symlink and proven
    this user's own and writable by nobody else; UnsafeFolder otherwise, FileNotFoundError
    when it does not exist. With ``dir_fd`` only ``path.name`` is opened, relative to it.

    Work relative to the descriptor (``dir_fd=``) afterwards: a check of a path is worth
    nothing once the path can name something else. Opened by its whole path (no ``dir_fd``),
    every folder above it must be safe too (``check_folders_above``). ``fix``: what the user
    can do instead, for a folder that is not a job root (an output folder, a cache).
    """
    if dir_fd is None:
        check_folders_above(path, what, fix=fix)
    try:
        fd = os.open(path.name if dir_fd is not None else path, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        try:
            st = os.lstat(path.name if dir_fd is not None else path, dir_fd=dir_fd)
        except OSError:  # gone again, or a component above it is not a folder
            raise UnsafeFolder(f"{what} {path} is not a folder; {fix or _fix_for(path, what, None)}") from None
        raise UnsafeFolder(_refusal(path, what, st, fix)) from None
    try:
        st = os.fstat(fd)
        if not is_private(st):
            raise UnsafeFolder(_refusal(path, what, st, fix))
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_folders_above(path: Path, what: str, *, fix: str | None = None) -> None:
    """UnsafeFolder unless nobody else can rename a folder above ``path``: each one, as
    written and as symlinks resolve, belongs to root or to this user and is writable by no
    one else, or is sticky (/tmp, /dev/shm: there nobody renames what is not theirs).

    Otherwise the folder checked could be renamed away after the check and another user's
    put in its place (a root under a shared project folder): the loader would then read their
    batches and report to their socket, `verify` import their code.
    """
    fix = fix or (
        "Use a root whose folders above only you or root can change (the default /dev/shm/prefetchd-<uid> "
        f"is one): --root DIR or {ROOT_ENV}=DIR"
    )
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
        if open_to_others and is_pod_volume(folder):
            open_to_others = False
        if not owner_ok or open_to_others:
            who = f"uid {st.st_uid}" if not owner_ok else f"mode {stat.S_IMODE(st.st_mode):o}, not sticky"
            raise UnsafeFolder(
                f"{what} {path} lies under {folder} ({who}), which another user can change: they could swap "
                f"the {what} for their own after it is checked. {fix[:1].upper()}{fix[1:]}"
            )


def is_pod_volume(folder: Path) -> bool:
    """Whether ``folder`` is the mount point that $PREFETCHD_POD_VOLUME names: a Kubernetes
    volume of the pod's own (an ``emptyDir``), which the kubelet makes 0777 and which no process
    of a pod under the ``restricted`` Pod Security standard (no root) can make sticky. Only the
    pod's containers reach it, so it stands as a folder nobody else can change, as that exact
    mount point and nothing else: never set it for a hostPath volume, which others on the node
    reach. Mode and owner of the folders above and below are checked as ever."""
    named = os.environ.get(POD_VOLUME_ENV)
    if not named or not os.path.isabs(named):
        return False
    return os.path.normpath(named) == os.path.normpath(os.path.abspath(folder)) and os.path.ismount(folder)


@dataclass
class MadeFolders:
    """The folders ``make_private_dir`` created, deepest last, each as (a descriptor of the
    folder that holds it, its name, its inode): what a failed run may remove, and nothing else."""

    made: list[tuple[int, str, int]]

    def remove(self) -> None:
        """rmdir each one still there and still the one made (its inode, relative to its parent's
        descriptor); one that holds anything, or was replaced, is left as it is. Then close."""
        for parent_fd, name, ino in reversed(self.made):
            with contextlib.suppress(OSError):
                if os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_ino == ino:
                    os.rmdir(name, dir_fd=parent_fd)
        self.close()

    def close(self) -> None:
        for parent_fd, _, _ in self.made:
            os.close(parent_fd)
        self.made = []


def make_private_dir(path: Path, what: str, *, mode: int = 0o700, fix: str | None = None) -> tuple[int, MadeFolders]:
    """A descriptor of the folder ``path`` as ``open_private_dir`` gives it, the folder and each
    missing one above it created first with exactly ``mode`` (the umask does not narrow it); and
    the folders it created. Each step opens the next name relative to the folder checked before
    it, without following a symlink: a folder above that another user makes meanwhile must
    pass the rule of ``check_folders_above``, checked on its descriptor.
    """
    check_folders_above(path, what, fix=fix)
    path = Path(os.path.abspath(path))
    if not path.name:  # "/": nothing to make, and mkdir("") said "No such file or directory"
        return open_private_dir(path, what, fix=fix), MadeFolders([])
    missing, top = [], path.parent
    while not os.path.isdir(top):
        missing.insert(0, top.name)
        top = top.parent
    # Following symlinks here is safe: check_folders_above proved that no other user can change
    # a folder above, as written or as resolved.
    parent = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    made = MadeFolders([])
    try:
        for name in [*missing, path.name]:
            ino = _make_dir(name, mode, parent)
            if ino is not None:
                made.made.append((parent, name, ino))  # kept open: a failed run removes it by it
            top = top / name
            if top == path:
                child = open_private_dir(path, what, dir_fd=parent, fix=fix)
            else:
                child = _open_folder_above(top, what, parent, fix)
            if ino is None:
                os.close(parent)
            parent = child
        return parent, made
    except BaseException:
        if all(parent != parent_fd for parent_fd, _, _ in made.made):
            os.close(parent)
        made.remove()
        raise


def _make_dir(name: str, mode: int, dir_fd: int) -> int | None:
    """The inode of the folder made, or None when ``name`` was there already."""
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        return None
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)  # not by name: the name may be another folder by now
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


def _open_folder_above(path: Path, what: str, dir_fd: int, fix: str | None) -> int:
    """A descriptor of ``path.name`` under ``dir_fd``: a real folder of root's or this user's
    that no one else can change (or sticky), as ``check_folders_above`` requires."""
    try:
        fd = os.open(path.name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        raise UnsafeFolder(
            f"{what}: {path} is not a folder (a symlink or a file); {fix or 'choose another folder'}"
        ) from None
    st = os.fstat(fd)
    open_to_others = st.st_mode & _WRITABLE_BY_OTHERS and not st.st_mode & stat.S_ISVTX and not is_pod_volume(path)
    if st.st_uid not in (0, os.getuid()) or open_to_others:
        os.close(fd)
        raise UnsafeFolder(
            f"{what}: {path} (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}) appeared while the folders "
            f"were being made, and another user can change it; {fix or 'choose another folder'}"
        )
    return fd


def _refusal(path: Path, what: str, st: os.stat_result, fix: str | None = None) -> str:
    if stat.S_ISLNK(st.st_mode):
        problem = f"is a symlink (of uid {st.st_uid})"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not you (uid {os.getuid()})"
    else:
        mode = stat.S_IMODE(st.st_mode)
        if st.st_mode & stat.S_ISVTX:  # /tmp or /dev/shm as root: chmod go-w would break the node's other users
            return (
                f"{what} {path} is a shared folder (mode {mode:o}: every user may create files in it); "
                "make a folder of your own inside it and use that"
            )
        return f"{what} {path} is writable by others (mode {mode:o}); run chmod go-w {path}"
    return f"{what} {path} {problem}: nothing in it is used; {fix or _fix_for(path, what, st)}"


def _fix_for(path: Path, what: str, st: os.stat_result | None) -> str:
    """What this user can do: another user's entry in the sticky /dev/shm cannot be removed
    by anyone but its owner or an administrator, so "remove it" would be advice that fails."""
    if st is not None and st.st_uid == os.getuid() and what == "job root":
        if path != default_root():  # named by --root or $PREFETCHD_ROOT: it may be the user's data
            return f"name a folder of your own as the root: --root DIR or {ROOT_ENV}=DIR"
        return f"remove it (rm {path}) or use another root: --root DIR or {ROOT_ENV}=DIR"
    if st is not None and st.st_uid == os.getuid():
        return f"remove it (rm {path})" + (" or use another job name" if what.startswith("job") else "")
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
