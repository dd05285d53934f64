"""The worker protocol: what the master and a worker say to each other over the worker's pipe.

One JSON object per message, ``{"op": ..., <fields>}``; each op is a frozen dataclass below
with every field always present. ``encode`` writes one, ``decode`` reads one and checks it
field by field (a [pipeline] callable that forks or prints can garble the pipe): anything
else is a BadWorkerMessage, and the master replaces that worker.

    master -> worker   Produce(epoch, step, rank, spare)  |  Stop()
    worker -> master   Ready(fields)  |  BootFailed(error)
                       Heartbeat(samples, sample, io)  every HEARTBEAT_S, from a thread: ``samples``
                           counts the sample attempts that ended, so the master can tell a task
                           that moves from one blocked in a call that releases the GIL; ``io``:
                           each object store's counters since the worker started,
                           {"s3://bucket": [requests, bytes, retries, errors, seconds]}
                       Done(epoch, step, rank, published, sources, replaced, longest_bad_run)
                       Failed(epoch, step, rank, error, sample, nospace, unreachable)
                           ``unreachable``: an object store did not answer (the batch waits for it)
    bridge -> master   ExecutorLost(why)  the Ray cluster can no longer be used (prefetchd.remote.raybridge)
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass

_MAX_STORES = 64  # object stores one worker reads: buckets and hosts, not objects
HEARTBEAT_S = 1.0  # how often a worker beats; also the granularity at which the master hears progress
MAX_MESSAGE_BYTES = 16 << 20  # a Done lists each replaced sample's path and error; a batch has a few thousand


class BadWorkerMessage(ValueError):
    """Bytes on a worker's pipe that are not one message of this protocol."""


@dataclass(frozen=True)
class Produce:
    epoch: int
    step: int
    rank: int
    spare: bool  # a consumed batch's file waits at the worker's temporary path for this batch: overwrite it


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Ready:
    fields: list  # FieldSpec.to_json() of each field of a batch: the layout every worker computes


@dataclass(frozen=True)
class BootFailed:
    error: str  # the traceback, last frames


@dataclass(frozen=True)
class Heartbeat:
    samples: int
    sample: list | None  # [sample id, path] being made, or None between samples
    io: dict = dataclasses.field(default_factory=dict)  # store -> sources.objects.IO_FIELDS, since the start


@dataclass(frozen=True)
class Done:
    epoch: int
    step: int
    rank: int
    published: bool  # False: its rank moved on, and the batch was not linked
    sources: list  # samples per source
    replaced: list  # {"slot", "index", "path", "error", "replacement"} per bad sample replaced
    longest_bad_run: int

    @property
    def task(self) -> tuple[int, int, int]:
        return self.epoch, self.step, self.rank


@dataclass(frozen=True)
class Failed:
    epoch: int
    step: int
    rank: int
    error: str
    sample: bool  # a sample could not be read, and on_error is "fail"
    nospace: bool  # the tmpfs is full
    unreachable: bool = False  # an object store did not answer, after its client's retries

    @property
    def task(self) -> tuple[int, int, int]:
        return self.epoch, self.step, self.rank


@dataclass(frozen=True)
class ExecutorLost:
    why: str


Message = Produce | Stop | Ready | BootFailed | Heartbeat | Done | Failed | ExecutorLost
_OPS = {"produce": Produce, "stop": Stop, "ready": Ready, "boot_failed": BootFailed, "heartbeat": Heartbeat}
_OPS |= {"done": Done, "failed": Failed, "executor_lost": ExecutorLost}
_OP_OF = {cls: op for op, cls in _OPS.items()}
_REPLACED_KEYS = {"slot": int, "index": int, "path": str, "error": str, "replacement": int}
_FIELD_KEYS = {"name": str, "dtype": str, "shape": list}
_HINTS = {cls: typing.get_type_hints(cls) for cls in _OPS.values()}  # evaluated once: a heartbeat a second per worker


def encode(msg: Message) -> bytes:
    return json.dumps({"op": _OP_OF[type(msg)], **dataclasses.asdict(msg)}).encode()


def decode(data: bytes) -> Message:
    """The message in ``data``, every field checked; BadWorkerMessage naming what is wrong."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadWorkerMessage(f"{len(data)} bytes, more than {MAX_MESSAGE_BYTES}")
    try:
        obj = json.loads(data)
    except UnicodeDecodeError:
        raise BadWorkerMessage("not UTF-8") from None
    except RecursionError:
        raise BadWorkerMessage("nested deeper than the parser goes") from None
    except ValueError as exc:
        raise BadWorkerMessage(f"not JSON ({exc})") from None
    if not isinstance(obj, dict) or type(obj.get("op")) is not str or obj["op"] not in _OPS:
        raise BadWorkerMessage(f"no known op in {str(obj)[:80]!r}")
    cls = _OPS[obj.pop("op")]
    hints = _HINTS[cls]
    if set(obj) != set(hints):
        raise BadWorkerMessage(f"{cls.__name__} needs the fields {sorted(hints)}, got {sorted(obj)}")
    for name, hint in hints.items():
        if not _is(obj[name], hint):
            kind = getattr(hint, "__name__", hint)
            raise BadWorkerMessage(f"{cls.__name__}.{name} must be {kind}, got {str(obj[name])[:80]!r}")
    if cls is Heartbeat and obj["sample"] is not None and not _is_sample(obj["sample"]):
        raise BadWorkerMessage(f"Heartbeat.sample must be [id, path], got {str(obj['sample'])[:80]!r}")
    if cls is Heartbeat and not _is_io(obj["io"]):
        raise BadWorkerMessage(f"Heartbeat.io must map a store to 5 counts, got {str(obj['io'])[:80]!r}")
    if cls is Done and not _is_done_lists(obj):
        raise BadWorkerMessage("Done.sources must list counts, Done.replaced the replaced samples")
    if cls is Ready and not all(_is_record(f, _FIELD_KEYS) and _are_counts(f["shape"]) for f in obj["fields"]):
        raise BadWorkerMessage(f"Ready.fields must list {{name, dtype, shape}}, got {str(obj['fields'])[:80]!r}")
    return cls(**obj)


def _is(value, hint) -> bool:
    """Whether a JSON value has the declared type; bool is not an int here."""
    if isinstance(hint, types.UnionType):
        return any(_is(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is int:
        return type(value) is int
    return isinstance(value, hint)


def _is_sample(value: list) -> bool:
    return len(value) == 2 and type(value[0]) is int and isinstance(value[1], str)


def _is_record(value, keys: dict) -> bool:
    """Whether ``value`` is a JSON object with exactly these keys, each of its type."""
    return isinstance(value, dict) and set(value) == set(keys) and all(_is(value[k], t) for k, t in keys.items())


def _is_io(value: dict) -> bool:
    """{store: [requests, bytes, retries, errors, seconds]}: non-negative finite numbers."""
    return len(value) <= _MAX_STORES and all(
        isinstance(store, str)
        and isinstance(counts, list)
        and len(counts) == 5
        and all(type(n) in (int, float) and 0 <= n < 1e18 for n in counts)
        for store, counts in value.items()
    )


def _are_counts(value: list) -> bool:
    return all(type(n) is int and n >= 0 for n in value)


def _is_done_lists(obj: dict) -> bool:
    return _are_counts(obj["sources"]) and all(_is_record(r, _REPLACED_KEYS) for r in obj["replaced"])
