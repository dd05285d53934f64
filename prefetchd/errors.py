"""Errors a user can act on.

Every exception here carries a message that names what went wrong, the file or flag
involved, and how to fix it. The CLI prints the message (never a traceback) and exits
with the class's exit code.
"""


class UserError(Exception):
    """A problem the user can fix; the message says how."""

    exit_code = 1


class ConfigError(UserError):
    """The config file or a flag is invalid."""

    exit_code = 2


class DataError(UserError):
    """The data a source points at is missing, empty or unreadable."""

    exit_code = 3


class JobError(UserError):
    """The job directory, its lock or its daemon is in a state that blocks the request."""

    exit_code = 4
