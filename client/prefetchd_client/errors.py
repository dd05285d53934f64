"""Errors the client raises. Each message says what went wrong and how to fix it."""

from .text import printable


class PrefetchError(RuntimeError):
    """Base class of every error the client raises on purpose.

    Its message is made printable (prefetchd_client.text) here, once for every kind: messages
    quote file names, a daemon's stop reason and a manifest's values, which are data, and a
    trainer's log or terminal shows them."""

    def __init__(self, message: object = "", *args: object):
        super().__init__(printable(message), *args)


class JobNotRunning(PrefetchError):
    """No daemon serves the requested job."""


class DaemonDied(PrefetchError):
    """The daemon stopped on an error (named in the message), or died, before or while the
    client waited for a batch."""


class BatchTimeout(PrefetchError, TimeoutError):
    """A batch did not appear within the client's timeout."""


class PlanMismatch(PrefetchError):
    """The client's rank, world size or state does not match the daemon's plan."""


class BatchFormatError(PrefetchError, ValueError):
    """A batch file is not a valid prefetchd batch (see prefetchd_client.batchfile)."""


class UnsafeFolder(PrefetchError):
    """A job root or job folder this user must not trust: a symlink, not a folder, another
    user's, or writable by others. Nothing in it was read, signalled or deleted."""


class AuthError(PrefetchError):
    """The job requires CURVE and this client's key is missing, unusable or not authorised."""
