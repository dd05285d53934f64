"""The locks that tell who is alive: the daemon's (``daemon.lock``, held exclusively for its
whole life) and each trainer's (``trainers/rank-<r>``, held shared by every live loader of
the rank). The kernel drops a flock when its process dies, however it dies.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

from .folders import FILE_FLAGS, OpenJob
from .layout import DEFAULT_CONSUMER, LOCK, JobPaths


def daemon_alive(paths: JobPaths, *, dir_fd: int | None = None) -> bool:
    """True while some process holds the job's lock, i.e. its daemon runs.

    The daemon holds an exclusive flock for its whole life; the kernel drops it when the
    process dies, however it dies, so a shared non-blocking probe tells live from dead.
    With ``dir_fd`` (``OpenJob.dir_fd``) the lock is probed in the folder that was checked.
    A symlink or FIFO in its place is no daemon's lock: the daemon opens it with O_NOFOLLOW.
    """
    try:
        fd = os.open(LOCK if dir_fd is not None else paths.lock, FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return False
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
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


def lock_holder(job: OpenJob) -> int | None:
    """The pid of the process that holds the job's exclusive lock, proven; else None.

    Proven twice, from the kernel's side, never from a file's word (a manifest can name any
    pid): /proc/locks lists a FLOCK WRITE lock on the lock file's device and inode held by
    that pid, and that process has the lock file open (/proc/<pid>/fd; a flock's pid is the
    one that took it, which could have died with a child still holding it, and its pid been
    reused since). None when the lock is free or its holder cannot be proven (another pid
    namespace, another user's process).
    """
    try:
        fd = os.open(LOCK, FILE_FLAGS, dir_fd=job.dir_fd)
    except OSError:
        return None
    try:
        lock = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(lock.st_mode):
        return None
    # "1: FLOCK  ADVISORY  WRITE 5828 00:1b:2 0 EOF"; a waiter's line has "->" after "1:".
    key = f"{os.major(lock.st_dev):02x}:{os.minor(lock.st_dev):02x}:{lock.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for fields in map(str.split, lines):
        if len(fields) >= 6 and fields[1:4] == ["FLOCK", "ADVISORY", "WRITE"] and fields[5] == key:
            pid = int(fields[4]) if fields[4].isdigit() else 0
            if pid > 0 and _has_open(pid, lock):
                return pid
    return None


def _has_open(pid: int, target: os.stat_result) -> bool:
    """Whether process ``pid`` holds a descriptor of the file ``target``."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:  # gone, or not ours to look at
        return False
    for name in names:
        try:
            st = os.stat(f"{fd_dir}/{name}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


# The trainer locks this process holds. A flock belongs to the open file, which a fork shares:
# a child that outlived a killed trainer (a DataLoader worker, a subprocess started by fork)
# would keep the rank "alive" and its window pinned. A child is no trainer: it lets go of its
# copies at once. (The child's copies of batch maps keep their locks on purpose: its inherited
# mapping really holds the batch's pages, and the bound must count them until it exits.)
_held_trainer_locks: set[int] = set()
_TRAINER_LOCK_TIMEOUT_S = 2.0


def _let_go_of_trainer_locks_in_child() -> None:
    if not _held_trainer_locks:
        return
    null = os.open(os.devnull, os.O_RDONLY)
    for fd in _held_trainer_locks:
        os.dup2(null, fd)  # the number stays valid for whoever closes it later; the lock's file is let go
    os.close(null)
    _held_trainer_locks.clear()


os.register_at_fork(after_in_child=_let_go_of_trainer_locks_in_child)


def hold_trainer_lock(paths: JobPaths, rank: int, consumer: str = DEFAULT_CONSUMER) -> int | None:
    """Take a shared flock that says "a trainer of this rank (and consumer) is alive"; returns
    the fd to keep (close it with ``release_trainer_lock``).

    The kernel drops it when the process dies, however it dies, so the daemon can tell a
    trainer that is gone from one that is only paused. None if the job has no such folder,
    something other than a regular file is planted under the lock's name, or another process
    holds it exclusively for seconds (then the daemon sees this rank as "never" or "gone").
    """
    try:
        flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(paths.trainer_lock(rank, consumer), flags, 0o600)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    # The daemon's probe holds the lock exclusively for microseconds; a process that holds it
    # longer is not the daemon: give up after a deadline rather than hang the trainer.
    if not flock_within(fd, fcntl.LOCK_SH, _TRAINER_LOCK_TIMEOUT_S):
        os.close(fd)
        return None
    _held_trainer_locks.add(fd)
    return fd


def flock_within(fd: int, mode: int, wait_s: float, poll_s: float = 0.01) -> bool:
    """Take ``flock(fd, mode)``, trying until ``wait_s`` has passed: whether it was taken. Never
    blocks for good on a lock another process keeps."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


def release_trainer_lock(fd: int) -> None:
    _held_trainer_locks.discard(fd)
    os.close(fd)


def trainer_state(paths: JobPaths, rank: int, consumer: str = DEFAULT_CONSUMER) -> str:
    """ "alive" (some loader holds the lock of the rank and consumer), "gone" (one did, none
    does) or "never"."""
    # O_NONBLOCK: a FIFO planted under the name must not block the daemon in open();
    # only a regular file can be a trainer's lock (a symlink fails with ELOOP: OSError).
    lock = paths.trainer_lock(rank, consumer)
    try:
        fd = os.open(lock, FILE_FLAGS)
    except FileNotFoundError:
        return "never"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(lock))
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return "alive"
        raise
    else:
        return "gone"
    finally:
        os.close(fd)  # closing drops our probe's lock too
