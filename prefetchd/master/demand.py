"""What the demand seen each turn asks of the workers: with ``--workers auto`` how many there are
(master/autoscale.py), with ``--ray-workers auto`` how many batches may be in flight on the Ray
cluster (the same policy: its slots beyond that are parked, holding no task and no cluster CPU),
and with a node CPU budget how many may be busy (master/cpubudget.py). The master's loop asks
it once a turn and before each task it hands out.

A job takes part in the node's budget with ``--workers auto`` (the budget then defaults to the
node's cores - 1) or whenever ``--node-cpus`` is given; a fixed ``--workers N`` without it keeps
its N workers to itself, as before budgets existed. Ray's slots make batches on the cluster's
CPUs, not the node's: the budget counts local workers only.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefetchd.config import Config
from prefetchd.master.autoscale import AutoWorkers
from prefetchd.master.cpubudget import NodeBudget
from prefetchd.master.cpushares import MAX_RUNWAY_S
from prefetchd.master.pool import WorkerPool
from prefetchd.master.scheduler import Scheduler
from prefetchd.ops.status import Rates
from prefetchd.settings import default_workers

log = logging.getLogger("prefetchd")

_AHEAD_COUNTED = 256  # batches ready ahead counted for the runway: more is minutes of any trainer


class Demand:
    def __init__(self, config: Config, pool: WorkerPool, scheduler: Scheduler, root: Path, now: float):
        self.pool, self.scheduler = pool, scheduler
        self.most = config.worker_range[1]
        self.autoscale = AutoWorkers(*config.worker_range, now) if config.workers == "auto" else None
        shares = config.workers == "auto" or config.node_cpus is not None
        cpus = config.node_cpus or default_workers()
        self.budget = NodeBudget(root, cpus, config.cpu_weight, config.name) if shares else None
        ray_auto = config.executor == "ray" and config.ray_workers == "auto"
        self.ray_auto = AutoWorkers(*config.ray_range, now) if ray_auto else None

    def may_start(self, busy: int, now: float) -> bool:
        """Whether a local worker may take a task while ``busy`` of them make one: within the
        CPUs the budget allows now (a lease beyond it is given back as those workers finish)."""
        return self.budget is None or busy < self.budget.allowed and self.budget.fresh(now)

    def may_send_to_ray(self, in_flight: int) -> bool:
        """Whether a Ray slot may take a task while ``in_flight`` are on the cluster."""
        return self.ray_auto is None or in_flight < self.ray_auto.target

    def turn(self, now: float, paused: bool, consumed: Rates) -> None:
        """``paused``: production waits (a full tmpfs, a store's outage): it asks for no CPU.
        ``consumed``: the batches the trainers took, for how long the ready ones last them."""
        if self.ray_auto is not None:
            self._ray_turn(now, paused)
        if self.budget is None and self.autoscale is None:
            return  # a fixed count of its own: nothing to look at on this path, each turn
        serving = self.pool.serving
        busy = sum(s.task is not None for s in serving)
        starving, more_work = self.scheduler.ready_ahead(1) == 0, self.scheduler.next_task() is not None
        # What it could keep busy: its workers, and with auto the one it would start next.
        demand = min(self.most, len(serving) + (self.autoscale is not None)) if more_work and not paused else busy
        if self.budget is not None and self.budget.due(now, demand):
            ahead, rate = self.scheduler.ready_ahead(_AHEAD_COUNTED), consumed.seen_per_second(now)
            runway = 0.0 if ahead == 0 else min(MAX_RUNWAY_S, ahead / rate) if rate > 0 else MAX_RUNWAY_S
            self.budget.settle(now, busy, demand, runway)
        if self.autoscale is None:
            return
        self.pool.remove_retired(now)
        before = self.autoscale.target
        more_work = more_work and self.may_start(busy, now)  # none beyond the budget's share: no growth
        target = self.autoscale.decide(now, len(serving), busy, starving, more_work)
        if target != before:
            log.info("workers: %d -> %d (%s)", before, target, self.autoscale.last_change)
        if target != len(serving):
            self.pool.resize(target, now)

    def _ray_turn(self, now: float, paused: bool) -> None:
        """--ray-workers auto: the target of batches in flight follows the demand as the local
        workers' count does; slots beyond it get no task (parked), so its change costs nothing."""
        relays = [s for s in self.pool.slots if s.kind == "ray" and s.ready]
        if not relays:
            return  # the bridge boots, or the cluster is lost
        in_flight = sum(s.task is not None for s in relays)
        starving = self.scheduler.ready_ahead(1) == 0
        more_work = not paused and self.scheduler.next_task() is not None
        before = self.ray_auto.target
        target = self.ray_auto.decide(now, min(before, len(relays)), in_flight, starving, more_work)
        if target != before:
            log.info("ray tasks in flight: %d -> %d (%s)", before, target, self.ray_auto.last_change)

    def leave(self) -> None:
        if self.budget is not None:
            self.budget.leave()

    def snapshot(self) -> tuple[dict | None, dict | None, dict | None]:
        """(the --workers auto state, the node budget's, the --ray-workers auto state) for status;
        None where not in use."""
        return (
            None if self.autoscale is None else self.autoscale.snapshot(),
            None if self.budget is None else self.budget.snapshot(),
            None if self.ray_auto is None else self.ray_auto.snapshot(),
        )
