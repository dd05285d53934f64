"""Where a job lives, and the names of everything in its directory.

The daemon and the client share this module, so a trainer started with the same
environment finds a job by its name alone::

    <root>/<job>/
      manifest.json      plan summary the client needs (written once the daemon serves)
      daemon.lock        flock held by the daemon for its whole life
      daemon.sock        ZeroMQ ipc endpoint (a TCP job has none: the manifest names its endpoint)
      daemon.log
      stopped.json       why the daemon stopped on an error: {type, message, exit_code, stopped_at}
      progress/rank-<r>  "<epoch> <step>": the next batch rank r will read
      batches/           finished batches, e<epoch>-s<step>-r<rank>.batch
      tmp/               batches being written
      retired/           consumed batches a client may still map (freed once unmapped)
      trainers/rank-<r>  flock held (shared) by every live loader of rank r

root is the ``root`` argument, else ``$PREFETCHD_ROOT``, else ``/dev/shm/prefetchd-<uid>``.

Every entry point (daemon, client, CLI) opens the root and the job folder with ``open_job``
(or ``open_private_dir``): a symlink, a folder of another user's or one that others can
write is refused (UnsafeFolder) before anything in it is read, signalled or deleted.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import UnsafeFolder
from .transport import parse_tcp_endpoint

ROOT_ENV = "PREFETCHD_ROOT"
MANIFEST = "manifest.json"
LOCK = "daemon.lock"
SOCKET = "daemon.sock"
LOG = "daemon.log"
STOPPED = "stopped.json"
PROGRESS_DIR = "progress"
BATCH_DIR = "batches"
TMP_DIR = "tmp"
TRAINERS_DIR = "trainers"
RETIRED_DIR = "retired"

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_BATCH_NAME = re.compile(r"^e(\d{6})-s(\d{8})-r(\d{4})\.batch$")
_PROGRESS_NAME = re.compile(r"^rank-(\d{1,4})$")
# A folder is opened as a folder, never through a symlink: O_NOFOLLOW fails on one (ENOTDIR
# with O_DIRECTORY, ELOOP without), so what was checked is what is used afterwards.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never blocks open()
_WRITABLE_BY_OTHERS = 0o022
_MAX_MANIFEST_BYTES = 1 << 20
# The manifest's own format. The daemon (package prefetchd) writes it and the client (package
# prefetchd-client) reads it; they are installed separately, so a client checks it first.
MANIFEST_VERSION = 1
_CURVE_KEY_CHARS = 40  # a CURVE public key in Z85 text


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
    def stopped(self) -> Path:
        return self.dir / STOPPED

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


# What a batch name holds (six digits of epoch, eight of step, four of rank): a position past
# these is outside every plan.
MAX_EPOCH, MAX_STEP, MAX_RANK = 10**6 - 1, 10**8 - 1, 10**4 - 1


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


def daemon_alive(paths: JobPaths, *, dir_fd: int | None = None) -> bool:
    """True while some process holds the job's lock, i.e. its daemon runs.

    The daemon holds an exclusive flock for its whole life; the kernel drops it when the
    process dies, however it dies, so a shared non-blocking probe tells live from dead.
    With ``dir_fd`` (``OpenJob.dir_fd``) the lock is probed in the folder that was checked.
    A symlink or FIFO in its place is no daemon's lock: the daemon opens it with O_NOFOLLOW.
    """
    try:
        fd = os.open(LOCK if dir_fd is not None else paths.lock, _FILE_FLAGS, dir_fd=dir_fd)
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
        fd = os.open(LOCK, _FILE_FLAGS, dir_fd=job.dir_fd)
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


def hold_trainer_lock(paths: JobPaths, rank: int) -> int | None:
    """Take a shared flock that says "a trainer of this rank is alive"; returns the fd to keep
    (close it with ``release_trainer_lock``).

    The kernel drops it when the process dies, however it dies, so the daemon can tell a
    trainer that is gone from one that is only paused. None if the job has no such folder,
    something other than a regular file is planted under the lock's name, or another process
    holds it exclusively for seconds (then the daemon sees this rank as "never" or "gone").
    """
    try:
        fd = os.open(paths.trainer_lock(rank), os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    # The daemon's probe holds the lock exclusively for microseconds; a process that holds it
    # longer is not the daemon: give up after a deadline rather than hang the trainer.
    deadline = time.monotonic() + _TRAINER_LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.01)
    _held_trainer_locks.add(fd)
    return fd


def release_trainer_lock(fd: int) -> None:
    _held_trainer_locks.discard(fd)
    os.close(fd)


def trainer_state(paths: JobPaths, rank: int) -> str:
    """ "alive" (some loader holds the rank's lock), "gone" (one did, none does) or "never"."""
    # O_NONBLOCK: a FIFO planted under the name must not block the daemon in open();
    # only a regular file can be a trainer's lock (a symlink fails with ELOOP: OSError).
    try:
        fd = os.open(paths.trainer_lock(rank), _FILE_FLAGS)
    except FileNotFoundError:
        return "never"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(paths.trainer_lock(rank)))
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return "alive"
        raise
    else:
        return "gone"
    finally:
        os.close(fd)  # closing drops our probe's lock too


def read_regular_file(path: str | os.PathLike, max_bytes: int, *, dir_fd: int | None = None) -> bytes:
    """The bytes of a file a peer could have planted: opened without following a symlink or
    blocking on a FIFO, and only a regular file of at most ``max_bytes``. FileNotFoundError
    when it is absent; ValueError saying why for the rest; other OSErrors (EMFILE) as raised."""
    try:
        fd = os.open(path, _FILE_FLAGS, dir_fd=dir_fd)
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


# Its message is at most 8,192 characters (prefetchd.errors.MAX_MESSAGE_CHARS), at most 6 bytes each as JSON.
_MAX_STOPPED_BYTES = 64 << 10
_STOPPED_KEYS = {"type", "message", "exit_code", "stopped_at"}


def read_stopped(paths: JobPaths, *, dir_fd: int | None = None) -> dict | None:
    """Why the job's daemon stopped on an error, as it left it in stopped.json: ``{"type",
    "message", "exit_code", "stopped_at"}``. None when there is none, or when the file is not
    one a daemon writes (not JSON, other keys or types, a symlink, a FIFO): anyone who can
    write in the folder could plant it, and a trainer must neither block on it nor fail for it.
    With ``dir_fd`` (``OpenJob.dir_fd``) it is read in the folder that was checked."""
    try:
        data = read_regular_file(STOPPED if dir_fd is not None else paths.stopped, _MAX_STOPPED_BYTES, dir_fd=dir_fd)
        stopped = json.loads(data)
    except (OSError, ValueError, RecursionError):  # RecursionError: a few thousand nested '['
        return None
    if not isinstance(stopped, dict) or set(stopped) != _STOPPED_KEYS:
        return None
    code, at = stopped["exit_code"], stopped["stopped_at"]
    valid = (
        isinstance(stopped["type"], str)
        and isinstance(stopped["message"], str)
        and type(code) is int
        and 0 < code < 256  # a daemon leaves stopped.json only when it ends with a non-zero exit status
        and type(at) in (int, float)
        and 0 <= at < 2**34  # before the year 2514: a time that time.localtime can show
    )
    return stopped if valid else None


def read_manifest(paths: JobPaths, *, dir_fd: int | None = None) -> dict:
    """The manifest as a dict; FileNotFoundError when the job is not serving, ValueError for
    anything that is not a regular file holding one JSON object (deep nesting included).

    With ``dir_fd`` (``OpenJob.dir_fd``) it is read in the folder that was checked. Its
    values are not checked here: ``check_manifest`` does, for those who use them.
    """
    data = read_regular_file(MANIFEST if dir_fd is not None else paths.manifest, _MAX_MANIFEST_BYTES, dir_fd=dir_fd)
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: a few thousand nested '['
        raise ValueError(f"{paths.manifest} is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{paths.manifest} is not a JSON object")
    return manifest


def _count_up_to(most: int):
    return lambda value: type(value) is int and 0 < value <= most, f"an integer from 1 to {most}"


# What a client reads from a manifest, and what each value must be (the bounds: what batch
# names can hold, what a sample count can be, the kernel's largest pid).
_MANIFEST_VALUES = {
    "world_size": _count_up_to(MAX_RANK + 1),
    "batch_size": _count_up_to(2**40),
    "global_batch": _count_up_to(2**50),
    "batches_per_epoch": _count_up_to(MAX_STEP + 1),
    "pid": _count_up_to(2**22),
    "config_hash": (lambda v: isinstance(v, str), "a string"),
    "config": (lambda v: isinstance(v, dict), "an object"),
}


class VersionMismatch(ValueError):
    """A file of the job written by another prefetchd version than this client's."""


def check_manifest(paths: JobPaths, manifest: dict) -> dict:
    """``manifest`` if every value a client uses has its type, its endpoint is one this job
    can have and its CURVE key is a key; ValueError naming the first that is not
    (VersionMismatch when another prefetchd version wrote it)."""
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        raise VersionMismatch(
            f"{paths.manifest} is of manifest version {str(manifest.get('manifest_version'))[:20]}, and this "
            f"prefetchd-client reads version {MANIFEST_VERSION}: the daemon and this trainer run different "
            "prefetchd versions; install the same version of both (pip install -U prefetchd prefetchd-client) "
            "and restart the job"
        )
    for key, (valid, kind) in _MANIFEST_VALUES.items():
        if not valid(manifest.get(key)):
            raise ValueError(f"{paths.manifest}: {key!r} must be {kind}, found {manifest.get(key)!r:.60}")
    if not valid_endpoint(paths, manifest.get("endpoint")):
        raise ValueError(
            f"{paths.manifest}: 'endpoint' must be {paths.endpoint} or tcp://HOST:PORT, "
            f"found {manifest.get('endpoint')!r:.80}"
        )
    if not valid_curve_key(manifest.get("curve_public_key")):
        raise ValueError(f"{paths.manifest}: 'curve_public_key' must be null or a {_CURVE_KEY_CHARS}-character key")
    return manifest


def valid_endpoint(paths: JobPaths, endpoint) -> bool:
    """An endpoint this job's daemon can listen on: its own ipc socket, or a TCP address."""
    if endpoint == paths.endpoint:
        return True
    try:
        tcp = parse_tcp_endpoint(endpoint)
    except ValueError:
        return False
    return not tcp.wildcard  # a bind address; a daemon writes where to connect


def valid_curve_key(key) -> bool:
    """None (no CURVE), or a public key in Z85 text (printable ASCII)."""
    if key is None:
        return True
    return isinstance(key, str) and len(key) == _CURVE_KEY_CHARS and key.isascii() and key.isprintable()
