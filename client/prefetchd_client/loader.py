"""PrefetchLoader: a drop-in replacement for DataLoader that reads prefetched batches.

Each ``iter()`` is one epoch from the current position. For every batch the loader tells
the daemon its position over ZeroMQ (never blocking: a slow or dead daemon never stalls the
trainer), waits for the batch file with a deadline, and maps it without copying. A thread
of the loader's (prefetchd_client.readahead) does that for the next batch while the trainer
works on this one, and mappings are closed off the trainer's thread too (unmapper).
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
import weakref
from collections.abc import Iterator

import zmq

from . import batchfile, transport
from .device import DeviceFeeder
from .errors import AuthError, BatchFormatError, BatchTimeout, DaemonDied, JobNotRunning, PlanMismatch
from .folders import open_job
from .layout import DEFAULT_CONSUMER, MAX_EPOCH, JobPaths, check_consumer_name, jobs_under, root_source
from .locks import daemon_alive, hold_trainer_lock, release_trainer_lock
from .manifest import VersionMismatch, check_manifest, check_plan, read_manifest, read_stopped
from .ranks import default_rank_and_world
from .readahead import ReadAhead, Readers
from .statecheck import config_mismatch
from .text import printable
from .waits import TrainerWaits

STATE_VERSION = 1
_LIVENESS_CHECK_S = 0.5  # how often a waiting client checks the daemon and repeats its position
_MIN_POLL_S = 0.0002  # first sleep between looks for a batch file, doubling up to:
_MAX_POLL_S = 0.005  # the longest
_SEND_QUEUE = 64  # position reports that may wait for the daemon; only the latest matters
_CLOSE_LINGER_MS = 200
_HANDSHAKE_TIMEOUT_S = 10.0  # a CURVE handshake on this node takes milliseconds
VERIFY_ENV = "PREFETCHD_VERIFY"


def _close_loader(readers: Readers, context: zmq.Context, socket: zmq.Socket, trainer_fd: int | None) -> None:
    readers.stop_all()  # first: they report on the socket
    _close_socket(context, socket, trainer_fd)


def _close_socket(context: zmq.Context, socket: zmq.Socket, trainer_fd: int | None) -> None:
    socket.close(linger=_CLOSE_LINGER_MS)
    context.term()
    if trainer_fd is not None:
        release_trainer_lock(trainer_fd)


def _torch():
    """torch when it is installed; None otherwise. Imported lazily: the daemon shares this package."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


class _EpochSampler:
    """The one sampler method frameworks call on a loader: ``set_epoch``."""

    def __init__(self, loader: PrefetchLoader):
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


def _why_it_stopped(stopped: dict) -> str:
    """The daemon's own words from its stopped.json (manifest.read_stopped), with its exit code."""
    return f"{stopped['message']}; exit code {stopped['exit_code']}"


class PrefetchLoader:
    """Iterate the batches of rank ``rank`` of the prefetchd job ``job``.

    ``timeout``: seconds the trainer waits for one batch, counted from its ``next()``.
    ``restart_grace``: seconds a waiting loader gives a dead daemon to be restarted before it
    raises DaemonDied. ``verify`` (default:
    ``$PREFETCHD_VERIFY=1``): check every batch before yielding it (its name, this job's
    config hash, the digest of its bytes) and raise BatchFormatError on any difference; a
    test mode, it reads every byte once.

    Batches are dicts of torch tensors (numpy arrays when torch is absent) mapped from the
    batch file: ``image`` uint8 [B, H, W, 3], ``label`` int64 [B], ``index`` int64 [B].

    ``device`` (torch): deliver them on that device instead, through pinned staging buffers
    and a side stream on CUDA (see prefetchd_client.device). ``normalize=(mean, std)`` (with
    ``device``): ``image`` becomes float32 [B, 3, H, W], ``(x / 255 - mean) / std``, made on
    the device.

    ``consumer``: the name of this trainer among several that read the same job (a training
    run and an evaluation beside it, two experiments of one plan): each consumer has its own
    positions and state, every batch is made once for all of them and deleted once they all
    passed it; one that falls behind is served on its own without holding the others back.
    None (the default) is the job's default consumer.

    ``curve_client_key`` (default: ``$PREFETCHD_CURVE_CLIENT_KEY``): this client's secret
    certificate, for a job whose daemon uses CURVE (its manifest has ``curve_public_key``).
    A missing, unusable or refused key raises AuthError here, not a batch timeout later.
    """

    def __init__(
        self,
        job: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        root: str | os.PathLike | None = None,
        timeout: float = 120.0,
        restart_grace: float = 10.0,
        as_tensors: bool | None = None,
        verify: bool | None = None,
        device=None,
        normalize=None,
        curve_client_key: str | os.PathLike | None = None,
        consumer: str | None = None,
    ):
        self.consumer = DEFAULT_CONSUMER if consumer is None else check_consumer_name(consumer)
        self._paths = JobPaths.of(job, root)
        self._root_source = root_source(root)
        self.manifest = self._read_manifest()
        if rank is None or world_size is None:
            default_rank, default_world = default_rank_and_world()
            rank = default_rank if rank is None else rank
            world_size = default_world if world_size is None else world_size
        self.rank, self.world_size = int(rank), int(world_size)
        check_plan(self.manifest, self._paths, self.rank, self.world_size)
        self.evaluation = self.manifest["config"].get("mode") == "eval"  # [job] mode = "eval"
        self.timeout = float(timeout)
        self.restart_grace = float(restart_grace)
        self.verify = os.environ.get(VERIFY_ENV) == "1" if verify is None else bool(verify)
        self._torch = _torch() if as_tensors in (None, True) else None
        if as_tensors and self._torch is None:
            raise ImportError("as_tensors=True needs torch; install it or pass as_tensors=False")
        self._feeder = None
        if device is not None:
            if self._torch is None:
                raise ImportError("device= needs torch (and as_tensors not False)")
            self._feeder = DeviceFeeder(self._torch, device, normalize)
        elif normalize is not None:
            raise ValueError("normalize= is applied on a device: pass device= too (device='cpu' on a CPU)")
        self._epoch, self._step = 0, 0  # the next batch this rank reads
        # The epoch a loaded state has finished (until an iteration starts), and whether
        # set_epoch named it: the next iteration is then that epoch's rest, which is empty.
        self._finished_by_state: int | None = None
        self._rest_is_empty = False
        self._epoch_set: int | None = None  # set_epoch's argument since the last iteration began
        self._loaded: tuple[tuple[int, int], int] | None = None  # ((epoch, step), samples) of the last load
        # The threads that map the next batch while the trainer holds this one; in a holder of
        # their own, which the finalizer stops (they hold this loader only weakly).
        self._readers = Readers()
        self._waits = TrainerWaits()  # the trainer's time waiting in next(), sent with each report
        self._send_lock = threading.Lock()
        server_key = self.manifest.get("curve_public_key")
        curve = transport.client_curve(server_key, curve_client_key, job=job) if server_key else None
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        # Reports queue while the connection comes up (it is asynchronous) and are
        # dropped once _SEND_QUEUE are waiting: a dead daemon costs the trainer nothing.
        self._socket.setsockopt(zmq.SNDHWM, _SEND_QUEUE)
        try:  # with CURVE, wait for the handshake: a refused key would otherwise drop every report
            if not transport.connect(self._socket, self.manifest["endpoint"], curve, _HANDSHAKE_TIMEOUT_S):
                raise AuthError(
                    f"no CURVE handshake with the daemon of job {job!r} at {self.manifest['endpoint']} within "
                    f"{_HANDSHAKE_TIMEOUT_S:.0f} s; check `prefetchd status {job}` and {self._paths.log}"
                )
        except BaseException:
            _close_socket(self._context, self._socket, None)
            raise
        # Tells the daemon this rank's trainer lives (a paused one too) until the process ends.
        self._trainer_fd = hold_trainer_lock(self._paths, self.rank, self.consumer)
        # Deliver the last reports at exit, but never wait on a dead daemon for long.
        self._finalizer = weakref.finalize(
            self, _close_loader, self._readers, self._context, self._socket, self._trainer_fd
        )

    # -- setup -----------------------------------------------------------------------------

    def _not_running_here(self) -> str:
        """No job of this name under the root: which root (and where it came from), the jobs
        that are there, and the fix."""
        job, root = self._paths.name, self._paths.dir.parent
        there = jobs_under(root)
        found = f"jobs there: {printable(', '.join(there))}" if there else "no job is there"
        return (
            f"no prefetchd job {job!r} is running under {root} ({self._root_source}); {found}; start it with "
            f"`prefetchd start CONFIG --name {job}`, or pass the root it runs under"
        )

    def _read_manifest(self) -> dict:
        """The manifest of the live job, read in folders proven this user's (folders.open_job):
        in folders another user could have prepared (its manifest naming their socket, its
        batches theirs) UnsafeFolder says whose they are, before anything there is used."""
        job, root = self._paths.name, self._paths.dir.parent
        hint = f"start it with `prefetchd start CONFIG --name {job}` (root {root})"
        try:
            folder = open_job(self._paths)
        except FileNotFoundError:
            raise JobNotRunning(self._not_running_here()) from None
        with folder:
            try:
                manifest = read_manifest(self._paths, dir_fd=folder.dir_fd)
            except FileNotFoundError:
                manifest = None
            except ValueError as exc:
                raise JobNotRunning(f"job {job!r} has no usable manifest ({exc}); {hint}") from None
            alive = manifest is not None and daemon_alive(self._paths, dir_fd=folder.dir_fd)
            # A daemon that stopped on its own error (a bad sample under --on-error fail, a
            # failure budget) may do so before its first trainer connects: say why.
            stopped = None if alive else read_stopped(self._paths, dir_fd=folder.dir_fd)
        if not alive:
            if stopped is not None:
                raise DaemonDied(
                    f"the daemon of job {job!r} stopped ({_why_it_stopped(stopped)}); see {self._paths.log} and "
                    "restart it with `prefetchd start`"
                )
            if manifest is None:
                raise JobNotRunning(self._not_running_here())
            raise JobNotRunning(f"the daemon of job {job!r} is not running (stale {self._paths.dir}): {hint}")
        try:
            return check_manifest(self._paths, manifest)
        except VersionMismatch as exc:
            raise PlanMismatch(str(exc)) from None
        except ValueError as exc:
            raise JobNotRunning(f"job {job!r} has no usable manifest ({exc}); {hint}") from None

    # -- DataLoader surface ----------------------------------------------------------------

    def __len__(self) -> int:
        return self.manifest["batches_per_epoch"]

    @property
    def batch_size(self) -> int:
        return self.manifest["batch_size"]

    @property
    def classes(self) -> list[str] | None:
        """The class names, label i named by ``classes[i]``, as torchvision's ImageFolder has them:
        an image folder's class folders, the classes `prefetchd pack` kept, a Parquet file's
        Hugging Face ClassLabel; None where the data names none."""
        names = self.manifest.get("class_names")
        return list(names) if isinstance(names, list) and all(isinstance(n, str) for n in names) else None

    @property
    def class_to_idx(self) -> dict[str, int] | None:
        """``{name: label}`` (torchvision's ``class_to_idx``), or None as for ``classes``."""
        names = self.classes
        return None if names is None else {name: i for i, name in enumerate(names)}

    @property
    def wait_stats(self) -> dict:
        """This loader's time waiting for data in ``next()``: ``wait_s``, ``waited_steps`` (> 1 ms),
        ``steps``; what ``prefetchd status`` shows for this rank (prefetchd_client.waits)."""
        return self._waits.totals()

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, step) of the next batch this rank will read.

        Right after an epoch's last batch this is already (epoch + 1, 0), whether or not the
        loop went on to exhaust the iterator.
        """
        if self._step >= len(self):
            return self._epoch + 1, 0
        return self._epoch, self._step

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at the beginning of ``epoch``.

        Setting the epoch the loader is already in changes nothing, so the usual
        ``loader.set_epoch(epoch)`` at the top of each epoch keeps a mid-epoch resume. Nor does
        setting, after ``load_state_dict``, the epoch that the loaded state has finished: a
        framework that resumes it believes it is still in that epoch (Lightning loads the state,
        calls ``iter()``, then ``sampler.set_epoch``), so the next iteration is that epoch's
        rest, which is empty, and the epoch after it comes next; the finished one never again.
        """
        epoch = int(epoch)
        if not 0 <= epoch <= MAX_EPOCH:
            raise ValueError(f"set_epoch({epoch}): epochs are 0..{MAX_EPOCH} (batch names hold six digits)")
        self._epoch_set = epoch
        self._rest_is_empty = epoch == self._finished_by_state
        if not self._rest_is_empty and epoch != self.position[0]:
            self._epoch, self._step = epoch, 0
            self._finished_by_state = self._loaded = None
            self._readers.drop_next()

    def _iteration_start(self) -> tuple[int, int]:
        """(epoch, step) where the iteration beginning now starts: the position, or the end of
        the epoch a loaded state finished, when set_epoch named that epoch (nothing to read)."""
        finished, self._finished_by_state = self._finished_by_state, None
        empty, self._rest_is_empty = self._rest_is_empty, False
        self._epoch_set = None
        epoch, step = (finished, len(self)) if empty else self.position
        if self.evaluation and 0 < step < len(self):
            # An evaluation left mid-epoch (Lightning's sanity check reads two batches) is not
            # resumed: every evaluation reads a whole epoch, and every epoch is the same.
            return epoch + 1, 0
        return epoch, step

    # Lightning reads it beside ``sampler`` before validating (is the loader shuffled?): there is none.
    batch_sampler = None

    @property
    def sampler(self) -> _EpochSampler:
        """Lightning calls ``loader.sampler.set_epoch(e)`` at every epoch start; so can you."""
        return _EpochSampler(self)

    def __iter__(self) -> Iterator[dict]:
        # The position is read at the first batch, not at iter(): Lightning calls iter()
        # before it sets the epoch.
        n = len(self)
        self._epoch, self._step = self._iteration_start()
        epoch = self._epoch
        readers = self._readers
        if readers.current is not None:  # an iterator left mid-epoch: only one thread reads
            readers.current.stop()
        reader = readers.current = readers.adopt(epoch, self._step) or ReadAhead(
            self._fetch, self._report, epoch, self._step, n, self.timeout
        )
        finished = False
        try:
            for step in range(self._step, n):
                # No local holds the batch across the yield: the trainer's reference is the only
                # one, so the batch is freed (and its mapping handed to the unmapper thread)
                # when the trainer drops it, during its step, not inside the next next().
                yield self._take(reader, step)
            finished = True
        finally:
            if finished:
                readers.keep_next(epoch + 1, reader.hand_over())
            else:
                reader.stop()
        self._epoch, self._step = epoch + 1, 0
        if not readers.announce_next():
            self._report(epoch + 1, 0)

    def _take(self, reader: ReadAhead, step: int) -> dict:
        batch = self._waits.timed(reader.take, step)
        self._step = step + 1
        return batch if self._feeder is None else self._feeder(batch)

    def state_dict(self) -> dict:
        """Global, tiny, JSON-serialisable position: the same on every rank.

        ``samples_consumed`` counts samples of the epoch's permutation, not batches, so a
        state resumes under another world size (elastic resume).
        """
        epoch, step = self.position
        consumed = step * self.manifest["global_batch"]
        if self._loaded is not None and self._loaded[0] == (epoch, step):
            # Nothing read since an elastic load: keep its exact offset, not the step's start,
            # or a chain of elastic resumes would each repeat up to a global batch.
            consumed = self._loaded[1]
        return {
            "version": STATE_VERSION,
            "config_hash": self.manifest["config_hash"],
            "config": self.manifest["config"],
            "epoch": epoch,
            "samples_consumed": consumed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` from the next ``iter()``; the daemon is told at once.

        With the same global batch (``world_size * batch_size``) the resumed run yields exactly
        what an uninterrupted one would, on any world size. With another global batch it
        resumes at the step holding the first unconsumed sample: fewer than one global batch
        of that epoch is seen twice, none is skipped. A state that has consumed this plan's
        whole epoch (a shorter one: a larger global batch drops more samples) resumes at the
        next epoch, and ``set_epoch`` of the finished one does not rewind it (see set_epoch).
        """
        job = self._paths.name
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            found = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise PlanMismatch(f"not a prefetchd loader state of version {STATE_VERSION} (found {found!r})")
        if state.get("config_hash") != self.manifest["config_hash"]:
            raise PlanMismatch(config_mismatch(job, state.get("config"), self.manifest["config"]))
        epoch, consumed = state.get("epoch"), state.get("samples_consumed")
        if not (type(epoch) is int and 0 <= epoch < MAX_EPOCH and type(consumed) is int and consumed >= 0):
            raise PlanMismatch(
                f"state has a bad position: epoch {epoch!r:.30}, samples_consumed {consumed!r:.30} "
                f"(epochs 0..{MAX_EPOCH - 1}, a non-negative sample count)"
            )
        step = consumed // self.manifest["global_batch"]
        if step >= len(self):  # the state has finished this plan's epoch
            self._epoch, self._step, self._finished_by_state = epoch + 1, 0, epoch
            self._loaded = None
        else:  # at step 0 of an epoch, the state has finished the one before
            self._epoch, self._step = epoch, step
            self._finished_by_state = epoch - 1 if step == 0 and epoch > 0 else None
            self._loaded = ((epoch, step), consumed)
        # set_epoch of the finished epoch may come before the load too (a loop that sets its
        # epoch, then restores the loader): that iteration is the finished epoch's empty rest.
        self._rest_is_empty = self._finished_by_state is not None and self._finished_by_state == self._epoch_set
        self._readers.drop_next()  # its batch unmapped now: the daemon may want the slot for the seek
        self._report(self._epoch, self._step)

    def close(self) -> None:
        if self._finalizer.alive:
            # The last position once more, from this thread: the read-ahead thread asked to
            # announce the next epoch may be stopped below before it has sent it.
            self._report(*self.position)
        self._finalizer()

    # -- internals -------------------------------------------------------------------------

    def _report(self, epoch: int, step: int) -> None:
        msg = {"op": "position", "rank": self.rank, "epoch": epoch, "step": step, "pid": os.getpid()}
        msg |= {"consumer": self.consumer} if self.consumer else {}  # the default's reports as older daemons read them
        msg.update(self._waits.report_fields())
        # The read-ahead thread reports too; a ZeroMQ socket is safe across threads with a lock.
        with self._send_lock:
            try:
                self._socket.send(json.dumps(msg).encode(), zmq.NOBLOCK)
            except zmq.Again:
                pass  # the daemon is slow or gone: the next report, or the wait loop, repeats it
            except zmq.ZMQError:
                pass  # closed under a read-ahead thread that is stopping

    def _check_batch(self, path, header: dict, arrays: dict, epoch: int, step: int) -> None:
        """Test mode: prove the batch is the one asked for, of this job's plan, and not torn."""
        expected = (epoch, step, self.rank, self.manifest["config_hash"])
        found = (header["epoch"], header["step"], header["rank"], header["meta"].get("config_hash"))
        if found != expected:
            raise BatchFormatError(f"{path}: header says epoch/step/rank/config {found}, expected {expected}")
        plan = self.manifest.get("plan_digest")  # absent in a manifest of an older daemon
        if plan is not None and header["meta"].get("plan_digest") != plan:
            raise BatchFormatError(
                f"{path}: made by another plan (its plan digest {header['meta'].get('plan_digest')!r:.40}, this "
                f"job's {plan!r}: world size, batch size, drop_last, weights, data, transforms or decoder differ); "
                "the daemon never serves such a batch, so something else put it there"
            )
        digest = batchfile.content_digest(arrays, header["fields"])
        if digest != header["meta"].get(batchfile.DIGEST_KEY):
            raise BatchFormatError(f"{path}: its bytes do not match the digest in its header (torn write?)")

    def _check_plan_again(self) -> None:
        """A daemon restarted under a waiting trainer may serve other ranks or another world
        size: PlanMismatch now, as a new loader would get, rather than BatchTimeout later."""
        try:
            manifest = self._read_manifest()
        except JobNotRunning:  # between a restart's lock and its manifest: look again later
            return
        check_plan(manifest, self._paths, self.rank, self.world_size)

    def _fetch(self, epoch: int, step: int, reader: ReadAhead) -> dict:
        """Wait for batch (epoch, step) and map it, on the read-ahead thread: between looks,
        ``reader.waiting()`` reports the trainer's progress and raises Stopped once it left."""
        path = self._paths.batch_file(epoch, step, self.rank)
        start = time.monotonic()
        next_check = start + _LIVENESS_CHECK_S
        delay, dead_since = _MIN_POLL_S, None
        while True:
            try:
                header, arrays = batchfile.map_batch(path, unmap_in_background=True, populate=True)
                break
            except FileNotFoundError:
                pass
            now = time.monotonic()
            if now >= next_check:
                # A daemon restarted within restart_grace (same job, e.g. after kill -9) serves
                # on: the reports below reach the new one and it makes what is missing.
                alive = daemon_alive(self._paths)
                dead_since = None if alive else (dead_since or now)
                stopped = None if alive else read_stopped(self._paths)
                if stopped is not None or (dead_since is not None and now - dead_since >= self.restart_grace):
                    reason = f" ({_why_it_stopped(stopped)})" if stopped else ""
                    raise DaemonDied(
                        f"the daemon of job {self._paths.name!r} stopped while rank {self.rank} waited for "
                        f"epoch {epoch} step {step}{reason}; see {self._paths.log} and restart it with "
                        "`prefetchd start`"
                    )
                if alive:
                    self._check_plan_again()
                reader.waiting(resend=True)  # a restarted daemon learns where this rank is
                next_check = now + _LIVENESS_CHECK_S
            if reader.trainer_waited_s() >= self.timeout:  # from when the trainer asked for it
                of = f" (consumer {self.consumer!r}; a job keeps 16, its log says if refused)" if self.consumer else ""
                raise BatchTimeout(
                    f"batch epoch {epoch} step {step} rank {self.rank}{of} of job {self._paths.name!r} did not arrive "
                    f"within {self.timeout:.0f} s; check `prefetchd status {self._paths.name}` and {self._paths.log}, "
                    "or raise timeout="
                )
            cut_short = reader.nap(delay)
            reader.waiting()
            delay = _MIN_POLL_S if cut_short else min(delay * 2, _MAX_POLL_S)
        if self.verify:
            self._check_batch(path, header, arrays, epoch, step)
        if self._feeder is not None:
            return arrays  # the feeder copies to the device on the trainer's thread (its stream)
        if self._torch is None:
            return arrays
        return {name: self._torch.from_numpy(a) for name, a in arrays.items()}
