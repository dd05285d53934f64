"""Errors a user can act on, and the one list of the exit codes they end in.

Every exception here carries a message that names what went wrong, the file or flag
involved, and how to fix it. The CLI prints the message (never a traceback) and exits
with the error's exit code.
"""

from enum import IntEnum


class ExitCode(IntEnum):
    """Every non-zero exit of ``prefetchd`` and of its daemon, in one place."""

    OK = 0
    USER = 1  # a problem the user can fix (the generic one)
    CONFIG = 2  # the config file or a flag is invalid
    DATA = 3  # the data is missing, empty or unreadable
    JOB = 4  # the job directory, its lock or its daemon blocks the request
    WORKER_BOOT = 5  # a worker could not start (an import, the [pipeline] callable)
    SAMPLE_ERROR = 6  # a sample could not be read under on_error = "fail"
    WORKER_CRASHES = 7  # workers died faster than --max-worker-restarts, or one batch kills its worker
    TASK_ERROR = 8  # a batch failed, or hung, too many times
    BAD_DATA = 9  # too many unreadable samples: the data, not a sample, is broken
    INTERNAL = 70  # a bug or an unforeseen failure (BSD's EX_SOFTWARE), named by its exception


class UserError(Exception):
    """A problem the user can fix; the message says how."""

    exit_code = ExitCode.USER


class ConfigError(UserError):
    """The config file or a flag is invalid."""

    exit_code = ExitCode.CONFIG


class DataError(UserError):
    """The data a source points at is missing, empty or unreadable."""

    exit_code = ExitCode.DATA


class JobError(UserError):
    """The job directory, its lock or its daemon is in a state that blocks the request."""

    exit_code = ExitCode.JOB


class DaemonStop(Exception):
    """Stops the daemon with a message and a named exit code (ExitCode.OK for a requested stop)."""

    def __init__(self, message: str, exit_code: ExitCode):
        super().__init__(message)
        self.exit_code = exit_code
