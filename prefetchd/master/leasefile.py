"""The file the daemons of one root keep their CPU leases in (master/cpubudget.py):
``<root>/.cpus/leases.json`` (no job's name starts with a dot), read and replaced whole under
``flock`` of ``<root>/.cpus/lock``. Only plain files of this user's are used (Refused for a
symlink, a FIFO, another owner's); leases that do not read as leases count as none (and the
reader is told), and a lease is dropped unless its daemon runs: that pid, started at that time
(a reused pid is not it), named by its job's manifest under the root."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
from pathlib import Path

from prefetchd.master.cpushares import MAX_RUNWAY_S
from prefetchd.master.jobdir import ensure_private_dir
from prefetchd.settings import CPU_WEIGHTS, MAX_NODE_CPUS
from prefetchd_client.folders import is_private
from prefetchd_client.layout import JobPaths, check_job_name
from prefetchd_client.locks import flock_within
from prefetchd_client.manifest import read_manifest

log = logging.getLogger("prefetchd")

FOLDER = ".cpus"
_LEASES, _LOCK = "leases.json", "lock"
_MAX_BYTES = 1 << 20  # leases of thousands of jobs; more is no file of ours
_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_ENTRY = {"pid": int, "started": float, "job": str, "lease": int, "busy": int, "demand": int, "runway_s": float}
_ENTRY |= {"weight": float, "used": float, "at": float}


class Refused(Exception):
    """The budget's files cannot be used (not a plain file of ours)."""


@contextlib.contextmanager
def locked(root: Path, wait_s: float):
    """The leases' folder (a descriptor) with its lock held, or None when the lock stayed busy
    for ``wait_s``: a daemon in the middle of a settle is not waited for."""
    folder = ensure_private_dir(root / FOLDER, "CPU budget folder")
    try:
        lock = _open_ours(_LOCK, os.O_RDWR | os.O_CREAT, folder)
        try:
            yield folder if flock_within(lock, fcntl.LOCK_EX, wait_s, poll_s=0.002) else None
        finally:
            os.close(lock)  # the lock goes with it
    finally:
        os.close(folder)


def read_live(folder: int, root: Path) -> tuple[dict[str, dict], bool]:
    """The leases whose daemons still run, and whether the file read as leases (absent: it did;
    the lease of another's crash-free first start is no loss)."""
    try:
        fd = _open_ours(_LEASES, os.O_RDONLY, folder)
    except FileNotFoundError:
        return {}, True
    try:
        data = os.read(fd, _MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        leases = json.loads(data) if len(data) <= _MAX_BYTES else None
    except (ValueError, RecursionError):
        leases = None
    if not isinstance(leases, dict):
        return {}, False
    return {
        k: e for k, e in leases.items() if _is_entry(e) and k == key_of(e["pid"], e["started"]) and alive(e, root)
    }, True


def write(folder: int, leases: dict[str, dict]) -> None:
    """All at once: a new file renamed over the old, so a kill mid-write leaves the old whole."""
    tmp = f"{_LEASES}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _FLAGS, 0o600, dir_fd=folder)
        try:
            data = json.dumps(leases).encode()
            if os.write(fd, data) != len(data):  # a full tmpfs can take part of it
                raise OSError(errno.ENOSPC, "the leases were written in part")
        finally:
            os.close(fd)
        os.rename(tmp, _LEASES, src_dir_fd=folder, dst_dir_fd=folder)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise


def key_of(pid: int, started: float) -> str:
    return f"{pid}-{started}"


def _open_ours(name: str, flags: int, folder: int) -> int:
    """A plain file of ours in the leases' folder; Refused for anything else."""
    try:
        fd = os.open(name, flags | _FLAGS, 0o600, dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(f"{FOLDER}/{name} is a symlink") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or not is_private(st):
        os.close(fd)
        kind = "a plain file" if stat.S_ISREG(st.st_mode) else "not a plain file"
        raise Refused(f"{FOLDER}/{name} is {kind} of uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}")
    return fd


def _is_entry(entry) -> bool:
    if not isinstance(entry, dict) or not all(type(entry.get(k)) is t for k, t in _ENTRY.items()):
        return False
    return (
        CPU_WEIGHTS[0] <= entry["weight"] <= CPU_WEIGHTS[1]
        and 0 <= entry["used"] < 1e12
        and 0 <= entry["at"] < 1e11
        and all(0 <= entry[k] <= MAX_NODE_CPUS for k in ("lease", "busy", "demand"))
        and 0 <= entry["runway_s"] <= MAX_RUNWAY_S
        and 0 < entry["pid"] < 1 << 31
    )


def alive(entry: dict, root: Path) -> bool:
    """Whether the lease's daemon still runs: that pid, started then (not a reused pid), and the
    daemon its job's manifest under this root names (not any process that happens to live)."""
    import psutil  # only with --node-cpus: not on every daemon's start

    try:
        process = psutil.Process(entry["pid"])
        if abs(process.create_time() - entry["started"]) >= 0.01 or process.status() == psutil.STATUS_ZOMBIE:
            return False
        return read_manifest(JobPaths(root / check_job_name(entry["job"]))).get("pid") == entry["pid"]
    except (psutil.Error, OSError, ValueError):
        return False
