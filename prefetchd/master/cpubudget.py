"""The node's CPU budget (``--node-cpus``), shared by the daemons of one root, with no process of
its own: each daemon keeps a lease in ``<root>/.cpus/leases.json`` (no job's name starts with a
dot), and a few times a second, under ``flock`` of ``<root>/.cpus/lock``, reads everyone's,
divides the budget by demand (master/cpushares.py: the same division in every daemon) and takes
its share: at once from CPUs nobody leases, from its own lease only as its busy workers finish.
So the leases never add up to more than the budget, and no daemon has more workers busy than its
lease: at no moment are more than ``cpus`` workers of these jobs busy.

A lease lives while its daemon does: its pid with that process's start time (a reused pid is
not it), so the share of a daemon killed with -9 (its workers die with it) returns at the next
settle. The files are this user's, in a root nobody else may write (the root rules); one that is
not a plain file of ours (planted, a symlink, a FIFO) is refused, the daemon then going on alone
within its own budget, logged once; one that does not read as leases (cut short by a kill during
a write is impossible: it is replaced by a rename) starts afresh.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import time
from pathlib import Path

import psutil

from prefetchd.errors import JobError
from prefetchd.master.cpushares import Claim, divide
from prefetchd.master.jobdir import ensure_private_dir
from prefetchd_client.folders import is_private

log = logging.getLogger("prefetchd")

FOLDER = ".cpus"
_LEASES, _LOCK = "leases.json", "lock"
SETTLE_S = 0.2  # how often a daemon settles its lease; at most every SETTLE_WANTING_S while it wants more
SETTLE_WANTING_S = 0.04  # under the loop's tick: a wanted CPU is asked for every turn
_LOCK_WAIT_S = 0.05  # one try at the lock; a daemon that cannot get it keeps its lease until the next
_MAX_BYTES = 1 << 20  # leases of thousands of jobs; more is no file of ours
_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_ENTRY = {"pid": int, "started": float, "job": str, "lease": int, "busy": int, "demand": int, "starving": bool}


class Refused(Exception):
    """The budget's files cannot be used (not a plain file of ours): the daemon goes on alone."""


class NodeBudget:
    def __init__(self, root: Path, cpus: int, weight: float, job: str):
        self.root, self.cpus, self.weight, self.job = root, cpus, weight, job
        me = psutil.Process()
        self.pid, self.started = me.pid, round(me.create_time(), 3)
        self.lease = 0
        self.jobs = 1  # daemons sharing the budget, at the last settle
        self.refused: str | None = None  # why the files are not used (then alone, within ``cpus``)
        self._next = self._last = 0.0  # the next settle due, the last one made

    @property
    def key(self) -> str:
        return f"{self.pid}-{self.started}"

    def settle(self, now: float, busy: int, demand: int, starving: bool) -> int:
        """This daemon's lease after this turn: how many of its workers may be busy."""
        wanting = demand > self.lease  # asked for at once (a tick apart): a task waits on it
        if now < self._next and not (wanting and now >= self._last + SETTLE_WANTING_S):
            return self.lease
        self._next, self._last = now + SETTLE_S, now
        if self.refused is not None:
            self.lease = max(busy, min(self.cpus, demand))
            return self.lease
        try:
            with self._locked() as folder:
                if folder is None:
                    return self.lease  # another daemon is settling: this one keeps its lease for now
                others = {k: e for k, e in self._read(folder).items() if k != self.key and _alive(e)}
                mine = Claim(self.key, demand, starving, self.weight)
                claims = [Claim(k, e["demand"], e["starving"], e.get("weight", 1.0)) for k, e in others.items()]
                share = divide([*claims, mine], self.cpus)[self.key]
                room = self.cpus - sum(e["lease"] for e in others.values())
                self.lease = max(busy, min(share, room))  # grow into free CPUs only; shrink as workers finish
                self.jobs = 1 + len(others)
                entry = {"pid": self.pid, "started": self.started, "job": self.job, "lease": self.lease}
                entry |= {"busy": busy, "demand": demand, "starving": starving, "weight": self.weight}
                self._write(folder, {**others, self.key: entry})
        except (Refused, JobError) as exc:
            self.refused = str(exc)
            log.warning("the node's CPU budget is not shared: %s; this job keeps to --node-cpus %d alone",
                        exc, self.cpus)
            self.lease = max(busy, min(self.cpus, demand))
        return self.lease

    def leave(self) -> None:
        """Give the lease back (the daemon stops); best effort: a dead daemon's lapses anyway."""
        if self.refused is not None:
            return
        with contextlib.suppress(Refused, JobError, OSError), self._locked(wait_s=1.0) as folder:
            if folder is not None:
                self._write(folder, {k: e for k, e in self._read(folder).items() if k != self.key})

    def snapshot(self) -> dict:
        return {"cpus": self.cpus, "lease": self.lease, "jobs": self.jobs, "weight": self.weight,
                "refused": self.refused}

    @contextlib.contextmanager
    def _locked(self, wait_s: float = _LOCK_WAIT_S):
        """The budget's folder (a descriptor) with its lock held, or None when the lock stayed busy."""
        folder = ensure_private_dir(self.root / FOLDER, "CPU budget folder")
        try:
            lock = _open_ours(_LOCK, os.O_RDWR | os.O_CREAT, folder)
            try:
                deadline = time.monotonic() + wait_s
                while True:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            yield None
                            return
                        time.sleep(0.002)
                yield folder
            finally:
                os.close(lock)  # the lock goes with it
        finally:
            os.close(folder)

    def _read(self, folder: int) -> dict[str, dict]:
        """The leases in the file; none when it is absent or does not read as leases."""
        try:
            fd = _open_ours(_LEASES, os.O_RDONLY, folder)
        except FileNotFoundError:
            return {}
        try:
            data = os.read(fd, _MAX_BYTES + 1)
        finally:
            os.close(fd)
        try:
            leases = json.loads(data) if len(data) <= _MAX_BYTES else None
        except (ValueError, RecursionError):
            leases = None
        if not isinstance(leases, dict):
            log.warning("the CPU budget's leases did not read as leases; starting them afresh")
            return {}
        return {k: e for k, e in leases.items() if _is_entry(e) and k == f"{e['pid']}-{e['started']}"}

    def _write(self, folder: int, leases: dict[str, dict]) -> None:
        """All at once: a new file renamed over the old, so a kill mid-write leaves the old whole."""
        tmp = f"{_LEASES}.{self.pid}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _FLAGS, 0o600, dir_fd=folder)
        try:
            os.write(fd, json.dumps(leases).encode())
        finally:
            os.close(fd)
        os.rename(tmp, _LEASES, src_dir_fd=folder, dst_dir_fd=folder)


def _open_ours(name: str, flags: int, folder: int) -> int:
    """A plain file of ours in the budget's folder; Refused for anything else."""
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
    weight = entry.get("weight", 1.0)
    return (
        type(weight) in (int, float)
        and 0 < weight < 1e6
        and all(0 <= entry[k] < 1 << 20 for k in ("lease", "busy", "demand"))
        and 0 < entry["pid"] < 1 << 31
    )


def _alive(entry: dict) -> bool:
    """Whether the lease's daemon still runs: that pid, started then (not a reused pid)."""
    try:
        process = psutil.Process(entry["pid"])
        return abs(process.create_time() - entry["started"]) < 0.01 and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
