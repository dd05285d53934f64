"""The node's CPU budget (``--node-cpus``), shared by the daemons of one root with no process of
its own: each keeps a lease in a file under the root (master/leasefile.py), and a few times a
second, under its lock, reads everyone's, divides the budget by demand (master/cpushares.py:
the same division in every daemon) and takes its share: at once from CPUs nobody leases, from its
own lease only as its busy workers finish. So the leases never add up to more than the budget,
and no daemon has more workers busy than its lease: at no moment are more than ``cpus`` workers
of these jobs busy. A daemon killed with -9 (its workers die with it) loses its lease at the
others' next settle. Lease files that are not ours are refused: the daemon then goes on alone,
within its own budget, logged once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

from prefetchd.errors import JobError
from prefetchd.master import leasefile
from prefetchd.master.cpushares import Claim, divide

log = logging.getLogger("prefetchd")

SETTLE_S = 0.2  # how often a daemon settles its lease; at most every SETTLE_WANTING_S while it wants more
SETTLE_WANTING_S = 0.04  # under the loop's tick: a wanted CPU is asked for every turn
_LOCK_WAIT_S = 0.05  # one try at the lock; a daemon that cannot get it keeps its lease until the next
_LOCK_STUCK_S = 2.0  # a lock taken this long is no settle: the daemon holding it is stopped or hung
REFUSED_ALONE_S = 10.0  # leases that cannot be settled this long: the daemon goes on alone within --node-cpus
# A lease not settled for this long is a stopped daemon's (SIGSTOP; a live one settles every
# SETTLE_S): it counts for nothing, and that daemon, resumed, starts no batch before it settles.
STALE_S = 5.0
USED_TAU_S = 2.0  # the CPU time that breaks ties is the last few seconds': a new job does not win for long


class NodeBudget:
    def __init__(self, root: Path, cpus: int, weight: float, job: str):
        self.root, self.cpus, self.weight, self.job = root, cpus, weight, job
        import psutil  # only with --node-cpus: not on every daemon's start

        me = psutil.Process()
        self.pid, self.started = me.pid, round(me.create_time(), 3)
        self.key = leasefile.key_of(self.pid, self.started)
        self.allowed = 0  # workers it may keep busy: its share, within the CPUs nobody else leases
        self.lease = 0  # what the file says it holds: allowed, or more while busy workers finish
        self.used = 0.0  # CPU-seconds leased lately (decaying over USED_TAU_S): turns, when CPUs are fewer than jobs
        self.jobs = 1  # daemons sharing the budget, at the last settle
        self.refused: str | None = None  # why the files cannot be used now (None: shared)
        self._shared = False  # shared at least once: a later refusal keeps what it had
        self._refused_since = 0.0
        self._lock_busy_since = 0.0  # when a settle first found the lock taken, 0: it did not
        self._distrust_until = 0.0  # after leases that did not read: no growth until each daemon wrote again
        self._next = self._last = 0.0  # the next settle due, the last one made
        self._settled_at = float("-inf")  # the last settle that decided ``allowed`` (shared or alone)
        self._seen: dict[str, dict] = {}  # the others' leases at the last settle

    def due(self, now: float, demand: int) -> bool:
        """Whether to settle now: every SETTLE_S, or every SETTLE_WANTING_S while it wants more
        than it is allowed (a task waits on it)."""
        return now >= self._next or demand > self.allowed and now >= self._last + SETTLE_WANTING_S

    def fresh(self, now: float) -> bool:
        """Whether ``allowed`` is recent enough to start a task on: not after a stop (SIGSTOP)
        during which the others may have taken the CPUs this daemon's lease no longer shows."""
        return now - self._settled_at <= STALE_S / 2

    def settle(self, now: float, busy: int, demand: int, runway_s: float) -> None:
        """Settle this daemon's lease with the others'; ``allowed`` is then what it may keep busy."""
        if self._last:
            decay = math.exp(-(now - self._last) / USED_TAU_S)
            self.used = self.used * decay + self.lease * USED_TAU_S * (1 - decay)
        self._next, self._last = now + SETTLE_S, now
        try:
            with leasefile.locked(self.root, _LOCK_WAIT_S) as folder:
                if folder is None:  # another daemon is settling, or one stopped while it held the lock
                    self._lock_busy_since = self._lock_busy_since or now
                    if now - self._lock_busy_since > _LOCK_STUCK_S:
                        self._stay(now, busy, demand, f"another process has held its lock for over {_LOCK_STUCK_S:g} s")
                    return
                self._lock_busy_since = 0.0
                leases, readable = leasefile.read_live(folder, self.root)
                if not readable:  # the others' leases are unknown until each writes again: take no more
                    log.warning("the CPU budget's leases did not read as leases; they are written afresh")
                    self._distrust_until = now + 2 * SETTLE_S
                others = {k: e for k, e in leases.items() if k != self.key}
                lost = {k: e for k, e in self._seen.items() if k not in others and leasefile.alive(e, self.root)}
                if lost:  # leases of running daemons gone from the file (removed, emptied): as they were
                    others |= lost
                    self._distrust_until = now + 2 * SETTLE_S
                self._seen = others
                wall = time.time()
                live = {k: e for k, e in others.items() if wall - e["at"] <= STALE_S}  # not stopped (SIGSTOP)
                claims = [Claim(k, e["demand"], e["runway_s"], e["weight"], e["used"]) for k, e in live.items()]
                share = divide([*claims, Claim(self.key, demand, runway_s, self.weight, self.used)], self.cpus)
                allowed = min(share[self.key], self.cpus - sum(e["lease"] for e in live.values()))
                self.allowed = max(0, min(allowed, self.allowed) if now < self._distrust_until else allowed)
                self.lease = max(busy, self.allowed)  # busy workers beyond it finish their batch first
                self.jobs = 1 + len(others)
                entry = {"pid": self.pid, "started": self.started, "job": self.job, "lease": self.lease, "at": wall}
                entry |= {"busy": busy, "demand": demand, "runway_s": round(runway_s, 3), "weight": self.weight}
                leasefile.write(folder, {**others, self.key: entry | {"used": round(self.used, 3)}})
        except (leasefile.Refused, JobError, OSError) as exc:
            self._stay(now, busy, demand, str(exc))
            return
        if self.refused is not None:
            log.info("the node's CPU budget is shared again")
        self.refused, self._shared, self._settled_at = None, True, now

    def _stay(self, now: float, busy: int, demand: int, why: str) -> None:
        """The leases cannot be settled now (their files refused, a full filesystem, a lock held):
        a daemon that shared keeps what it had, taking no more, for REFUSED_ALONE_S; one that
        never could, or past that, goes on alone within ``cpus``. Tried again at each settle."""
        if self.refused is None:
            self._refused_since = now
            log.warning("the node's CPU budget cannot be settled (%s); trying again", why)
        self.refused = why
        if not self._shared or now - self._refused_since > REFUSED_ALONE_S:
            self.allowed = min(self.cpus, demand)
        self.lease = max(busy, self.allowed)
        self._settled_at = now  # decided, on what it had or alone

    def leave(self) -> None:
        """Give the lease back (the daemon stops); best effort: a dead daemon's lapses anyway."""
        with contextlib.suppress(leasefile.Refused, JobError, OSError), leasefile.locked(self.root, 1.0) as folder:
            if folder is not None:
                leases, _ = leasefile.read_live(folder, self.root)
                leasefile.write(folder, {k: e for k, e in leases.items() if k != self.key})

    def snapshot(self) -> dict:
        return {
            "cpus": self.cpus, "lease": self.lease, "allowed": self.allowed, "jobs": self.jobs, "weight": self.weight,
            "refused": self.refused,
        }
