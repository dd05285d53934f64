"""The worker processes: start them, talk to them over their pipes, judge their liveness,
bury the dead and start their replacements. What a death or a result means for the job
(retries, budgets, the ledger) is the master's business; this module only reports them.

With ``--executor ray`` the pool also runs the Ray bridge (prefetchd.remote.raybridge): one process
with one pipe per batch it may have in flight on the cluster. Each pipe is a slot of kind
"ray" that the master treats as any worker; they share the bridge's process, so they die
together, and the bridge is started again once all are buried. When the bridge says the
cluster is lost (or cannot start again), its slots are dropped and the local workers go on;
without local workers the daemon stops (EXECUTOR_LOST).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefetchd import messages, stopsignals
from prefetchd.errors import DaemonStop, ExitCode, JobError
from prefetchd.master import rayfolder
from prefetchd.master.job import Job
from prefetchd.workers import workerserver
from prefetchd_client.batchfile import FieldSpec

log = logging.getLogger("prefetchd")

WORKER_BOOT_TIMEOUT_S = 120.0
_LOCAL_RAY_STORE_BYTES = 1 << 30
_WORKER_STOP_TIMEOUT_S = 5.0
_SPAWN_ATTEMPTS = 5  # a fork server killed during a spawn is started again; one that always dies is not
_LOST_WITH_SERVER = 255  # multiprocessing's exit code for a worker whose fork server went away
_SERVER_EXIT_S = 1.0  # a killed server's exit shows within milliseconds; a worker that exits 255 itself waits this
_CHARGED_REMEMBERED = 256  # deaths charged lately, by process: the workers of one server die over several turns


@dataclass
class WorkerSlot:
    process: multiprocessing.Process
    conn: multiprocessing.connection.Connection
    ready: bool = False
    task: tuple[int, int] | None = None  # (rank, linear index)
    last_heard: float = field(default_factory=time.monotonic)
    # Liveness is progress: the heartbeat thread beats on while the sample loop is blocked in a
    # call that releases the GIL (a read on a hung mount), so a busy worker must also finish samples.
    samples_finished: int = 0  # the worker's count of sample attempts that ended, as last heard
    progressed_at: float = field(default_factory=time.monotonic)  # the count last moved, or the task began
    making: list | None = None  # [sample id, path] it last said it was making
    hung: bool = False  # killed by kill_hung: a hang of its task counts as a failed attempt
    reaped: bool = False  # its death is accounted for, its replacement maybe not yet spawned
    kind: str = "local"  # or "ray": a relay of the Ray bridge, whose process it shares
    server: int | None = None  # pid of the fork server a local worker came from
    io: dict = field(default_factory=dict)  # its object stores' counters, as its last heartbeat said
    retiring: float | None = None  # when it was asked to stop, idle, by resize (--workers auto): no death

    @property
    def pid(self) -> int:
        return self.process.pid

    def note_heartbeat(self, beat: messages.Heartbeat) -> None:
        self.io = beat.io  # totals since the worker started: the last beat has them all
        if beat.samples != self.samples_finished:
            self.samples_finished = beat.samples
            self.progressed_at = self.last_heard
        self.making = beat.sample

    def making_text(self) -> str:
        """' (last seen at sample 5, /data/x.jpg)', or '' when it did not say (a silent worker's
        last beat may predate the sample it is stuck on)."""
        if self.making is not None:
            return f" (last seen at sample {self.making[0]}, {self.making[1]})"
        return ""


class WorkerPool:
    def __init__(self, job: Job):
        self.job = job
        self._spec_json = json.dumps(job.spec.to_json())
        self._fields: list[FieldSpec] = []  # the batch layout's fields, as the first worker to boot said
        self.slots: list[WorkerSlot] = []
        self.changed = True  # slots were replaced since the master last registered their pipes
        self.ray_booted = False  # the bridge has connected once: a later failure loses Ray, not the start
        self.ray_lost: str | None = None  # why the Ray cluster was given up
        self._charged: dict[tuple[str, int], None] = {}  # deaths counted lately, oldest first (charge_death)
        self._ray_folder: Path | None = None  # a private Ray instance's folder (--ray-address local)
        self._io_of_the_dead: dict[str, list] = {}  # object-store counters of workers gone, summed

    def spawn_all(self) -> None:
        for _ in range(self.job.config.worker_range[1]):  # with --workers auto, the most: then by demand
            self.slots.append(self._spawn())
        if self.job.config.executor == "ray":
            self.slots.extend(self._spawn_bridge())

    def _spawn_bridge(self) -> list[WorkerSlot]:
        from prefetchd.remote.raybridge import bridge_main  # the Ray executor's machinery: only where it runs

        cfg = self.job.config
        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(cfg.ray_range[1])]  # with --ray-workers auto, the most: then by demand
        options = {
            "address": cfg.ray_address,
            "resources": dict(cfg.ray_resources or {}),
            "worker_timeout": cfg.worker_timeout,
            # --ray-address local: a private instance, its object store on disk-backed /tmp, not the tmpfs
            "local_cpus": cfg.ray_range[1],
            "store_bytes": _LOCAL_RAY_STORE_BYTES,
            "plasma_dir": tempfile.gettempdir(),
            "ray_temp": self._private_ray_folder() if cfg.ray_address == "local" else None,
        }
        if self._ray_folder is not None and self._ray_folder.parent != self.job.paths.dir:
            options["ray_folder_elsewhere"] = str(self._ray_folder)  # the bridge's guard removes it after a kill -9
        process = ctx.Process(
            target=bridge_main,
            args=(self._spec_json, [child for _, child in pipes], cfg.worker_nice, options),
            daemon=True,
            name="prefetchd-ray-bridge",
        )
        process.start()
        for _, child in pipes:
            child.close()
        self.changed = True
        return [WorkerSlot(process, parent, kind="ray") for parent, _ in pipes]

    def _private_ray_folder(self) -> str:
        """Ray's temp folder for a private instance (--ray-address local), in a 0700 folder of this
        user's (master/rayfolder.py); what a previous instance left there is ended first."""
        self._end_private_ray()
        self._ray_folder = rayfolder.make_private(self.job.paths.dir)
        return rayfolder.temp_of(self._ray_folder)

    def _end_private_ray(self) -> None:
        rayfolder.end_instance(self._ray_folder or self.job.paths.dir / rayfolder.RAY_FOLDER)
        self._ray_folder = None

    def _spawn(self) -> WorkerSlot:
        for _ in range(_SPAWN_ATTEMPTS):
            workerserver.unstick()  # a stopped server would block this spawn for good
            workerserver.start()  # usually running already (the daemon started it first thing)
            server = workerserver.server_pid()
            parent_conn, child_conn = workerserver.CONTEXT.Pipe()
            process = workerserver.CONTEXT.Process(
                target=workerserver.run_worker,
                args=(self._spec_json, child_conn, self.job.config.worker_nice),
                daemon=True,
                name="prefetchd-worker",
            )
            try:
                process.start()
            except (EOFError, ConnectionError) as exc:  # the fork server died during the spawn (killed)
                parent_conn.close()
                child_conn.close()
                log.warning("the fork server (pid %s) died starting a worker (%r); starting it again", server, exc)
                if server is not None:
                    workerserver.await_death(server)
                continue
            child_conn.close()
            self.changed = True
            return WorkerSlot(process, parent_conn, server=server)
        raise DaemonStop(
            f"the fork server that workers start from died {_SPAWN_ATTEMPTS} times in a row while starting a "
            f"worker; see {self.job.paths.log}",
            ExitCode.WORKER_BOOT,
        )

    def await_first(self) -> list[FieldSpec]:
        """Wait for one worker of each kind to boot (the Ray bridge too: a cluster that cannot be
        used fails the start); their fields are the batch layout (they all compute the same)."""
        deadline = time.monotonic() + WORKER_BOOT_TIMEOUT_S
        kinds = {s.kind for s in self.slots}
        while time.monotonic() < deadline:
            stopsignals.check_starting()
            for slot in self.slots:
                self.receive(slot)  # no task is out yet: nothing but its boot to hear
                if {s.kind for s in self.slots if s.ready} == kinds:
                    return self._fields
                if not slot.process.is_alive() and not slot.conn.poll(0):
                    what = "the Ray bridge" if slot.kind == "ray" else "a worker"
                    raise JobError(
                        f"{what} exited with code {slot.process.exitcode} while booting; see {self.job.paths.log}"
                    )
            multiprocessing.connection.wait([s.conn for s in self.slots], timeout=0.2)
        if any(s.kind == "ray" and not s.ready for s in self.slots):
            from prefetchd.remote import raycluster

            said = raycluster.reason_in_logs(self._ray_folder and rayfolder.temp_of(self._ray_folder))
            raise JobError(
                f"the Ray bridge did not connect to {self.job.config.ray_address} and check its nodes within "
                f"{WORKER_BOOT_TIMEOUT_S:.0f} s"
                + (f"; Ray's own words: {said}" if said else "")
                + f"; see {self.job.paths.log}"
            )
        raise JobError(f"no worker booted within {WORKER_BOOT_TIMEOUT_S:.0f} s; see {self.job.paths.log}")

    def receive(self, slot: WorkerSlot) -> list[messages.Done | messages.Failed]:
        """The worker's messages waiting on its pipe. Heartbeats and its boot are handled here;
        the results are returned. A boot failure stops the daemon (DaemonStop)."""
        results = []
        try:
            while slot.conn.poll(0):
                try:
                    msg = messages.decode(slot.conn.recv_bytes())
                except messages.BadWorkerMessage as exc:
                    # interleaved writes (a callable that forked): the pipe is broken
                    log.warning("unreadable message from worker pid %d (%s); replacing it", slot.pid, exc)
                    slot.process.kill()
                    return results
                slot.last_heard = time.monotonic()
                if isinstance(msg, messages.Heartbeat):
                    slot.note_heartbeat(msg)
                elif isinstance(msg, messages.BootFailed):
                    self._boot_failed(slot, msg)
                elif isinstance(msg, messages.Ready):
                    slot.ready = True
                    self.ray_booted = self.ray_booted or slot.kind == "ray"
                    self._fields = [FieldSpec.from_json(f) for f in msg.fields]
                elif isinstance(msg, messages.ExecutorLost) and slot.kind == "ray":
                    self._lose_ray(slot, msg.why)
                elif isinstance(msg, messages.Done | messages.Failed):
                    results.append(msg)
                else:  # Produce or Stop, from a [pipeline] callable that reached the pipe: no result
                    log.warning("dropped a message only the master sends, from worker pid %d: %.200s", slot.pid, msg)
        except (EOFError, OSError):
            pass  # the worker is gone; the master buries it
        return results

    def _boot_failed(self, slot: WorkerSlot, msg: messages.BootFailed) -> None:
        last = msg.error.strip().splitlines()[-1] if msg.error.strip() else "(no message)"
        if slot.kind == "ray" and self.ray_booted:  # it served before: the cluster is gone, not the config
            self._lose_ray(slot, f"the Ray bridge could not connect again: {last}")
            return
        log.error("%s failed to boot:\n%s", "the Ray bridge" if slot.kind == "ray" else "worker", msg.error)
        what = "the Ray executor" if slot.kind == "ray" else "a worker"
        raise DaemonStop(f"{what} could not start: {last} (in full in {self.job.paths.log})", ExitCode.WORKER_BOOT)

    def _lose_ray(self, slot: WorkerSlot, why: str) -> None:
        """Give the cluster up: the bridge is ended; its slots, once buried, are not replaced."""
        if self.ray_lost is None:
            local = sum(s.kind == "local" for s in self.slots)
            log.error("the Ray cluster is lost (%s); going on with %d local workers", why, local)
        self.ray_lost = why
        slot.process.kill()

    def send_task(self, slot: WorkerSlot, rank: int, index: int, spare: bool) -> bool:
        """Hand ``slot`` its task (``spare``: a file waits at its temporary path for it); False
        when its worker is dying (the master replaces it, and bury sweeps the file)."""
        epoch, step = self.job.plan.unlinear(index)
        try:
            slot.conn.send_bytes(messages.encode(messages.Produce(epoch=epoch, step=step, rank=rank, spare=spare)))
        except OSError:
            return False
        slot.task = (rank, index)
        slot.progressed_at = time.monotonic()  # a new task: its first sample has the whole timeout
        return True

    def kill_hung(self, now: float) -> None:
        """Liveness is progress. A worker silent for --worker-timeout (stopped, or stuck holding
        the GIL) is killed, and so is a busy one that finished no sample in that time (blocked in
        a call that releases the GIL: its heartbeat thread beats on). The master then buries it,
        reissues its batch and counts the hang against the batch.

        One sample that legitimately takes longer than --worker-timeout looks the same as a hung
        one: its worker is killed each time and the daemon stops after a few attempts; the
        message says to raise --worker-timeout above the slowest sample (not the whole batch).
        """
        for slot in self.slots:
            if not slot.process.is_alive() or slot.retiring is not None:  # stopping: remove_retired's
                continue
            why = self._hang(slot, now)
            if why is None:
                continue
            if slot.kind == "local" and workerserver.unstick():  # its death could not be reported
                log.warning("the fork server was stopped (SIGSTOP); killed it, its workers are replaced")
                return
            timeout = self.job.config.worker_timeout
            log.warning("worker pid %d %s (--worker-timeout %g s); killing it", slot.pid, why, timeout)
            slot.hung = True
            slot.process.kill()
            slot.process.join(5.0)

    def _hang(self, slot: WorkerSlot, now: float) -> str | None:
        """Why ``slot``'s worker counts as hung, or None while it lives and moves."""
        timeout = self.job.config.worker_timeout
        # Booting (an interpreter and its imports, on a loaded machine) has its own deadline.
        silence_allowed = timeout if slot.ready else max(timeout, WORKER_BOOT_TIMEOUT_S)
        if now - slot.last_heard > silence_allowed:
            return f"silent for {now - slot.last_heard:.0f} s"
        # Progress is heard once a heartbeat: a sample just under the timeout is not a hang.
        if slot.task is None or now - slot.progressed_at <= timeout + messages.HEARTBEAT_S:
            return None
        stalled = now - slot.progressed_at
        name = self.job.batch_name(*slot.task)
        return f"finished no sample of batch {name} for {stalled:.0f} s{slot.making_text()}"

    def died_booting(self, slot: WorkerSlot, code: int | None) -> bool:
        """It ended by itself before it booted: started again, it would end again. Killed by a
        signal (code < 0) is a death like any other; so is a bridge that lost its cluster."""
        lost = slot.kind == "ray" and self.ray_lost is not None
        return not slot.ready and code is not None and code >= 0 and not lost and not self._died_with_server(slot)

    @staticmethod
    def _died_with_server(slot: WorkerSlot) -> bool:
        """Whether a local worker died with its fork server (kill -9 of the server). multiprocessing
        then reports exit code 255, as soon as the server's socket closes: a moment before the
        kernel reports the server's own exit, which is given that moment to show."""
        if slot.kind != "local" or slot.server is None or slot.process.exitcode != _LOST_WITH_SERVER:
            return False
        return workerserver.died(slot.server, within_s=_SERVER_EXIT_S)

    def charge_death(self, slot: WorkerSlot) -> bool:
        """Whether this death counts against the restart budget: once per process that died. The
        Ray bridge's slots share its process, and the workers killed with their fork server
        (kill -9 of it) die of that one death: on a node of 40 workers it must not count 40."""
        death = ("fork server", slot.server) if self._died_with_server(slot) else ("process", slot.pid)
        if death in self._charged:
            return False
        self._charged[death] = None
        while len(self._charged) > _CHARGED_REMEMBERED:
            self._charged.pop(next(iter(self._charged)))  # the oldest: its pid may be reused one day
        return True

    def newly_dead(self) -> list[WorkerSlot]:
        """Dead workers whose death the master has not accounted for yet (not those retired)."""
        return [s for s in self.slots if not s.reaped and s.retiring is None and not s.process.is_alive()]

    @property
    def serving(self) -> list[WorkerSlot]:
        """The local workers that take tasks: neither retiring nor buried."""
        return [s for s in self.slots if s.kind == "local" and s.retiring is None and not s.reaped]

    def resize(self, target: int, now: float) -> list[int]:
        """Toward ``target`` local workers (--workers auto): new ones start now; idle ones beyond it
        are asked to stop (a busy one finishes its batch first, and goes at a later call).
        Returns the pids asked to stop."""
        serving = self.serving
        for _ in range(target - len(serving)):
            self.slots.append(self._spawn())
        stopped = []
        idle = [s for s in reversed(serving) if s.ready and s.task is None]  # the youngest first
        for slot in idle[: max(0, len(serving) - target)]:
            try:
                slot.conn.send_bytes(messages.encode(messages.Stop()))
            except OSError:
                continue  # dying already: buried as a death, and replaced
            slot.retiring = now
            stopped.append(slot.pid)
        return stopped

    def remove_retired(self, now: float) -> None:
        """Bury the workers resize stopped once they have exited (killed, should one not within
        _WORKER_STOP_TIMEOUT_S): no death, no replacement, their object-store counters kept."""
        for slot in [s for s in self.slots if s.retiring is not None]:
            if slot.process.is_alive() and now - slot.retiring > _WORKER_STOP_TIMEOUT_S and not slot.hung:
                log.warning("worker pid %d did not stop in time; killing it", slot.pid)
                slot.hung = True  # killed once: its death is all that is awaited
                slot.process.kill()
            elif slot.hung and slot.process.is_alive() and workerserver.unstick():  # its death cannot be reported
                log.warning("the fork server was stopped (SIGSTOP); killed it, its workers are replaced")
            if not slot.process.is_alive():
                slot.process.join()
                self.bury(slot)
                self.slots.remove(slot)
                self.changed = True

    def bury(self, slot: WorkerSlot) -> int | None:
        """Close a dead worker's pipe and remove its files; its exit code. Safe to repeat: the
        master marks the slot reaped only once the whole death is accounted for, so a turn cut
        short (out of descriptors) accounts for it again, restart budget included."""
        slot.conn.close()
        self._sweep_files(slot.pid)
        self._io_of_the_dead = _summed(self._io_of_the_dead, slot.io)
        slot.io = {}  # counted once, however often bury is repeated
        return slot.process.exitcode

    def _sweep_files(self, pid: int) -> None:
        """Remove a dead worker's temporary files (``tmp/<batch>.<pid>``). Its own ``finally``
        never ran after a kill -9: an empty or whole batch outside the ledger and, once it had
        linked the batch, a second name that keeps the batch's pages after it is deleted."""
        suffix = f".{pid}"
        with os.scandir(self.job.paths.tmp_dir) as entries:
            for entry in entries:
                if entry.name.endswith(suffix):
                    try:
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        pass

    def respawn_buried(self) -> None:
        """Start a replacement for each buried worker, and a new bridge once all its slots are
        buried (unless Ray is lost). A spawn that fails (out of descriptors) leaves its slot
        buried, and the next turn tries again."""
        for i, slot in enumerate(self.slots):
            if slot.reaped and slot.kind == "local":
                self.changed = True  # before the spawn: a dead slot's closed pipe must not stay registered
                self.slots[i] = self._spawn()
        relays = [s for s in self.slots if s.kind == "ray"]
        if relays and all(s.reaped for s in relays):
            self.changed = True
            self.slots = [s for s in self.slots if s.kind != "ray"]
            if self.ray_lost is None:
                self.slots.extend(self._spawn_bridge())
            elif not self.slots:
                raise DaemonStop(
                    f"the Ray cluster is lost ({self.ray_lost}) and this daemon has no local workers (--workers 0); "
                    "restart it when the cluster is back (the buffer is kept), or give it --workers",
                    ExitCode.EXECUTOR_LOST,
                )

    def wait_handles(self) -> list:
        """What the loop waits on for the workers: each pipe, and each process's death."""
        live = [s for s in self.slots if not s.conn.closed]
        return [s.conn.fileno() for s in live] + [s.process.sentinel for s in live]

    def halt(self) -> None:
        """Ask workers to stop, wait up to the deadline, then kill what is left."""
        for slot in self.slots:
            try:
                slot.conn.send_bytes(messages.encode(messages.Stop()))
            except OSError:
                pass
        deadline = time.monotonic() + _WORKER_STOP_TIMEOUT_S
        for slot in self.slots:
            slot.process.join(max(0.0, deadline - time.monotonic()))
            if slot.process.is_alive():
                log.warning("worker pid %d did not stop in time; killing it", slot.pid)
                slot.process.kill()
                slot.process.join(2.0)
            slot.conn.close()
        self.slots = []
        if self.job.config.executor == "ray" and self.job.config.ray_address == "local":
            self._end_private_ray()  # a bridge killed mid-boot leaves Ray's agents, which ignore SIGTERM

    def snapshot(self) -> list[dict]:
        """Each worker's pid, kind, whether it is busy, and with which batch (for status)."""
        return [
            {
                "pid": s.pid,
                "kind": s.kind,
                "ready": s.ready,
                "task": None if s.task is None else self.job.batch_name(*s.task),
            }
            for s in self.slots
            if s.retiring is None
        ]

    def io_status(self) -> dict[str, dict]:
        """Each object store's counters over every worker since the start (for status)."""
        totals = self._io_of_the_dead
        for slot in self.slots:
            totals = _summed(totals, slot.io)
        return {
            store: {"requests": int(n), "bytes": int(b), "retries": int(r), "errors": int(e), "seconds": round(s, 3)}
            for store, (n, b, r, e, s) in sorted(totals.items())
        }

    def executor_status(self) -> dict:
        """Where batches are made: local workers, and the Ray cluster's state (for status)."""
        cfg = self.job.config
        status = {"kind": cfg.executor, "local_workers": sum(s.kind == "local" for s in self.slots)}
        if cfg.executor == "ray":
            relays = [s for s in self.slots if s.kind == "ray"]
            state = "lost" if self.ray_lost else "connected" if any(s.ready for s in relays) else "connecting"
            status |= {"address": cfg.ray_address, "state": state, "why": self.ray_lost}
            status |= {"in_flight": sum(s.task is not None for s in relays), "slots": len(relays)}
        return status


def _summed(a: dict[str, list], b: dict[str, list]) -> dict[str, list]:
    """Counters per store, added store by store."""
    out = {store: list(values) for store, values in a.items()}
    for store, values in b.items():
        out[store] = [x + y for x, y in zip(out.get(store, [0] * len(values)), values)]
    return out
