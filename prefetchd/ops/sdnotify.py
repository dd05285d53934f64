"""systemd's readiness and watchdog protocol (sd_notify(3)), in the standard library.

The service manager names an AF_UNIX datagram socket in ``$NOTIFY_SOCKET`` (a path, or, after
a leading ``@``, an abstract address); each message is one datagram of newline-separated
``KEY=VALUE`` assignments, UTF-8, no reply:

    READY=1\\nMAINPID=4242\\nSTATUS=serving job imagenet ...    once the job serves
    WATCHDOG=1                                                  every $WATCHDOG_USEC / 2
    STOPPING=1\\nSTATUS=stopping                                 when the stop begins

The daemon takes the variables out of its environment before it starts anything (the worker
server, and so every worker, would inherit them): only the master ever speaks on the socket.
Without ``$NOTIFY_SOCKET`` the Notifier is silent and does nothing. A send that fails (the
socket is gone, its queue is full) is logged once and otherwise ignored: the manager's absence
must never stop the daemon. A watchdog meant for another process (``$WATCHDOG_PID``) is
left alone.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Callable, MutableMapping

log = logging.getLogger("prefetchd")

ENV_NAMES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
_USEC = re.compile(r"[0-9]{1,20}")  # ASCII digits only; 20 digits hold any 64-bit count


class Notifier:
    """Sends the daemon's state to the service manager; every method is a no-op when there is
    none. ``beat()`` is called by the master's loop on every turn and sends ``WATCHDOG=1`` when
    one is due: from the loop itself, so a loop that hangs stops the beats and the manager acts."""

    def __init__(
        self, address: str | None, watchdog_s: float | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.address = _socket_address(address)
        self.interval_s = watchdog_s / 2 if self.address is not None and watchdog_s else None
        self._clock = clock
        self._next_beat = clock() + self.interval_s if self.interval_s else 0.0
        self._socket: socket.socket | None = None
        self._failures = 0

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str] = os.environ) -> Notifier:
        """The Notifier the environment asks for; the variables are removed from ``environ``
        (os.environ: unset, so no process started from here on inherits them)."""
        address, usec, pid = (environ.pop(name, None) for name in ENV_NAMES)
        watchdog_s = None
        if usec and (not pid or pid == str(os.getpid())):
            # systemd writes an unsigned 64-bit count of microseconds. Anything else ("abc",
            # "-5", "1e9", "²" that isdigit() takes but int() refuses, 5,000 digits) is no
            # watchdog, never an exception in the daemon's start.
            if _USEC.fullmatch(usec) and 0 < int(usec) < 2**64:
                watchdog_s = int(usec) / 1e6
            else:
                log.warning("WATCHDOG_USEC=%.40r is not a number of microseconds: no watchdog beats", usec)
        if address and _socket_address(address) is None:
            log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract address: not notifying", address)
        return cls(address, watchdog_s)

    def ready(self, status: str) -> None:
        self.send(f"READY=1\nMAINPID={os.getpid()}\nSTATUS={_one_line(status)}")
        if self.interval_s:
            self._next_beat = self._clock() + self.interval_s

    def beat(self) -> None:
        if not self.interval_s:
            return
        now = self._clock()
        if now < self._next_beat:
            return
        self.send("WATCHDOG=1")
        # Due times keep their grid, so beats come every interval, not every interval plus one
        # loop turn; after a stall (a stopped process) the grid starts again from now.
        self._next_beat += self.interval_s
        if self._next_beat <= now:
            self._next_beat = now + self.interval_s

    def stopping(self, status: str = "stopping") -> None:
        self.send(f"STOPPING=1\nSTATUS={_one_line(status)}")

    def send(self, message: str) -> bool:
        """One datagram; False (logged the first time) when it could not be sent."""
        if self.address is None:
            return False
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # close-on-exec, as Python makes all
            # MSG_DONTWAIT: a manager that does not read must not block the master's loop.
            # "replace": a STATUS= naming a path that is not UTF-8 is still sent, never an exception.
            self._socket.sendto(message.encode(errors="replace"), socket.MSG_DONTWAIT, self.address)
            return True
        except OSError as exc:
            self._failures += 1
            if self._failures == 1:
                log.warning("cannot notify the service manager at %r (%s); going on without it", self.address, exc)
            return False

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _socket_address(address: str | None) -> str | bytes | None:
    if not address:
        return None
    if address.startswith("@"):
        return b"\0" + os.fsencode(address[1:])  # Linux's abstract namespace; the environment's bytes as they were
    if address.startswith("/"):
        return address
    return None  # "vsock:..." and the like: not for a daemon on the node


def _one_line(text: str) -> str:
    return " ".join(text.split())


SILENT = Notifier(None, None)  # no service manager: what the master runs with unless told otherwise
