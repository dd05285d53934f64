"""Leaving a process without the interpreter's teardown.

Freeing numpy, typer's pydantic and the rest module by module takes ~100 ms at the end of a
command, a tenth of `prefetchd start`; a forked daemon must not unwind into the command's code it
was forked from. Neither needs the teardown: only what these exit hooks do.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush the logs and stdio, run multiprocessing's exit hooks (they remove a fork server's
    $TMPDIR/pymp-* folder), then end the process with ``code``."""
    logging = sys.modules.get("logging")
    if logging is not None:
        logging.shutdown()
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        mp_util._run_finalizers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed (`prefetchd status | head`), or None
            stream.flush()
    os._exit(code)
