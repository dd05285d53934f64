"""The daemon process's own setup: its log on the tmpfs, and its limit on open files."""

from __future__ import annotations

import logging
import os
import resource

from prefetchd_client.text import printable

from .errors import DaemonStop, UserError

log = logging.getLogger("prefetchd")


class _PrintableLines(logging.Formatter):
    """Each line of a record made printable (prefetchd_client.text): the log names files and
    quotes readers, and whoever reads it runs `tail -f` on a terminal. A worker's traceback
    keeps its lines."""

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(map(printable, super().format(record).split("\n")))


def log_to(path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    # backslashreplace: a line naming a file whose name is not UTF-8 must reach the log, not be lost
    handler = logging.StreamHandler(os.fdopen(fd, "a", buffering=1, errors="backslashreplace"))
    handler.setFormatter(_PrintableLines("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def log_start_failure(exc: BaseException) -> None:
    """Say in the job's log why the start failed (the log stays when the job folder was there
    before); an unforeseen error with its traceback. Nothing before the log is open: with no
    handler, logging would print the traceback on a foreground terminal."""
    if not log.handlers:
        return
    if isinstance(exc, UserError | DaemonStop):
        log.error("stopped: start-up failed: %s", exc)
    elif isinstance(exc, Exception):
        log.error("start-up failed on an internal error", exc_info=exc)
    else:
        log.error("start-up interrupted (%s)", type(exc).__name__)


def raise_descriptor_limit() -> None:
    """Raise the soft limit on open files to the hard one: peers' connections (each a
    descriptor) must not run the master out of them at the common soft limit of 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return
        log.info("open-file limit raised from %d to %d", soft, hard)
