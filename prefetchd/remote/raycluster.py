"""The Ray cluster as the bridge sees it: connecting, a private instance's folder, processes and
own words, the nodes that can run the tasks, and the check that each decodes as this node does.
Ray is imported by the caller (the bridge process); the functions that read Ray's logs need no
Ray and run in the master too.

Connecting to a Ray cluster means running code the cluster sends: Ray's driver (the bridge)
deserialises what the cluster returns with pickle whenever the object says so, and the object's
metadata is written by the node that made it. So the bridge joins only a cluster of the user's
own (``rayaddress``), and reads every result past Ray's deserialiser (``rayresults``).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

from prefetchd.remote import raytask
from prefetchd.remote.rayresults import fingerprint_report, get_plain
from prefetchd_client.text import printable

CALL_TIMEOUT_S = 60.0  # a Ray call that does not return by then: the cluster is not answering
CONNECT_TIMEOUT_S = 45.0  # ray.init retries a refused GCS port forever: the start must fail before its deadline


class RayBootError(Exception):
    """The cluster cannot be used for this job; the message says why and what to do."""


# -- a private instance (--ray-address local): its folder, its processes, its own words ----------

# Ray's socket paths: <temp>/session_<YYYY-MM-DD_HH-MM-SS_ffffff>_<pid>/sockets/plasma_store, at
# most 107 bytes (AF_UNIX's sun_path, ray._private.utils.validate_socket_filepath). Measured with
# Ray 2.60: sockets/raylet and sockets/plasma_store; the pid is the bridge's, up to 7 digits.
MAX_SOCKET_PATH_BYTES = 107
SOCKET_SUFFIX_BYTES = len("/session_2026-11-26_04-26-43_976988_1234567") + len("/sockets/plasma_store")
# A line of Ray's that says why: its C++ log at level E, F or C ("[2026-11-26 04:30:56,331 E 19281 19281]
# ..."), a Python exception's last line, an ERROR record, or the OS's words.
_REASON = re.compile(
    r"^\[[^\]]* [EFC] \d+ \d+\]|\b\w*(Error|Exception)\b:|\bERROR\b|Permission denied|Check failed|No space left"
)


# Every process of a private instance starts with this in its environment: the bridge sets it
# before ray.init starts the GCS and the raylet, and they pass their environment on to the agents
# and workers (measured with Ray 2.60: 8 of 8 processes). rayinstance finds them by it.
INSTANCE_MARK = "PREFETCHD_RAY_INSTANCE"


def instance_mark(folder: str) -> dict[str, str]:
    """The environment entry of the processes of the private instance in ``folder`` (its 0700
    folder, whose ``s`` Ray takes as its temp folder), the folder named as the clean-up names it."""
    return {INSTANCE_MARK: os.path.join(os.path.realpath(os.path.dirname(folder)), os.path.basename(folder))}


def fits_ray_sockets(temp_dir: str) -> bool:
    return len(os.fsencode(temp_dir)) + SOCKET_SUFFIX_BYTES <= MAX_SOCKET_PATH_BYTES


def reason_in_logs(temp_dir: str | None) -> str | None:
    """Ray's own words on why its instance did not boot: the last line that reads like an error
    in the newest session's logs (raylet, GCS, agents), with the file it is from."""
    if not temp_dir:
        return None
    logs = Path(temp_dir) / "session_latest" / "logs"
    try:
        files = sorted(
            (f for f in logs.iterdir() if f.suffix in (".err", ".out", ".log") and f.is_file()),
            key=lambda f: f.stat().st_mtime,
        )
    except OSError:
        return None
    said = None
    for f in files:
        try:
            with open(f, "rb") as stream:
                stream.seek(max(0, f.stat().st_size - 65536))
                tail = stream.read().decode("utf-8", "replace").splitlines()
        except OSError:
            continue
        lines = [line.strip() for line in tail if _REASON.search(line)]
        if lines:
            line = lines[-1]
            if "Check failed:" in line:  # after Ray's "you have likely discovered a bug in Ray" preamble
                line = line[line.index("Check failed:") :]
            said = f"{f.name}: {printable(line, 400)}"  # Ray's logs hold whatever its processes printed
    return said


def usable_nodes(ray, demand: dict) -> list[dict]:
    """Alive nodes with the resources a task asks for."""
    return [
        n
        for n in call(ray.nodes)
        if n.get("Alive") and all(n.get("Resources", {}).get(k, 0) >= v for k, v in demand.items())
    ]


def check_every_node(ray, fingerprint_task, demand: dict, address: str, expected: str, args: tuple) -> None:
    """Each node that can run the tasks decodes the job's first samples as this node does, or
    RayBootError names it: batches from it would differ from a local worker's."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = usable_nodes(ray, demand)
    if not nodes:
        raise RayBootError(
            f"no alive node of the Ray cluster ({address}) has what a task asks for "
            f"({resources_text(demand)}); start nodes with those resources, or change --ray-resources"
        )
    refs = {
        f"{n['NodeManagerAddress']} (node id {n['NodeID'][:12]})": fingerprint_task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(*args)
        for n in nodes
    }
    here = raytask.decoder_facts()
    for node, ref in refs.items():
        (raw,) = call(get_plain, ray, [ref], CALL_TIMEOUT_S)
        got, facts = fingerprint_report(raw)
        if got != expected:
            raise RayBootError(mismatch_text(node, here, facts))


def connect(ray, address: str, options: dict, on_timeout) -> None:
    """ray.init, for a private instance or a cluster's concrete address (``resolve_address``);
    ``on_timeout(message)`` ends the process when it has not returned within CONNECT_TIMEOUT_S.

    A private instance lives in ``options["ray_temp"]`` (a folder of this user's, inside a 0700
    one: the pool makes it), never the shared /tmp/ray."""
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    temp_dir = options.get("ray_temp") if address == "local" else None
    if address == "local":  # a private instance: its object store off the tmpfs, sized to what is in flight
        os.environ.update(instance_mark(os.path.dirname(temp_dir)))  # inherited by every process ray.init starts
        kwargs = dict(
            address="local",  # not None: Ray would take $RAY_ADDRESS or <temp>/ray_current_cluster then
            num_cpus=options["local_cpus"],
            include_dashboard=False,
            object_store_memory=options["store_bytes"],
            _plasma_directory=options["plasma_dir"],
            _temp_dir=temp_dir,
            **quiet,
        )
    else:
        kwargs = dict(address=address, **quiet)

    def timed_out():
        said = reason_in_logs(temp_dir)
        why = f"Ray's own words: {said}" if said else f"no answer within {CONNECT_TIMEOUT_S:.0f} s"
        on_timeout(
            f"cannot connect to the Ray cluster at {address}: {why}; start one (`ray start --head` on this node) "
            "or pass --ray-address HOST:PORT of a running cluster's head"
        )

    try:
        # On this thread (ray.init installs signal handlers), and with a deadline: it retries a refused
        # GCS port forever, and the start must fail with this message, not the pool's boot deadline.
        timer = threading.Timer(CONNECT_TIMEOUT_S, timed_out)
        timer.daemon = True
        timer.start()
        try:
            ray.init(**kwargs)
        finally:
            timer.cancel()
    except Exception as exc:
        said = reason_in_logs(temp_dir)
        raise RayBootError(
            f"cannot connect to the Ray cluster at {address}: {type(exc).__name__}: {first_line(exc)}"
            + (f" (Ray's own words: {said})" if said else "")
            + "; start one (`ray start --head` on this node) or pass --ray-address HOST:PORT"
        ) from None
    if not hasattr(getattr(ray._private.worker.global_worker, "core_worker", None), "get_objects"):
        raise RayBootError(
            f"Ray {ray.__version__} has no core_worker.get_objects, which prefetchd reads results through "
            "(never unpickling them): install the Ray version prefetchd[ray] names"
        )


def call(fn, *args, timeout_s: float | None = None):
    """A Ray call with a deadline (Ray's own may wait a minute or more for a lost head)."""
    timeout_s = CALL_TIMEOUT_S if timeout_s is None else timeout_s
    result: list = []

    def run():
        try:
            result.append((True, fn(*args)))
        except Exception as exc:
            result.append((False, exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    if not result:
        raise TimeoutError(f"no answer from Ray within {timeout_s:.0f} s")
    ok, value = result[0]
    if not ok:
        raise value
    return value


def mismatch_text(node: str, here: dict, there: dict) -> str:
    differ = ", ".join(
        f"{k} {there.get(k)} there, {here[k]} here" for k in sorted(here) if k != "host" and here[k] != there.get(k)
    )
    return (
        f"Ray node {node} decodes and augments this job's samples into other bytes than this node "
        f"({differ or 'same versions: is the data at the same path there?'}); its batches would differ "
        "from a local worker's. Install the same Pillow / libjpeg-turbo / simplejpeg on every node and mount "
        "the data at the same path, or keep that node out of the cluster"
    )


def resources_text(demand: dict) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in demand.items())


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "(no message)"
