"""The typed worker protocol (prefetchd.messages) and the versions of the files that cross
package boundaries: the manifest (daemon -> client) and producer.json (master -> workers, verify)."""

from __future__ import annotations

import json

import pytest

from prefetchd import messages
from prefetchd.messages import BadWorkerMessage, BootFailed, Done, Failed, Heartbeat, Produce, Ready, Stop
from prefetchd.workers.spec import SPEC_VERSION, ProducerSpec, SpecMismatch

EVERY_MESSAGE = [
    Produce(epoch=1, step=2, rank=3, spare=True),
    Stop(),
    Ready(fields=[{"name": "image", "dtype": "uint8", "shape": [4, 8, 8, 3]}]),
    BootFailed(error="Traceback ...\nImportError: no module named x"),
    Heartbeat(samples=7, sample=None),
    Heartbeat(samples=8, sample=[12, "/data/a/\udcff.jpg"]),
    Heartbeat(samples=9, sample=None, io={"s3://bucket": [3, 120_000, 1, 1, 0.25]}),
    Done(1, 2, 3, True, [4, 0], [{"slot": 0, "index": 9, "path": "/x.jpg", "error": "bad", "replacement": 10}], 1),
    Failed(1, 2, 3, "ENOSPC", sample=False, nospace=True),
    Failed(1, 2, 3, "s3://b/x.tar: no answer", sample=False, nospace=False, unreachable=True),
]


@pytest.mark.parametrize("msg", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_pipe_as_itself(msg):
    assert messages.decode(messages.encode(msg)) == msg


def _wire(msg) -> dict:
    return json.loads(messages.encode(msg))


DONE = _wire(EVERY_MESSAGE[7])
BEAT = {"op": "heartbeat", "samples": 1, "sample": None, "io": {}}
HOSTILE = {
    "not json": b"{op: done",
    "not utf-8": b'{"op": "stop"\xff}',
    "a list": b'["done"]',
    "no op": b'{"epoch": 1}',
    "an op that is a list": b'{"op": ["done"]}',
    "an unknown op": b'{"op": "exec"}',
    "nested past the parser": b"[" * 100_000 + b"]" * 100_000,
    "a field missing": json.dumps({k: v for k, v in DONE.items() if k != "longest_bad_run"}).encode(),
    "a field too many": json.dumps(DONE | {"extra": 1}).encode(),
    "a bool for an int": json.dumps(DONE | {"epoch": True}).encode(),
    "a float for an int": json.dumps(DONE | {"step": 1.5}).encode(),
    "a string for a bool": json.dumps(DONE | {"published": "yes"}).encode(),
    "sources not counts": json.dumps(DONE | {"sources": ["a"]}).encode(),
    "negative count": json.dumps(DONE | {"sources": [-1]}).encode(),
    "a replaced sample without its path": json.dumps(DONE | {"replaced": [{"slot": 0}]}).encode(),
    "a field spec without its shape": json.dumps({"op": "ready", "fields": [{"name": "x", "dtype": "uint8"}]}).encode(),
    "a field spec's shape not counts": json.dumps(
        {"op": "ready", "fields": [{"name": "x", "dtype": "uint8", "shape": ["4"]}]}
    ).encode(),
    "a heartbeat's sample malformed": json.dumps(BEAT | {"sample": [1]}).encode(),
    "a heartbeat's store counts short": json.dumps(BEAT | {"io": {"s3://b": [1, 2]}}).encode(),
    "a heartbeat's store counts negative": json.dumps(BEAT | {"io": {"s3://b": [1, 2, 0, 0, -1.0]}}).encode(),
    "a heartbeat's store counts not numbers": json.dumps(BEAT | {"io": {"s3://b": [1, 2, 0, 0, "1"]}}).encode(),
    "a heartbeat's store counts NaN": json.dumps(BEAT | {"io": {"s": [1, 0, 0, 0, float("nan")]}}).encode(),
    "a heartbeat of too many stores": json.dumps(BEAT | {"io": {str(i): [0] * 5 for i in range(65)}}).encode(),
    "failed without nospace": json.dumps(
        {"op": "failed", "epoch": 0, "step": 0, "rank": 0, "error": "x", "sample": False}
    ).encode(),
    "huge": b'{"op": "boot_failed", "error": "' + b"x" * (messages.MAX_MESSAGE_BYTES + 1) + b'"}',
}


@pytest.mark.parametrize("data", HOSTILE.values(), ids=HOSTILE.keys())
def test_anything_else_on_the_pipe_is_a_bad_worker_message(data):
    with pytest.raises(BadWorkerMessage):
        messages.decode(data)


def test_a_result_names_its_task():
    assert EVERY_MESSAGE[7].task == (1, 2, 3) and EVERY_MESSAGE[8].task == (1, 2, 3)


def test_a_producer_spec_of_another_version_is_refused_by_name():
    spec = ProducerSpec("/j", {}, ["s"], [], None, "h")
    assert ProducerSpec.from_json(spec.to_json()) == spec and spec.version == SPEC_VERSION
    with pytest.raises(SpecMismatch, match="another prefetchd version"):
        ProducerSpec.from_json(spec.to_json() | {"version": 999})
    with pytest.raises(SpecMismatch):
        ProducerSpec.from_json({k: v for k, v in spec.to_json().items() if k != "version"})
