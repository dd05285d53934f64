"""How a node's CPU budget is divided between the jobs that share it (``--node-cpus``). Pure: the
daemons each compute the same division from the same leases (master/cpubudget.py reads and
writes them), so no process has to be the one that decides.

A job asks for ``demand`` workers (what it could keep busy now) and says how many batches its
trainers have ready ahead (``ahead``, the fewest over its ranks). The budget goes first to the
jobs whose trainers wait or are about to (fewer than LOW_AHEAD ahead), then to the rest (filling
windows). The first tier is one, not "waiting now" before "about to": a trainer that always
waits (production-bound) would otherwise keep every CPU from a slow one, which would then wait
at every step for a batch made only once it waits. Within each tier by weighted max-min
fairness: one CPU at a time to the job with the fewest per unit of ``weight`` among those that
want more, so equal weights get equal shares when all want more than their share, and what a job
does not want goes to the others. Where that ties (more jobs want a CPU than there are CPUs),
the job that has had the least CPU time per unit of weight (``used``) goes first: jobs take
turns, batch by batch, instead of one of them forever.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

LOW_AHEAD = 2  # fewer batches ready ahead than this: served before windows are filled


@dataclass(frozen=True)
class Claim:
    key: str  # the job's lease: its daemon's pid and start time
    demand: int  # workers it could keep busy now
    ahead: int  # batches ready ahead of its trainers, the fewest over its ranks (0: one waits)
    weight: float = 1.0  # --cpu-weight
    used: float = 0.0  # CPU-seconds leased so far


def divide(claims: list[Claim], cpus: int) -> dict[str, int]:
    """Each claim's share of ``cpus`` (keys as given; 0 for a claim that wants none). O(cpus log jobs)."""
    shares = {c.key: 0 for c in claims}
    left = cpus
    for tier in ([c for c in claims if c.ahead < LOW_AHEAD], [c for c in claims if c.ahead >= LOW_AHEAD]):
        # The fewest per unit of weight first, then the least used; ties by key: every daemon divides alike.
        heap = [(0.0, c.used / c.weight, c.key, c) for c in tier if c.demand > 0]
        heapq.heapify(heap)
        while left > 0 and heap:
            _, used, key, claim = heapq.heappop(heap)
            shares[key] += 1
            left -= 1
            if shares[key] < claim.demand:
                heapq.heappush(heap, (shares[key] / claim.weight, used, key, claim))
    return shares
