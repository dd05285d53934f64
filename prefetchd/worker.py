"""The worker process: receives batch tasks from the master, produces them, reports back.

Started with ``spawn`` (no inherited locks, sockets or threads), its entry point takes one
small JSON spec. Messages on the pipe are JSON in both directions:

    master -> worker   {"op": "produce", "epoch": E, "step": K, "rank": R}  |  {"op": "stop"}
    worker -> master   {"op": "ready", "fields": [...]}  |  {"op": "boot_failed", "error": "..."}
                       {"op": "heartbeat", "samples": n, "sample": [id, path] | null}  (every second,
                        from a thread: n counts the sample attempts that ended, so the master can
                        tell a task that moves from one blocked in a call that releases the GIL)
                       {"op": "done", "epoch", "step", "rank", "published": bool, "sources": [n, ...],
                        "replaced": [{"slot", "index", "path", "error", "replacement"}], "longest_bad_run": n}
                       {"op": "failed", "epoch", "step", "rank", "error": "...", "sample": bool, "nospace": bool}
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import threading
import time
import traceback

from .producer import BatchProducer, ProducerSpec, SampleError, SampleProgress

_PARENT_CHECK_S = 1.0


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
HEARTBEAT_S = 1.0  # also the granularity at which the master hears progress
_send_lock = threading.Lock()  # the heartbeat thread and the main loop share the pipe


def _send(conn, msg: dict) -> None:
    data = json.dumps(msg).encode()
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
        beat = {"op": "heartbeat", "samples": progress.finished, "sample": sample}
        try:
            _send(conn, beat)
        except OSError:
            return


def _printable(path: str) -> str:
    """A file name that is not UTF-8 (kept by os.fsdecode as surrogates) would break the log line."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _die_with_the_master() -> None:
    """Ask the kernel for SIGKILL when the master dies: a worker blocked in a sample (a hung
    mount) never gets back to checking its parent, and would hold its tmp file and the index
    after a kill -9 of the master. Linux only; elsewhere the parent check between tasks remains."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def worker_main(spec_json: str, conn, nice: int = 0) -> None:
    # Ctrl-C in a foreground daemon reaches the whole process group; the master alone
    # decides how workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_the_master()
    # Below the trainer: when its threads wake (a step ends, a batch is wanted) they get a
    # core at once instead of queueing behind augmentation for a scheduler tick or two.
    os.nice(nice)
    parent = os.getppid()
    progress = SampleProgress()
    # Beating from before the boot: a slow import or first sample is not mistaken for a hang.
    threading.Thread(target=_send_heartbeats, args=(conn, progress), daemon=True, name="heartbeat").start()
    try:
        producer = BatchProducer(ProducerSpec(**json.loads(spec_json)), progress)
    except Exception:
        _send(conn, {"op": "boot_failed", "error": traceback.format_exc(limit=-4)})
        return
    _send(conn, {"op": "ready", "fields": [f.to_json() for f in producer.layout.fields]})
    while True:
        if not conn.poll(_PARENT_CHECK_S):
            if os.getppid() != parent:  # the master died: nobody will collect our work
                return
            continue
        try:
            task = json.loads(conn.recv_bytes())
        except EOFError:
            return
        if task["op"] == "stop":
            return
        e, k, r = task["epoch"], task["step"], task["rank"]
        try:
            published, report = producer.produce(e, k, r)
            done = {"op": "done", "epoch": e, "step": k, "rank": r, "published": published}
            _send(
                conn,
                done
                | {
                    "sources": report.per_source,
                    "replaced": report.replaced,
                    "longest_bad_run": report.longest_bad_run,
                },
            )
        except SampleError as exc:
            _send(conn, {"op": "failed", "epoch": e, "step": k, "rank": r, "error": str(exc), "sample": True})
        except OSError as exc:
            # ENOSPC: something else filled the tmpfs; nothing was published, the master backs off.
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            error = str(exc) if full else traceback.format_exc(limit=-4)
            _send(
                conn,
                {"op": "failed", "epoch": e, "step": k, "rank": r, "error": error, "sample": False, "nospace": full},
            )
        except Exception:
            error = traceback.format_exc(limit=-4)
            _send(conn, {"op": "failed", "epoch": e, "step": k, "rank": r, "error": error, "sample": False})
