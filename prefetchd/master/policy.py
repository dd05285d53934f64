"""The job's policies: when a failure stops the daemon, when a batch may be tried again, how
long to wait on a full tmpfs, which refusals reach the log. Pure: no processes, no files, no
logging, no clock of their own (``now`` is an argument, ``time.monotonic()`` seconds), so
each rule is tested in microseconds (tests/unit/test_policy.py) instead of by ``kill -9`` runs.

A policy that decides the daemon must stop raises ``DaemonStop`` with the message the user
reads and its named exit code; logging what happened is the caller's business.

``task`` is the scheduler's ``(rank, linear index)``; ``name`` a batch's printable name
("e0 s3 r1"); ``log`` the daemon log's path, named in the messages that point to it.
"""

from __future__ import annotations

import collections

from prefetchd.errors import DaemonStop, ExitCode

_RESTART_WINDOW_S = 60.0  # --max-worker-restarts counts deaths within this window
_TASK_ATTEMPTS = 3  # a batch that fails this often (not a bad sample) stops the daemon
# A batch whose worker died this often while making it stops the daemon. More than the
# attempts: a worker killed from outside (an OOM kill, an operator) is not the batch's fault.
_TASK_DEATHS = 5
_RETRY_DELAY_S = 0.5  # times the attempt number: a failure that clears by itself (a busy mount) is given time
_NO_SPACE_MIN_S, _NO_SPACE_MAX_S = 0.1, 2.0  # back-off range while the tmpfs is full
_BAD_IN_A_ROW = 64  # unreadable samples in a row within a batch: the data, not a sample, is broken
_BAD_RATE_MIN_SAMPLES = 1000  # judge the bad-sample rate only over this many samples
_OUTAGE_RETRY_S = 0.5  # a worker's reads back off by themselves first (sources.objects._RETRIES)
_REFUSALS_LOGGED = 10  # of each kind; then one line a minute with the count (the log is on the tmpfs)
_REFUSAL_SUMMARY_S = 60.0

Task = tuple[int, int]


class RestartBudget:
    """--max-worker-restarts: more worker deaths than that within a sliding window stop the
    daemon, instead of restarting forever a worker that cannot live."""

    def __init__(self, max_restarts: int, log: str, window_s: float = _RESTART_WINDOW_S):
        self.max_restarts = max_restarts
        self.log = log
        self.window_s = window_s
        self._deaths: collections.deque[float] = collections.deque()

    def note_death(self, now: float, exit_code: int | None) -> None:
        self._deaths.append(now)
        while self._deaths and self._deaths[0] < now - self.window_s:
            self._deaths.popleft()
        if len(self._deaths) > self.max_restarts:
            raise DaemonStop(
                f"{len(self._deaths)} workers died within {self.window_s:.0f} s (last exit code {exit_code}); "
                f"stopping instead of restarting forever; see {self.log}",
                ExitCode.WORKER_CRASHES,
            )

    @property
    def recent(self) -> int:
        """Deaths within the window as of the last one (status shows it as "restarts")."""
        return len(self._deaths)


class TaskRetries:
    """Per batch: a failed or hung attempt counts against ``attempts``, a death of its worker
    against ``deaths``; either spent stops the daemon, so a batch that can never be made does
    not loop forever below the restart rate. A failed batch waits before its next attempt."""

    def __init__(self, log: str, worker_timeout: float, attempts: int = _TASK_ATTEMPTS, deaths: int = _TASK_DEATHS):
        self.log = log
        self.worker_timeout = worker_timeout
        self.attempts = attempts
        self.deaths = deaths
        self._attempts: collections.Counter[Task] = collections.Counter()
        self._deaths: collections.Counter[Task] = collections.Counter()
        self._retry_after: dict[Task, float] = {}

    def attempts_made(self, task: Task) -> int:
        """Failed or hung attempts counted so far (the next failure is this plus one)."""
        return self._attempts[task]

    def failed(self, task: Task, name: str, error: str, now: float) -> int:
        """A worker reported the batch failed (not a bad sample, not a full tmpfs): the attempt
        number. The last allowed attempt raises DaemonStop(TASK_ERROR)."""
        self._attempts[task] += 1
        attempt = self._attempts[task]
        if attempt >= self.attempts:
            last = error.strip().splitlines()[-1]
            raise DaemonStop(f"batch {name} failed {self.attempts} times: {last}", ExitCode.TASK_ERROR)
        self._retry_after[task] = now + _RETRY_DELAY_S * attempt
        return attempt

    def hung(self, task: Task, name: str, making: str) -> None:
        """Its worker was killed as hung: a failed attempt, so a sample that blocks every time
        stops the daemon. ``making`` is the worker's " (last seen at sample ...)" text, or ''."""
        self._attempts[task] += 1
        if self._attempts[task] >= self.attempts:
            raise DaemonStop(
                f"batch {name} made no progress within --worker-timeout "
                f"{self.worker_timeout:g} s, {self.attempts} times{making}: a sample of it "
                "blocks (a read on a hung network mount?) or takes longer than --worker-timeout; fix the data "
                f"source, or raise --worker-timeout above the slowest sample; see {self.log}",
                ExitCode.TASK_ERROR,
            )

    def died(self, task: Task, name: str, exit_code: int | None, making: str) -> None:
        """Its worker died making it (not killed as hung): a sample that crashes the decoder,
        a callable that exits, again and again."""
        self._deaths[task] += 1
        if self._deaths[task] >= self.deaths:
            raise DaemonStop(
                f"the worker making batch {name} died {self.deaths} times (last exit code "
                f"{exit_code}){making}: a sample of it crashes its process (a broken "
                f"file and a native decoder, or a [pipeline] callable that exits); see {self.log}",
                ExitCode.WORKER_CRASHES,
            )

    def published(self, task: Task) -> None:
        """Made at last: its count starts again should it ever be made again (a seek back)."""
        self._attempts.pop(task, None)
        self._deaths.pop(task, None)
        self._retry_after.pop(task, None)

    def may_start(self, task: Task, now: float) -> bool:
        """False while the task backs off after a failure."""
        if self._retry_after.get(task, 0.0) > now:
            return False
        self._retry_after.pop(task, None)
        return True


class BadSampleBudget:
    """Unreadable samples are replaced and counted; too many stop the daemon, as the data
    rather than a sample is then broken: ``in_a_row`` of them in a row within a batch, or more
    than ``max_rate`` of all samples once ``min_samples`` were made (a few bad samples early
    on say nothing about the rate)."""

    def __init__(
        self, max_rate: float, log: str, min_samples: int = _BAD_RATE_MIN_SAMPLES, in_a_row: int = _BAD_IN_A_ROW
    ):
        self.max_rate = max_rate
        self.log = log
        self.min_samples = min_samples
        self.in_a_row = in_a_row
        self.samples = 0  # made, in published batches
        self.bad = 0  # of them replaced because unreadable

    def add_batch(self, samples: int, replaced: list[dict], longest_bad_run: int) -> None:
        """A batch reported published with its replaced samples (dicts with at least "path")
        and the longest run of unreadable ones in a row."""
        self.samples += samples
        self.bad += len(replaced)
        if longest_bad_run >= self.in_a_row:
            last = replaced[-1]
            # The record's short form (a header too small for every path and cause) has no error.
            why = f": {last['error']}" if last.get("error") else ""
            raise DaemonStop(
                f"{longest_bad_run} unreadable samples in a row (the last: {last.get('path', '?')}{why}); "
                f"is the data intact? see {self.log}",
                ExitCode.BAD_DATA,
            )
        if self.samples >= self.min_samples and self.bad > self.max_rate * self.samples:
            raise DaemonStop(
                f"{self.bad} of {self.samples} samples were unreadable, more than "
                f"--max-bad-rate {self.max_rate}; see {self.log} for their paths",
                ExitCode.BAD_DATA,
            )

    def add_unreported_batch(self, samples: int) -> None:
        """A batch published by a worker that died before reporting it: its samples count, its
        bad ones are unknown, and the budget is judged at the next reported batch."""
        self.samples += samples


class NoSpaceBackoff:
    """The tmpfs is full (someone else filled it): wait, doubling from _NO_SPACE_MIN_S to
    _NO_SPACE_MAX_S, until a batch is published again."""

    def __init__(self) -> None:
        self._delay_s = 0.0
        self._until = 0.0

    def full(self, now: float) -> bool:
        """A batch failed for want of space; True when this starts a back-off (log it once)."""
        starts = self._delay_s == 0
        self._delay_s = min(max(2 * self._delay_s, _NO_SPACE_MIN_S), _NO_SPACE_MAX_S)
        self._until = now + self._delay_s
        return starts

    def space_back(self) -> bool:
        """A batch was published; True when that ends a back-off (log it). The wait already
        begun still runs out: the next delay starts again from the shortest."""
        if not self._delay_s:
            return False
        self._delay_s = 0.0
        return True

    def waiting(self, now: float) -> bool:
        """True while no task should be sent."""
        return now < self._until

    @property
    def backing_off(self) -> bool:
        return self._delay_s > 0


class StoreOutage:
    """An object store that does not answer (a worker's reads failed after their retries,
    sources.objects): not the batch's fault, so no attempt is counted; every task waits
    _OUTAGE_RETRY_S after each such failure, and the first batch published ends the outage.
    One that lasts longer than ``limit_s`` stops the daemon, naming the store."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.since: float | None = None  # time.monotonic() of the outage's first failure
        self.error = ""  # its last failure's words (a URL without credentials, the store's error)
        self.outages = 0  # since the start
        self._until = 0.0

    def failed(self, error: str, now: float) -> bool:
        """A batch failed for want of the store; True when this starts an outage (log it once).
        DaemonStop(STORE_UNREACHABLE) once it has lasted longer than the limit."""
        starts = self.since is None
        if starts:
            self.since, self.outages = now, self.outages + 1
        self.error, self._until = error, now + _OUTAGE_RETRY_S
        if now - self.since > self.limit_s:
            raise DaemonStop(
                f"the object store has not answered for {now - self.since:.0f} s (--store-timeout "
                f"{self.limit_s:g} s): {error}; check the store and the network, then start the job again "
                "(it resumes where its trainers are)",
                ExitCode.STORE_UNREACHABLE,
            )
        return starts

    def back(self, now: float) -> float | None:
        """A batch was published: how long the outage it ends lasted, or None when there was none."""
        if self.since is None:
            return None
        lasted, self.since = now - self.since, None
        return lasted

    def waiting(self, now: float) -> bool:
        """True while no task should be sent."""
        return now < self._until

    def snapshot(self, now: float) -> dict:
        return {
            "unreachable_s": None if self.since is None else round(now - self.since, 1),
            "error": self.error if self.since is not None else None,
            "outages": self.outages,
        }


class ProductionPauses:
    """Why no task is sent for a while, though batches are wanted: the tmpfs is full, or an
    object store does not answer. The lines to log come back from each call (None: nothing new)."""

    def __init__(self, store_timeout_s: float, job_dir: str):
        self.no_space, self.outage, self.job_dir = NoSpaceBackoff(), StoreOutage(store_timeout_s), job_dir

    def failed(self, msg, now: float) -> str | None:
        """A worker's Failed of ``nospace`` or ``unreachable``."""
        if msg.unreachable:
            if self.outage.failed(msg.error, now):
                return f"an object store does not answer ({msg.error}); batches wait for it"
        elif self.no_space.full(now):
            return f"the filesystem of {self.job_dir} is full ({msg.error}); backing off until space returns"
        return None

    def producing(self, now: float) -> str | None:
        """A batch was published: what that ends."""
        ended = []
        if self.no_space.space_back():
            ended.append("space is back")
        lasted = self.outage.back(now)
        if lasted is not None:
            ended.append(f"the object store answers again after {lasted:.1f} s")
        return f"{' and '.join(ended)}: producing again" if ended else None

    def waiting(self, now: float) -> bool:
        return self.no_space.waiting(now) or self.outage.waiting(now)


class Refusals:
    """Peer input refused, counted by kind ("message", "position", "waits", "progress_file",
    "trainer_lock"). The first few of each kind are logged with the reason, then one line a
    minute with the counts: a peer repeating a bad file or message cannot grow the log (it
    lives on the tmpfs, outside the bound)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._next_summary = 0.0

    def note(self, kind: str, why: str, now: float) -> str | None:
        """Count one refusal; the line to log, or None."""
        self.counts[kind] += 1
        if self.counts[kind] <= _REFUSALS_LOGGED:
            return f"refused a {kind.replace('_', ' ')}: {why}"
        if now >= self._next_summary:
            self._next_summary = now + _REFUSAL_SUMMARY_S
            return f"refused so far: {dict(self.counts)} (last: {why})"
        return None
