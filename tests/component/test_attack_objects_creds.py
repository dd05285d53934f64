"""Attack: a store whose error answer echoes the request's headers (as S3's own InvalidToken /
ExpiredToken / SignatureDoesNotMatch answers do: <Token-0>, <CanonicalRequest>) puts
AWS_SESSION_TOKEN into the daemon's messages, its log and `status --json`."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading

import pytest

from prefetchd.errors import DataError
from prefetchd.sources import objects, shards
from tests.component.test_objectsource import shard_bytes
from tests.conftest import cli, wait_until, write_config

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
def test_an_error_answer_that_echoes_the_request_does_not_show_the_session_token(echo_s3, status, tmp_path, monkeypatch):
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
