"""The worker process: receives batch tasks from the master, produces them, reports back.

Started with ``spawn`` (no inherited locks, sockets or threads), its entry point takes one
small JSON spec. The messages both ways are prefetchd.messages.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
import traceback

from prefetchd.messages import (
    HEARTBEAT_S,
    BootFailed,
    Done,
    Failed,
    Heartbeat,
    Message,
    Produce,
    Ready,
    decode,
    encode,
)
from prefetchd.sources import objects
from prefetchd.workers import kernel
from prefetchd.workers.producer import BatchProducer, SampleError, SampleProgress
from prefetchd.workers.spec import ProducerSpec

_PARENT_CHECK_S = 1.0


WORKER_NAME = b"prefetchd-work"  # a worker's name in `ps -o comm` (at most 15 bytes)
_send_lock = threading.Lock()  # the heartbeat thread and the main loop share the pipe


def _send(conn, msg: Message) -> None:
    data = encode(msg)
    with _send_lock:
        conn.send_bytes(data)


def _send_heartbeats(conn, progress: SampleProgress) -> None:
    """A stopped (SIGSTOP) worker, or one stuck holding the GIL, stops beating; one blocked in a
    call that releases the GIL beats on, but its sample count stops moving. Either way the
    master kills and replaces it."""
    while True:
        time.sleep(HEARTBEAT_S)
        current = progress.current
        sample = None if current is None else [current[0], _printable(current[1])]
        try:
            io = progress.io()
        except Exception:  # noqa: BLE001 - counters are for status: a beat must not stop for them
            io = {}
        beat = Heartbeat(samples=progress.finished, sample=sample, io=io)
        try:
            _send(conn, beat)
        except OSError:
            return


def _printable(path: str) -> str:
    """A file name that is not UTF-8 (kept by os.fsdecode as surrogates) would break the log line."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def worker_main(spec_json: str, conn, nice: int = 0) -> None:
    # Ctrl-C in a foreground daemon reaches the whole process group; the master alone
    # decides how workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGKILL when its parent dies: a worker blocked in a sample (a hung mount) never gets back
    # to checking its parent, and would hold its tmp file and the index after a kill -9.
    # Elsewhere than Linux the parent check between tasks remains.
    kernel.die_with_the_parent(WORKER_NAME)
    # Below the trainer: when its threads wake (a step ends, a batch is wanted) they get a
    # core at once instead of queueing behind augmentation for a scheduler tick or two.
    os.nice(nice)
    parent = os.getppid()
    progress = SampleProgress()
    # Beating from before the boot: a slow import or first sample is not mistaken for a hang.
    threading.Thread(target=_send_heartbeats, args=(conn, progress), daemon=True, name="heartbeat").start()
    try:
        producer = BatchProducer(ProducerSpec.from_json(json.loads(spec_json)), progress)
    except Exception:
        _send(conn, BootFailed(error=traceback.format_exc(limit=-4)))
        return
    _send(conn, Ready(fields=[f.to_json() for f in producer.layout.fields]))
    while True:
        if not conn.poll(_PARENT_CHECK_S):
            if os.getppid() != parent:  # the master died: nobody will collect our work
                return
            continue
        try:
            task = decode(conn.recv_bytes())
        except EOFError:
            return
        if not isinstance(task, Produce):  # Stop
            return
        _send(conn, _produce(producer, task))


def _produce(producer: BatchProducer, task: Produce) -> Done | Failed:
    """Make the batch; its report, or why it failed (the worker lives on either way)."""
    e, k, r = task.epoch, task.step, task.rank
    try:
        published, report = producer.produce(e, k, r, task.spare)
        return Done(e, k, r, published, report.per_source, report.replaced, report.longest_bad_run)
    except SampleError as exc:
        return Failed(e, k, r, str(exc), sample=True, nospace=False)
    except objects.StoreUnreachable as exc:
        return Failed(e, k, r, str(exc), sample=False, nospace=False, unreachable=True)
    except objects.ObjectChanged as exc:
        return Failed(e, k, r, str(exc), sample=True, nospace=False)
    except OSError as exc:
        # ENOSPC: something else filled the tmpfs; nothing was published, the master backs off.
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        return Failed(e, k, r, str(exc) if full else traceback.format_exc(limit=-4), sample=False, nospace=full)
    except Exception:
        return Failed(e, k, r, traceback.format_exc(limit=-4), sample=False, nospace=False)
