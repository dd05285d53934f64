"""Map the next batch on a thread of its own while the trainer works on this one.

A batch that is already in the buffer still costs the thread that reads it: open, lock and
map the file, check its header, wrap the arrays, and tell the daemon the new position
(~0.2-0.5 ms on a trainer whose caches went cold during its step). One ReadAhead per epoch
does that for batch k + 1 while the trainer holds batch k, so ``next(loader)`` only takes
what is waiting.

What the daemon hears is the trainer's position, never the thread's: the step the trainer
took last, sent by the thread as soon as it notices (at once when it is waiting to hand
over, within one poll, <= 5 ms, when it is waiting for a file). A small window therefore
works as without it: the daemon makes batch k + 1 once the trainer has reached it.
Errors (DaemonDied, BatchTimeout, a bad batch) travel to the trainer's thread and are raised
there, at the step they belong to.

At the end of an epoch the thread maps the next epoch's first batch too, while the trainer
holds the last one, and starts the next epoch's ReadAhead with it (a thread start costs the
starting thread 0.2-5 ms here: better this one than the trainer's); ``hand_over`` gives that
one to the loader. A new epoch starts with its first batch in hand and its reader running.
The threads hold the loader weakly (its fetch and report methods), so a loader dropped
between epochs is still collected, and its finalizer stops them.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

from .errors import BatchTimeout

_TAKE_MARGIN_S = 5.0  # beyond the loader's own timeout, which the reading thread enforces
_JOIN_S = 5.0


class Stopped(Exception):
    """Raised in the reading thread once the trainer has left the epoch."""


class ReadAhead:
    """Reads steps ``first .. n - 1`` of ``epoch`` with ``fetch(epoch, step, self)``, in order,
    then step 0 of ``epoch + 1`` for the next epoch's reader (``hand_over``); the trainer takes
    them with ``take(step)``. ``report(epoch, step)`` tells the daemon. ``mapped``: step
    ``first``, mapped already by the previous epoch's reader, which started this one.

    ``fetch`` sleeps with ``nap(seconds)`` between its looks for a file and then calls
    ``waiting(resend)``: that raises Stopped when the trainer has left, and reports a position
    the trainer reached meanwhile (or, with ``resend``, the current one again, for a daemon
    that may have restarted).
    """

    def __init__(
        self,
        fetch: Callable[[int, int, ReadAhead], object],
        report: Callable[[int, int], None],
        epoch: int,
        first: int,
        n: int,
        timeout_s: float,
        mapped: object = None,
    ):
        self._fetch, self._report = _weakly(fetch), _weakly(report)
        self._epoch, self._first, self._n = epoch, first, n
        self._timeout_s = timeout_s
        self._stopped = threading.Event()
        self._cond = threading.Condition()
        # (step, batch or exception, is_error); step n is the next epoch's step 0
        self._slot: tuple[int, object, bool] | None = None if mapped is None else (first, mapped, False)
        self._to_fetch = first if mapped is None else first + 1  # fixed here: the trainer may empty the slot at once
        self._reached = first  # the step the trainer reads: taken last, or about to be
        # A reader started ahead of its epoch stays quiet until the trainer takes a batch of
        # it: the loader reports the new epoch's start itself when the trainer gets there.
        self._sent = -1 if mapped is None else first
        self._wanted = threading.Event()  # the trainer waits for the slot: stop napping
        self._asked_at: float | None = None  # when the trainer began to wait for the empty slot
        self._thread = threading.Thread(target=self._run, name="prefetchd-readahead", daemon=True)
        self._thread.start()

    # -- the trainer's side ------------------------------------------------------------------

    def take(self, step: int):
        """The batch of ``step``: at once when it is mapped already, else when it arrives."""
        limit = self._timeout_s + _TAKE_MARGIN_S
        with self._cond:
            self._reached = step
            self._cond.notify_all()
            if self._slot is None:
                self._wanted.set()
                self._asked_at = time.monotonic()
            if not self._cond.wait_for(lambda: self._slot is not None, timeout=limit):
                raise BatchTimeout(f"the read-ahead thread gave nothing for step {step} within {limit:.0f} s")
            got, value, is_error = self._slot
            self._slot = None
            self._cond.notify_all()
        if is_error:
            raise value
        if got != step:  # a bug, never a user error: the thread reads in order
            raise RuntimeError(f"read-ahead delivered step {got} for step {step}")
        return value

    def stop(self) -> None:
        """End the thread and drop what it mapped (the trainer left the epoch, or closed)."""
        successor = self.hand_over()
        if successor is not None:
            successor.stop()

    def announce(self) -> None:
        """Have this reader's thread tell the daemon that the trainer is at its first step (the
        loader calls it when the trainer leaves the last epoch): a send on the trainer's
        thread costs it 0.1-4 ms here, as zmq wakes its I/O thread."""
        with self._cond:
            self._sent = -1
            self._cond.notify_all()

    def hand_over(self) -> ReadAhead | None:
        """End the thread; return the next epoch's reader, started with that epoch's first
        batch, if it is there already, else None (that batch is still on its way, or it
        failed: the next epoch's reader is made afresh and fetches it)."""
        self._stopped.set()
        self._wanted.set()  # out of a nap at once
        with self._cond:
            slot, self._slot = self._slot, None
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_S)
        if slot is not None and slot[0] == self._n and not slot[2]:
            return slot[1]
        return None

    # -- the reading thread ------------------------------------------------------------------

    def nap(self, seconds: float) -> bool:
        """Sleep between looks for a file, cut short when the trainer starts waiting for this
        batch (its file may well be there: a batch ready when asked must not wait out a nap).
        True when cut short."""
        if self._wanted.wait(seconds):
            self._wanted.clear()
            return True
        return False

    def trainer_waited_s(self) -> float:
        """How long the trainer has been waiting for the batch being fetched; 0 while it has
        not asked for it yet (it may be in a long evaluation: that is no time-out)."""
        asked = self._asked_at
        return 0.0 if asked is None else time.monotonic() - asked

    def waiting(self, resend: bool = False) -> None:
        if self._stopped.is_set():
            raise Stopped()
        if resend:
            self._sent = -1
        self._send_position()

    def _send_position(self) -> None:
        reached = self._reached
        if reached != self._sent:
            self._call(self._report, self._epoch, reached)
            self._sent = reached

    def _call(self, method: Callable[[], Callable | None], *args):
        bound = method()
        if bound is None:  # the loader was collected: nobody reads on
            raise Stopped()
        return bound(*args)

    def _run(self) -> None:
        try:
            self._send_position()
            for step in range(self._to_fetch, self._n):
                self._wait_slot_free()  # one batch ahead of the trainer, no more
                # Straight into the slot: a local here would keep the batch alive after the
                # trainer dropped it, until the next fetch.
                self._fill(step, self._call(self._fetch, self._epoch, step, self), False)
            self._wait_slot_free()
            self._send_position()  # the trainer took the last batch: where it is now
            # While it holds that one: the next epoch's first batch and reader, for hand_over().
            fetch, report = self._fetch(), self._report()
            if fetch is None or report is None:
                raise Stopped()  # the loader was collected
            first = fetch(self._epoch + 1, 0, self)
            successor = ReadAhead(fetch, report, self._epoch + 1, 0, self._n, self._timeout_s, mapped=first)
            try:
                self._fill(self._n, successor, False)
            except Stopped:
                successor.stop()
                raise
        except Stopped:
            return
        except BaseException as exc:  # noqa: BLE001 - every error belongs to the trainer's thread
            try:
                self._wait_slot_free()
                self._fill(-1, exc, True)
            except Stopped:
                return

    def _wait_slot_free(self) -> None:
        """Wait until the trainer took what is in the slot, reporting its progress meanwhile
        (outside the lock: the trainer never waits on a send). Stopped once it has left."""
        while True:
            if self._stopped.is_set():
                raise Stopped()
            self._send_position()
            with self._cond:
                if self._slot is None:
                    return
                self._cond.wait(0.5)

    def _fill(self, step: int, value, is_error: bool) -> None:
        with self._cond:
            if self._stopped.is_set():
                raise Stopped()  # checked under the lock: stop() empties the slot after it
            self._slot = (step, value, is_error)
            self._asked_at = None
            self._cond.notify_all()


def _weakly(fn: Callable) -> Callable[[], Callable | None]:
    """A weak reference to a bound method (the loader's); a plain function is held as it is."""
    try:
        return weakref.WeakMethod(fn)
    except TypeError:
        return lambda: fn


class Readers:
    """The loader's read-ahead threads: the current epoch's, and the next epoch's, started by
    the last one with that epoch's first batch (kept until an ``iter()`` adopts it)."""

    def __init__(self):
        self.current: ReadAhead | None = None
        self._next: tuple[int, ReadAhead] | None = None

    def keep_next(self, epoch: int, reader: ReadAhead | None) -> None:
        self.drop_next()
        if reader is not None:
            self._next = (epoch, reader)

    def adopt(self, epoch: int, step: int) -> ReadAhead | None:
        """The next epoch's reader, if that is where this iteration starts; else it is stopped."""
        if self._next is not None and self._next[0] == epoch and step == 0:
            reader, self._next = self._next[1], None
            return reader
        self.drop_next()
        return None

    def announce_next(self) -> bool:
        """Have the next epoch's reader, if there is one, report that the trainer reached it."""
        if self._next is None:
            return False
        self._next[1].announce()
        return True

    def drop_next(self) -> None:
        following, self._next = self._next, None
        if following is not None:
            following[1].stop()

    def stop_all(self) -> None:
        self.drop_next()
        if self.current is not None:
            self.current.stop()
            self.current = None
