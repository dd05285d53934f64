"""The master process: the event loop that ties the job's parts together. It never touches
pixels: it hands (epoch, step, rank) tasks to workers (pool), applies the positions peers report
(intake) to the buffer, asks the policies what a failure means, and stops. One thread runs the
loop; signal handlers (stopsignals) and the progress watcher only record, and the loop
dispatches. ``start_master`` (master/startup.py) builds every part before the Master exists.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time

import zmq

from prefetchd import messages, stopsignals
from prefetchd.errors import DaemonStop, ExitCode
from prefetchd.master.buffer import Buffer
from prefetchd.master.demand import Demand
from prefetchd.master.intake import PeerIntake
from prefetchd.master.job import Job
from prefetchd.master.jobdir import JobDir
from prefetchd.master.policy import BadSampleBudget, ProductionPauses, RestartBudget, TaskRetries
from prefetchd.master.pool import WorkerPool, WorkerSlot
from prefetchd.ops import scrapes, sdnotify
from prefetchd.ops.status import Rates, job_status
from prefetchd.sizes import format_size
from prefetchd_client.layout import MAX_EPOCH

log = logging.getLogger("prefetchd")

_LOOP_TICK_MS = 50
_OUT_OF_DESCRIPTORS_S = 0.5  # pause after EMFILE/ENFILE: let peers' connections time out
_DESCRIPTOR_WARNINGS_LOGGED = 10
_REPLACED_LOGGED = ("index", "path", "error", "replacement")  # of a bad sample a batch replaced


class Master:
    def __init__(
        self, job: Job, jobdir: JobDir, pool: WorkerPool, buffer: Buffer, intake: PeerIntake, context, keep: bool,
        started_at: float,
    ):
        cfg, log_path = job.config, str(job.paths.log)
        self.job, self.config, self.paths = job, cfg, job.paths
        self.jobdir, self.pool, self.buffer, self.intake = jobdir, pool, buffer, intake
        self.keep = keep
        self.started_at = started_at  # time.time() when the start began: uptime counts the start-up too
        self.stop_reason: DaemonStop | None = None
        self.restarts = RestartBudget(cfg.max_worker_restarts, log_path)
        self.retries = TaskRetries(log_path, cfg.worker_timeout)
        self.samples = BadSampleBudget(cfg.max_bad_rate, log_path)
        self.pauses = ProductionPauses(cfg.store_timeout, str(self.paths.dir))
        self.demand = Demand(cfg, pool, buffer.scheduler, job.paths.dir.parent, time.monotonic())
        self.produced = 0
        self.worker_restarts = 0  # workers that died and were replaced since the start
        self.produced_per_source = [0] * len(job.source_names)
        self.produce_rate, self.consume_rate = Rates(), Rates()
        self._context = context
        self._poller: zmq.Poller | None = None
        self._descriptor_warnings = 0
        self.metrics = scrapes.NOT_SERVED  # with --metrics, a metrics_http.MetricsServer (startup sets it)

    # -- the loop ------------------------------------------------------------------------

    def run(self, notifier: sdnotify.Notifier = sdnotify.SILENT) -> int:
        try:
            while self.stop_reason is None:
                notifier.beat()  # from this thread: a loop that hangs stops the beats (sdnotify.py)
                if (sig := stopsignals.received()) is not None:  # recorded since the start began
                    log.info("%s: stopping", sig.name)
                    self.stop_reason = DaemonStop("signal", ExitCode.OK)
                    break
                try:
                    self.run_once()
                except OSError as exc:
                    if exc.errno not in (errno.EMFILE, errno.ENFILE):
                        raise
                    self._wait_for_descriptors(exc)
        except DaemonStop as stop:
            self.stop_reason = stop
        except Exception as exc:  # a bug: log it fully, stop cleanly
            log.exception("internal error")
            self.stop_reason = DaemonStop(f"internal error: {exc!r}; see {self.paths.log}", ExitCode.INTERNAL)
        notifier.stopping(f"stopping: {self.stop_reason}")
        self.shutdown()
        return self.stop_reason.exit_code

    def run_once(self) -> None:
        """One turn of the loop: wait for something to happen (at most a tick), then act."""
        if self._poller is None or self.pool.changed:  # built again only when a worker was replaced
            self._poller = zmq.Poller()
            self._poller.register(self.intake.server.socket, zmq.POLLIN)
            for handle in self.pool.wait_handles() + self.metrics.wait_handles():  # a worker's message or death
                self._poller.register(handle, zmq.POLLIN)
            self.pool.changed = False
        self._poller.poll(_LOOP_TICK_MS)
        now = time.monotonic()
        self.intake.serve_control(self.move_position, self.answer)
        for slot in self.pool.slots:
            self._take_results(slot)
        self.pool.kill_hung(now)
        self._replace_dead_workers(now)
        self.intake.read_progress_files(self.move_position)
        self.intake.check_trainers(now, self._release_trainer)
        self.buffer.free_retired(now)
        self.assign_tasks(now)
        self.demand.turn(now, self.pauses.waiting(now), self.consume_rate)  # --workers auto, the node budget
        self.metrics.answer(self.status)  # /metrics scrapes waiting: their snapshot is taken on this thread

    def _wait_for_descriptors(self, exc: OSError) -> None:
        """Out of file descriptors (peers holding connections open, say): back off, then the turn is
        tried again (each step is safe to repeat); control.HANDSHAKE_TIMEOUT_MS gives them back."""
        self._descriptor_warnings += 1
        if self._descriptor_warnings <= _DESCRIPTOR_WARNINGS_LOGGED or self._descriptor_warnings % 100 == 0:
            n, pause = self._descriptor_warnings, _OUT_OF_DESCRIPTORS_S
            log.warning("out of file descriptors (%s; %d times so far); pausing %.1f s", exc.strerror, n, pause)
        time.sleep(_OUT_OF_DESCRIPTORS_S)

    # -- peers ---------------------------------------------------------------------------

    def move_position(self, rank: int, index: int, consumer: str) -> None:
        """Apply a trainer's position, checked against the plan by the intake."""
        now = time.monotonic()
        consumed = self.buffer.move_position(rank, index, consumer, now)
        if consumed:
            self.consume_rate.add(now, consumed)

    def answer(self, msg: dict) -> dict:
        """The reply to a control request (the ops besides position: control.py's schema)."""
        if msg["op"] == "status":
            return self.status()
        if msg["op"] == "stop":
            self.keep = self.keep or msg.get("keep", False)
            self.stop_reason = DaemonStop("stop requested", ExitCode.OK)
        return {"ok": True, "pid": os.getpid()}

    def _release_trainer(self, rank: int, consumer: str) -> None:
        """A gone trainer's place is given up (intake.check_trainers says when)."""
        now = time.monotonic()
        for index in self.buffer.scheduler.park(rank, consumer):
            self.buffer.delete(rank, index, now)
        if not any(consumer in state.positions for state in self.buffer.scheduler.ranks.values()):
            self.intake.forget_if_gone(consumer)  # its name is free once no rank keeps a place for it

    def status(self) -> dict:
        return job_status(self)

    # -- workers -------------------------------------------------------------------------

    def _take_results(self, slot: WorkerSlot) -> None:
        for msg in self.pool.receive(slot):
            if slot.task is None or msg.task != (*self.job.plan.unlinear(slot.task[1]), slot.task[0]):
                # A result counts only for the task its worker holds: a second report (a [pipeline]
                # callable that forked, and both processes went on) is dropped.
                log.warning("dropped a report from worker pid %d for a task it does not hold: %.200s", slot.pid, msg)
            elif isinstance(msg, messages.Done):
                self._on_batch_done(slot, msg)
            else:
                self._on_batch_failed(slot, msg)

    def _on_batch_done(self, slot: WorkerSlot, msg: messages.Done) -> None:
        rank, index = slot.task
        slot.task = None
        if (line := self.pauses.producing(time.monotonic())) is not None:
            log.info(line)
        for i, n in enumerate(msg.sources[: len(self.produced_per_source)]):
            self.produced_per_source[i] += n
        self._count_published(rank, index)
        for bad in msg.replaced:
            log.warning("bad sample %d (%s): %s; replaced by sample %d", *(bad[k] for k in _REPLACED_LOGGED))
        self.samples.add_batch(self.config.batch_size, msg.replaced, msg.longest_bad_run)

    def _count_published(self, rank: int, index: int) -> None:
        """A batch is in ``batches/``: into the ledger as ready, or out through the delete path."""
        self.retries.published((rank, index))
        self.produced += 1
        self.produce_rate.add(time.monotonic())
        if not self.buffer.scheduler.task_finished(rank, index):
            self.buffer.delete(rank, index, time.monotonic())  # its rank moved on (or back) while it was made

    def _on_batch_failed(self, slot: WorkerSlot, msg: messages.Failed) -> None:
        rank, index = slot.task
        slot.task = None
        self.buffer.scheduler.task_abandoned(rank, index)
        name = self.job.batch_name(rank, index)
        if msg.sample:
            log.error("bad sample in batch %s: %s", name, msg.error)
            raise DaemonStop(f"cannot read a sample: {msg.error}", ExitCode.SAMPLE_ERROR)
        if msg.nospace or msg.unreachable:  # production waits (past --store-timeout, a store's outage stops it)
            if (line := self.pauses.failed(msg, time.monotonic())) is not None:
                log.warning(line)
            return
        log.warning("batch %s failed (attempt %d):\n%s", name, self.retries.attempts_made((rank, index)) + 1, msg.error)
        self.retries.failed((rank, index), name, msg.error, time.monotonic())  # stops the daemon at the limit

    def _replace_dead_workers(self, now: float) -> None:
        """Account for each dead worker (its last reports, its files, its task, the restart
        budget), then start its replacement."""
        for slot in self.pool.newly_dead():
            self._take_results(slot)  # it may have reported before dying
            code = self.pool.bury(slot)
            if slot.task is not None:
                self._settle_unreported_task(slot)
            if self.pool.died_booting(slot, code):  # respawning would loop (a crash in an import, say)
                raise DaemonStop(
                    f"a worker exited with code {code} before it booted; see {self.paths.log}", ExitCode.WORKER_BOOT
                )
            charged = self.pool.charge_death(slot)  # once per death: a Ray bridge's slots, a fork server's workers
            if charged:
                self.restarts.note_death(now, code)
            if charged or slot.kind == "local":  # every local worker replaced, the Ray bridge once
                self.worker_restarts += 1
                log.warning("worker pid %d died (exit code %s); starting a new one", slot.pid, code)
            slot.reaped = True  # last: a turn cut short above (out of descriptors) accounts for it again
        self.pool.respawn_buried()

    def _settle_unreported_task(self, slot: WorkerSlot) -> None:
        """The task of a worker that died without reporting it. If it had published the batch
        (linked before the kill, "done" never sent), the batch counts as made: left out of the
        ledger it would be outside the bound until made again. Otherwise it is missing again,
        and the death or the hang counts against the batch (policy.TaskRetries)."""
        rank, index = slot.task
        slot.task = None
        name = self.job.batch_name(rank, index)
        try:
            published = stat.S_ISREG(os.lstat(self.paths.batch(*self.job.plan.unlinear(index), rank)).st_mode)
        except FileNotFoundError:
            published = False
        if published:
            log.info("worker pid %d published batch %s but died before reporting it; counted as made", slot.pid, name)
            self._count_published(rank, index)
            self.samples.add_unreported_batch(self.config.batch_size)
            return
        self.buffer.scheduler.task_abandoned(rank, index)
        if slot.hung:
            self.retries.hung((rank, index), name, slot.making_text())
        else:
            self.retries.died((rank, index), name, slot.process.exitcode, slot.making_text())

    def assign_tasks(self, now: float) -> None:
        if self.pauses.waiting(now):
            return
        scheduler = self.buffer.scheduler
        busy = sum(s.task is not None for s in self.pool.serving)  # local ones: the node budget's count
        on_ray = sum(s.task is not None for s in self.pool.slots if s.kind == "ray")
        for slot in self.pool.slots:
            if not slot.ready or slot.task is not None or slot.retiring is not None:
                continue
            if not (self.demand.may_start(busy, now) if slot.kind == "local" else self.demand.may_send_to_ray(on_ray)):
                continue
            task = scheduler.next_task()
            if task is None:
                if not self.buffer.make_room(now):
                    return
                task = scheduler.next_task()
                if task is None:
                    return  # its slot is still mapped by a client: freed within a tick
            if not self.retries.may_start(task, now):
                return  # the most urgent batch is backing off after a failure
            epoch, step = self.job.plan.unlinear(task[1])
            if epoch > MAX_EPOCH:  # past the last epoch a batch name can hold
                return
            spare = self.buffer.take_spare(self.paths.tmp_file(epoch, step, task[0], slot.pid))
            if self.pool.send_task(slot, *task, spare):
                scheduler.task_started(*task)
                busy += slot.kind == "local"
                on_ray += slot.kind == "ray"
                self.buffer.note_peak()

    # -- stopping ------------------------------------------------------------------------

    def shutdown(self) -> None:
        self.metrics.close()  # before the lock goes: a start right after this one finds the port free
        self.pool.halt()
        self.demand.leave()
        self.intake.close()
        self._context.term()
        peak = format_size(self.buffer.peak_bytes)
        log.info("stopped (produced %d, deleted %d, peak %s)", self.produced, self.buffer.deleted, peak)
        failed = self.stop_reason is not None and self.stop_reason.exit_code != ExitCode.OK
        left_why = False
        if failed:
            log.error("stopped: %s", self.stop_reason)
            # Before the manifest goes: a trainer that finds no manifest finds stopped.json.
            left_why = self.jobdir.write_stopped(self.stop_reason)
        if self.keep:
            self.buffer.retired.drop_spares()
            self.paths.manifest.unlink(missing_ok=True)
            self.paths.socket.unlink(missing_ok=True)
        elif failed:  # free the tmpfs, but keep the log and stopped.json that say why (`prefetchd stop` removes them)
            self.jobdir.remove(keep=[self.paths.log, self.paths.lock, self.paths.stopped])
        else:
            self.jobdir.remove()
        if failed and not left_why:  # a full tmpfs has room for it now that the batches went
            self.jobdir.write_stopped(self.stop_reason)
        self.jobdir.release()
