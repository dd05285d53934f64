"""The loopback object stores of tests/objectstores.py, checked with the clients prefetchd uses:
obstore (in this process and in a child process configured by environment) and plain http.client
where a raw view of the bytes on the wire is needed."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import obstore
import pytest
from obstore.exceptions import GenericError, PreconditionError
from obstore.store import HTTPStore, S3Store

from tests.objectstores import FAULTS, DelayProxy, MotoS3, RangeServer

# The servers' own checks: the long tier (the quick tier's object-storage tests go through most faults).
pytestmark = [pytest.mark.timeout(60), pytest.mark.long]

DATA = bytes(range(256)) * 4096  # 1 MiB: several TCP sends, so "half the body" is a real partial read
PATH = "/data/train-000.tar"


def quick_retries(max_retries: int = 2, within: float = 3.0) -> dict:
    """obstore retries 10 times over up to 3 minutes by default; the tests need seconds."""
    return {
        "max_retries": max_retries,
        "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(milliseconds=200), "base": 2},
        "retry_timeout": timedelta(seconds=within),
    }


def http_store(endpoint: str, max_retries: int = 2, within: float = 3.0, **client_options) -> HTTPStore:
    return HTTPStore.from_url(
        endpoint + "/",
        client_options={"allow_http": True, **client_options},
        retry_config=quick_retries(max_retries, within),
    )


def s3_store(s3: MotoS3) -> S3Store:
    return S3Store(
        s3.bucket,
        endpoint=s3.endpoint,
        access_key_id=s3.ACCESS_KEY_ID,
        secret_access_key=s3.SECRET_ACCESS_KEY,
        region=s3.REGION,
        client_options={"allow_http": True},
        retry_config=quick_retries(),
    )


def read(store, path: str, **options) -> bytes:
    return bytes(obstore.get(store, path.lstrip("/"), options=options).bytes())


def raw_get(server: RangeServer, path: str, headers: dict | None = None) -> tuple[http.client.HTTPResponse, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response, response.read()
    finally:
        conn.close()


@pytest.fixture(autouse=True)
def nothing_left_running():
    """Every helper's threads are named objectstores-...: none may outlive its test."""
    yield
    deadline = time.monotonic() + 2
    while (left := [t.name for t in threading.enumerate() if t.name.startswith("objectstores-")]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert not left


@pytest.fixture
def server():
    with RangeServer({PATH: DATA}) as s:
        yield s


# --- RangeServer: a well-behaved server ------------------------------------------------------------


def test_head_and_ranges_as_obstore_reads_them(server):
    store = http_store(server.endpoint)
    meta = obstore.head(store, PATH.lstrip("/"))
    assert meta["size"] == len(DATA) and meta["e_tag"].startswith('"')
    assert read(store, PATH, range=(10, 20)) == DATA[10:20]
    assert read(store, PATH, range={"offset": len(DATA) - 3}) == DATA[-3:]
    assert read(store, PATH, range={"suffix": 5}) == DATA[-5:]
    assert read(store, PATH) == DATA
    assert HTTPStore.from_url(server.url(PATH), client_options={"allow_http": True}).head("")["size"] == len(DATA)
    with pytest.raises(FileNotFoundError):
        read(store, "/data/missing.tar")
    assert server.ranges == [
        (PATH, "bytes=10-19"),
        (PATH, f"bytes={len(DATA) - 3}-"),
        (PATH, "bytes=-5"),
        (PATH, None),
        ("/data/missing.tar", None),
    ]
    assert server.bytes_sent == 10 + 3 + 5 + len(DATA) + len(b"no such object\n")
    # (Not checked: obstore's pool opens a second connection now and then, when it asks again
    # before the previous one is back in the pool; test_the_wire_keep_alive_and_416 checks keep-alive.)


def test_if_match_and_a_rewrite(server):
    store = http_store(server.endpoint)
    etag = obstore.head(store, PATH.lstrip("/"))["e_tag"]
    assert read(store, PATH, if_match=etag, range=(0, 4)) == DATA[:4]
    server.objects[PATH] = b"rewritten"
    with pytest.raises(PreconditionError):
        read(store, PATH, if_match=etag)
    new_etag = obstore.head(store, PATH.lstrip("/"))["e_tag"]
    assert new_etag != etag
    assert read(store, PATH, if_match=new_etag) == b"rewritten"


def test_the_wire_keep_alive_and_416(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("HEAD", PATH)
        head = conn.getresponse()
        head.read()
        assert head.status == 200 and head.getheader("Content-Length") == str(len(DATA))
        assert head.getheader("Accept-Ranges") == "bytes" and head.getheader("Last-Modified")
        conn.request("GET", PATH, headers={"Range": "bytes=100-"})
        part = conn.getresponse()
        assert part.status == 206 and part.read() == DATA[100:]
        assert part.getheader("Content-Range") == f"bytes 100-{len(DATA) - 1}/{len(DATA)}"
        for outside in (f"bytes={len(DATA)}-", "bytes=5-2", "bytes=0-1,4-5"):
            conn.request("GET", PATH, headers={"Range": outside})
            refused = conn.getresponse()
            refused.read()
            assert refused.status == 416 and refused.getheader("Content-Range") == f"bytes */{len(DATA)}"
    finally:
        conn.close()
    assert server.connections == 1 and server.requests == 5 and server.gets == 4


def test_fault_names_and_parameters_are_checked(server):
    with pytest.raises(ValueError, match="unknown fault"):
        server.fault("slow")
    with pytest.raises(TypeError, match="hold"):
        server.fault("reset", 1, hold=3)
    assert set(FAULTS) >= {"503", "429", "reset", "truncate", "lying_length", "endless"}


# --- RangeServer: the faults ---------------------------------------------------------------------------


@pytest.mark.parametrize("status", ["503", "429"])
def test_a_storm_shorter_than_the_retries_is_survived(server, status):
    server.fault(status, 2)
    assert read(http_store(server.endpoint, max_retries=3), PATH) == DATA
    assert server.requests == 3
    server.fault(status, 5)
    with pytest.raises(GenericError, match=status):
        read(http_store(server.endpoint, max_retries=2), PATH)


@pytest.mark.parametrize(("fault", "seen"), [("reset", ConnectionResetError), ("truncate", http.client.IncompleteRead)])
def test_a_cut_body(server, fault, seen):
    server.fault(fault, 1)
    with pytest.raises(seen):
        raw_get(server, PATH)
    server.fault(fault, 1)
    # obstore resumes a body cut once with a range from where it stopped...
    assert read(http_store(server.endpoint), PATH) == DATA
    first, resumed = server.ranges[-2:]
    assert first == (PATH, None) and resumed[1].startswith("bytes=") and resumed[1].endswith(f"-{len(DATA) - 1}")
    if fault == "truncate":
        assert resumed[1] == f"bytes={len(DATA) // 2}-{len(DATA) - 1}"  # a clean close loses nothing sent
    server.fault(fault)
    with pytest.raises(GenericError, match="body"):  # ...and gives up when every answer is cut
        read(http_store(server.endpoint), PATH)


def test_a_lying_length_stalls_until_the_clients_timeout(server):
    server.fault("lying_length", hold=20)
    store = http_store(server.endpoint, max_retries=0, timeout="1s")
    started = time.monotonic()
    with pytest.raises(GenericError, match="body"):
        read(store, PATH)
    assert 1 <= time.monotonic() - started < 5
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=0.5)
    conn.request("GET", PATH)
    response = conn.getresponse()
    assert response.getheader("Content-Length") == str(len(DATA))
    with pytest.raises(TimeoutError):
        response.read()
    conn.close()
    started = time.monotonic()
    server.stop()  # the held connections end with it, long before their 20 s
    assert time.monotonic() - started < 2


def test_an_endless_body_ends_at_the_clients_timeout(server):
    server.fault("endless")
    store = http_store(server.endpoint, max_retries=0, timeout="2s")
    started = time.monotonic()
    received = 0
    with pytest.raises(GenericError, match="body"):
        # Streamed: GetResult.bytes() would allocate the declared 1 PiB up front and abort the process.
        for chunk in obstore.get(store, PATH.lstrip("/")):
            received += len(chunk)
    assert 2 <= time.monotonic() - started < 6
    assert received > len(DATA) and server.bytes_sent >= received


def test_stop_ends_an_endless_stream(server):
    server.fault("endless", declared=None)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", PATH)
    response = conn.getresponse()
    assert response.getheader("Content-Length") is None and len(response.read(1 << 20)) == 1 << 20
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 2
    # What was in flight, then the end: a body without a length ends at the close, cleanly.
    while response.read(1 << 16):
        pass
    conn.close()


def test_a_redirect_loop(server):
    server.fault("redirect_loop")
    response, _ = raw_get(server, PATH)
    assert response.status == 302 and response.getheader("Location") == PATH
    with pytest.raises(GenericError, match="redirect"):
        read(http_store(server.endpoint), PATH)
    server.clear_faults()
    assert read(http_store(server.endpoint), PATH, range=(0, 1)) == DATA[:1]


def test_a_huge_header(server):
    server.fault("huge_header", 1, size=1 << 20)
    with pytest.raises(http.client.HTTPException):  # http.client allows 64 KiB a header line
        raw_get(server, PATH)
    server.fault("huge_header")
    with pytest.raises(GenericError):
        read(http_store(server.endpoint), PATH)
    server.fault("huge_header", 1, size=1000)  # a large but acceptable one
    assert read(http_store(server.endpoint), PATH, range=(0, 3)) == DATA[:3]


def test_an_etag_that_keeps_changing(server):
    server.fault("etag_changes")
    store = http_store(server.endpoint)
    etags = {obstore.head(store, PATH.lstrip("/"))["e_tag"] for _ in range(3)}
    assert len(etags) == 3
    with pytest.raises(PreconditionError):
        read(store, PATH, if_match=etags.pop())


def test_an_outage_on_the_same_port(server):
    port = server.port
    store = http_store(server.endpoint, max_retries=1)
    assert read(store, PATH, range=(0, 2)) == DATA[:2]
    server.stop()
    with pytest.raises(GenericError):
        read(store, PATH)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    server.start()
    assert server.port == port
    assert read(store, PATH, range=(0, 2)) == DATA[:2]
    # A client whose retries outlast the outage reads through it.
    server.down_for(1.0)
    patient = http_store(server.endpoint, max_retries=30, within=10)
    started = time.monotonic()
    assert read(patient, PATH) == DATA
    assert time.monotonic() - started >= 0.9


# --- DelayProxy ------------------------------------------------------------------------------------------


def test_the_proxy_adds_its_delay_to_each_request(server):
    def timed_read(store, i: int) -> float:
        started = time.monotonic()
        assert read(store, PATH, range=(i, i + 100)) == DATA[i : i + 100]
        return time.monotonic() - started

    direct = http_store(server.endpoint)
    with DelayProxy(("127.0.0.1", server.port), delay=0.020) as proxy:
        delayed = http_store(proxy.endpoint)
        # Alternated, so that a moment of load on the machine slows both sides of a pair.
        pairs = [(timed_read(direct, i), timed_read(delayed, i)) for i in range(10)]
        assert proxy.chunks == 10  # a request a chunk
    assert min(through for _, through in pairs) >= 0.020  # each request waited its 20 ms
    added = sorted(through - straight for straight, through in pairs)
    assert added[len(added) // 2] >= 0.010


def test_stopping_the_proxy_cuts_its_connections(server):
    with DelayProxy(("127.0.0.1", server.port), delay=0.001) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        conn.request("GET", PATH, headers={"Range": "bytes=0-9"})
        assert conn.getresponse().read() == DATA[:10]
        started = time.monotonic()
        proxy.stop()
        assert time.monotonic() - started < 2
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            conn.request("GET", PATH)
            conn.getresponse()
        conn.close()


# --- MotoS3 --------------------------------------------------------------------------------------------


def test_moto_puts_gets_ranges_and_if_match():
    with MotoS3() as s3:
        s3.put("train/shard-000.tar", DATA)
        store = s3_store(s3)
        meta = obstore.head(store, "train/shard-000.tar")
        assert meta["size"] == len(DATA)
        assert read(store, "train/shard-000.tar", range=(100, 200)) == DATA[100:200]
        assert read(store, "train/shard-000.tar", if_match=meta["e_tag"]) == DATA
        with pytest.raises(PreconditionError):
            read(store, "train/shard-000.tar", if_match='"not-it"')
        with pytest.raises(GenericError, match="416"):
            read(store, "train/shard-000.tar", range=(len(DATA) + 1, len(DATA) + 10))
        assert s3.gets == 4 and s3.bytes_sent >= 100 + len(DATA)
        assert s3.ranges[0] == (f"/{s3.bucket}/train/shard-000.tar", "bytes=100-199")
        s3.delete("train/shard-000.tar")
        with pytest.raises(FileNotFoundError):
            read(store, "train/shard-000.tar")


def test_moto_stop_and_restart_keep_port_and_objects():
    with MotoS3("prefetchd-restart") as s3:
        s3.put("a.parquet", b"PAR1 then data")
        store = s3_store(s3)
        assert read(store, "a.parquet") == b"PAR1 then data"
        port = s3.port
        s3.stop()
        with pytest.raises(GenericError):
            read(store, "a.parquet")
        s3.restart()
        assert s3.port == port
        assert read(store, "a.parquet") == b"PAR1 then data"  # the same client: its pool reconnects


def test_moto_through_env_in_another_process_and_through_the_proxy():
    with MotoS3() as s3, DelayProxy(("127.0.0.1", s3.port)) as proxy:
        s3.put("train/shard-001.tar", DATA[:1000])
        child = (
            "import json, sys, obstore; from obstore.store import from_url\n"
            "store = from_url(sys.argv[1])\n"
            "data = bytes(obstore.get(store, 'train/shard-001.tar', options={'range': (10, 20)}).bytes())\n"
            "print(json.dumps(list(data)))\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        for endpoint in (s3.endpoint, proxy.endpoint):
            result = subprocess.run(
                [sys.executable, "-c", child, s3.url("")],
                env={**env, **s3.env, "AWS_ENDPOINT_URL": endpoint},
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert result.returncode == 0, result.stderr
            assert bytes(json.loads(result.stdout)) == DATA[10:20]
        assert s3.url("train/shard-001.tar") == f"s3://{s3.bucket}/train/shard-001.tar"
        assert proxy.connections >= 1 and s3.gets == 2
