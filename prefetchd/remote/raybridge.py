"""The Ray bridge: one local process, the Ray driver, that has batches made on a Ray cluster.

The pool gives it one pipe per batch it may have in flight (--ray-workers); to the master each
pipe is a worker slot that speaks the worker protocol (prefetchd.messages). A relay thread per
pipe takes a Produce, runs prefetchd.remote.raytask.make_batch as a Ray task, checks that what comes
back is that batch of this plan (its header, plan digest, layout and size) and publishes it
into the node's tmpfs as a local worker does: written to ``tmp/``, linked into ``batches/``.

The cluster's code runs here, in Ray's driver: the bridge joins only a cluster of the user's own
(rayaddress.resolve_address: ``auto`` never means another user's), and takes every result as
RAW bytes past Ray's deserialiser (rayresults.get_plain), a JSON report checked field by field
and a batch file checked byte by byte; nothing from the cluster is unpickled by prefetchd's code.

Ray stays out of the master: a driver that loses its cluster may be ended by Ray itself, and
then only this process goes. When the cluster can no longer run the tasks (its head gone, no
alive node with the resources, a node that decodes otherwise), the bridge says why
(ExecutorLost) and exits; the pool then goes on with its local workers, or stops the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import threading
import time
import traceback

import numpy as np

from prefetchd.messages import BootFailed, Done, ExecutorLost, Failed, Produce, Ready, decode, encode
from prefetchd.remote import rayaddress, raycluster, rayinstance, rayresults, raytask
from prefetchd.workers import kernel
from prefetchd.workers.producer import BatchProducer, SampleProgress
from prefetchd.workers.spec import ProducerSpec, why_not_this_batch
from prefetchd.workers.worker import _send, _send_heartbeats
from prefetchd_client.batchfile import BatchFormatError, read_batch
from prefetchd_client.batchwriter import write_batch_file

_NODE_CHECK_S = 2.0  # how often the bridge asks Ray whether a node can still run the tasks
_LOST_AFTER_S = 10.0  # how long the cluster may be unusable before the bridge gives it up
_TASK_SLACK_S = 60.0  # added to a whole batch's time before a task is cancelled as wedged


def bridge_main(spec_json: str, conns: list, nice: int, options: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the master alone decides when it stops
    kernel.die_with_the_parent()  # SIGKILL with the master, whatever Ray is doing
    os.nice(nice)
    parent = os.getppid()
    progress = [SampleProgress() for _ in conns]
    for conn, p in zip(conns, progress):
        threading.Thread(target=_send_heartbeats, args=(conn, p), daemon=True, name="heartbeat").start()
    try:
        bridge = Bridge(spec_json, conns, options)
    except raycluster.RayBootError as exc:
        error = str(exc)
    except Exception as exc:  # the log gets the traceback; the start's message, its last line, says what failed
        said = raycluster.reason_in_logs(options.get("ray_temp")) if options["address"] == "local" else None
        error = (
            f"{traceback.format_exc(limit=-4)}\nRay failed while the bridge connected and checked the nodes: "
            f"{type(exc).__name__}: {raycluster.first_line(exc)}" + (f" (Ray's own words: {said})" if said else "")
        )
    else:
        error = None
    if error is not None:
        for conn in conns:
            _send(conn, BootFailed(error=error))
        _leave_ray()
    ready = Ready(fields=[f.to_json() for f in bridge.local.layout.fields])
    for conn in conns:
        _send(conn, ready)
    threading.Thread(target=bridge.watch_cluster, daemon=True, name="cluster-check").start()
    relays = [
        threading.Thread(target=bridge.relay, args=(conn, p, parent), name=f"relay-{i}")
        for i, (conn, p) in enumerate(zip(conns, progress))
    ]
    for t in relays:
        t.start()
    for t in relays:
        t.join()


def _leave_ray() -> None:
    """End this process after a failed boot: a private instance (--ray-address local) shut down
    first, within a deadline; a ray.init still retrying in its thread does not hold the exit."""
    import ray

    try:
        if ray.is_initialized():
            raycluster.call(ray.shutdown, timeout_s=15.0)
    except Exception:
        pass
    finally:
        os._exit(0)


class Bridge:
    def __init__(self, spec_json: str, conns: list, options: dict):
        import ray

        self.ray, self.conns, self.spec_json = ray, conns, spec_json
        self.spec = ProducerSpec.from_json(json.loads(spec_json))
        self.local = BatchProducer(self.spec)  # this node's layout, and its fingerprint to match
        self.expected = self.local.fingerprint()
        self.address = rayaddress.resolve_address(options["address"])  # before Ray can resolve "auto" its own way
        self.demand = {"CPU": 1.0, **options["resources"]}
        self.timeout_s = options["worker_timeout"]
        self.deadline_s = options["worker_timeout"] * self.local.plan.batch_size + _TASK_SLACK_S
        if self.address == "local":  # before ray.init starts the instance's first process
            folder = os.path.dirname(options["ray_temp"])
            self.guard = rayinstance.start_guard(folder, options.get("ray_folder_elsewhere") == folder)
        raycluster.connect(ray, self.address, options, self._connect_timed_out)
        index = self.local.index.in_memory()  # the columns as arrays: Ray sends them once, not with every task
        self.index_ref = ray.put((index.paths, index.offsets, index.labels, index.kinds, index.members, index.starts))
        self.spec_ref = ray.put(spec_json)
        # One CPU and the custom resources each; no retries by Ray: a failed batch is the master's to reissue.
        as_task = ray.remote(num_cpus=1, resources=options["resources"], max_retries=0)
        self.fingerprint = as_task(raytask.fingerprint)
        self.make = ray.remote(num_cpus=1, resources=options["resources"], max_retries=0, num_returns=2)(
            raytask.make_batch
        )
        args = (spec_json, self.index_ref)
        raycluster.check_every_node(ray, self.fingerprint, self.demand, self.address, self.expected, args)

    def _connect_timed_out(self, message: str) -> None:
        for conn in self.conns:
            _send(conn, BootFailed(error=message))
        os._exit(0)  # ray.init is still retrying on the main thread

    # -- serving ---------------------------------------------------------------------------

    def relay(self, conn, progress: SampleProgress, parent: int) -> None:
        """Serve one slot: each Produce becomes a Ray task; its result, checked, a batch file."""
        while True:
            try:
                if not conn.poll(1.0):
                    if os.getppid() != parent:  # the master died: nobody will collect our work
                        return
                    continue
                task = decode(conn.recv_bytes())
            except (EOFError, OSError):
                return
            if not isinstance(task, Produce):  # Stop
                return
            try:
                result = self._make(task, progress)
                decode(encode(result))  # a report a Ray node got wrong fails this batch, not the bridge's pipe
            except Exception:
                result = Failed(task.epoch, task.step, task.rank, traceback.format_exc(limit=-4), False, False)
            finally:  # the spare the master left for a batch that was not written (a failed Ray task)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.local.paths.tmp_file(task.epoch, task.step, task.rank, os.getpid()))
            _send(conn, result)

    def _make(self, task: Produce, progress: SampleProgress) -> Done | Failed:
        e, k, r = task.epoch, task.step, task.rank
        refs = self.make.remote(self.spec_ref, self.index_ref, self.expected, self.timeout_s, e, k, r)
        deadline = time.monotonic() + self.deadline_s
        while True:
            try:
                report_bytes, data = rayresults.get_plain(self.ray, refs, timeout_s=1.0)
                report = rayresults.task_report(report_bytes)
                break
            except self.ray.exceptions.GetTimeoutError:
                # Waiting on Ray is not a hang of this process: the task's own watchdog (raytask)
                # ends a Ray worker that finishes no sample, and the deadline catches a wedged one.
                progress.finished += 1
                if time.monotonic() > deadline:
                    self.ray.cancel(refs[0], force=True)
                    return Failed(e, k, r, f"the Ray task made no batch in {self.deadline_s:.0f} s", False, False)
            except rayresults.NotPlainData as exc:  # not what prefetchd's task returns: refused unread
                return Failed(e, k, r, f"on Ray: {raycluster.first_line(exc)}", False, False)
            except Exception as exc:  # the Ray worker died (killed, OOM, its watchdog), or the cluster went
                return Failed(e, k, r, f"on Ray: {type(exc).__name__}: {raycluster.first_line(exc)}", False, False)
        if "mismatch" in report:
            there = report["mismatch"]
            self.lose(raycluster.mismatch_text(there.get("host", "?"), raytask.decoder_facts(), there))
        if not report.get("ok"):
            return Failed(e, k, r, str(report.get("error")), bool(report.get("sample")), False)
        data = np.frombuffer(data, np.uint8)  # a view of the RAW object in Ray's store: no copy
        why = not_this_batch(data, (e, k, r), self.local.layout, self.spec)
        if why is not None:
            return Failed(e, k, r, f"a batch from Ray is not e{e} s{k} r{r} of this job ({why})", False, False)
        try:
            published = self._publish(data, e, k, r, task.spare)
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)  # the master backs off until space returns
            return Failed(e, k, r, str(exc) if full else traceback.format_exc(limit=-4), False, full)
        return Done(e, k, r, published, report["per_source"], report["replaced"], report["longest_bad_run"])

    def _publish(self, data, e: int, k: int, r: int, spare: bool) -> bool:
        """As a local worker publishes: a whole file in tmp/ (over the spare the master left
        there, if it did), then a link that fails if the batch is there. The relay removes the
        temporary name, written or not."""
        tmp = self.local.paths.tmp_file(e, k, r, os.getpid())
        return write_batch_file(tmp, data, spare=spare, publish_as=self.local.paths.batch_file(e, k, r))

    # -- losing the cluster ----------------------------------------------------------------

    def watch_cluster(self) -> None:
        """Give the cluster up once no node could run a task for _LOST_AFTER_S, or it stops answering."""
        unusable_since = None
        while True:
            time.sleep(_NODE_CHECK_S)
            try:
                usable = raycluster.usable_nodes(self.ray, self.demand)
                why = None if usable else f"no alive Ray node has {raycluster.resources_text(self.demand)}"
            except Exception as exc:
                why = f"the Ray cluster does not answer ({type(exc).__name__}: {raycluster.first_line(exc)})"
            if why is None:
                unusable_since = None
                continue
            unusable_since = unusable_since or time.monotonic()
            if time.monotonic() - unusable_since >= _LOST_AFTER_S:
                self.lose(why)

    def lose(self, why: str) -> None:
        """Tell the master the cluster is gone, and end this process (its tasks end with it)."""
        try:
            _send(self.conns[0], ExecutorLost(why=why[:2000]))
        finally:
            os._exit(0)


def not_this_batch(data, position: tuple[int, int, int], layout, spec: ProducerSpec) -> str | None:
    """Why ``data``, a batch file's bytes from another machine, is not batch ``position`` of this
    plan and layout: its header, plan digest, fields and size (why_not_this_batch). None when it is.

    The content is not checked against the digest in its header here: Ray's transport is checked
    already. (When that was decided, the digest was a CRC-32 costing 1.6 ms for a 4.8 MB batch, a
    tenth of the bridge's work per batch; the XXH3 of format 3 costs 0.4 ms.) `prefetchd verify`
    and the client's verify mode check it."""
    try:
        header, _ = read_batch(data)
        return why_not_this_batch(header, len(data), position, layout, spec)
    except BatchFormatError as exc:
        return str(exc)
