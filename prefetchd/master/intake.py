"""Peer input: control messages, progress files and trainer locks, turned into positions.

A trainer is known by its rank and its consumer (the default one, or one named by its loader
when several trainers read the job).

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
from prefetchd.ops.stalls import BadWaits, StallLedger, trainer_name
from prefetchd_client.layout import DEFAULT_CONSUMER, MAX_CONSUMERS, MAX_EPOCH
from prefetchd_client.locks import trainer_state
from prefetchd_client.ranks import format_ranks

log = logging.getLogger("prefetchd")

_TRAINER_CHECK_S = 1.0


class OutsidePlan(control.BadMessage):
    """A reported position that no batch of the plan has."""


class TooManyConsumers(control.BadMessage):
    """A report of a consumer past the most a job keeps positions for."""


class PeerIntake:
    def __init__(self, job: Job, server: control.ControlServer, watcher: ProgressWatcher):
        self.job = job
        self.server = server
        self.watcher = watcher
        self.refusals = Refusals()  # peer input refused, by kind: message, position, progress_file, trainer_lock
        self.served = job.config.served_ranks
        # Keys (rank, consumer): one trainer of one consumer. Its state: "alive", "gone" or "never".
        self.trainers = {(rank, DEFAULT_CONSUMER): "never" for rank in self.served}
        self.consumers = [DEFAULT_CONSUMER]  # and those named by reports, at most MAX_CONSUMERS, in the order heard
        self.last_report: dict[tuple[int, str], float] = {}  # when its position last arrived
        self.stalls = StallLedger()  # the trainer's waits for data, when its reports carry them
        self._next_trainer_check = 0.0
        self._gone_since: dict[tuple[int, str], float] = {}  # trainers gone whose place is kept for now

    def refuse(self, kind: str, why: str) -> None:
        line = self.refusals.note(kind, why, time.monotonic())
        if line is not None:  # the first few of each kind, then a summary a minute: the log is on the tmpfs
            log.warning("%s", line)

    def check_position(self, rank, epoch, step, consumer: str = DEFAULT_CONSUMER) -> int:
        """The linear index of a reported position; OutsidePlan (nothing changed) outside the
        plan, TooManyConsumers for a consumer beyond the first MAX_CONSUMERS named.

        Peers send it, so every value is checked here, before it can become a task: a huge
        epoch would reach a worker and fail there forever.
        """
        plan = self.job.plan
        if not (rank in self.served and 0 <= epoch <= MAX_EPOCH and 0 <= step <= plan.batches_per_epoch):
            raise OutsidePlan(
                f"position rank {str(rank)[:24]} epoch {str(epoch)[:24]} step {str(step)[:24]} is outside the plan "
                f"(ranks {format_ranks(self.served)} served here, epochs 0..{MAX_EPOCH}, "
                f"steps 0..{plan.batches_per_epoch})"
            )
        self._admit(consumer)
        self.last_report[rank, consumer] = time.monotonic()
        return plan.linear(epoch, step)

    def _admit(self, consumer: str) -> None:
        """Know a consumer from its first report on: its trainers are watched, status shows it."""
        if consumer in self.consumers:
            return
        if len(self.consumers) > MAX_CONSUMERS:  # the default one is not counted
            raise TooManyConsumers(
                f"consumer {consumer!r} would be the {MAX_CONSUMERS + 1}th of this job (at most {MAX_CONSUMERS} "
                f"named: {', '.join(self.consumers[1:5])}, ...); the trainers of a finished one are forgotten "
                "once their locks are released"
            )
        self.consumers.append(consumer)
        self.trainers.update({(rank, consumer): "never" for rank in self.served})

    def forget_if_gone(self, consumer: str) -> bool:
        """Forget a named consumer none of whose trainers is alive (its windows were released): its
        name is free again. Whether it was forgotten."""
        keys = [(rank, consumer) for rank in self.served]
        if consumer == DEFAULT_CONSUMER or any(self.trainers.get(key) == "alive" for key in keys):
            return False
        self.consumers.remove(consumer)
        for key in keys:
            self.trainers.pop(key, None)
            self.last_report.pop(key, None)
            self._gone_since.pop(key, None)
            self.stalls.forget(key)
        return True

    def note_waits(self, msg: dict) -> None:
        """Add a position report's wait totals to its trainer's (a refusal leaves the position applied)."""
        key = (msg["rank"], msg.get("consumer", DEFAULT_CONSUMER))
        try:
            self.stalls.note(key, msg["loader"], msg["wait_s"], msg["waited_steps"], msg["steps"], time.monotonic())
        except BadWaits as exc:
            self.refuse("waits", str(exc))

    def serve_control(self, move: Callable[[int, int, str], None], answer: Callable[[dict], dict]) -> None:
        """Handle the control messages waiting, at most MAX_MESSAGES_PER_TURN (a flood cannot
        starve the workers): a position goes to ``move(rank, index, consumer)``, any other op to ``answer``,
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
                    consumer = msg.get("consumer", DEFAULT_CONSUMER)
                    move(msg["rank"], self.check_position(msg["rank"], msg["epoch"], msg["step"], consumer), consumer)
                    if "loader" in msg:  # its waits too (all four fields: control checked)
                        self.note_waits(msg)
                    continue
                reply = answer(msg)
            except control.BadMessage as exc:
                self.refuse("position" if isinstance(exc, (OutsidePlan, TooManyConsumers)) else "message", str(exc))
                continue
            except (DaemonStop, OSError):
                raise  # our own stop, or out of descriptors: the loop handles those
            except Exception:  # a bug on a peer's input: dropped like a bad message, logged in full
                log.exception("internal error answering a control message; dropped it")
                self.refuse("message", "internal error (logged above)")
                continue
            socket.send_multipart([peer, json.dumps(reply).encode()])

    def read_progress_files(self, move: Callable[[int, int, str], None]) -> None:
        for rank, consumer in self.watcher.drain():
            try:
                position = self.watcher.read(rank, consumer)
            except BadProgressFile as exc:
                self.refuse("progress_file", str(exc))
                continue
            if position is None:
                continue
            try:
                index = self.check_position(rank, *position, consumer)
            except control.BadMessage as exc:
                self.refuse("position", f"progress file {self.job.paths.progress(rank, consumer).name}: {exc}")
                continue
            move(rank, index, consumer)

    def check_trainers(self, now: float, release: Callable[[int, str], None]) -> None:
        """Tell a trainer that is gone (its process, and so its lock, ended) from a paused one
        (lock held, no reports), and ``release(rank, consumer)`` the place of one that is gone:
        at once under on_trainer_exit "release"; under "keep" (a warm restart), a named
        consumer's after --consumer-timeout, the default consumer's never while it is the job's
        only one. A named consumer's trainer that never held a lock (progress files) counts as
        gone since its last report."""
        if now < self._next_trainer_check:
            return
        self._next_trainer_check = now + _TRAINER_CHECK_S
        paths, config = self.job.paths, self.job.config
        for key, was in list(self.trainers.items()):  # release() may forget a consumer
            rank, consumer = key
            try:
                state = trainer_state(paths, rank, consumer)
            except OSError as exc:  # a symlink or FIFO planted under the name: it proves nothing
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    raise
                self.refuse("trainer_lock", f"{paths.trainer_lock(rank, consumer)}: {exc.strerror}")
                continue
            if key not in self.trainers:
                continue
            self.trainers[key] = state
            if state == "alive":
                self._gone_since.pop(key, None)
            elif state == "gone" and key not in self._gone_since and (was == "alive" or consumer):
                # (a named consumer reported in this daemon's life; an old lock of the default one,
                # left by a trainer before a restart, says nothing about the trainer now)
                log.info("the trainer of %s is gone (%s its window)", trainer_name(key), config.on_trainer_exit)
                self._gone_since[key] = now
            elif state == "never" and consumer:  # a progress-file trainer holds no lock: gone when silent
                self._gone_since[key] = self.last_report.get(key, now)
            since = self._gone_since.get(key)
            # Under "keep" the default consumer of a job alone keeps its place for a warm restart;
            # beside named consumers, it would hold them back: it has their timeout.
            if since is None or not consumer and config.on_trainer_exit == "keep" and len(self.consumers) == 1:
                continue
            at_once = state == "gone" and config.on_trainer_exit == "release"
            if at_once or now - since >= config.consumer_timeout:
                del self._gone_since[key]
                if not at_once:
                    idle = now - since
                    log.info("released the place of %s (its trainer gone or silent %.0f s)", trainer_name(key), idle)
                release(rank, consumer)

    def close(self) -> None:
        self.watcher.stop()
        self.server.close()  # the socket, then the authenticator thread (term() waits for it)
