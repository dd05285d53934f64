"""How a node's CPU budget is divided between the jobs that share it (``--node-cpus``). Pure: the
daemons each compute the same division from the same leases (master/cpubudget.py reads and
writes them), so no process has to be the one that decides.

A job asks for ``demand`` workers (what it could keep busy now) and says how long its trainers
can go on with the batches ready (``runway_s``: the fewest ready ahead over its ranks, at the
rate its trainers consume them; 0 when one waits). The budget goes first to the jobs whose
runway is under LOW_RUNWAY_S (waiting, or soon), then to the rest (filling windows nobody needs
yet). Waiting now is not a tier before "soon": a trainer that always waits (production-bound)
would otherwise keep every CPU from a slow one, which would then wait at every step for a batch
made only once it waits; and a fast trainer two batches ahead is sooner than a slow one ten
batches ahead, which counting batches would not see. Within each tier by weighted max-min
fairness: one CPU at a time to the job with the fewest per unit of ``weight`` among those that
want more, so equal weights get equal shares when all want more than their share, and what a job
does not want goes to the others. Where that ties (more jobs want a CPU than there are CPUs),
the job that has had the least CPU time per unit of weight (``used``) goes first: jobs take
turns, batch by batch, instead of one of them forever.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

LOW_RUNWAY_S = 2.0  # trainers that would wait within this: served before windows are filled
MAX_RUNWAY_S = 1e6  # what "no trainer consumes" counts as (JSON has no infinity)


@dataclass(frozen=True)
class Claim:
    key: str  # the job's lease: its daemon's pid and start time
    demand: int  # workers it could keep busy now
    runway_s: float  # how long its trainers can go on with the batches ready (0: one waits)
    weight: float = 1.0  # --cpu-weight
    used: float = 0.0  # CPU-seconds leased so far


def divide(claims: list[Claim], cpus: int) -> dict[str, int]:
    """Each claim's share of ``cpus`` (keys as given; 0 for a claim that wants none). O(cpus log jobs)."""
    shares = {c.key: 0 for c in claims}
    left = cpus
    for tier in ([c for c in claims if c.runway_s < LOW_RUNWAY_S], [c for c in claims if c.runway_s >= LOW_RUNWAY_S]):
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
