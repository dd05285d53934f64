"""The open-file limit (`ulimit -n`): raised to what the system allows, and checked against what a
daemon needs before anything is made.

A daemon holds about 16 descriptors of its own and 4 for each worker (a pipe each way, the
process's sentinel, its fork), then one for each trainer connection, status request and retired
batch it checks. Started under a low limit it ran out part way through its start and, out of
descriptors, could not even remove the job folder it had made (an internal error, exit 70). So
the command and the daemon both check first: the command before it reads the data, the daemon
before it takes its job folder.
"""

from __future__ import annotations

import resource

from prefetchd.errors import UserError

_BASE = 64  # the daemon's own at start (16), and room for trainers' connections and status requests
_PER_WORKER = 4


def needed(config=None) -> int:
    """Descriptors a daemon of ``config`` needs (None: one with no worker counted yet)."""
    if config is None:
        return _BASE
    writers = config.worker_range[1] + (config.ray_range[1] if config.executor == "ray" else 0)
    return _BASE + _PER_WORKER * writers


def ensure(config=None) -> tuple[int, int] | None:
    """Raise the soft limit to the hard one (peers' connections must not run the master out at
    the common soft limit of 1,024); UserError, before anything is made, when even the hard one
    is below ``needed(config)``. Returns (the soft limit it raised, the new one), or None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = needed(config)
    if hard != resource.RLIM_INFINITY and hard < need:
        fix = "raise it (ulimit -n 1024)"
        what = "a daemon"
        if config is not None:
            what, fix = f"a daemon with {(need - _BASE) // _PER_WORKER} workers", f"{fix}, or start fewer --workers"
        raise UserError(f"the open-file limit (ulimit -n) is {hard}, and {what} needs at least {need}: {fix}")
    if soft == hard:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return None
    return soft, hard
