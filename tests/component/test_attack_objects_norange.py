"""Attack: a server that ignores Range (answers 200 with the whole object). objects.read means to
name it ("it does not serve ranges as S3 and HTTP/1.1 servers do", an ObjectError), but obstore
refuses the answer first with NotSupportedError, which _failure sorts as StoreUnreachable: start
says "cannot reach the store ... check the network" after 7 GETs, and a running job waits as for
an outage until --store-timeout (600 s), then exits 11 saying the store "has not answered"."""

from __future__ import annotations

import http.server
import threading

import pytest

from prefetchd.sources import objects

pytestmark = pytest.mark.timeout(60)


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
