"""The typed worker protocol (prefetchd.messages) and the versions of the files that cross
package boundaries: the manifest (daemon -> client) and producer.json (master -> workers, verify)."""

from __future__ import annotations

import json
import os

import pytest

from prefetchd import messages
from prefetchd.messages import BadWorkerMessage, BootFailed, Done, Failed, Heartbeat, Produce, Ready, Stop
from prefetchd.workers.producer import PRODUCER_SPEC, SPEC_VERSION, ProducerSpec, SpecMismatch
from prefetchd_client import PlanMismatch, PrefetchLoader
from prefetchd_client.manifest import MANIFEST_VERSION
from tests.conftest import cli, start_job, write_config

EVERY_MESSAGE = [
    Produce(epoch=1, step=2, rank=3),
    Stop(),
    Ready(fields=[{"name": "image", "dtype": "uint8", "shape": [4, 8, 8, 3]}]),
    BootFailed(error="Traceback ...\nImportError: no module named x"),
    Heartbeat(samples=7, sample=None),
    Heartbeat(samples=8, sample=[12, "/data/a/\udcff.jpg"]),
    Done(1, 2, 3, True, [4, 0], [{"slot": 0, "index": 9, "path": "/x.jpg", "error": "bad", "replacement": 10}], 1),
    Failed(1, 2, 3, "ENOSPC", sample=False, nospace=True),
]


@pytest.mark.parametrize("msg", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_pipe_as_itself(msg):
    assert messages.decode(messages.encode(msg)) == msg


def _wire(msg) -> dict:
    return json.loads(messages.encode(msg))


DONE = _wire(EVERY_MESSAGE[6])
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
    "a heartbeat's sample malformed": json.dumps({"op": "heartbeat", "samples": 1, "sample": [1]}).encode(),
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
    assert EVERY_MESSAGE[6].task == (1, 2, 3) and EVERY_MESSAGE[7].task == (1, 2, 3)


def test_a_producer_spec_of_another_version_is_refused_by_name():
    spec = ProducerSpec("/j", {}, ["s"], [], None, "h")
    assert ProducerSpec.from_json(spec.to_json()) == spec and spec.version == SPEC_VERSION
    with pytest.raises(SpecMismatch, match="another prefetchd version"):
        ProducerSpec.from_json(spec.to_json() | {"version": 999})
    with pytest.raises(SpecMismatch):
        ProducerSpec.from_json({k: v for k, v in spec.to_json().items() if k != "version"})


@pytest.mark.timeout(120)
def test_a_client_refuses_a_manifest_of_another_version_and_says_how_to_fix_it(tmp_path, jpeg_folder, job_root):
    paths = start_job(write_config(tmp_path, jpeg_folder, name="versions"))
    manifest = json.loads(paths.manifest.read_text())
    assert manifest["manifest_version"] == MANIFEST_VERSION
    loader = PrefetchLoader("versions", rank=0, world_size=1)  # this version reads it
    try:
        assert next(iter(loader)) is not None
    finally:
        loader.close()
    _rewrite(paths.manifest, manifest | {"manifest_version": 999})
    with pytest.raises(PlanMismatch, match=r"manifest version 999.*install the same version of both"):
        PrefetchLoader("versions", rank=0, world_size=1)


@pytest.mark.timeout(120)
def test_verify_refuses_a_producer_spec_of_another_version(tmp_path, jpeg_folder, job_root):
    paths = start_job(write_config(tmp_path, jpeg_folder, name="spec"))
    spec = json.loads((paths.dir / PRODUCER_SPEC).read_text())
    assert spec["version"] == SPEC_VERSION
    _rewrite(paths.dir / PRODUCER_SPEC, spec | {"version": 999})
    result = cli("verify", "spec", "--epoch", "0", "--step", "0")
    assert result.returncode == 4, result.stderr
    assert "another prefetchd version" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.timeout(120)
def test_verify_names_a_manifest_of_another_version_without_calling_it_foreign(tmp_path, jpeg_folder, job_root):
    paths = start_job(write_config(tmp_path, jpeg_folder, name="manifestv"))
    _rewrite(paths.manifest, json.loads(paths.manifest.read_text()) | {"manifest_version": 999})
    result = cli("verify", "manifestv", "--epoch", "0", "--step", "0")
    assert result.returncode == 4, result.stderr
    assert "manifest version 999" in result.stderr and "a daemon never writes that" not in result.stderr


def _rewrite(path, data: dict) -> None:
    tmp = path.with_name(path.name + ".edit")
    tmp.write_text(json.dumps(data))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
