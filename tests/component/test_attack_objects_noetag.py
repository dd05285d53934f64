"""Attack: an HTTP server that sends no ETag (python -m http.server, many plain servers and
proxies). The object's identity is then its size alone, so a shard rewritten with the same size
(labels fixed: .cls "3" -> "4") is served with the old labels from the index cache, and a running
job mixes the old index with the new bytes: docs/data.md promises "two versions are never mixed"."""

from __future__ import annotations

import http.server
import io
import re
import tarfile
import threading

import pytest

from prefetchd.sources import shards
from prefetchd.sources.tarmembers import TarMembers

pytestmark = pytest.mark.timeout(60)


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
