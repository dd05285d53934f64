"""Errors a user can act on, the one list of the exit codes they end in, and the one form in
which an error crosses a process boundary.

Every exception here carries a message that names what went wrong, the file or flag
involved, and how to fix it. The CLI prints the message (never a traceback) and exits
with the error's exit code.

As data (the daemon's readiness message to ``prefetchd start``, ``<job>/stopped.json``) an
error is one JSON object, written by ``to_json`` and read back by ``error_from_json``::

    {"type": "DataError", "message": "--data /x does not exist ...", "exit_code": 3}

    type       the class name: UserError, ConfigError, DataError, JobError or DaemonStop
               (another name, from a subclass elsewhere, reads back as a UserError)
    message    at most MAX_MESSAGE_CHARS characters (to_json cuts a longer one)
    exit_code  an ExitCode; a ConfigError, DataError or JobError has its class's code, and only
               a DaemonStop ends with 0 (a requested stop)

stopped.json adds ``stopped_at`` (unix time). ``error_from_json`` checks all of that and never
raises: a dict prefetchd never writes comes back as an internal error saying what is wrong.
"""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path

from prefetchd_client.text import printable


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
    EXECUTOR_LOST = 10  # the Ray cluster was lost and no local workers were left to go on
    STORE_UNREACHABLE = 11  # an object store stayed unreachable longer than --store-timeout
    INTERNAL = 70  # a bug or an unforeseen failure (BSD's EX_SOFTWARE), named by its exception


# A message with the last line of a worker's traceback is under 2 KiB; the bound keeps a
# readiness line and stopped.json small whatever an exception's text holds.
MAX_MESSAGE_CHARS = 8192
_MAX_TYPE_CHARS = 64
_DESCRIBE_CHARS = 2000
_KEYS = {"type", "message", "exit_code"}
_OPTIONAL_KEYS = {"stopped_at"}  # stopped.json's


class UserError(Exception):
    """Ends a command, or the daemon, with a message for the user and its exit code; the
    message says how to fix what the user can fix. ``exit_code`` is the class's unless given
    (a UserError read back from another process carries the code it was sent with)."""

    exit_code = ExitCode.USER

    def __init__(self, message: str, exit_code: ExitCode | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = ExitCode(exit_code)

    def to_json(self) -> dict:
        return to_json(self)


class ConfigError(UserError):
    """The config file or a flag is invalid."""

    exit_code = ExitCode.CONFIG


class DataError(UserError):
    """The data a source points at is missing, empty or unreadable."""

    exit_code = ExitCode.DATA


class JobError(UserError):
    """The job directory, its lock or its daemon is in a state that blocks the request."""

    exit_code = ExitCode.JOB


class DaemonStop(UserError):
    """Stops the daemon with a message and a named exit code (ExitCode.OK for a requested stop).

    A UserError too: every command that ends on an error, the daemon's included, ends on a
    UserError, printed as its message with its exit code."""

    def __init__(self, message: str, exit_code: ExitCode):
        super().__init__(message, exit_code)


_TYPES: dict[str, type[UserError]] = {c.__name__: c for c in (UserError, ConfigError, DataError, JobError, DaemonStop)}


def to_json(error: UserError) -> dict:
    """``error`` as data: ``{"type", "message", "exit_code"}`` (see the module's docstring)."""
    message = str(error)
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 15] + " [... cut here]"
    return {"type": type(error).__name__, "message": message, "exit_code": int(error.exit_code)}


def error_from_json(data: object) -> UserError:
    """The error that ``to_json`` wrote, as an instance of its class (of UserError for a type
    this module does not define). Never raises: anything ``to_json`` never writes comes back
    as a DaemonStop with ExitCode.INTERNAL that says what is wrong with it."""
    problem = _problem_with(data)
    if problem is not None:
        return DaemonStop(f"internal error: an error report that prefetchd never writes: {problem}", ExitCode.INTERNAL)
    code = ExitCode(data["exit_code"])
    cls = _TYPES.get(data["type"], UserError)
    if cls is DaemonStop or cls is UserError:
        return cls(data["message"], code)
    return cls(data["message"])


def _problem_with(data: object) -> str | None:
    """Why ``data`` is not an error to_json writes; None when it is one."""
    if not isinstance(data, dict):
        return f"a {type(data).__name__}, not an object"
    keys = set(data)
    if not _KEYS <= keys or keys - _KEYS - _OPTIONAL_KEYS:
        return f"keys {sorted(map(str, keys))[:8]}, not {sorted(_KEYS)}"
    kind, message, code = data["type"], data["message"], data["exit_code"]
    if not isinstance(kind, str) or not kind.isidentifier() or len(kind) > _MAX_TYPE_CHARS:
        return f"'type' must be a class name, found {kind!r:.80}"
    if not isinstance(message, str) or len(message) > MAX_MESSAGE_CHARS:
        return f"'message' must be text of at most {MAX_MESSAGE_CHARS} characters"
    if type(code) is not int or code not in ExitCode._value2member_map_:
        return f"'exit_code' must be one of {sorted(ExitCode._value2member_map_)}, found {code!r:.40}"
    cls = _TYPES.get(kind, UserError)
    if cls not in (UserError, DaemonStop) and code != cls.exit_code:
        return f"a {kind} ends with exit code {int(cls.exit_code)}, not {code}"
    if code == ExitCode.OK and cls is not DaemonStop:
        return f"a {kind} never ends with exit code 0"
    stopped_at = data.get("stopped_at", 0.0)
    if type(stopped_at) not in (int, float) or not 0 <= stopped_at < 2**34:
        return f"'stopped_at' must be a unix time, found {stopped_at!r:.40}"
    return None


def describe(exc: BaseException, limit: int = _DESCRIBE_CHARS) -> str:
    """An exception named by its class, with its text cut to ``limit`` characters: for a
    message, not a log. One line: control characters, newlines among them, and lone
    surrogates are shown as escapes (prefetchd_client.text.printable), because a cause is
    embedded in a log line and in messages whose last line is what travels (a worker's error)."""
    try:
        text = str(exc)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a [pipeline] callable's exception may fail even at that (SystemExit too)
        text = "(its text could not be made)"
    name = printable(type(exc).__name__, _MAX_TYPE_CHARS)  # a class made at run time may be named anything
    text = printable(text, max(limit - 3, 0)) if len(text) > limit else printable(text, limit)
    return f"{name}: {text}" if text else name


def start_failure(exc: BaseException, log: Path) -> UserError | None:
    """Why a start failed, as the error to report: ``exc`` itself when it is a UserError, an
    internal error naming an unforeseen exception (and ``log``, when it is there to hold the
    traceback); None for an interrupt (KeyboardInterrupt, SystemExit), which is no error."""
    if isinstance(exc, UserError):
        return exc
    if not isinstance(exc, Exception):
        return None
    where = f"; the traceback is in {log}" if log.exists() else ""
    return DaemonStop(f"internal error during start-up: {describe(exc)}{where}", ExitCode.INTERNAL)
