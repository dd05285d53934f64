"""The buffer: batch files on the tmpfs, kept within the byte bound.

The Scheduler is its ledger (where each rank's consumers are, what it has ready, in flight,
consumed); this module does what the ledger decides to the files: retires consumed batches
(still counted while a client maps them), keeps a previous daemon's valid batches, measures
what the filesystem holds. Every byte the bound counts is in ``used_bytes``.
"""

from __future__ import annotations

import logging
import os

from prefetchd.master.job import Job
from prefetchd.master.retire import RetiredBatches
from prefetchd.master.scheduler import Scheduler
from prefetchd.sizes import format_size
from prefetchd.workers.spec import why_not_this_batch
from prefetchd_client.batchfile import BatchFormatError, BatchLayout, map_batch
from prefetchd_client.layout import parse_batch_name

log = logging.getLogger("prefetchd")

_RETIRED_CHECK_S = 0.05  # how often consumed batches still mapped by a client are tried again
_PINNED_WARNING_S = 30.0
_FILES_SCAN_S = 0.5  # status requests in a flood share one scan of the folders


class Buffer:
    def __init__(self, job: Job, layout: BatchLayout, capacity: int):
        self.job, self.paths, self.plan = job, job.paths, job.plan
        self.layout = layout
        self.scheduler = Scheduler(job.config.served_ranks, capacity, job.config.retain)
        self.retired = RetiredBatches(job.paths.retired_dir, job.paths.tmp_dir, layout.size)
        self.deleted = 0
        self.peak_bytes = 0
        self._next_retired_check = 0.0
        self._next_pinned_warning = 0.0
        self._files_scan = (float("-inf"), 0)  # when the files were last measured, their bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the bound in use: batches ready or being written, retired ones still mapped,
        and spares (consumed batches' files waiting to be overwritten)."""
        return (self.scheduler.held + self.retired.spares) * self.layout.size + self.retired.pinned_bytes

    def take_spare(self, path: str) -> bool:
        """Put a spare at ``path`` for the task about to start, if there is one. Every task
        started takes one when there is one: spares fill slots of the bound that no batch
        holds (``_fit_spares``), and a task that takes one keeps the bytes in use the same."""
        return self.retired.take_spare(path)

    def note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def move_position(self, rank: int, index: int, consumer: str, now: float) -> int:
        """Apply a consumer's position on a rank (already checked against the plan); the
        batches it consumed."""
        state = self.scheduler.ranks[rank]
        before = state.consumed_total
        for gone in self.scheduler.move_position(rank, index, consumer):
            self.delete(rank, gone, now)
        return state.consumed_total - before

    def delete(self, rank: int, index: int, now: float) -> None:
        epoch, step = self.plan.unlinear(index)
        if self.retired.retire(self.paths.batch_file(epoch, step, rank)):
            self.deleted += 1
            self._reserve_pinned(now)

    def make_room(self, now: float) -> bool:
        """Delete the ready batch farthest ahead when a full buffer lacks a rank's next batch
        (Scheduler.make_room); whether one was deleted."""
        gave_way = self.scheduler.make_room()
        if gave_way is None:
            return False
        self.delete(*gave_way, now)
        log.info(
            "the buffer was full with a batch missing before ready ones: deleted batch %s, the farthest ahead, "
            "to make the missing one first",
            self.job.batch_name(*gave_way),
        )
        return True

    def free_retired(self, now: float, sweep: bool = False) -> None:
        """Free the retired batches no client maps any more, and the spares no task took (a few
        times a second)."""
        if not sweep and (not (self.retired.pinned or self.retired.spares) or now < self._next_retired_check):
            return
        self.retired.drop_idle_spares(now)
        self._next_retired_check = now + _RETIRED_CHECK_S
        if sweep:
            self.retired.sweep()
        else:
            self.retired.retry_pinned()
        self._reserve_pinned(now)

    def _reserve_pinned(self, now: float) -> None:
        # A mapped batch holds its pages: whole slots of the bound stay taken until it goes.
        sched = self.scheduler
        sched.reserved = -(-self.retired.pinned_bytes // self.layout.size)
        self._fit_spares()
        self.note_peak()
        if sched.held < sched.capacity <= sched.held + sched.reserved and now >= self._next_pinned_warning:
            self._next_pinned_warning = now + _PINNED_WARNING_S
            log.warning(
                "%d consumed batches (%s) are still mapped by a trainer and count against the bound, so "
                "fewer batches are made ahead; drop references to old batches, or raise --buffer",
                len(self.retired.pinned),
                format_size(self.retired.pinned_bytes),
            )

    def _fit_spares(self) -> None:
        """Spares only fill slots of the bound that nothing else takes (the scheduler counts
        batches and pinned slots, not spares): free those past it (a leftover adopted, a
        smaller bound than the last daemon's)."""
        sched = self.scheduler
        while self.retired.spares and sched.held + sched.reserved + self.retired.spares > sched.capacity:
            self.retired.drop_spare()

    def adopt_leftovers(self) -> None:
        """Keep the valid batches a previous daemon of this job left; delete the rest.

        Valid: a name inside the plan, a header that parses, this plan's digest, this layout.
        A torn write never reaches ``batches/`` (publication is a link of a complete file).
        """
        kept = dropped = 0
        for entry in sorted(os.scandir(self.paths.batch_dir), key=lambda e: e.name):
            if self._valid_leftover(entry):
                epoch, step, rank = parse_batch_name(entry.name)
                if self.scheduler.adopt(rank, self.plan.linear(epoch, step)):
                    kept += 1
                    continue
            os.unlink(entry.path)
            dropped += 1
        self.scheduler.start_at_adopted()
        self._fit_spares()
        self.note_peak()
        if kept or dropped:
            log.info("kept %d batches from a previous daemon, deleted %d", kept, dropped)
        if kept:
            log.info(
                "kept batches are this plan's by its digest, which knows the data by its file list and a "
                "[pipeline] callable by its name: if images were rewritten in place or the callable's code "
                "changed, `prefetchd stop %s` and start again",
                self.paths.name,
            )

    def _valid_leftover(self, entry: os.DirEntry) -> bool:
        """A leftover is this plan's batch, of a rank served here (spec.why_not_this_batch)."""
        name = parse_batch_name(entry.name)
        if name is None or not entry.is_file(follow_symlinks=False):
            return False
        epoch, step, rank = name
        if step >= self.plan.batches_per_epoch or rank not in self.scheduler.ranks:  # another node's, say
            return False
        try:
            header, _ = map_batch(entry.path, pin=False)
            return why_not_this_batch(header, entry.stat().st_size, name, self.layout, self.job.spec) is None
        except (OSError, BatchFormatError):
            return False

    def files_bytes(self, now: float) -> int:
        """Blocks allocated to the buffer's files, as the filesystem reports them; each file once
        (a batch linked into batches/ still has its tmp/ name until its worker unlinks it)."""
        scanned_at, fs_bytes = self._files_scan
        if now - scanned_at < _FILES_SCAN_S:
            return fs_bytes
        fs_bytes, seen = 0, set()
        for folder in (self.paths.batch_dir, self.paths.tmp_dir, self.paths.retired_dir):
            with os.scandir(folder) as entries:
                for e in entries:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if st.st_ino not in seen:
                        seen.add(st.st_ino)
                        fs_bytes += st.st_blocks * 512
        self._files_scan = (now, fs_bytes)
        return fs_bytes
