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
from pathlib import Path

import psutil

from prefetchd.errors import JobError
from prefetchd.master import leasefile
from prefetchd.master.cpushares import Claim, divide

log = logging.getLogger("prefetchd")

SETTLE_S = 0.2  # how often a daemon settles its lease; at most every SETTLE_WANTING_S while it wants more
SETTLE_WANTING_S = 0.04  # under the loop's tick: a wanted CPU is asked for every turn
_LOCK_WAIT_S = 0.05  # one try at the lock; a daemon that cannot get it keeps its lease until the next


class NodeBudget:
    def __init__(self, root: Path, cpus: int, weight: float, job: str):
        self.root, self.cpus, self.weight, self.job = root, cpus, weight, job
        me = psutil.Process()
        self.pid, self.started = me.pid, round(me.create_time(), 3)
        self.key = leasefile.key_of(self.pid, self.started)
        self.lease = 0
        self.jobs = 1  # daemons sharing the budget, at the last settle
        self.refused: str | None = None  # why the files are not used (then alone, within ``cpus``)
        self._next = self._last = 0.0  # the next settle due, the last one made

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
            with leasefile.locked(self.root, _LOCK_WAIT_S) as folder:
                if folder is None:
                    return self.lease  # another daemon is settling: this one keeps its lease for now
                others = {k: e for k, e in leasefile.read_live(folder).items() if k != self.key}
                mine = Claim(self.key, demand, starving, self.weight)
                claims = [Claim(k, e["demand"], e["starving"], e.get("weight", 1.0)) for k, e in others.items()]
                share = divide([*claims, mine], self.cpus)[self.key]
                room = self.cpus - sum(e["lease"] for e in others.values())
                self.lease = max(busy, min(share, room))  # grow into free CPUs only; shrink as workers finish
                self.jobs = 1 + len(others)
                entry = {"pid": self.pid, "started": self.started, "job": self.job, "lease": self.lease}
                entry |= {"busy": busy, "demand": demand, "starving": starving, "weight": self.weight}
                leasefile.write(folder, {**others, self.key: entry})
        except (leasefile.Refused, JobError, OSError) as exc:
            self.refused = str(exc)
            log.warning(
                "the node's CPU budget is not shared: %s; this job keeps to --node-cpus %d alone", exc, self.cpus
            )
            self.lease = max(busy, min(self.cpus, demand))
        return self.lease

    def leave(self) -> None:
        """Give the lease back (the daemon stops); best effort: a dead daemon's lapses anyway."""
        if self.refused is not None:
            return
        with contextlib.suppress(leasefile.Refused, JobError, OSError), leasefile.locked(self.root, 1.0) as folder:
            if folder is not None:
                leasefile.write(folder, {k: e for k, e in leasefile.read_live(folder).items() if k != self.key})

    def snapshot(self) -> dict:
        return {
            "cpus": self.cpus, "lease": self.lease, "jobs": self.jobs, "weight": self.weight, "refused": self.refused
        }
