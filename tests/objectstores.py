"""Real object stores on loopback for the tests of the object-storage sources: an S3 bucket (moto),
a plain HTTP server with byte ranges and switchable faults, and a proxy that adds a remote bucket's
latency. No mocks: they are HTTP servers on 127.0.0.1 that real clients (obstore, in the test
process or in the daemon's processes through `MotoS3.env`) connect to.

Every server here can be stopped at any moment without hanging: each connection has a named daemon
thread ("objectstores-..."), stop() cuts the open connections as well as the listening socket, and
every wait has a timeout. A stopped server can start again on the same port, which is how a test
makes an outage that clients configured with the endpoint recover from.
"""

from __future__ import annotations

import errno
import hashlib
import http.server
import re
import socket
import socketserver
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any
from urllib.parse import urlsplit

HOST = "127.0.0.1"
IDLE_TIMEOUT = 30.0  # s: a connection idle (or a client not reading) this long is closed, freeing its thread
STOP_TIMEOUT = 5.0  # s: the longest stop() waits for one connection's thread to end


def _listen(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:port (0: a free port). SO_REUSEADDR lets a restarted server take
    its port back although the connections it cut are in TIME_WAIT; the retries cover a port that is
    briefly held by a socket still closing."""
    deadline = time.monotonic() + 5.0
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
            sock.listen(128)
            return sock
        except OSError as e:
            sock.close()
            if port == 0 or e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _shutdown_quietly(sock: socket.socket) -> None:
    """Wakes every thread blocked on the socket (a recv returns b"", a send fails) without closing
    it under them; already closed is fine."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _ClosableServer:
    """Mixed in before socketserver's classes. socketserver's shutdown() only stops accepting: the
    keep-alive connections already accepted go on being served, so an "outage" would not cut a
    pooled client off, and their threads would outlive the test. This tracks every connection (and
    any socket a handler opens, like a proxy's upstream) and close() cuts them all."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, *args: Any, owner: Any, **kwargs: Any) -> None:
        self.owner = owner  # the helper object whose state the handlers read and count into
        self.closing = threading.Event()  # set by close(): handlers waiting or streaming end at once
        self._open: dict[socket.socket, threading.Thread | None] = {}
        self._open_lock = threading.Lock()
        self._serving: threading.Thread | None = None
        super().__init__(*args, **kwargs)

    @classmethod
    def listening(cls, port: int, handler: type, owner: Any) -> Any:
        """A socketserver-based server on the socket _listen() binds (socketserver's own bind
        has no retry for a port being given back)."""
        server = cls((HOST, port), handler, bind_and_activate=False, owner=owner)
        server.socket.close()
        server.socket = _listen(port)
        server.server_address = server.socket.getsockname()
        return server

    def serve_in_background(self) -> None:
        name = f"objectstores-{type(self.owner).__name__}-serve"
        # A short poll interval: shutdown() waits for the loop to notice, and stop() should be quick.
        self._serving = threading.Thread(target=self.serve_forever, args=(0.05,), name=name, daemon=True)
        self._serving.start()

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        name = f"objectstores-{type(self.owner).__name__}-conn"
        thread = threading.Thread(
            target=self.process_request_thread, args=(request, client_address), name=name, daemon=True
        )
        # Without it a response written as headers then body waits for the client's delayed ACK of the
        # headers (Nagle): ~40 ms on loopback, which would swamp the latencies tests measure.
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._open_lock:
            self._open[request] = thread
        self.owner._count_connection()
        thread.start()

    def shutdown_request(self, request: socket.socket) -> None:
        self.untrack(request)
        super().shutdown_request(request)

    def track(self, sock: socket.socket) -> None:
        """A socket a handler opened itself, to be cut by close() too."""
        with self._open_lock:
            self._open[sock] = None

    def untrack(self, sock: socket.socket) -> None:
        with self._open_lock:
            self._open.pop(sock, None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # the client went away, or close() cut the connection: expected, not worth a traceback
        super().handle_error(request, client_address)

    def close(self) -> None:
        self.closing.set()
        if self._serving is not None:
            self.shutdown()
            self._serving.join(STOP_TIMEOUT)
        self.server_close()
        with self._open_lock:
            still_open = list(self._open.items())
        for sock, _ in still_open:
            _shutdown_quietly(sock)
        for _, thread in still_open:
            if thread is not None:
                thread.join(STOP_TIMEOUT)


# --- S3 -------------------------------------------------------------------------------------------


class MotoS3:
    """An S3 endpoint with one bucket, served by moto on 127.0.0.1 in this process.

        with MotoS3() as s3:
            s3.put("train/shard-000.tar", data)
            subprocess.run([...], env={**os.environ, **s3.env})  # reads s3.url("train/shard-000.tar")

    Moto's own ThreadedMotoServer is not used: its stop() leaves the listening socket open and the
    keep-alive connections served, and starting it again on the same port fails (werkzeug exits the
    server thread on EADDRINUSE and start() then waits forever). Here moto's WSGI application runs
    in werkzeug's threaded server on a socket this class binds, so stop() is a real outage and
    restart() comes back on the same port. The objects survive a restart: moto keeps its buckets in
    module-level state, not in the server.

    That state is shared by everything in the process, so two MotoS3 alive at once need different
    bucket names. Entering empties the bucket (a previous test's leftovers), leaving deletes it.

    Moto answers Range (206; 416 outside the object) and If-Match (412) as S3 does.

    Counts (`connections`, `requests`, `gets`, `bytes_sent`, `ranges`) are taken in a WSGI layer
    around moto; they include this class's own put()/delete() as requests, never as gets (it issues
    no GET after entering).
    """

    ACCESS_KEY_ID = "testing-key"
    SECRET_ACCESS_KEY = "testing-secret"
    REGION = "us-east-1"

    def __init__(self, bucket: str = "prefetchd-test") -> None:
        if not 3 <= len(bucket) <= 63:
            raise ValueError(f"an S3 bucket name has 3 to 63 characters: {bucket!r}")
        self.bucket = bucket
        self.port = 0  # 0 until the first start; then kept, so restart() comes back on it
        self._server: _ClosableServer | None = None
        self._client: Any = None  # boto3's S3 client, made on entering
        self._count_lock = threading.Lock()
        self.reset_counts()

    def __enter__(self) -> MotoS3:
        self.start()
        try:
            self._connect_client()
            self._client.create_bucket(Bucket=self.bucket)  # us-east-1: creating one's own bucket again is fine
            self._empty_bucket()
        except BaseException:
            self.stop()
            raise
        self.reset_counts()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.start()  # a test may leave it stopped; the next one with this bucket must find it gone
            self._empty_bucket()
            self._client.delete_bucket(Bucket=self.bucket)
        finally:
            self.stop()
            if self._client is not None:
                self._client.close()

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The environment that points obstore (or boto3) in another process at this endpoint."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": self.SECRET_ACCESS_KEY,
            "AWS_REGION": self.REGION,
            "AWS_DEFAULT_REGION": self.REGION,  # the name boto3 reads
            "AWS_ALLOW_HTTP": "true",  # obstore refuses plain http without it
        }

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key.lstrip('/')}"

    def put(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=key.lstrip("/"), Body=data)

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=key.lstrip("/"))

    def reset_counts(self) -> None:
        with self._count_lock:
            self.connections = 0  # accepted
            self.requests = 0  # every HTTP request
            self.gets = 0  # GET requests
            self.bytes_sent = 0  # body bytes of the GET responses
            self.ranges: list[tuple[str, str | None]] = []  # per GET: ("/bucket/key", Range header or None)

    def start(self) -> None:
        """Listens (again) on `port`; a no-op while running."""
        if self._server is not None:
            return
        # Imported here: moto takes ~0.5 s to import, which tests using only RangeServer need not pay.
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

        class QuietHandler(WSGIRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real S3 endpoint
            timeout = IDLE_TIMEOUT

            def log_request(self, *args: Any) -> None:
                pass  # werkzeug logs each request to stderr: thousands of lines in a test's output

        class Server(_ClosableServer, ThreadedWSGIServer):
            pass

        sock = _listen(self.port)
        try:
            app = self._counting(DomainDispatcherApplication(create_backend_app))
            # fd=: werkzeug serves a duplicate of our socket (its own bind would sys.exit on EADDRINUSE).
            server = Server(HOST, self.port, app, QuietHandler, fd=sock.fileno(), owner=self)
        finally:
            sock.close()
        self.port = server.server_address[1]
        server.serve_in_background()
        self._server = server

    def stop(self) -> None:
        """An outage: the port refuses connections and the open ones are cut. The objects are kept."""
        if self._server is not None:
            self._server.close()
            self._server = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def _count_connection(self) -> None:
        with self._count_lock:
            self.connections += 1

    def _connect_client(self) -> None:
        import boto3
        from botocore.config import Config

        self._client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.ACCESS_KEY_ID,
            aws_secret_access_key=self.SECRET_ACCESS_KEY,
            region_name=self.REGION,
            # Plain PUT bodies: no aws-chunked trailers with checksums that moto would then store.
            config=Config(request_checksum_calculation="when_required", connect_timeout=5, read_timeout=30),
        )

    def _empty_bucket(self) -> None:
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            for obj in page.get("Contents", []):
                self._client.delete_object(Bucket=self.bucket, Key=obj["Key"])

    def _counting(self, app: Any) -> Any:
        def counted(environ: dict, start_response: Any) -> Any:
            is_get = environ["REQUEST_METHOD"] == "GET"
            with self._count_lock:
                self.requests += 1
                if is_get:
                    self.gets += 1
                    self.ranges.append((environ.get("PATH_INFO", ""), environ.get("HTTP_RANGE")))
            body = app(environ, start_response)
            try:
                for chunk in body:
                    if is_get:
                        with self._count_lock:
                            self.bytes_sent += len(chunk)
                    yield chunk
            finally:
                if hasattr(body, "close"):
                    body.close()

        return counted


# --- plain HTTP with byte ranges and faults -------------------------------------------------------

# name -> what the next `count` requests get (count=None: every request until clear_faults()).
FAULTS = {
    "503": "answer 503 Service Unavailable (any method): a storm shorter than the client's retries is survived",
    "429": "answer 429 Too Many Requests (any method), as a throttling bucket does",
    "403": "answer 403 Forbidden (any method), as a bucket does to wrong credentials",
    "redirect_loop": "answer 302 to the same URL (any method): a client following redirects never gets there",
    "huge_header": "serve normally plus a header `X-Padding` of `size` bytes (default 1 MiB)",
    "etag_changes": "serve normally with an ETag never seen before, and answer 412 to any If-Match",
    "reset": "GET: headers and half the body, then a TCP reset (SO_LINGER 0)",
    "truncate": "GET: the full Content-Length, half the body, then a clean close",
    "lying_length": "GET: the full Content-Length, half the body, then silence for `hold` s (default 30) and a close",
    "endless": "GET: 200, Content-Length `declared` (default 1 PiB; None: none); bytes till the client or stop() quits",
}
_FAULT_PARAMS: dict[str, dict[str, Any]] = {
    "huge_header": {"size": 1 << 20},
    "lying_length": {"hold": IDLE_TIMEOUT},
    "endless": {"declared": 1 << 50},
}
# 503, 429 and redirect_loop answer instead of the object; huge_header and etag_changes change the
# headers of an answer, so they combine with the others; these change the body:
_BODY_FAULTS = ("reset", "truncate", "lying_length", "endless")  # GETs only; HEADs do not use them up


@dataclass
class _Fault:
    remaining: int | None  # None: every request until cleared
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Stamp:
    data: bytes  # the object these were computed for: a replaced object gets new ones
    etag: str
    last_modified: str


class RangeServer:
    """An HTTP source's server: objects from the dict `objects` (path -> bytes, a path like
    "/data/train-000.tar"), served by a threaded HTTP/1.1 server on 127.0.0.1 (plain http, no TLS).

    It answers as a static object server does: HEAD and GET with Content-Length, ETag (the quoted
    MD5 of the content, as S3 gives an object put in one part), Last-Modified and Accept-Ranges:
    bytes; a single `Range: bytes=a-b`, `bytes=a-` or `bytes=-n` gets 206 with Content-Range, one
    outside the object (or several ranges, not supported here) gets 416; If-Match that names no
    current ETag gets 412; keep-alive.

    Rewriting an object is replacing it: `server.objects[path] = new_bytes`; its ETag and
    Last-Modified change from the next request on, so a reader holding the old ETag gets 412.

    Faults, switched on at runtime with `fault(name, count)` (see FAULTS): each affects the next
    `count` requests that it applies to, or every one until `clear_faults()` when count is None.
    An outage is `stop()` then `start()`: the same port again (or `down_for(seconds)`, which comes
    back by itself).

    Beware "endless" with its default 1 PiB Content-Length: obstore's GetResult.bytes() allocates
    the declared length up front and aborts the whole process (Rust OOM). Iterate the GetResult
    instead (a reader of untrusted servers should), or pass declared=None, which obstore refuses
    at once (no Content-Length).

    Counts: `connections` (accepted), `requests` (all), `gets`, `bytes_sent` (body bytes written,
    or being written when a fault or the client cut the connection),
    `ranges` (per GET: (path, Range header or None), in arrival order).
    """

    def __init__(self, objects: dict[str, bytes] | None = None) -> None:
        self.objects: dict[str, bytes] = dict(objects or {})
        self.port = 0  # 0 until the first start; then kept, so start() after stop() comes back on it
        self._server: _ClosableServer | None = None
        self._lock = threading.Lock()  # the counts, the faults, the stamps
        self._faults: dict[str, _Fault] = {}
        self._stamps: dict[str, _Stamp] = {}
        self._etag_serial = 0
        self._comeback: threading.Timer | None = None
        self._running = threading.RLock()  # start() and stop() one at a time: down_for() starts from a timer
        self.reset_counts()

    def __enter__(self) -> RangeServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._comeback is not None:
            self._comeback.cancel()
            self._comeback.join(STOP_TIMEOUT)
        self.stop()

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def url(self, path: str) -> str:
        return self.endpoint + "/" + path.lstrip("/")

    def reset_counts(self) -> None:
        with self._lock:
            self.connections = 0
            self.requests = 0
            self.gets = 0
            self.bytes_sent = 0
            self.ranges: list[tuple[str, str | None]] = []

    def fault(self, name: str, count: int | None = None, **params: Any) -> None:
        """Switches a fault on (replacing the same fault's earlier setting); count=0 switches it off."""
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        unknown = set(params) - set(_FAULT_PARAMS.get(name, {}))
        if unknown:
            raise TypeError(f"fault {name!r} takes no parameter {', '.join(sorted(unknown))}")
        with self._lock:
            if count == 0:
                self._faults.pop(name, None)
            else:
                self._faults[name] = _Fault(count, {**_FAULT_PARAMS.get(name, {}), **params})

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def start(self) -> None:
        """Listens (again) on `port`; a no-op while running."""
        with self._running:
            if self._server is not None:
                return
            server = _RangeHTTPServer.listening(self.port, _RangeHandler, owner=self)
            self.port = server.server_address[1]
            server.serve_in_background()
            self._server = server

    def stop(self) -> None:
        """An outage: the port refuses connections, the open ones are cut (streams included)."""
        with self._running:
            if self._server is not None:
                server, self._server = self._server, None
                server.close()

    def down_for(self, seconds: float) -> None:
        """stop() now and start() again `seconds` later, in the background: the client under test
        runs through the outage meanwhile."""
        if self._comeback is not None:
            self._comeback.cancel()
        self.stop()
        self._comeback = threading.Timer(seconds, self.start)
        self._comeback.name = "objectstores-RangeServer-comeback"
        self._comeback.daemon = True
        self._comeback.start()

    # The handlers' side.

    def _count_connection(self) -> None:
        with self._lock:
            self.connections += 1

    def _count(self, method: str, path: str, range_header: str | None) -> None:
        with self._lock:
            self.requests += 1
            if method == "GET":
                self.gets += 1
                self.ranges.append((path, range_header))

    def _count_sent(self, n: int) -> None:
        with self._lock:
            self.bytes_sent += n

    def _take_fault(self, name: str) -> dict[str, Any] | None:
        """The fault's parameters when it applies to this request (using one of its count), else None."""
        with self._lock:
            fault = self._faults.get(name)
            if fault is None:
                return None
            if fault.remaining is not None:
                fault.remaining -= 1
                if fault.remaining <= 0:
                    del self._faults[name]
            return fault.params

    def _stamp(self, path: str, data: bytes) -> _Stamp:
        with self._lock:
            stamp = self._stamps.get(path)
            if stamp is None or stamp.data is not data:
                etag = '"' + hashlib.md5(data).hexdigest() + '"'
                if stamp is None or stamp.etag != etag:
                    stamp = _Stamp(data, etag, formatdate(usegmt=True))
                else:
                    stamp = _Stamp(data, etag, stamp.last_modified)  # the same bytes again: not modified
                self._stamps[path] = stamp
            return stamp

    def _fresh_etag(self, etag: str) -> str:
        with self._lock:
            self._etag_serial += 1
            return f'{etag[:-1]}-{self._etag_serial}"'


class _RangeHTTPServer(_ClosableServer, http.server.ThreadingHTTPServer):
    pass


class _Unsatisfiable(Exception):
    pass


_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def _byte_range(header: str, size: int) -> tuple[int, int]:
    """[start, stop) of a single-range header; _Unsatisfiable (416) for one outside the object,
    a malformed one or several ranges."""
    m = _RANGE.fullmatch(header.strip())
    if m is None or m.group(1) == m.group(2) == "":
        raise _Unsatisfiable
    first, last = m.group(1), m.group(2)
    if first == "":  # bytes=-n: the last n bytes
        n = int(last)
        if n == 0 or size == 0:
            raise _Unsatisfiable
        return max(0, size - n), size
    start = int(first)
    if start >= size or (last != "" and int(last) < start):
        raise _Unsatisfiable
    return start, size if last == "" else min(int(last) + 1, size)


def _if_match(header: str, etag: str) -> bool:
    tags = [t.strip() for t in header.split(",")]
    return "*" in tags or etag in tags


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every answer below has a Content-Length or closes
    timeout = IDLE_TIMEOUT
    server: Any  # the _ClosableServer whose owner is the RangeServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one stderr line per request would flood the test output

    def do_HEAD(self) -> None:
        self._serve(with_body=False)

    def do_GET(self) -> None:
        self._serve(with_body=True)

    def _serve(self, with_body: bool) -> None:
        owner: RangeServer = self.server.owner
        path = urlsplit(self.path).path
        range_header = self.headers.get("Range")
        owner._count(self.command, path, range_header)

        if owner._take_fault("503") is not None:
            return self._answer(503, b"slow down\n")
        if owner._take_fault("429") is not None:
            return self._answer(429, b"too many requests\n")
        if owner._take_fault("403") is not None:
            return self._answer(403, b"access denied\n")
        if owner._take_fault("redirect_loop") is not None:
            return self._answer(302, b"", {"Location": self.path})
        padding = owner._take_fault("huge_header")
        new_etag = owner._take_fault("etag_changes") is not None

        data = owner.objects.get(path)
        if data is None:
            return self._answer(404, b"no such object\n")
        stamp = owner._stamp(path, data)
        etag = owner._fresh_etag(stamp.etag) if new_etag else stamp.etag
        headers = {"ETag": etag, "Last-Modified": stamp.last_modified, "Accept-Ranges": "bytes"}
        if padding is not None:
            headers["X-Padding"] = "x" * padding["size"]

        if_match = self.headers.get("If-Match")
        if if_match is not None and (new_etag or not _if_match(if_match, etag)):
            return self._answer(412, b"precondition failed\n", headers)
        status, start, stop = 200, 0, len(data)
        if range_header is not None:
            try:
                start, stop = _byte_range(range_header, len(data))
            except _Unsatisfiable:
                headers["Content-Range"] = f"bytes */{len(data)}"
                return self._answer(416, b"range not satisfiable\n", headers)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
        body = data[start:stop]

        if not with_body:
            return self._send_head(status, {**headers, "Content-Length": str(len(body))})
        for name in _BODY_FAULTS:
            params = owner._take_fault(name)
            if params is not None:
                return getattr(self, f"_{name}")(status, headers, body, **params)
        self._send_head(status, {**headers, "Content-Length": str(len(body))})
        self._write(body)

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self._send_head(status, {**(headers or {}), "Content-Type": "text/plain", "Content-Length": str(len(body))})
        if self.command != "HEAD":
            self._write(body)

    def _send_head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        headers.setdefault("Content-Type", "application/octet-stream")
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _write(self, data: bytes) -> None:
        # Counted first: a client may have the bytes, and its test check the count, before write() returns.
        self.server.owner._count_sent(len(data))
        self.wfile.write(data)

    # The body faults: the answer's head is right, its body is not.

    def _reset(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self._send_head(status, {**headers, "Content-Length": str(len(body))})
        self._write(body[: len(body) // 2])
        # Linger 0: close() sends RST at once, instead of the FIN after the data of a clean close.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()  # the real close happens when handle() returns and rfile/wfile close

    def _truncate(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self._send_head(status, {**headers, "Content-Length": str(len(body)), "Connection": "close"})
        self._write(body[: len(body) // 2])
        self.close_connection = True

    def _lying_length(self, status: int, headers: dict[str, str], body: bytes, hold: float) -> None:
        self._send_head(status, {**headers, "Content-Length": str(len(body))})
        self._write(body[: len(body) // 2])
        self.server.closing.wait(hold)  # a stalled transfer: the client's timeout must end it, or stop()
        self.close_connection = True

    def _endless(self, status: int, headers: dict[str, str], body: bytes, declared: int | None) -> None:
        headers = {k: v for k, v in headers.items() if k != "Content-Range"}
        if declared is not None:
            headers["Content-Length"] = str(declared)
        self._send_head(200, {**headers, "Connection": "close"})
        self.close_connection = True
        chunk = bytes(range(256)) * 256
        try:
            while not self.server.closing.is_set():
                self._write(chunk)  # fails once the client disconnects, or stop() shuts the socket
        except OSError:
            pass


# --- latency ----------------------------------------------------------------------------------------


class DelayProxy:
    """A TCP proxy on 127.0.0.1 in front of `upstream` (host, port) that waits `delay` seconds before
    forwarding each chunk the client sends: each request of a keep-alive connection arrives ~delay
    later, as at a remote bucket; the answers pass at once. Point a client at `endpoint` instead of
    the server's (for MotoS3: `{**s3.env, "AWS_ENDPOINT_URL": proxy.endpoint}`; moto does not check
    the signed Host).

    Counts: `connections` (accepted) and `chunks` (forwarded from clients, ~ one per request).
    stop() cuts every connection, both sides.
    """

    def __init__(self, upstream: tuple[str, int], delay: float = 0.020) -> None:
        self.upstream = upstream
        self.delay = delay
        self.port = 0
        self._lock = threading.Lock()
        self._server: _ClosableServer | None = None
        self.reset_counts()

    def __enter__(self) -> DelayProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def reset_counts(self) -> None:
        with self._lock:
            self.connections = 0
            self.chunks = 0

    def start(self) -> None:
        """Listens (again) on `port`; a no-op while running."""
        if self._server is not None:
            return
        server = _ProxyServer.listening(self.port, _ProxyHandler, owner=self)
        self.port = server.server_address[1]
        server.serve_in_background()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.close()

    def _count_connection(self) -> None:
        with self._lock:
            self.connections += 1

    def _count_chunk(self) -> None:
        with self._lock:
            self.chunks += 1


class _ProxyServer(_ClosableServer, socketserver.ThreadingTCPServer):
    pass


class _ProxyHandler(socketserver.BaseRequestHandler):
    server: Any  # the _ClosableServer whose owner is the DelayProxy

    def handle(self) -> None:
        proxy: DelayProxy = self.server.owner
        client: socket.socket = self.request
        try:
            upstream = socket.create_connection(proxy.upstream, timeout=STOP_TIMEOUT)
        except OSError:
            return  # upstream down: the client sees its connection closed, as a dead endpoint does
        self.server.track(upstream)
        try:
            client.settimeout(IDLE_TIMEOUT)
            upstream.settimeout(IDLE_TIMEOUT)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as the accepted side: no Nagle
            answers = threading.Thread(
                target=self._pass_answers, args=(upstream, client), name="objectstores-DelayProxy-answers", daemon=True
            )
            answers.start()
            try:
                while chunk := client.recv(1 << 16):
                    if self.server.closing.wait(proxy.delay):
                        break
                    proxy._count_chunk()
                    upstream.sendall(chunk)
                upstream.shutdown(socket.SHUT_WR)  # the client is done sending: pass its half-close on
            except OSError:
                pass
            answers.join(IDLE_TIMEOUT + STOP_TIMEOUT)
        finally:
            self.server.untrack(upstream)
            upstream.close()

    @staticmethod
    def _pass_answers(upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(1 << 16):
                client.sendall(data)
        except OSError:
            pass
        finally:
            # The server closed: nothing more can be answered; this also ends the handler's recv.
            _shutdown_quietly(client)
