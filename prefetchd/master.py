"""The master process: plan, schedule, supervise workers, collect garbage, answer status.

It never touches pixels: it sends (epoch, step, rank) tasks to workers and deletes the
files of consumed batches. One thread runs the loop; signal handlers and the progress
watcher only enqueue, and the loop dispatches.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import multiprocessing
import os
import resource
import signal
import stat
import time
from dataclasses import dataclass, field

import zmq

from prefetchd_client.batchfile import VERSION as BATCH_FORMAT_VERSION
from prefetchd_client.batchfile import BatchFormatError, FieldSpec, map_batch
from prefetchd_client.layout import MAX_EPOCH, JobPaths, parse_batch_name, trainer_state

from . import control
from .config import Config, content_hash, plan_digest
from .errors import ConfigError, DaemonStop, DataError, ExitCode, JobError, UserError
from .jobdir import JobDir
from .plan import Plan
from .producer import PRODUCER_SPEC, ProducerSpec, builtin_fields, plan_layout
from .progress_watch import BadProgressFile, ProgressWatcher
from .retire import RetiredBatches
from .scheduler import Scheduler
from .sizes import format_size
from .sources import build_index
from .status import Rates, job_status
from .worker import HEARTBEAT_S, worker_main

log = logging.getLogger("prefetchd")

_WORKER_BOOT_TIMEOUT_S = 120.0
_WORKER_STOP_TIMEOUT_S = 5.0
_LOOP_TICK_MS = 50
_RESTART_WINDOW_S = 60.0  # --max-worker-restarts counts deaths within this window
_TASK_ATTEMPTS = 3  # a batch that fails this often (not a bad sample) stops the daemon
# A batch whose worker died this often while making it stops the daemon. More than the
# attempts: a worker killed from outside (an OOM kill, an operator) is not the batch's fault.
_TASK_DEATHS = 5
_TRAINER_CHECK_S = 1.0
_PINNED_WARNING_S = 30.0
_RETIRED_CHECK_S = 0.05  # how often consumed batches still mapped by a client are tried again
_NO_SPACE_MIN_S, _NO_SPACE_MAX_S = 0.1, 2.0  # back-off range while the tmpfs is full
_BAD_IN_A_ROW = 64  # unreadable samples in a row within a batch: the data, not a sample, is broken
_BAD_RATE_MIN_SAMPLES = 1000  # judge the bad-sample rate only over this many samples
_REFUSALS_LOGGED = 10  # of each kind; then one line a minute with the count (the log is on the tmpfs)
_REFUSAL_SUMMARY_S = 60.0
_OUT_OF_DESCRIPTORS_S = 0.5  # pause after EMFILE/ENFILE: let peers' connections time out


class OutsidePlan(control.BadMessage):
    """A reported position that no batch of the plan has."""


@dataclass
class WorkerSlot:
    process: multiprocessing.Process
    conn: object
    ready: bool = False
    task: tuple[int, int] | None = None  # (rank, linear index)
    last_heard: float = field(default_factory=time.monotonic)
    # Liveness is progress: the heartbeat thread beats on while the sample loop is blocked in a
    # call that releases the GIL (a read on a hung mount), so a busy worker must also finish samples.
    samples_finished: int = 0  # the worker's count of sample attempts that ended, as last heard
    progressed_at: float = field(default_factory=time.monotonic)  # the count last moved, or the task began
    making: list | None = None  # [sample id, path] it last said it was making
    hung: bool = False  # killed by kill_hung_workers: a hang of its task counts as a failed attempt
    reaped: bool = False  # its death is accounted for (reap_workers), its replacement maybe not yet spawned

    def note_heartbeat(self, msg: dict) -> None:
        samples = msg.get("samples")
        if samples != self.samples_finished:
            self.samples_finished = samples
            self.progressed_at = self.last_heard
        self.making = msg.get("sample")

    def making_text(self) -> str:
        """' (last seen at sample 5, /data/x.jpg)', or '' when it did not say (a silent worker's
        last beat may predate the sample it is stuck on)."""
        if isinstance(self.making, list) and len(self.making) == 2:
            return f" (last seen at sample {self.making[0]}, {self.making[1]})"
        return ""


class Master:
    def __init__(self, config: Config, paths: JobPaths, keep: bool = False):
        self.config = config
        self.paths = paths
        self.keep = keep
        self.jobdir = JobDir(paths)
        self.workers: list[WorkerSlot] = []
        self.stop_reason: DaemonStop | None = None
        self._signals: collections.deque[int] = collections.deque()
        self._restarts: collections.deque[float] = collections.deque()
        self._attempts: collections.Counter = collections.Counter()
        self._deaths: collections.Counter = collections.Counter()  # per task: its worker died making it
        self._retry_after: dict[tuple[int, int], float] = {}
        self._no_space_delay, self._no_space_until = 0.0, 0.0
        self._context = zmq.Context()
        self._socket = None
        self._control: control.ControlServer | None = None  # the socket, its endpoint, the CURVE authenticator
        self._poller: zmq.Poller | None = None
        self._watcher = None
        self.produced, self.deleted = 0, 0
        # Peer input refused, by kind: "message" (control socket), "position" (outside the plan,
        # from either intake), "progress_file" (planted or malformed), "trainer_lock" (planted).
        self.refusals: collections.Counter = collections.Counter()
        self._next_refusal_summary = 0.0
        self._descriptor_warnings = 0
        self._files_scan = (float("-inf"), 0)  # status: when the buffer's files were last measured, their bytes
        self.samples_produced, self.bad_samples = 0, 0
        self.peak_bytes = 0
        self.retired = RetiredBatches(paths.retired_dir)
        self._next_retired_check = 0.0
        self._next_pinned_warning = 0.0
        self._produce_rate, self._consume_rate = Rates(), Rates()
        self._last_report: dict[int, float] = {}
        self.started_at = time.time()
        self.trainers = ["never"] * config.world_size  # per rank: "alive", "gone" or "never"
        self._next_trainer_check = 0.0

    # -- start-up ------------------------------------------------------------------------

    def start(self) -> None:
        """Lock the job, index the data, boot workers, bind the socket, write the manifest.

        A start that fails removes only what it made (JobDir.remove_what_this_start_made): a
        killed daemon's warm buffer survives a typo in --data, and its log, kept, says why."""
        self.jobdir.note_existing()
        self.jobdir.acquire()  # raises without touching anything if another daemon runs
        try:
            self._start_locked()
        except BaseException as exc:
            _log_start_failure(exc)
            self._halt_workers()
            self._close_io()
            try:
                self.jobdir.remove_what_this_start_made()
            except OSError as cleanup:  # never hide why the start failed behind this
                log.warning("could not remove what the failed start made: %s", cleanup)
            self.jobdir.release()
            raise

    def _start_locked(self) -> None:
        self.jobdir.prepare()
        _log_to(self.paths.log)
        _raise_descriptor_limit()
        cfg = self.config
        log.info("starting job %s (pid %d): %s", self.paths.name, os.getpid(), json.dumps(cfg.to_json()))
        index, sizes = build_index(cfg.sources)
        index.save(self.paths.dir / "index")
        weights = tuple(s["weight"] for s in cfg.sources) if "weight" in cfg.sources[0] else ()
        self.plan = Plan(len(index), cfg.world_size, cfg.batch_size, cfg.seed, cfg.drop_last, sizes, weights, cfg.mix)
        if self.plan.batches_per_epoch < 1:
            raise DataError(
                f"an epoch has {self.plan.epoch_length} samples, fewer than one global batch "
                f"({cfg.world_size} ranks x batch_size {cfg.batch_size}); lower --batch-size or add data"
            )
        self.source_names = [s["name"] for s in cfg.sources]
        self.produced_per_source = [0] * len(sizes)
        fingerprint = index.fingerprint()
        self.content = cfg.content(len(index), fingerprint)
        self.config_hash = content_hash(self.content)
        self.plan_digest = plan_digest(cfg, self.plan.to_json(), fingerprint)
        self.spec = ProducerSpec(
            job_dir=str(self.paths.dir),
            plan=self.plan.to_json(),
            source_names=self.source_names,
            transforms=list(cfg.transforms),
            pipeline=cfg.pipeline,
            config_hash=self.config_hash,
            on_error=cfg.on_error,
            decoder=cfg.decoder,
            plan_digest=self.plan_digest,
        )
        _write_json(self.paths.dir / PRODUCER_SPEC, self.spec.to_json())  # `prefetchd verify` remakes batches
        if cfg.pipeline is None:  # known now: refuse a bad buffer before booting anything
            self._set_layout(builtin_fields(cfg.batch_size, list(cfg.transforms)))
        for _ in range(cfg.workers):
            self.workers.append(self.spawn_worker())
        fields = self._await_first_worker()
        if cfg.pipeline is not None:
            self._set_layout(fields)
        self._control = control.bind_server(self._context, self.paths, cfg)  # ipc, or TCP by --endpoint
        self._socket = self._control.socket
        # After the last step that can fail on a setting (the bind): adoption deletes the
        # leftovers of another plan, which a start that then failed must not have cost.
        self.free_retired(sweep=True)  # a previous daemon's retired batches, still mapped or not
        self.adopt_batches()
        self._watcher = ProgressWatcher(str(self.paths.progress_dir))
        self._watcher.start()
        self._write_manifest()
        log.info(
            "serving: %d batches/epoch/rank of %s, window %d batches/rank, bound %s",
            self.plan.batches_per_epoch,
            format_size(self.layout.size),
            self.scheduler.window,
            format_size(cfg.buffer_bytes),
        )

    def adopt_batches(self) -> None:
        """Keep the valid batches a previous daemon of this job left; delete the rest.

        Valid: a name inside the plan, a header that parses, this config's hash, this layout's
        size. A torn write never reaches ``batches/`` (publication is a link of a complete file).
        """
        kept = dropped = 0
        for entry in sorted(os.scandir(self.paths.batch_dir), key=lambda e: e.name):
            if self._valid_leftover(entry):
                epoch, step, rank = parse_batch_name(entry.name)
                if self.scheduler.adopt(rank, self.plan.linear(epoch, step)):
                    kept += 1
                    continue
            os.unlink(entry.path)
            dropped += 1
        self.scheduler.start_at_adopted()
        if kept or dropped:
            log.info("kept %d batches from a previous daemon, deleted %d", kept, dropped)
        if kept:
            log.info(
                "kept batches are this plan's by its digest, which knows the data by its file list and a "
                "[pipeline] callable by its name: if images were rewritten in place or the callable's code "
                "changed, `prefetchd stop %s` and start again",
                self.paths.name,
            )

    def _valid_leftover(self, entry: os.DirEntry) -> bool:
        """A leftover is this plan's batch: its plan digest, not merely its config hash (which
        leaves out world size, batch size and weights so resume states stay elastic); and this
        layout's field table, which a [pipeline] callable decides beyond what the digest names."""
        name = parse_batch_name(entry.name)
        if name is None or not entry.is_file(follow_symlinks=False):
            return False
        epoch, step, rank = name
        if step >= self.plan.batches_per_epoch or rank >= self.config.world_size:
            return False
        try:
            header, _ = map_batch(entry.path, pin=False)
            meta = header["meta"]
        except (OSError, BatchFormatError):
            return False
        fields = [{k: f[k] for k in ("name", "dtype", "shape", "offset")} for f in header["fields"]]
        return (
            (header["epoch"], header["step"], header["rank"]) == name
            and meta.get("plan_digest") == self.plan_digest
            and meta.get("config_hash") == self.config_hash
            and fields == json.loads(self.layout.table_bytes)
            and entry.stat().st_size == self.layout.size
        )

    def _set_layout(self, fields: list[FieldSpec]) -> None:
        self.layout = plan_layout(fields, self.source_names)
        cfg, size = self.config, self.layout.size
        capacity = cfg.buffer_bytes // size
        needed = cfg.world_size * (cfg.retain + 1)
        if capacity < needed:
            raise ConfigError(
                f"--buffer {format_size(cfg.buffer_bytes)} is smaller than one batch per rank: a batch is "
                f"{format_size(size)}, and {cfg.world_size} rank(s) x (1 ahead + --retain {cfg.retain}) need "
                f"{format_size(size * needed)}; use --buffer {format_size(size * cfg.world_size * (cfg.retain + 8))} "
                "or more (a few hundred batches per rank is typical)"
            )
        stats = os.statvfs(self.paths.dir)
        free = stats.f_bavail * stats.f_frsize
        if cfg.buffer_bytes > free:
            raise ConfigError(
                f"--buffer {format_size(cfg.buffer_bytes)} exceeds the {format_size(free)} free on the "
                f"filesystem of {self.paths.dir.parent}; use a smaller --buffer, another --root, or give the "
                "container more shared memory (Docker's /dev/shm is 64 MB unless run with --shm-size=32g)"
            )
        self.scheduler = Scheduler(cfg.world_size, capacity, cfg.retain)

    def _await_first_worker(self) -> list[FieldSpec]:
        """Wait for one worker to boot; its fields are the batch layout (they all compute the same)."""
        deadline = time.monotonic() + _WORKER_BOOT_TIMEOUT_S
        while time.monotonic() < deadline:
            for slot in self.workers:
                for msg in self._receive(slot):
                    if msg["op"] == "ready":
                        slot.ready = True
                        return [FieldSpec.from_json(f) for f in msg["fields"]]
                    self._on_boot_failure(msg)
                if not slot.process.is_alive() and not slot.conn.poll(0):
                    raise JobError(
                        f"a worker exited with code {slot.process.exitcode} while booting; see {self.paths.log}"
                    )
            multiprocessing.connection.wait([s.conn for s in self.workers], timeout=0.2)
        raise JobError(f"no worker booted within {_WORKER_BOOT_TIMEOUT_S:.0f} s; see {self.paths.log}")

    def _on_boot_failure(self, msg: dict) -> None:
        if msg["op"] == "boot_failed":
            log.error("worker failed to boot:\n%s", msg["error"])
            last = msg["error"].strip().splitlines()[-1]
            raise DaemonStop(
                f"a worker could not start: {last} (full traceback in {self.paths.log})", ExitCode.WORKER_BOOT
            )

    def _write_manifest(self) -> None:
        cfg = self.config
        manifest = {
            "format_version": BATCH_FORMAT_VERSION,
            "job": self.paths.name,
            "config_hash": self.config_hash,
            "plan_digest": self.plan_digest,  # every batch's meta carries it (verify mode checks)
            "config": self.content,
            "num_samples": self.plan.num_samples,
            "batches_per_epoch": self.plan.batches_per_epoch,
            "world_size": cfg.world_size,
            "batch_size": cfg.batch_size,
            "global_batch": self.plan.global_batch,
            "drop_last": cfg.drop_last,
            "fields": [f.to_json() for f in self.layout.fields],
            "batch_bytes": self.layout.size,
            "buffer_bytes": cfg.buffer_bytes,
            "window_per_rank": self.scheduler.window,
            "retain": cfg.retain,
            "workers": cfg.workers,
            "pid": os.getpid(),
            "endpoint": self._control.endpoint,
            "curve_public_key": self._control.public_key,  # clients use CURVE when it is set
            "started_at": self.started_at,
        }
        _write_json(self.paths.manifest, manifest)

    # -- workers -------------------------------------------------------------------------

    def spawn_worker(self) -> WorkerSlot:
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        process = ctx.Process(
            target=worker_main,
            args=(json.dumps(self.spec.to_json()), child_conn, self.config.worker_nice),
            daemon=True,
            name="prefetchd-worker",
        )
        process.start()
        child_conn.close()
        return WorkerSlot(process, parent_conn)

    def _receive(self, slot: WorkerSlot) -> list[dict]:
        msgs = []
        try:
            while slot.conn.poll(0):
                msg = _decode_worker_message(slot.conn.recv_bytes())
                if msg is None:  # interleaved writes (a callable that forked): the pipe is broken
                    log.warning("unreadable message from worker pid %d; replacing it", slot.process.pid)
                    slot.process.kill()
                    return msgs
                slot.last_heard = time.monotonic()
                if msg["op"] == "heartbeat":
                    slot.note_heartbeat(msg)
                else:
                    msgs.append(msg)
        except (EOFError, OSError):
            pass  # the worker is gone; reap_workers notices
        return msgs

    def collect_results(self, slot: WorkerSlot) -> None:
        for msg in self._receive(slot):
            op = msg["op"]
            if op == "ready":
                slot.ready = True
            elif op == "boot_failed":
                self._on_boot_failure(msg)
            elif op in ("done", "failed") and not self._reports_its_task(slot, msg):
                continue
            elif op == "done":
                self._on_batch_done(slot, msg)
            elif op == "failed":
                self._on_batch_failed(slot, msg)

    def _reports_its_task(self, slot: WorkerSlot, msg: dict) -> bool:
        """A result counts only for the task its worker holds: the identity travels with the task
        and is checked. A second report (a [pipeline] callable that forked, and both processes
        went on) is dropped."""
        if slot.task is not None:
            rank, index = slot.task
            if (msg.get("epoch"), msg.get("step"), msg.get("rank")) == (*self.plan.unlinear(index), rank):
                return True
        log.warning("dropped a report from worker pid %d for a task it does not hold: %.200s", slot.process.pid, msg)
        return False

    def _on_batch_done(self, slot: WorkerSlot, msg: dict) -> None:
        rank, index = slot.task
        slot.task = None
        if self._no_space_delay:
            log.info("space is back: producing again")
            self._no_space_delay = 0.0
        for i, n in enumerate(msg["sources"][: len(self.produced_per_source)]):
            self.produced_per_source[i] += n
        self._count_published(rank, index)
        self._count_bad_samples(msg)

    def _count_published(self, rank: int, index: int) -> None:
        """A batch is in ``batches/``: into the ledger as ready, or out through the delete path."""
        self._attempts.pop((rank, index), None)
        self._deaths.pop((rank, index), None)
        self.produced += 1
        self._produce_rate.add(time.monotonic())
        self.samples_produced += self.config.batch_size
        if not self.scheduler.task_finished(rank, index):
            self.delete_batch(rank, index)  # its rank moved on (or back) while it was made

    def _count_bad_samples(self, msg: dict) -> None:
        """Log every replaced sample with its path; stop when the failure budget is spent."""
        for bad in msg["replaced"]:
            log.warning(
                "bad sample %d (%s): %s; replaced by sample %d",
                bad["index"],
                bad["path"],
                bad["error"],
                bad["replacement"],
            )
        self.bad_samples += len(msg["replaced"])
        if msg["longest_bad_run"] >= _BAD_IN_A_ROW:
            raise DaemonStop(
                f"{msg['longest_bad_run']} unreadable samples in a row (the last: {msg['replaced'][-1]['path']}); "
                f"is the data intact? see {self.paths.log}",
                ExitCode.BAD_DATA,
            )
        if (
            self.samples_produced >= _BAD_RATE_MIN_SAMPLES
            and self.bad_samples > self.config.max_bad_rate * self.samples_produced
        ):
            raise DaemonStop(
                f"{self.bad_samples} of {self.samples_produced} samples were unreadable, more than "
                f"--max-bad-rate {self.config.max_bad_rate}; see {self.paths.log} for their paths",
                ExitCode.BAD_DATA,
            )

    def _on_batch_failed(self, slot: WorkerSlot, msg: dict) -> None:
        rank, index = slot.task
        slot.task = None
        self.scheduler.task_abandoned(rank, index)
        epoch, step = self.plan.unlinear(index)
        if msg["sample"]:
            log.error("bad sample in batch e%d s%d r%d: %s", epoch, step, rank, msg["error"])
            raise DaemonStop(f"cannot read a sample: {msg['error']}", ExitCode.SAMPLE_ERROR)
        if msg.get("nospace"):
            self._back_off_no_space(msg["error"])
            return
        self._attempts[(rank, index)] += 1
        log.warning(
            "batch e%d s%d r%d failed (attempt %d):\n%s", epoch, step, rank, self._attempts[(rank, index)], msg["error"]
        )
        if self._attempts[(rank, index)] >= _TASK_ATTEMPTS:
            last = msg["error"].strip().splitlines()[-1]
            raise DaemonStop(
                f"batch e{epoch} s{step} r{rank} failed {_TASK_ATTEMPTS} times: {last}", ExitCode.TASK_ERROR
            )
        self._retry_after[(rank, index)] = time.monotonic() + 0.5 * self._attempts[(rank, index)]

    def _back_off_no_space(self, error: str) -> None:
        """The tmpfs is full (someone else filled it): wait, longer each time, and retry."""
        now = time.monotonic()
        if self._no_space_delay == 0:
            log.warning("the filesystem of %s is full (%s); backing off until space returns", self.paths.dir, error)
        self._no_space_delay = min(max(2 * self._no_space_delay, _NO_SPACE_MIN_S), _NO_SPACE_MAX_S)
        self._no_space_until = now + self._no_space_delay

    def kill_hung_workers(self) -> None:
        """Liveness is progress. A worker silent for --worker-timeout (stopped, or stuck holding
        the GIL) is killed, and so is a busy one that finished no sample in that time (blocked in
        a call that releases the GIL: its heartbeat thread beats on). reap_workers then replaces
        it and reissues its batch; a batch that hangs _TASK_ATTEMPTS times stops the daemon.

        One sample that legitimately takes longer than --worker-timeout looks the same as a hung
        one: its worker is killed each time and the daemon stops after _TASK_ATTEMPTS; the
        message says to raise --worker-timeout above the slowest sample (not the whole batch).
        """
        now = time.monotonic()
        for slot in self.workers:
            if not slot.process.is_alive():
                continue
            why = self._hang(slot, now)
            if why is None:
                continue
            timeout = self.config.worker_timeout
            log.warning("worker pid %d %s (--worker-timeout %g s); killing it", slot.process.pid, why, timeout)
            slot.hung = True
            slot.process.kill()
            slot.process.join(5.0)

    def _hang(self, slot: WorkerSlot, now: float) -> str | None:
        """Why ``slot``'s worker counts as hung, or None while it lives and moves."""
        timeout = self.config.worker_timeout
        # Booting (an interpreter and its imports, on a loaded machine) has its own deadline.
        silence_allowed = timeout if slot.ready else max(timeout, _WORKER_BOOT_TIMEOUT_S)
        if now - slot.last_heard > silence_allowed:
            return f"silent for {now - slot.last_heard:.0f} s"
        # Progress is heard once a heartbeat: a sample just under the timeout is not a hang.
        if slot.task is None or now - slot.progressed_at <= timeout + HEARTBEAT_S:
            return None
        rank, index = slot.task
        epoch, step = self.plan.unlinear(index)
        stalled = now - slot.progressed_at
        return f"finished no sample of batch e{epoch} s{step} r{rank} for {stalled:.0f} s{slot.making_text()}"

    def reap_workers(self) -> None:
        """Replace dead workers; their unfinished batch goes back to the scheduler."""
        now = time.monotonic()
        for i, slot in enumerate(self.workers):
            if slot.process.is_alive():
                continue
            if not slot.reaped:  # once: a spawn that failed (out of descriptors) is retried next turn
                self._reap(slot, now)
            self._poller = None  # before the spawn: a dead slot's closed pipe must not stay registered
            self.workers[i] = self.spawn_worker()

    def _reap(self, slot: WorkerSlot, now: float) -> None:
        """Account for a dead worker: its last reports, its files, its task, the restart budget."""
        self.collect_results(slot)  # it may have reported before dying
        code = slot.process.exitcode
        slot.conn.close()
        self.sweep_worker_files(slot.process.pid)
        if slot.task is not None:
            self._settle_unreported_task(slot)
        if not slot.ready and code is not None and code >= 0:
            # It ended by itself before booting (a crash in an import, say): respawning would
            # loop. Killed by a signal (code < 0) is a death like any other.
            raise DaemonStop(
                f"a worker exited with code {code} before it booted; see {self.paths.log}", ExitCode.WORKER_BOOT
            )
        self._restarts.append(now)
        while self._restarts and self._restarts[0] < now - _RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) > self.config.max_worker_restarts:
            raise DaemonStop(
                f"{len(self._restarts)} workers died within {_RESTART_WINDOW_S:.0f} s (last exit code {code}); "
                f"stopping instead of restarting forever; see {self.paths.log}",
                ExitCode.WORKER_CRASHES,
            )
        log.warning("worker pid %d died (exit code %s); starting a new one", slot.process.pid, code)
        slot.reaped = True

    def sweep_worker_files(self, pid: int) -> None:
        """Remove a dead worker's temporary files (``tmp/<batch>.<pid>``). Its own ``finally``
        never ran after a kill -9: an empty or whole batch outside the ledger and, once it had
        linked the batch, a second name that keeps the batch's pages after it is deleted."""
        suffix = f".{pid}"
        with os.scandir(self.paths.tmp_dir) as entries:
            for entry in entries:
                if entry.name.endswith(suffix):
                    try:
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        pass

    def _settle_unreported_task(self, slot: WorkerSlot) -> None:
        """The task of a worker that died without reporting it. If it had published the batch
        (linked before the kill, "done" never sent), the batch counts as made: left out of the
        ledger it would be outside the bound until made again. Otherwise it is missing again;
        and if the worker was killed as hung, that is a failed attempt of the batch, so a
        sample that blocks every time stops the daemon instead of looping forever."""
        rank, index = slot.task
        slot.task = None
        epoch, step = self.plan.unlinear(index)
        try:
            published = stat.S_ISREG(os.lstat(self.paths.batch(epoch, step, rank)).st_mode)
        except FileNotFoundError:
            published = False
        if published:
            log.info(
                "worker pid %d published batch e%d s%d r%d but died before reporting it; counting it as made",
                slot.process.pid,
                epoch,
                step,
                rank,
            )
            self._count_published(rank, index)
            return
        self.scheduler.task_abandoned(rank, index)
        if not slot.hung:
            # A worker that dies making the same batch again and again (a sample that crashes
            # the decoder, a callable that exits) must not loop forever below the restart rate.
            self._deaths[(rank, index)] += 1
            if self._deaths[(rank, index)] >= _TASK_DEATHS:
                raise DaemonStop(
                    f"the worker making batch e{epoch} s{step} r{rank} died {_TASK_DEATHS} times (last exit code "
                    f"{slot.process.exitcode}){slot.making_text()}: a sample of it crashes its process (a broken "
                    f"file and a native decoder, or a [pipeline] callable that exits); see {self.paths.log}",
                    ExitCode.WORKER_CRASHES,
                )
            return
        self._attempts[(rank, index)] += 1
        if self._attempts[(rank, index)] >= _TASK_ATTEMPTS:
            raise DaemonStop(
                f"batch e{epoch} s{step} r{rank} made no progress within --worker-timeout "
                f"{self.config.worker_timeout:g} s, {_TASK_ATTEMPTS} times{slot.making_text()}: a sample of it "
                "blocks (a read on a hung network mount?) or takes longer than --worker-timeout; fix the data "
                f"source, or raise --worker-timeout above the slowest sample; see {self.paths.log}",
                ExitCode.TASK_ERROR,
            )

    def assign_tasks(self) -> None:
        now = time.monotonic()
        if now < self._no_space_until:
            return
        for slot in self.workers:
            if not slot.ready or slot.task is not None:
                continue
            task = self.scheduler.next_task()
            if task is None:
                gave_way = self.scheduler.make_room()
                if gave_way is None:
                    return
                rank, index = gave_way
                self.delete_batch(rank, index)
                log.info(
                    "the buffer was full with a batch missing before ready ones: deleted epoch %d step %d of "
                    "rank %d, the farthest ahead, to make the missing one first",
                    *self.plan.unlinear(index),
                    rank,
                )
                task = self.scheduler.next_task()
                if task is None:
                    return  # its slot is still mapped by a client: freed within a tick
            if self._retry_after.get(task, 0) > now:
                return  # the most urgent batch is backing off after a failure
            self._retry_after.pop(task, None)
            rank, index = task
            epoch, step = self.plan.unlinear(index)
            if epoch > MAX_EPOCH:  # a window reaching past the last epoch a batch name can hold
                return
            try:
                slot.conn.send_bytes(json.dumps({"op": "produce", "epoch": epoch, "step": step, "rank": rank}).encode())
            except OSError:
                continue  # dying worker: reap_workers replaces it
            self.scheduler.task_started(rank, index)
            slot.task = task
            slot.progressed_at = time.monotonic()  # a new task: its first sample has the whole timeout
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    # -- positions and garbage -----------------------------------------------------------

    def move_position(self, rank: int, epoch: int, step: int) -> None:
        """Apply a rank's reported position; BadMessage (nothing changed) for one outside the plan.

        Peers send it (a progress file, a control message), so every value is checked here,
        before it can become a task: a huge epoch would reach a worker and fail there forever.
        """
        if not (
            0 <= rank < self.config.world_size
            and 0 <= epoch <= MAX_EPOCH
            and 0 <= step <= self.plan.batches_per_epoch
        ):
            raise OutsidePlan(
                f"position rank {str(rank)[:24]} epoch {str(epoch)[:24]} step {str(step)[:24]} is outside the plan "
                f"(ranks 0..{self.config.world_size - 1}, epochs 0..{MAX_EPOCH}, "
                f"steps 0..{self.plan.batches_per_epoch})"
            )
        state = self.scheduler.ranks[rank]
        before = state.consumed
        for index in self.scheduler.move_position(rank, self.plan.linear(epoch, step)):
            self.delete_batch(rank, index)
        now = time.monotonic()
        self._last_report[rank] = now
        if state.consumed > before:
            self._consume_rate.add(now, state.consumed - before)

    def delete_batch(self, rank: int, index: int) -> None:
        epoch, step = self.plan.unlinear(index)
        if self.retired.retire(self.paths.batch(epoch, step, rank)):
            self.deleted += 1
            self._reserve_pinned()

    def free_retired(self, sweep: bool = False) -> None:
        """Free the retired batches no client maps any more (a few times a second)."""
        now = time.monotonic()
        if not sweep and (not self.retired.pinned or now < self._next_retired_check):
            return
        self._next_retired_check = now + _RETIRED_CHECK_S
        if sweep:
            self.retired.sweep()
        else:
            self.retired.retry_pinned()
        self._reserve_pinned()

    def _reserve_pinned(self) -> None:
        # A mapped batch holds its pages: whole slots of the bound stay taken until it goes.
        self.scheduler.reserved = -(-self.retired.pinned_bytes // self.layout.size)
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        sched, now = self.scheduler, time.monotonic()
        if sched.held < sched.capacity <= sched.held + sched.reserved and now >= self._next_pinned_warning:
            self._next_pinned_warning = now + _PINNED_WARNING_S
            log.warning(
                "%d consumed batches (%s) are still mapped by a trainer and count against the bound, so "
                "fewer batches are made ahead; drop references to old batches, or raise --buffer",
                len(self.retired.pinned),
                format_size(self.retired.pinned_bytes),
            )

    @property
    def used_bytes(self) -> int:
        """Bytes of the bound in use: batches ready or being written, and retired ones still mapped."""
        return self.scheduler.held * self.layout.size + self.retired.pinned_bytes

    def handle_control(self) -> None:
        """Answer the control messages waiting, at most MAX_MESSAGES_PER_TURN (a flood cannot
        starve the workers). A message that does not decode, validate or apply is counted and
        dropped: nothing a peer sends ends the loop."""
        for _ in range(control.MAX_MESSAGES_PER_TURN):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.refuse("message", f"{len(frames)} frames, expected one")
                continue
            peer, data = frames
            try:
                msg = control.decode_message(data)
                if msg["op"] == "position":
                    self.move_position(msg["rank"], msg["epoch"], msg["step"])
                    continue
                reply = self._answer(msg)
            except control.BadMessage as exc:
                self.refuse("position" if isinstance(exc, OutsidePlan) else "message", str(exc))
                continue
            except (DaemonStop, OSError):
                raise  # our own stop, or out of descriptors: the loop handles those
            except Exception:  # a bug on a peer's input: dropped like a bad message, logged in full
                log.exception("internal error answering a control message; dropped it")
                self.refuse("message", "internal error (logged above)")
                continue
            self._socket.send_multipart([peer, json.dumps(reply).encode()])

    def refuse(self, kind: str, why: str) -> None:
        """Count a peer's input that was refused. The first few of each kind are logged with
        the reason, then one line a minute with the counts: a peer repeating a bad file or
        message cannot grow the log (it lives on the tmpfs, outside the bound)."""
        self.refusals[kind] += 1
        now = time.monotonic()
        if self.refusals[kind] <= _REFUSALS_LOGGED:
            log.warning("refused a %s: %s", kind.replace("_", " "), why)
        elif now >= self._next_refusal_summary:
            self._next_refusal_summary = now + _REFUSAL_SUMMARY_S
            log.warning("refused so far: %s (last: %s)", dict(self.refusals), why)

    def _answer(self, msg: dict) -> dict:
        if msg["op"] == "status":
            return self.status()
        if msg["op"] == "stop":
            self.keep = self.keep or msg.get("keep", False)
            self.stop_reason = DaemonStop("stop requested", ExitCode.OK)
        return {"ok": True, "pid": os.getpid()}

    def check_trainers(self) -> None:
        """Tell a trainer that is gone (its process, and so its lock, ended) from a paused one
        (lock held, no reports); by policy, release the window of a gone one."""
        now = time.monotonic()
        if now < self._next_trainer_check:
            return
        self._next_trainer_check = now + _TRAINER_CHECK_S
        for rank in range(self.config.world_size):
            try:
                state = trainer_state(self.paths, rank)
            except OSError as exc:  # a symlink or FIFO planted under the name: it proves nothing
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    raise
                self.refuse("trainer_lock", f"{self.paths.trainer_lock(rank)}: {exc.strerror}")
                continue
            if state == "gone" and self.trainers[rank] == "alive":
                log.info("the trainer of rank %d is gone (%s its window)", rank, self.config.on_trainer_exit)
                if self.config.on_trainer_exit == "release":
                    for index in self.scheduler.park(rank):
                        self.delete_batch(rank, index)
            self.trainers[rank] = state

    def read_progress_files(self) -> None:
        for rank in self._watcher.drain():
            try:
                position = self._watcher.read(rank)
            except BadProgressFile as exc:
                self.refuse("progress_file", str(exc))
                continue
            if position is None:
                continue
            try:
                self.move_position(rank, *position)
            except control.BadMessage as exc:
                self.refuse("position", f"progress file of rank {rank}: {exc}")

    def status(self) -> dict:
        return job_status(self)

    # -- the loop ------------------------------------------------------------------------

    def _make_poller(self) -> zmq.Poller:
        """Wake on a control message, a worker's message, or a worker's death."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        for slot in self.workers:
            if not slot.conn.closed:  # a reaped slot whose replacement could not be spawned yet
                poller.register(slot.conn.fileno(), zmq.POLLIN)
                poller.register(slot.process.sentinel, zmq.POLLIN)
        return poller

    def handle_signal(self, signum: int, frame) -> None:
        self._signals.append(signum)  # the loop acts on it

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle_signal)
        try:
            while self.stop_reason is None:
                if self._signals:
                    log.info("signal %d: stopping", self._signals.popleft())
                    self.stop_reason = DaemonStop("signal", ExitCode.OK)
                    break
                try:
                    self.run_once()
                except OSError as exc:
                    if exc.errno not in (errno.EMFILE, errno.ENFILE):
                        raise
                    self._wait_for_descriptors(exc)
        except DaemonStop as stop:
            self.stop_reason = stop
        except Exception as exc:  # a bug: log it fully, stop cleanly
            log.exception("internal error")
            self.stop_reason = DaemonStop(f"internal error: {exc!r}; see {self.paths.log}", ExitCode.INTERNAL)
        self.shutdown()
        return self.stop_reason.exit_code

    def run_once(self) -> None:
        """One turn of the loop: wait for something to happen (at most a tick), then act."""
        if self._poller is None:  # built again only when a worker was replaced
            self._poller = self._make_poller()
        self._poller.poll(_LOOP_TICK_MS)
        self.handle_control()
        for slot in self.workers:
            self.collect_results(slot)
        self.kill_hung_workers()
        self.reap_workers()
        self.read_progress_files()
        self.check_trainers()
        self.free_retired()
        self.assign_tasks()

    def _wait_for_descriptors(self, exc: OSError) -> None:
        """Out of file descriptors (peers holding connections open, say): back off and go on.

        Every step of the loop is safe to repeat, so the turn that failed is simply tried
        again; unauthenticated connections are closed by ZeroMQ's handshake timeout
        (control.HANDSHAKE_TIMEOUT_MS), which gives the descriptors back.
        """
        self._descriptor_warnings += 1
        if self._descriptor_warnings <= _REFUSALS_LOGGED or self._descriptor_warnings % 100 == 0:
            log.warning(
                "out of file descriptors (%s; %d times so far); pausing %.1f s",
                exc.strerror,
                self._descriptor_warnings,
                _OUT_OF_DESCRIPTORS_S,
            )
        time.sleep(_OUT_OF_DESCRIPTORS_S)

    # -- stopping ------------------------------------------------------------------------

    def _halt_workers(self) -> None:
        """Ask workers to stop, wait up to the deadline, then kill what is left."""
        for slot in self.workers:
            try:
                slot.conn.send_bytes(b'{"op": "stop"}')
            except OSError:
                pass
        deadline = time.monotonic() + _WORKER_STOP_TIMEOUT_S
        for slot in self.workers:
            slot.process.join(max(0.0, deadline - time.monotonic()))
            if slot.process.is_alive():
                log.warning("worker pid %d did not stop in time; killing it", slot.process.pid)
                slot.process.kill()
                slot.process.join(2.0)
            slot.conn.close()
        self.workers = []

    def _close_io(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        if self._control is not None:
            self._control.close()  # the socket, then the authenticator thread (term() waits for it)
        self._context.term()

    def shutdown(self) -> None:
        self._halt_workers()
        self._close_io()
        log.info(
            "stopped (produced %d, deleted %d, peak %s)", self.produced, self.deleted, format_size(self.peak_bytes)
        )
        failed = self.stop_reason is not None and self.stop_reason.exit_code != ExitCode.OK
        if failed:
            log.error("stopped: %s", self.stop_reason)
        if self.keep:
            self.paths.manifest.unlink(missing_ok=True)
            self.paths.socket.unlink(missing_ok=True)
        elif failed:  # free the tmpfs, but keep the log that says why (`prefetchd stop` removes it)
            self.jobdir.remove(keep=[self.paths.log, self.paths.lock])
        else:
            self.jobdir.remove()
        self.jobdir.release()


def _write_json(path, data: dict) -> None:
    """Atomically, 0600: a reader sees the whole file or none."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _decode_worker_message(data: bytes) -> dict | None:
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return msg if isinstance(msg, dict) and isinstance(msg.get("op"), str) else None


def _raise_descriptor_limit() -> None:
    """Raise the soft limit on open files to the hard one: peers' connections (each a
    descriptor) must not run the master out of them at the common soft limit of 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return
        log.info("open-file limit raised from %d to %d", soft, hard)


def _log_start_failure(exc: BaseException) -> None:
    """Say in the job's log why the start failed (the log stays when the job folder was there
    before; a trainer waiting on the job reads its last "stopped:" line); an unforeseen error
    with its traceback. Nothing before the log is open: with no handler, logging would print
    the traceback on a foreground terminal."""
    if not log.handlers:
        return
    if isinstance(exc, UserError | DaemonStop):
        log.error("stopped: start-up failed: %s", exc)
    elif isinstance(exc, Exception):
        log.error("start-up failed on an internal error", exc_info=exc)
    else:
        log.error("start-up interrupted (%s)", type(exc).__name__)


def _log_to(path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    # backslashreplace: a line naming a file whose name is not UTF-8 must reach the log, not be lost
    handler = logging.StreamHandler(os.fdopen(fd, "a", buffering=1, errors="backslashreplace"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
