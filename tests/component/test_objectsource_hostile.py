"""Stores that are hostile or unusual, found by attacking the object-storage source: one whose
error answers echo the request (S3's InvalidToken answers carry the session token), one that
gives no ETag (python -m http.server), one that ignores Range, and index objects left from an
earlier version of their shard. Servers of the test's own, on loopback."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import re
import tarfile
import threading

import numpy as np
import pytest

from prefetchd.errors import DataError
from prefetchd.sources import objects, shards
from prefetchd.sources.tarmembers import TarMembers
from tests.component.test_objectsource import shard_bytes
from tests.conftest import cli, wait_until, write_config
from tests.objectstores import MotoS3

pytestmark = pytest.mark.timeout(120)


TOKEN = "FQoGZXIvYXdzEXAMPLESESSIONTOKENVALUE"


class _EchoS3(http.server.BaseHTTPRequestHandler):
    """Serves objects as S3 does (HEAD, ranged GET) until `fail` is set: then every GET answers
    `fail` with a one-line body that repeats the request's headers."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _serve(self, body: bool) -> None:
        data = self.server.objects.get(self.path.split("?")[0])
        if data is None:
            return self._send(404, {}, b"")
        if self.command == "GET" and self.server.fail:
            echo = ("<Error><Code>InvalidToken</Code> request: " + json.dumps(dict(self.headers)) + "</Error>").encode()
            return self._send(self.server.fail, {}, echo)
        headers = {"ETag": '"' + hashlib.md5(data).hexdigest() + '"', "Accept-Ranges": "bytes"}
        status, part = 200, data
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range") or "")
        if m and self.command == "GET":
            a, b = int(m[1]), min(int(m[2]) + 1, len(data))
            status, part = 206, data[a:b]
            headers["Content-Range"] = f"bytes {a}-{b - 1}/{len(data)}"
        self._send(status, headers, part if body else b"", length=len(part))

    def _send(self, status, headers, body, length=None):
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def do_HEAD(self):
        self._serve(False)

    def do_GET(self):
        self._serve(True)


@pytest.fixture
def echo_s3(monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EchoS3)
    server.daemon_threads = True
    server.objects, server.fail = {}, 0
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_port}",
        "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "secret-example",
        "AWS_SESSION_TOKEN": TOKEN,
        "AWS_REGION": "us-east-1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    server.env = env
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("status", [403, 400, 503])
def test_an_error_answer_that_echoes_the_request_does_not_show_the_session_token(
    echo_s3, status, tmp_path, monkeypatch
):
    monkeypatch.setenv("PREFETCHD_CACHE", str(tmp_path / "cache"))
    echo_s3.objects["/bucket/wds/train-000.tar"] = shard_bytes(0, 4)
    echo_s3.fail = status
    with pytest.raises(DataError) as caught:
        shards.scan_webdataset({"urls": "s3://bucket/wds/train-000.tar"}, "src")
    assert TOKEN not in str(caught.value)


def test_a_running_daemon_does_not_log_or_show_the_session_token(echo_s3, tmp_path, job_root):
    echo_s3.objects["/bucket/wds/train-000.tar"] = shard_bytes(0, 24)
    source = 'kind = "webdataset"\nurls = "s3://bucket/wds/train-000.tar"'
    config = write_config(tmp_path, "", name="echo", batch_size=4, buffer="64K", source=source)
    result = cli("start", str(config), "--store-timeout", "30", env=echo_s3.env)
    assert result.returncode == 0, result.stderr
    try:
        echo_s3.fail = 503  # the store "goes down", its error answers echoing the request
        shown = wait_until(
            lambda: (json.loads(cli("status", "echo", "--json").stdout or "{}").get("store") or {}).get("error"),
            timeout_s=60,
            what="status showing the store's error",
        )
        log = (job_root / "echo" / "daemon.log").read_text()
        leaks = [where for where, text in (("status", json.dumps(shown)), ("daemon.log", log)) if TOKEN in text]
        assert not leaks, f"the session token is in {leaks}: {shown}"
    finally:
        cli("stop", "echo")


def shard(labels: list[int], images: list[bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, (label, image) in enumerate(zip(labels, images)):
            for ext, data in (("cls", str(label).encode()), ("jpg", image)):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


class _NoETag(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _serve(self, body: bool) -> None:
        data = self.server.objects.get(self.path)
        if data is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        status, part, headers = 200, data, {"Accept-Ranges": "bytes", "Last-Modified": self.server.modified}
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range") or "")
        if m and self.command == "GET":
            a, b = int(m[1]), min(int(m[2]) + 1, len(data))
            status, part = 206, data[a:b]
            headers["Content-Range"] = f"bytes {a}-{b - 1}/{len(data)}"
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(part)))
        self.end_headers()
        if body:
            self.wfile.write(part)

    def do_HEAD(self):
        self._serve(False)

    def do_GET(self):
        self._serve(True)


@pytest.fixture
def server(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFETCHD_CACHE", str(tmp_path / "cache"))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoETag)
    srv.daemon_threads = True
    srv.objects, srv.modified = {}, "Mon, 02 Nov 2026 10:00:00 GMT"
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


IMAGES = [bytes([i]) * 3000 for i in range(4)]


def test_a_shard_rewritten_with_the_same_size_is_not_served_with_its_old_labels(server):
    url = f"http://127.0.0.1:{server.server_port}/d/train-000.tar"
    server.objects["/d/train-000.tar"] = shard([1, 2, 3, 4], IMAGES)
    assert shards.scan_webdataset({"urls": url}, "src").labels.tolist() == [1, 2, 3, 4]
    server.objects["/d/train-000.tar"] = shard([5, 6, 7, 8], IMAGES)  # relabelled: same size
    server.modified = "Tue, 03 Nov 2026 10:00:00 GMT"
    assert shards.scan_webdataset({"urls": url}, "src").labels.tolist() == [5, 6, 7, 8]


def test_a_shard_rewritten_under_a_running_reader_is_not_mixed_with_its_old_index(server):
    url = f"http://127.0.0.1:{server.server_port}/d/train-000.tar"
    server.objects["/d/train-000.tar"] = shard([1, 2, 3, 4], IMAGES)
    index = shards.scan_webdataset({"urls": url}, "src")
    server.objects["/d/train-000.tar"] = shard([1, 2, 3, 4], IMAGES[::-1])  # images swapped, labels kept
    server.modified = "Tue, 03 Nov 2026 10:00:00 GMT"
    reader = TarMembers()
    reader.objects_indexed = index.objects
    with pytest.raises(Exception, match="changed"):
        reader.read(index.path(0), *index.member(0))  # sample 0's label 1 with image 3's bytes otherwise


class _NoRanges(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    data = bytes(range(256)) * 64

    def log_message(self, *args):
        pass

    def _serve(self, body: bool) -> None:
        self.send_response(200)
        self.send_header("ETag", '"v1"')
        self.send_header("Content-Length", str(len(self.data)))
        self.end_headers()
        if body:
            try:
                self.wfile.write(self.data)
            except OSError:
                pass

    def do_HEAD(self):
        self._serve(False)

    def do_GET(self):
        self._serve(True)


def test_a_server_that_ignores_range_is_named_as_such_not_as_an_outage():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoRanges)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    try:
        store = objects.Objects()
        url = f"http://127.0.0.1:{srv.server_port}/d/train-000.tar"
        info = store.head(url)
        with pytest.raises(objects.ObjectError, match="ranges"):
            store.read(url, 512, 1024, info)
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def s3(monkeypatch, tmp_path):
    with MotoS3(bucket="attack-staleidx") as store:
        for key, value in store.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("PREFETCHD_CACHE", str(tmp_path / "cache"))
        yield store


def test_an_index_object_of_an_earlier_version_of_its_shard_does_not_serve_its_labels(s3):
    old = shard([1, 2, 3, 4], IMAGES)
    s3.put("wds/train-000.tar", old)
    table = shards.scan_webdataset({"urls": s3.url("wds/train-000.tar")}, "src")
    index = shards.index_object_bytes(
        np.column_stack([table.members, table.labels]), len(old), hashlib.md5(old).hexdigest()
    )
    s3.put("wds/train-000.tar.idx", index)
    new = shard([5, 6, 7, 8], IMAGES)  # relabelled, same size, new ETag
    assert len(new) == len(old)
    s3.put("wds/train-000.tar", new)
    assert shards.scan_webdataset({"urls": s3.url("wds/train-000.tar")}, "src").labels.tolist() == [5, 6, 7, 8]


@pytest.mark.parametrize("url", ["https://[::1/x.tar", "s3://bucket:99999999/x.tar", "http://host:port/x.tar"])
def test_a_url_that_does_not_parse_is_a_data_error_naming_it(url):
    with pytest.raises(DataError, match="not a URL that parses"):
        list(shards.expand_urls(url))
