"""Start-up: build every part of a job's master, or, failing, remove only what this start made."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable

import zmq

from prefetchd import control, openfiles, stopsignals
from prefetchd.config import Config
from prefetchd.errors import JobError, start_failure
from prefetchd.logsetup import log_start_failure, log_to
from prefetchd.master.buffer import Buffer
from prefetchd.master.intake import PeerIntake
from prefetchd.master.job import build_job, fit_layout, write_manifest
from prefetchd.master.jobdir import JobDir
from prefetchd.master.loop import Master
from prefetchd.master.pool import WorkerPool
from prefetchd.master.progress_watch import ProgressWatcher
from prefetchd.ops.startclock import StartClock
from prefetchd.sizes import format_size
from prefetchd.workers.spec import builtin_fields
from prefetchd_client.layout import JobPaths

log = logging.getLogger("prefetchd")


def start_master(
    config: Config,
    paths: JobPaths,
    *,
    keep: bool = False,
    announce: Callable[[], bool] | None = None,
    clock: StartClock | None = None,
) -> Master:
    """Lock the job, index the data, boot workers, bind the socket, write the manifest; the
    Master, every part built.

    A start that fails removes only what it made (JobDir.remove_what_this_start_made): a
    killed daemon's warm buffer survives a typo in --data, and its log, kept, says why.
    ``announce()``, the last step, tells `prefetchd start` the job serves; False (the command
    is gone: killed, interrupted) fails the start too: the user saw no job start, so none serves.
    ``clock`` hears each step; the log gets them once the job serves."""
    clock = clock or StartClock()
    started_at = time.time()  # status's uptime and the manifest's started_at count the start-up too
    stopsignals.check_starting()  # here and between the steps below: a stop that came undoes the start
    raised = openfiles.ensure(config)  # before anything is made: out of descriptors, nothing is undone
    jobdir = JobDir(paths)
    jobdir.note_existing()
    jobdir.acquire()  # raises without touching anything if another daemon runs
    context = pool = server = watcher = metrics = None
    try:
        context = zmq.Context()  # inside: a start that fails here still removes the folder it made
        jobdir.prepare()
        log_to(paths.log)
        if raised is not None:
            log.info("open-file limit raised from %d to %d", *raised)
        log.info("starting job %s (pid %d): %s", paths.name, os.getpid(), json.dumps(config.to_json()))
        if config.metrics is not None:  # first: a port in use or a host that does not resolve costs nothing
            from prefetchd.ops.metrics_http import (
                bind_metrics,  # http.server and prometheus_client: only with --metrics
            )

            metrics = bind_metrics(config.metrics)
        stopsignals.check_starting()
        job = build_job(config, paths)
        clock.mark("indexed")
        stopsignals.check_starting()
        # The built-in pipeline's fields are known now: refuse a bad buffer before booting anything.
        known = None
        if config.pipeline is None:
            known = fit_layout(job, builtin_fields(config.batch_size, list(config.transforms), job.plan.evaluation))
        pool = WorkerPool(job)
        pool.spawn_all()
        fields = pool.await_first()  # checks for a stop while it waits
        clock.mark("first worker booted")
        layout, capacity = known or fit_layout(job, fields)
        server = control.bind_server(context, paths, config)  # ipc, or TCP by --endpoint
        buffer = Buffer(job, layout, capacity)
        # After the last step that can fail on a setting (the bind): adoption deletes the
        # leftovers of another plan, which a start that then failed must not have cost.
        buffer.free_retired(time.monotonic(), sweep=True)  # a previous daemon's retired batches
        buffer.adopt_leftovers()
        watcher = ProgressWatcher(paths)
        watcher.start()
        stopsignals.check_starting()  # the last check: from here on the master's loop acts on a stop
        master = Master(job, jobdir, pool, buffer, PeerIntake(job, server, watcher), context, keep, started_at)
        if metrics is not None:
            master.metrics = metrics  # its scrapes wait for the loop, which answers them from now on
            metrics.serve()
        window = buffer.scheduler.window
        write_manifest(
            job, layout, window=window, endpoint=server.endpoint, curve_public_key=server.public_key,
            started_at=master.started_at,
        )
        log.info(
            "serving: %d batches/epoch/rank of %s, window %d batches/rank, bound %s",
            job.plan.batches_per_epoch,
            format_size(layout.size),
            window,
            format_size(config.buffer_bytes),
        )
        clock.mark("serving")
        log.info(clock.log_line())
        if announce is not None and not announce():
            raise JobError("`prefetchd start` ended (killed, interrupted) before the job served: the start is undone")
        return master
    except BaseException as exc:
        log_start_failure(exc)
        closers = (metrics and metrics.close, pool and pool.halt, watcher and watcher.stop, server and server.close)
        for close in (*closers, context and context.term):
            if close:
                close()
        try:
            jobdir.remove_what_this_start_made(start_failure(exc, paths.log))
        except OSError as cleanup:  # never hide why the start failed behind this
            log.warning("could not remove what the failed start made: %s", cleanup)
        jobdir.release()
        raise
