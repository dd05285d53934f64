"""How a node's CPU budget is divided between the jobs that share it (``--node-cpus``). Pure: the
daemons each compute the same division from the same leases (master/cpubudget.py reads and
writes them), so no process has to be the one that decides.

A job asks for ``demand`` workers (what it could keep busy now) and says whether one of its
trainers *starves* (waits for a batch). The budget goes to starving jobs first, then to the rest;
within each tier by weighted max-min fairness: one CPU at a time to the job with the fewest per
unit of ``weight`` among those that want more, so equal weights get equal shares when all want
more than their share, and what a job does not want goes to the others.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    key: str  # the job's lease: its daemon's pid and start time
    demand: int  # workers it could keep busy now
    starving: bool  # a trainer of it waits for a batch
    weight: float = 1.0  # --cpu-weight


def divide(claims: list[Claim], cpus: int) -> dict[str, int]:
    """Each claim's share of ``cpus`` (keys as given; 0 for a claim that wants none)."""
    shares = {c.key: 0 for c in claims}
    left = cpus
    for tier in ([c for c in claims if c.starving], [c for c in claims if not c.starving]):
        wanting = sorted((c for c in tier if c.demand > 0), key=lambda c: c.key)
        while left > 0 and wanting:
            # The fewest per unit of weight first; ties by key, so every daemon divides alike.
            claim = min(wanting, key=lambda c: (shares[c.key] / c.weight, c.key))
            shares[claim.key] += 1
            left -= 1
            if shares[claim.key] >= claim.demand:
                wanting.remove(claim)
    return shares
