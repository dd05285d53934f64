"""What runs on a Ray node: make one batch in memory, for the bridge (prefetchd.remote.raybridge).

Imported by Ray's worker processes by name (prefetchd must be installed on every node), and
free of Ray itself: the bridge wraps these functions as tasks. Arguments are plain data: the
spec as JSON text, the index as numpy arrays, integers. Results are ``bytes`` and nothing else:
Ray stores a task's ``bytes`` as a RAW object, which the bridge reads as those bytes without
Ray's deserialiser (anything else would be unpickled there); make_batch returns two of them
(its JSON report, the batch file), which the bridge checks field by field and byte by byte
before anything publishes them.

A Ray worker process builds its BatchProducer once per plan and, before its first batch,
checks that it decodes and augments as the trainer's node does (``fingerprint``): a node with
another Pillow, libjpeg-turbo or simplejpeg build, or without the data at the same path, is
refused, never mixed in. Liveness is progress here too: a watchdog ends the process when a
task finishes no sample within --worker-timeout, so Ray reports the task failed and the
master reissues the batch, as it would for a hung local worker.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import threading
import time
import traceback

import numpy as np

from prefetchd import __version__
from prefetchd.sources.index import SampleIndex
from prefetchd.workers import roidecode, tjlib
from prefetchd.workers.producer import BatchProducer, SampleError
from prefetchd.workers.spec import ProducerSpec

_HUNG_EXIT = 75  # what the watchdog exits with: Ray then fails the task and the master reissues it
_producers: dict[str, BatchProducer] = {}  # per Ray worker process: the job's producer, by plan digest
_watchdog_lock = threading.Lock()


def decoder_facts() -> dict:
    """What decides a decoded sample's bytes on this machine, for the message that refuses it."""
    from PIL import Image, features

    facts = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "prefetchd": __version__,
        "numpy": np.__version__,
        "pillow": Image.__version__,
        "libjpeg_turbo": features.version("libjpeg_turbo"),
    }
    try:
        import simplejpeg

        facts["simplejpeg"] = simplejpeg.__version__
    except Exception:  # noqa: BLE001 - absent or broken: a fact about this node, and a job may not need it
        pass
    try:
        roidecode.require()  # an ImportError whatever fails (fastdecode.require)
        facts["libturbojpeg"] = os.path.basename(tjlib.library_path())
    except ImportError:
        pass
    return facts


def fingerprint(spec_json: str, index: tuple) -> bytes:
    """This node's fingerprint of the job's first samples, and its decoder facts, as JSON
    ``{"fingerprint": str, "facts": {name: version}}``."""
    return json.dumps({"fingerprint": _producer(spec_json, index).fingerprint(), "facts": decoder_facts()}).encode()


def make_batch(spec_json: str, index: tuple, expected: str, timeout_s: float, epoch: int, step: int, rank: int):
    """Batch (epoch, step, rank): (its report as JSON, the batch file), both ``bytes``.

    A report ``{"ok": true, "per_source", "replaced", "longest_bad_run"}``, or ``{"ok": false,
    "error", "sample"}`` (a sample unreadable under on_error = "fail", or any other failure),
    or ``{"ok": false, "mismatch": {...}}`` when this node decodes otherwise than the trainer's.
    """
    empty = b""
    try:
        producer = _producer(spec_json, index)
        if getattr(producer, "checked_against", None) != expected:
            mine = producer.fingerprint()
            if mine != expected:
                return _report({"ok": False, "mismatch": {"fingerprint": mine, **decoder_facts()}}), empty
            producer.checked_against = expected
        _watch(producer, timeout_s)
        data, report = producer.make_in_memory(epoch, step, rank)
    except SampleError as exc:
        return _report({"ok": False, "sample": True, "error": str(exc)}), empty
    except Exception:
        return _report({"ok": False, "sample": False, "error": traceback.format_exc(limit=-4)}), empty
    finally:
        _watching.clear()
    summary = {
        "ok": True,
        "per_source": report.per_source,
        "replaced": report.replaced,
        "longest_bad_run": report.longest_bad_run,
    }
    return _report(summary), bytes(data)  # bytes, not a buffer or an array: Ray stores bytes RAW


def _report(report: dict) -> bytes:
    return json.dumps(report).encode()


def _producer(spec_json: str, index: tuple) -> BatchProducer:
    spec = ProducerSpec.from_json(json.loads(spec_json))
    if spec.plan_digest not in _producers:
        _producers.clear()  # one job at a time per process: another plan's is dropped
        arrays = (None if a is None else np.asarray(a) for a in index)  # kinds, members, starts: None for files only
        _producers[spec.plan_digest] = BatchProducer(spec, index=SampleIndex(*arrays))
    return _producers[spec.plan_digest]


_watching: dict = {}  # while a batch is made: {"producer", "timeout_s"}


def _watch(producer: BatchProducer, timeout_s: float) -> None:
    """Watch this batch's sample count; a thread started once per process does the watching."""
    _watching.update(producer=producer, timeout_s=timeout_s)
    with _watchdog_lock:
        if not any(t.name == "prefetchd-watchdog" for t in threading.enumerate()):
            switch = _dead_mans_switch(timeout_s)
            threading.Thread(target=_watchdog, args=(switch,), daemon=True, name="prefetchd-watchdog").start()


# A thread cannot watch its own process when the process is stopped (SIGSTOP) or a call holds the
# GIL: a small process of its own kills it when the watchdog thread has not beaten for the timeout.
_SWITCH = """
import os, select, signal, sys
parent, limit = int(sys.argv[1]), float(sys.argv[2])
fd = sys.stdin.fileno()
while True:
    ready, _, _ = select.select([fd], [], [], limit)
    if not ready:
        os.kill(parent, signal.SIGKILL)
        break
    if not os.read(fd, 4096):  # the Ray worker is gone
        break
"""


def _dead_mans_switch(timeout_s: float):
    import subprocess
    import sys

    args = [sys.executable, "-c", _SWITCH, str(os.getpid()), str(timeout_s + 2.0)]
    return subprocess.Popen(args, stdin=subprocess.PIPE, close_fds=True, start_new_session=True)


def _watchdog(switch) -> None:
    last, since = None, time.monotonic()
    while True:
        time.sleep(1.0)
        try:
            switch.stdin.write(b".")
            switch.stdin.flush()
        except OSError:
            pass
        producer, timeout_s = _watching.get("producer"), _watching.get("timeout_s")
        now = time.monotonic()
        if producer is None:
            last, since = None, now
            continue
        count = (id(producer), producer.progress.finished)
        if count != last:
            last, since = count, now
        elif now - since > timeout_s:
            current = producer.progress.current
            print(f"prefetchd: no sample finished for {timeout_s:g} s (at {current}); exiting", flush=True)
            os._exit(_HUNG_EXIT)
