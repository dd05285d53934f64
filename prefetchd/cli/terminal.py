"""How the command speaks to a terminal: what it prints from data (file names, a reader's words,
a daemon's stop reason) is shown as it is, never acted on: control characters escaped
(prefetchd_client.text), rich markup and emoji codes printed literally, messages bounded.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from rich.console import Console
from rich.markup import escape

from prefetchd.errors import MAX_MESSAGE_CHARS
from prefetchd.logsetup import escape_terminal_records
from prefetchd_client.text import printable

_TERMINAL_CELLS = range(20, 10_001)  # COLUMNS or LINES outside: no table fits, or no screen is that big


def prepare_terminal() -> None:
    """Before any console (ours, typer's help's) reads them: drop a COLUMNS or LINES rich cannot use
    (it prints nothing at 0, pads lines to 99999999999, raises on ²), so it follows the terminal,
    80 x 25 without one; a name a non-UTF-8 terminal cannot encode shows as \\u65e5, not a crash."""
    for name in ("COLUMNS", "LINES"):
        value = os.environ.get(name, "20")
        if not (value.isascii() and value.isdigit() and len(value) <= 5 and int(value) in _TERMINAL_CELLS):
            del os.environ[name]
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):  # not a TextIOWrapper, or closed
            stream.reconfigure(errors="backslashreplace")
    escape_terminal_records()  # this process's own log records and warnings name data too


prepare_terminal()
# soft_wrap: never break a path across lines; emoji=False: rich would show a name holding ":fire:"
# as an emoji (markup that rich.markup.escape does not escape), and data prints as it is.
err = Console(stderr=True, soft_wrap=True, emoji=False)
out = Console(soft_wrap=True, emoji=False)


def literal(text: object) -> str:
    """``text`` shown as it is by a rich print: printable (prefetchd_client.text), not markup."""
    return escape(printable(text))


_TAIL_CHARS = 400  # of a message cut short: its end says how to fix it (at most 10 shown characters each)


def bounded(message: str) -> str:
    """``message`` made printable, and at most MAX_MESSAGE_CHARS long (a daemon's stop reason's
    bound): a 2 MB config key quoted whole took seconds to print. The head and the end are kept;
    no escape is cut in half."""
    shown = printable(message)
    if len(shown) <= MAX_MESSAGE_CHARS:
        return shown
    cut = " [... cut here] "
    head = printable(message[:-_TAIL_CHARS], MAX_MESSAGE_CHARS - 10 * _TAIL_CHARS - len(cut) - 3)
    return head + cut + printable(message[-_TAIL_CHARS:])


PROGRESS_EVERY_S = 2.0  # a progress line this often when the output is not a terminal


@contextlib.contextmanager
def progress(console: Console, what: str):
    """A ``report(done, total, info="")`` for a long step: a bar on a terminal; elsewhere (a pipe,
    a log file) a line every PROGRESS_EVERY_S and at the end, where rich would show nothing until then."""
    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        info = TextColumn("{task.fields[info]}")
        columns = (TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), info)
        with Progress(*columns, console=console) as bar:
            task = bar.add_task(what, total=None, info="")
            yield lambda done, total, info="": bar.update(task, completed=done, total=total, info=info)
        return
    last = [0.0]

    def line(done: int, total: int, info: str = "") -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S or done == total:
            last[0] = now
            console.print(f"{what}: {done} of {total}" + (f", {info}" if info else ""), highlight=False)

    yield line
