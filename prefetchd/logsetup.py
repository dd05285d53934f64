"""The daemon process's own setup: its log on the tmpfs, and its limit on open files."""

from __future__ import annotations

import logging
import os
import sys

from prefetchd.errors import DaemonStop, UserError
from prefetchd_client.text import printable

log = logging.getLogger("prefetchd")


class _PrintableLines(logging.Formatter):
    """Each line of a record made printable (prefetchd_client.text): the log names files and
    quotes readers, and whoever reads it runs `tail -f` on a terminal. A worker's traceback
    keeps its lines."""

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(map(printable, super().format(record).split("\n")))


class _PrintableToStderr(logging.Handler):
    """Each record's lines made printable, to the stderr of the moment (as logging's own last
    resort writes: a test or a redirect may replace sys.stderr)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


_TERMINAL = _PrintableToStderr(logging.WARNING)
_TERMINAL.setFormatter(_PrintableLines("%(message)s"))


def escape_terminal_records() -> None:
    """Whatever reaches stderr through logging made printable. The CLI's own process (`verify`,
    `pack`, a foreground start before its log is open) has no handler: logging's last resort
    would print a record naming a shard member raw on the terminal, and warnings.warn prints a
    library's message (Pillow's, pyarrow's) raw; a detached daemon's stderr is daemon.log. Both
    go through a handler that makes each line printable, as daemon.log's own lines are."""
    logging.lastResort = _TERMINAL  # documented as settable: the handler of records no handler took
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger (which would drop them unhandled)
    warnings_log = logging.getLogger("py.warnings")
    if _TERMINAL not in warnings_log.handlers:
        warnings_log.addHandler(_TERMINAL)


def log_to(path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    # backslashreplace: a line naming a file whose name is not UTF-8 must reach the log, not be lost
    handler = logging.StreamHandler(os.fdopen(fd, "a", buffering=1, errors="backslashreplace"))
    handler.setFormatter(_PrintableLines("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    # A detached daemon's stderr becomes this log (daemon.serve): warnings and other loggers'
    # records written there must be printable lines too.
    escape_terminal_records()


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
