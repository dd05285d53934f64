"""The Ray cluster as the bridge sees it: which cluster (only one of the user's own), connecting,
what comes back from it (plain bytes, never unpickled), the nodes that can run the tasks, and the
check that each decodes as this node does. Ray is imported by the caller (the bridge process);
the functions that find a cluster or read Ray's logs need no Ray and run in the master too.

Connecting to a Ray cluster means running code the cluster sends: Ray's driver (the bridge)
deserialises what the cluster returns with pickle whenever the object says so, and the object's
metadata is written by the node that made it. So the bridge joins only a cluster of the user's
own (``resolve_address``), and reads every result past Ray's deserialiser (``get_plain``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import socket
import threading
from pathlib import Path

import psutil

from prefetchd_client.text import printable

from . import raytask

CALL_TIMEOUT_S = 60.0  # a Ray call that does not return by then: the cluster is not answering
CONNECT_TIMEOUT_S = 45.0  # ray.init retries a refused GCS port forever: the start must fail before its deadline


class RayBootError(Exception):
    """The cluster cannot be used for this job; the message says why and what to do."""


class NotPlainData(Exception):
    """A task's result is not the plain bytes prefetchd's tasks return; it was not read."""


class RayTaskFailed(Exception):
    """Ray reports the task failed (its worker died, the task raised); the message is Ray's."""


# -- which cluster: only one of the user's own ---------------------------------------------------
#
# Ray's own "auto" takes $RAY_ADDRESS, then /tmp/ray/ray_current_cluster (written by whoever ran
# `ray start` last, any user), then any raylet in the process table whatever its owner. Here it is
# resolved before Ray sees it, and Ray is handed the concrete address.

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def resolve_address(address: str, environ=os.environ) -> str:
    """The address to hand Ray for ``--ray-address``: ``local``, or a concrete HOST:PORT (or
    ray://...). RayBootError when it would be a cluster of another user's on this node.

    ``auto``: $RAY_ADDRESS when set (the user's own choice), else the one cluster whose raylet on
    this node runs as this user. An address that names this node is accepted only when the port's
    listener is this user's (or root's): a head of the user's that died may have left its port to
    another user's."""
    if address == "auto":
        chosen = environ.get("RAY_ADDRESS", "").strip()
        if chosen and chosen != "auto":
            return chosen if chosen == "local" else check_owner(chosen, "$RAY_ADDRESS")
        return check_owner(_own_cluster(), "--ray-address auto")
    if address == "local":
        return address
    return check_owner(address, "--ray-address")


def _own_cluster() -> str:
    uid = os.getuid()
    mine, others = set(), set()
    for owner, gcs in _raylets():
        if owner == uid:
            mine.add(gcs)
        else:
            others.add(owner)
    if len(mine) == 1:
        return next(iter(mine))
    if mine:
        raise RayBootError(
            f"--ray-address auto: several Ray clusters of yours run on this node ({', '.join(sorted(mine))}); "
            "pass --ray-address HOST:PORT of the one to use"
        )
    uids = ", ".join(map(str, sorted(others)))
    theirs = f" (Ray runs here as uid {uids}: another user's cluster, never joined: its code would run as you)"
    theirs = theirs if others else ""
    raise RayBootError(
        f"--ray-address auto found no Ray cluster of yours on this node{theirs}. Start your own (`ray start --head`), "
        "or pass --ray-address HOST:PORT (or set RAY_ADDRESS) of a cluster you trust, or use --ray-address local"
    )


def _raylets() -> list[tuple[int, str]]:
    """(owner uid, GCS address) of each raylet on this node: a head's and a worker node's alike
    (`ray start` runs one; its command line names the cluster's GCS)."""
    found = []
    for p in psutil.process_iter(["uids", "cmdline"]):
        cmdline, uids = p.info["cmdline"], p.info["uids"]
        if not cmdline or uids is None or os.path.basename(cmdline[0]) != "raylet":
            continue
        gcs = next((a.split("=", 1)[1] for a in cmdline if a.startswith("--gcs-address=")), None)
        if gcs and uids.real == uids.effective:
            found.append((uids.real, gcs))
    return found


def check_owner(address: str, what: str) -> str:
    """``address`` as given, once a listener on this node at its port, if any, is this user's
    (or root's): RayBootError naming the owner otherwise. An address on another machine cannot
    be checked from here: it is the user's word."""
    host, port = _host_port(address)
    if host is None:
        raise RayBootError(f"{what} {address!r} is not HOST:PORT (nor auto or local)")
    if not _is_this_node(host):
        return address
    strangers = sorted(_listeners(port) - {os.getuid(), 0})  # root's: root can run code as anyone anyway
    if strangers:
        raise RayBootError(
            f"{what} {address} is a Ray cluster of another user (port {port} on this node is uid "
            f"{', '.join(map(str, strangers))}'s, not yours, uid {os.getuid()}): joining it would run its code as you. "
            "Start your own (`ray start --head --port P`) and pass its address, or use --ray-address local"
        )
    return address


def _host_port(address: str) -> tuple[str | None, int]:
    rest = address.split("://", 1)[1] if "://" in address else address
    match = re.fullmatch(r"\[?([^\[\]/]+?)\]?:(\d{1,5})", rest)
    if match is None or not 0 < int(match[2]) < 65536:
        return None, 0
    return match[1], int(match[2])


def _is_this_node(host: str) -> bool:
    try:
        found = {info[4][0].split("%")[0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False  # Ray's connect says so, with its own words
    here = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return any(ip in here or ipaddress.ip_address(ip).is_loopback for ip in found)


def _listeners(port: int) -> set[int]:
    """The uids of the sockets listening on TCP ``port`` on this node (this network namespace)."""
    uids = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
            if len(fields) > 7 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                uids.add(int(fields[7]))
    return uids


# -- what comes back: plain bytes, read past Ray's deserialiser -----------------------------------
#
# ray.get deserialises by the object's metadata, which the node that made it writes: "PYTHON"
# runs pickle.loads on the payload (cloudpickle: any code), "XLANG" msgpack, an error type a
# pickled exception, "RAW" none: a task that returns ``bytes`` is stored RAW and read back as
# those bytes. ``get_plain`` takes the serialised object from Ray's core worker and accepts RAW
# alone; an error object yields its type's name and the text Ray recorded (protobuf fields), never
# the pickled exception beside it.

MAX_REPORT_BYTES = 1 << 20  # a task's JSON report: counts and a few error texts, far below this
_RAW = b"RAW"


def get_plain(ray, refs: list, timeout_s: float) -> list:
    """The bytes (a memoryview, zero-copy: it keeps the object pinned) each task result in
    ``refs`` holds; NotPlainData for a result that is not RAW bytes, RayTaskFailed for a task
    Ray reports failed, Ray's GetTimeoutError after ``timeout_s``."""
    core = ray._private.worker.global_worker.core_worker
    objects = core.get_objects(refs, int(timeout_s * 1000))
    values = []
    for data, metadata, *_ in objects:
        metadata = bytes(metadata or b"")
        kind = metadata.split(b",")[0]
        if kind == _RAW:
            values.append(memoryview(data) if data is not None else memoryview(b""))
        elif kind.isdigit() and len(kind) < 10:
            raise RayTaskFailed(_error_text(int(kind), data))
        else:
            raise NotPlainData(
                f"a Ray task returned a {kind[:40].decode('ascii', 'replace')!r} object where prefetchd's tasks return "
                "bytes: refused unread (Ray would have unpickled it). Is the cluster running prefetchd's code?"
            )
    return values


def _error_text(error_type: int, data) -> str:
    """'WORKER_DIED', or 'TASK_EXECUTION_EXCEPTION: <Ray's formatted text>': the protobuf that Ray
    wraps in msgpack, read for its text fields; the pickled exception in it is not touched."""
    from ray._raylet import MessagePackSerializer, split_buffer
    from ray.core.generated.common_pb2 import ErrorType, RayErrorInfo, RayException

    try:
        name = ErrorType.Name(error_type)
    except ValueError:
        return f"Ray error type {error_type}"
    if not data:
        return name

    def refuse(index):
        raise NotPlainData("a Ray error object carries a Python object")

    try:
        packed, _pickled = split_buffer(data)  # the pickled part is never read
        raw = MessagePackSerializer.loads(packed, refuse)
        if not isinstance(raw, bytes):
            return name
        if name in ("TASK_EXECUTION_EXCEPTION", "TASK_CANCELLED"):
            text = RayException.FromString(raw).formatted_exception_string
        else:
            text = RayErrorInfo.FromString(raw).error_message
    except Exception:
        return name
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return f"{name}: {lines[-1][:500]}" if lines else name


def plain_json(raw, what: str) -> dict:
    """The JSON object in ``raw`` (bytes from a Ray task), or NotPlainData saying why not."""
    if len(raw) > MAX_REPORT_BYTES:
        raise NotPlainData(f"{what} from Ray is {len(raw)} bytes, more than {MAX_REPORT_BYTES}")
    try:
        obj = json.loads(bytes(raw))
    except (ValueError, RecursionError) as exc:
        raise NotPlainData(f"{what} from Ray is not JSON ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise NotPlainData(f"{what} from Ray is not a JSON object")
    return obj


def task_report(raw) -> dict:
    """make_batch's report, each field of the type it must have (raytask.make_batch lists them);
    the lists' items are checked where the result becomes a message (messages.decode)."""
    report = plain_json(raw, "a task's report")
    if report.get("ok") is True:
        _require(report, {"ok": bool, "per_source": list, "replaced": list, "longest_bad_run": int})
    elif "mismatch" in report:
        _require(report, {"ok": bool, "mismatch": dict})
        _require_text_values(report["mismatch"], "mismatch")
    else:
        _require(report, {"ok": bool, "sample": bool, "error": str})
    return report


def fingerprint_report(raw) -> tuple[str, dict]:
    report = plain_json(raw, "a node's fingerprint")
    _require(report, {"fingerprint": str, "facts": dict})
    _require_text_values(report["facts"], "facts")
    return report["fingerprint"], report["facts"]


def _require(obj: dict, fields: dict) -> None:
    if set(obj) != set(fields):
        raise NotPlainData(f"a report from Ray has the fields {sorted(obj)[:10]}, not {sorted(fields)}")
    for name, kind in fields.items():
        value = obj[name]
        if type(value) is not kind:  # bool is not an int here, nor an int a bool
            raise NotPlainData(f"a report from Ray has {name} = {str(value)[:80]!r}, not a {kind.__name__}")


def _require_text_values(obj: dict, what: str) -> None:
    if len(obj) > 64 or not all(isinstance(v, str) and len(v) <= 4096 or v is None for v in obj.values()):
        raise NotPlainData(f"a report from Ray has a {what} that is not a few names and texts")


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
