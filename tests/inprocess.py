"""An in-process master for wiring tests: the daemon's real parts built by the test's own process.

`prefetchd start` costs a test about 2.2 CPU-seconds before the first batch (the command's
interpreter and imports, the daemon's, the worker server's preload) and `prefetchd stop` 0.7
more; on this 2-core machine that was most of the suite's time. Here startup.start_master builds
the same parts a daemon builds (the locked job folder, the index, workers forked from the real
worker server, the buffer, the control socket, the progress watcher) and the master's loop runs
on a thread, so a test pays only for its batches. The worker server is started once per test
process and serves every in-process job; it dies with that process (workerserver.py).

What stays on a real daemon (conftest.start_job): a test of the command itself (its messages,
exit codes, flags), of signals and kills, of the daemon's pid, process tree, umask or service
manager, and of anything a test must see survive the test process. A job started here must not
be stopped by `prefetchd stop`: the process holding its lock is the test's. Two jobs serving at
once share the process's "prefetchd" logger, so each one's log also holds the other's lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prefetchd.config import load_config
from prefetchd.errors import DaemonStop, ExitCode
from prefetchd.master.loop import Master
from prefetchd.master.startup import start_master
from prefetchd.workers import workerserver
from prefetchd_client.layout import JobPaths

_STOP_TIMEOUT_S = 30.0  # the loop's tick is 50 ms and halting workers takes at most a few seconds


@dataclass
class InProcessJob:
    master: Master
    paths: JobPaths
    thread: threading.Thread

    @property
    def exit_code(self) -> int | None:
        """The master's exit code once its loop ended (a stop it decided itself: a bad-sample
        budget spent, a worker that cannot start), else None."""
        return None if self.thread.is_alive() or self.master.stop_reason is None else self.master.stop_reason.exit_code

    def wait_stopped(self, timeout_s: float) -> DaemonStop:
        """Wait for the master to stop on its own; why it stopped."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the master did not stop within {timeout_s} s"
        assert self.master.stop_reason is not None
        return self.master.stop_reason

    def stop(self, keep: bool = False) -> None:
        """What `prefetchd stop [--keep]` asks of the loop, without the command's process."""
        if self.thread.is_alive():
            self.master.keep = self.master.keep or keep
            if self.master.stop_reason is None:
                self.master.stop_reason = DaemonStop("stop requested", ExitCode.OK)
        self.wait_stopped(_STOP_TIMEOUT_S)


@contextlib.contextmanager
def master_in_process(
    config: Path | None, overrides: dict | None = None, *, root: Path | None = None, keep: bool = False
) -> Iterator[InProcessJob]:
    """Start the job of ``config`` (and flag ``overrides``, as `prefetchd start` takes them) in
    this process; yield it serving; stop it at the end, as `prefetchd stop` would. A start
    that fails raises what start_master raised (a UserError: its message and exit code)."""
    workerserver.start()  # a no-op while this process's server runs
    cfg = load_config(config, overrides)
    paths = JobPaths.of(cfg.name, root)
    log = logging.getLogger("prefetchd")
    with _daemon_process_state():
        before = list(log.handlers)
        master = start_master(cfg, paths, keep=keep)
        own_log = [h for h in log.handlers if h not in before]  # this job's daemon.log (logsetup.log_to)

        def run() -> None:
            try:
                master.run()
            finally:  # as the daemon's process ends: another job of this test logs to its own file only
                for handler in own_log:
                    log.removeHandler(handler)
                    handler.close()

        thread = threading.Thread(target=run, name=f"master-{cfg.name}", daemon=True)
        thread.start()
        job = InProcessJob(master, paths, thread)
        try:
            yield job
        finally:
            job.stop()


@contextlib.contextmanager
def _daemon_process_state() -> Iterator[None]:
    """The process-wide settings a daemon makes its own, undone for the tests that follow: the
    umask (daemon._begin), the job log's handler and the warnings it captures (logsetup.log_to)."""
    umask = os.umask(0o077)
    log = logging.getLogger("prefetchd")
    handlers, level, last_resort, propagate = list(log.handlers), log.level, logging.lastResort, log.propagate
    # A daemon's lines go to its log alone (its process has no root handler). Here pytest's would
    # take them too, and xdist cannot send a line naming a non-UTF-8 file to the controller.
    log.propagate = False
    try:
        yield
    finally:
        log.propagate = propagate
        os.umask(umask)
        for handler in log.handlers:
            if handler not in handlers:
                log.removeHandler(handler)
                handler.close()
        log.setLevel(level)
        logging.lastResort = last_resort
        logging.captureWarnings(False)
