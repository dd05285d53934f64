"""Fuzz the daemon's two intakes, progress files and control messages, against a live master (in
this process, on its real control socket): thousands of hostile values, and afterwards every
rank still gets byte-identical batches."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefetchd import control
from prefetchd.workers.producer import BatchProducer
from prefetchd.workers.spec import PRODUCER_SPEC, ProducerSpec
from prefetchd_client import PrefetchLoader
from prefetchd_client.manifest import read_manifest
from tests.conftest import wait_until, write_config

pytestmark = pytest.mark.timeout(300)

HUGE = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 10**30, -1, -(2**63), 10**6, 999_999])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    HUGE,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
)
OPS = st.sampled_from(["position", "status", "ping", "stop", "exec", "", "POSITION", None, 0, ["position"]])


def control_messages() -> st.SearchStrategy[bytes]:
    return _control_messages().map(_never_a_valid_stop)


def _never_a_valid_stop(payload: bytes) -> bytes:
    """A well-formed stop is a legitimate command, not an attack: it would end the fuzzing."""
    try:
        msg = control.decode_message(payload)
    except control.BadMessage:
        return payload
    return b'{"op": "stop", "keep": "no"}' if msg["op"] == "stop" else payload


@st.composite
def _control_messages(draw) -> bytes:
    kind = draw(st.integers(0, 5))
    if kind == 0:  # a position with hostile values in each field
        fields = {k: draw(st.one_of(HUGE, JSON_VALUES)) for k in ("rank", "epoch", "step", "pid")}
        return json.dumps({"op": "position", **fields}).encode()
    if kind == 1:  # an op with random fields
        msg = {**draw(st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)), "op": draw(OPS)}
        return json.dumps(msg).encode()
    if kind == 2:  # any JSON value at all
        return json.dumps(draw(JSON_VALUES)).encode()
    if kind == 3:  # nesting deep enough to break a recursive parser, within the size cap (a larger
        # message makes ZeroMQ drop the connection, and what was queued on it, before it is read)
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        depth = draw(st.integers(1000, (control.MAX_MESSAGE_BYTES - 8) // (len(opener) + len(closer))))
        return (opener * depth + "1" + closer * depth).encode()
    if kind == 4:  # not JSON, not UTF-8
        return draw(st.binary(max_size=256))
    return b'{"op": "position", "rank": 0, "epoch": 1, "step": ' + draw(st.binary(max_size=16)) + b"}"


@st.composite
def progress_contents(draw) -> tuple[int, bytes]:
    rank = draw(st.sampled_from([0, 1, 2, 9999]))
    kind = draw(st.integers(0, 3))
    if kind == 0:
        epoch, step = draw(st.one_of(HUGE, st.integers(0, 50))), draw(st.one_of(HUGE, st.integers(0, 50)))
        return rank, f"{epoch} {step}\n".encode()
    if kind == 1:
        return rank, draw(st.binary(max_size=200))
    if kind == 2:
        return rank, draw(st.text(max_size=40)).encode("utf-8", "surrogatepass")
    return rank, b"1 " * draw(st.integers(1, 50_000))  # oversize


def refusals(paths) -> int:
    status = control.request(paths.endpoint, {"op": "status"}, timeout_s=10)
    assert status is not None, "the daemon stopped answering"
    return sum(status["totals"]["refused"].values())


def plant_special_files(paths, scratch) -> int:
    """Symlinks (to a FIFO, a file, a folder, nowhere), a FIFO and a folder under a rank's name,
    each left until the master has looked at it (or 3 s)."""
    fifo = scratch / "fifo"
    os.mkfifo(fifo)
    plants = [
        lambda p: os.symlink(fifo, p),  # open() without O_NONBLOCK would wait for a writer forever
        lambda p: os.symlink("/etc/passwd", p),
        lambda p: os.symlink("/nonexistent", p),
        lambda p: os.symlink(scratch, p),
        lambda p: os.mkfifo(p),
        lambda p: os.mkdir(p),
    ]
    path = paths.progress_dir / "rank-1"
    for plant in plants:
        before = refusals(paths)
        plant(path)
        deadline = time.monotonic() + 3
        while refusals(paths) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        (os.rmdir if path.is_dir() and not path.is_symlink() else os.unlink)(path)
    return len(plants)


def read_all(job: str, rank: int, epochs: int) -> list[dict]:
    loader = PrefetchLoader(job, rank=rank, world_size=2, as_tensors=False, verify=True, timeout=60)
    try:
        out = []
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            out += [{k: np.array(v) for k, v in batch.items()} for batch in loader]
        return out
    finally:
        loader.close()


# Generating a hostile message costs Hypothesis ~16 ms (recursive JSON values): 2,500 of them took
# 41 s, most of this test. The quick tier sends 100; the long tier the 2,500 that found the bugs.
@pytest.mark.heavy
@pytest.mark.parametrize("messages", [100, pytest.param(2500, marks=pytest.mark.long)])
def test_fuzzed_intakes_leave_the_daemon_serving_identical_batches(tmp_path, jpeg_folder, serve, messages):
    job = serve(write_config(tmp_path, jpeg_folder, world_size=2, batch_size=4, buffer="2M"))
    paths = job.paths
    pid = read_manifest(paths)["pid"]
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 30_000)  # a daemon that stopped reading fails the test, never hangs it
    sock.connect(paths.endpoint)
    sent = {"messages": 0, "malformed": 0, "files": 0}
    try:

        @settings(max_examples=messages, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(control_messages())
        def send_message(payload: bytes) -> None:
            sock.send(payload)
            sent["messages"] += 1
            try:
                control.decode_message(payload)
            except control.BadMessage:
                sent["malformed"] += 1
            while sock.poll(0):  # replies to the valid status and ping requests among them
                sock.recv()

        @settings(max_examples=messages // 3, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(progress_contents())
        def write_progress_file(case: tuple[int, bytes]) -> None:
            rank, data = case
            tmp = paths.progress_dir / ".fuzz.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, paths.progress_dir / f"rank-{rank}")
            sent["files"] += 1

        send_message()
        write_progress_file()
        for name in os.listdir(paths.progress_dir):
            os.unlink(paths.progress_dir / name)
        sent["files"] += plant_special_files(paths, tmp_path)
    finally:
        sock.close()
        context.term()

    def all_counted():
        status = control.request(paths.endpoint, {"op": "status"}, timeout_s=10)
        assert status is not None, "the daemon stopped answering after the fuzzing"
        return status if status["totals"]["refused"].get("message", 0) >= sent["malformed"] else None

    status = wait_until(all_counted, timeout_s=60, what="every malformed message counted")
    assert job.exit_code is None and status["pid"] == pid
    refused = status["totals"]["refused"]
    print(
        f"\nfuzz: {sent['messages']} messages ({sent['malformed']} malformed), {sent['files']} progress files; "
        f"refused {refused}"
    )
    assert refused["message"] == sent["malformed"]
    assert refused.get("progress_file", 0) > 0 and refused.get("position", 0) > 0

    # Every rank, two epochs, each batch equal byte for byte to the one the plan makes here.
    producer = BatchProducer(ProducerSpec.from_json(json.loads((paths.dir / PRODUCER_SPEC).read_text())))
    per_epoch = read_manifest(paths)["batches_per_epoch"]
    for rank in (0, 1):
        batches = read_all("job", rank, epochs=2)
        assert len(batches) == 2 * per_epoch
        for i, batch in enumerate(batches):
            _, expected = producer.regenerate(*divmod(i, per_epoch), rank)
            for name, array in expected.items():
                assert np.array_equal(batch[name], array), (rank, i, name)
    assert read_manifest(paths)["pid"] == pid and job.exit_code is None
