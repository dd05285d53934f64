"""Peer input: control messages, progress files and trainer locks, turned into positions.

Everything here comes from processes the daemon does not control (trainers, planted files,
anyone who can reach the socket), so every value is checked before it is used, and input
that fails a check is refused: counted by kind (status ``totals.refused``) and logged at a
bounded rate. Nothing a peer sends ends the loop.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from collections.abc import Callable

import zmq

from prefetchd import control
from prefetchd.errors import DaemonStop
from prefetchd.master.job import Job
from prefetchd.master.policy import Refusals
from prefetchd.master.progress_watch import BadProgressFile, ProgressWatcher
from prefetchd.ops.stalls import BadWaits, StallLedger
from prefetchd_client.layout import MAX_EPOCH
from prefetchd_client.locks import trainer_state
from prefetchd_client.ranks import format_ranks

log = logging.getLogger("prefetchd")

_TRAINER_CHECK_S = 1.0


class OutsidePlan(control.BadMessage):
    """A reported position that no batch of the plan has."""


class PeerIntake:
    def __init__(self, job: Job, server: control.ControlServer, watcher: ProgressWatcher):
        self.job = job
        self.server = server
        self.watcher = watcher
        self.refusals = Refusals()  # peer input refused, by kind: message, position, progress_file, trainer_lock
        self.served = job.config.served_ranks
        self.trainers = dict.fromkeys(self.served, "never")  # per rank served: "alive", "gone" or "never"
        self.last_report: dict[int, float] = {}  # per rank: when its position last arrived
        self.stalls = StallLedger()  # per rank: the trainer's waits for data, when its reports carry them
        self._next_trainer_check = 0.0

    def refuse(self, kind: str, why: str) -> None:
        line = self.refusals.note(kind, why, time.monotonic())
        if line is not None:  # the first few of each kind, then a summary a minute: the log is on the tmpfs
            log.warning("%s", line)

    def check_position(self, rank, epoch, step) -> int:
        """The linear index of a reported position; OutsidePlan (nothing changed) outside the plan.

        Peers send it, so every value is checked here, before it can become a task: a huge
        epoch would reach a worker and fail there forever.
        """
        plan = self.job.plan
        if not (rank in self.trainers and 0 <= epoch <= MAX_EPOCH and 0 <= step <= plan.batches_per_epoch):
            raise OutsidePlan(
                f"position rank {str(rank)[:24]} epoch {str(epoch)[:24]} step {str(step)[:24]} is outside the plan "
                f"(ranks {format_ranks(self.served)} served here, epochs 0..{MAX_EPOCH}, "
                f"steps 0..{plan.batches_per_epoch})"
            )
        self.last_report[rank] = time.monotonic()
        return plan.linear(epoch, step)

    def note_waits(self, msg: dict) -> None:
        """Add a position report's wait totals to its rank's (a refusal leaves the position applied)."""
        try:
            self.stalls.note(
                msg["rank"], msg["loader"], msg["wait_s"], msg["waited_steps"], msg["steps"], time.monotonic()
            )
        except BadWaits as exc:
            self.refuse("waits", str(exc))

    def serve_control(self, move: Callable[[int, int], None], answer: Callable[[dict], dict]) -> None:
        """Handle the control messages waiting, at most MAX_MESSAGES_PER_TURN (a flood cannot
        starve the workers): a position goes to ``move(rank, index)``, any other op to ``answer``,
        whose reply is sent back. A message that does not decode, validate or apply is refused."""
        socket = self.server.socket
        for _ in range(control.MAX_MESSAGES_PER_TURN):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.refuse("message", f"{len(frames)} frames, expected one")
                continue
            peer, data = frames
            try:
                msg = control.decode_message(data)
                if msg["op"] == "position":
                    move(msg["rank"], self.check_position(msg["rank"], msg["epoch"], msg["step"]))
                    if "loader" in msg:  # its waits too (all four fields: control checked)
                        self.note_waits(msg)
                    continue
                reply = answer(msg)
            except control.BadMessage as exc:
                self.refuse("position" if isinstance(exc, OutsidePlan) else "message", str(exc))
                continue
            except (DaemonStop, OSError):
                raise  # our own stop, or out of descriptors: the loop handles those
            except Exception:  # a bug on a peer's input: dropped like a bad message, logged in full
                log.exception("internal error answering a control message; dropped it")
                self.refuse("message", "internal error (logged above)")
                continue
            socket.send_multipart([peer, json.dumps(reply).encode()])

    def read_progress_files(self, move: Callable[[int, int], None]) -> None:
        for rank in self.watcher.drain():
            try:
                position = self.watcher.read(rank)
            except BadProgressFile as exc:
                self.refuse("progress_file", str(exc))
                continue
            if position is None:
                continue
            try:
                index = self.check_position(rank, *position)
            except control.BadMessage as exc:
                self.refuse("position", f"progress file of rank {rank}: {exc}")
                continue
            move(rank, index)

    def check_trainers(self, now: float, gone: Callable[[int], None]) -> None:
        """Tell a trainer that is gone (its process, and so its lock, ended) from a paused one
        (lock held, no reports); ``gone(rank)`` hears of each that was alive and is gone."""
        if now < self._next_trainer_check:
            return
        self._next_trainer_check = now + _TRAINER_CHECK_S
        paths = self.job.paths
        for rank in self.served:
            try:
                state = trainer_state(paths, rank)
            except OSError as exc:  # a symlink or FIFO planted under the name: it proves nothing
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    raise
                self.refuse("trainer_lock", f"{paths.trainer_lock(rank)}: {exc.strerror}")
                continue
            if state == "gone" and self.trainers[rank] == "alive":
                gone(rank)
            self.trainers[rank] = state

    def close(self) -> None:
        self.watcher.stop()
        self.server.close()  # the socket, then the authenticator thread (term() waits for it)
