"""What the bridge takes from a Ray cluster: plain bytes read past Ray's deserialiser, and JSON
reports checked field by field. Nothing from the cluster is unpickled.
"""

from __future__ import annotations

import json


class NotPlainData(Exception):
    """A task's result is not the plain bytes prefetchd's tasks return; it was not read."""


class RayTaskFailed(Exception):
    """Ray reports the task failed (its worker died, the task raised); the message is Ray's."""


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
