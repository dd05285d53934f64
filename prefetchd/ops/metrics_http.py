"""``--metrics HOST:PORT``: the /metrics HTTP server, a thread of the master's process.

Bound during the start-up, before anything else is made, so a port in use or a host that does
not resolve fails ``prefetchd start`` (ConfigError, exit 2) at no cost to a warm buffer; it
serves once the master exists and stops in the master's shutdown, before the job's lock goes
(a start right after a stop finds the port free).

Each request runs on a thread of its own, at most _MAX_CONNECTIONS at once: beyond that a
connection is closed unread, so a flood costs threads and descriptors in bounded number; a
client that sends nothing is dropped after _CLIENT_TIMEOUT_S. A client that sends its request
a byte at a time (slowloris) would hold its slot for as long as it likes: when every slot is
taken, a new connection takes the slot of the oldest one still sending its request (a scraper
sends its request at once), so such clients cannot lock Prometheus out. A request for /metrics asks the
master's loop for a snapshot (prefetchd.ops.scrapes) and waits at most _ANSWER_TIMEOUT_S: a
stopped or hung loop gives a 503, never a hung scrape. The snapshot becomes text by
prometheus_client (``generate_latest`` over a registry of this server's own, one collector).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import selectors
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prefetchd.errors import ConfigError
from prefetchd.ops.scrapes import ScrapeQueue

log = logging.getLogger("prefetchd")

_ANSWER_TIMEOUT_S = 3.0  # a healthy loop answers within one tick (50 ms); Prometheus gives up after 10 s
_CLIENT_TIMEOUT_S = 5.0
_MAX_CONNECTIONS = 8
# Scrapes closer together than this get the same page: a storm of them costs the master's loop
# one snapshot, and its process one rendering, per interval (50 threads scraping at once halved
# a trainer's rate on 2 cores without it); Prometheus scrapes every few seconds.
_REUSE_PAGE_S = 0.5
_STOP_TIMEOUT_S = 2.0
_EVICT_WAIT_S = 1.0  # for the slot of a connection that was cut: its thread sees the close at once
_FLAG = "[daemon] metrics / --metrics"


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = _CLIENT_TIMEOUT_S  # on the connection's socket: a silent client is dropped
    server_version = "prefetchd"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.partition("?")[0]
        if path == "/metrics":
            body, status, content_type = self.server.render(self.headers.get("Accept", ""))
        elif path == "/":
            body, status, content_type = b"prefetchd: the job's metrics are at /metrics\n", 200, "text/plain"
        else:
            body, status, content_type = b"not found; the metrics are at /metrics\n", 404, "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def parse_request(self) -> bool:
        try:
            return super().parse_request()  # reads the headers
        finally:
            self.server.request_read(self.connection)  # sent whole (or refused): no longer evictable

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
        pass  # every request, and every garbled one, would grow the log on the tmpfs


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a handler still waiting for the loop never holds the daemon's exit

    def __init__(self, address: tuple, family: int, queue: ScrapeQueue, answer_timeout_s: float):
        from prometheus_client import CollectorRegistry

        from prefetchd.ops.metrics import SnapshotCollector

        self.address_family = family
        self.queue = queue
        self.registry = CollectorRegistry(auto_describe=False)  # its own: never the global registry
        self.registry.register(SnapshotCollector(lambda: queue.ask(answer_timeout_s)))
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._pages: dict[str, tuple[float, bytes]] = {}  # by content type: (when rendered, the page)
        self._pages_lock = threading.Lock()
        self._sending_lock = threading.Lock()
        self._sending: dict[socket.socket, float] = {}  # connections still sending their request: since when
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # not HTTPServer's: its getfqdn may wait on DNS
        self.server_name, self.server_port = self.server_address[:2]

    def render(self, accept: str) -> tuple[bytes, int, str]:
        from prometheus_client.exposition import choose_encoder

        from prefetchd.ops.metrics import MasterDidNotAnswer

        encoder, content_type = choose_encoder(accept)
        now = time.monotonic()
        with self._pages_lock:
            page = self._pages.get(content_type)
        if page is not None and now - page[0] < _REUSE_PAGE_S:
            return page[1], 200, content_type
        try:
            body = encoder(self.registry)
        except MasterDidNotAnswer as exc:
            return f"{exc}; try again\n".encode(), 503, "text/plain; charset=utf-8"
        with self._pages_lock:
            self._pages[content_type] = (now, body)
        return body, 200, content_type

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            if not (self._cut_slowest_sender() and self._slots.acquire(timeout=_EVICT_WAIT_S)):
                self.shutdown_request(request)  # a flood: closed unread
                return
        with self._sending_lock:
            self._sending[request] = time.monotonic()
        try:
            super().process_request(request, client_address)  # its thread releases the slot
        except BaseException:
            self.request_read(request)
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.request_read(request)
            self._slots.release()

    def request_read(self, request) -> None:
        with self._sending_lock:
            self._sending.pop(request, None)

    def _cut_slowest_sender(self) -> bool:
        """Close the connection that has been sending its request the longest (its thread
        then ends and frees its slot); False when every slot holds a request already read."""
        with self._sending_lock:
            if not self._sending:
                return False
            oldest = min(self._sending, key=self._sending.__getitem__)
            del self._sending[oldest]
        try:
            oldest.shutdown(socket.SHUT_RDWR)  # its thread's recv returns at once; it closes the socket
        except OSError:
            pass
        return True

    def handle_error(self, request, client_address) -> None:
        log.debug("metrics: a request from %s failed", client_address, exc_info=True)  # a reset, garbage


class MetricsServer:
    """The bound server; ``serve()`` starts its thread. The master holds it (``Master.metrics``):
    its loop waits on ``wait_handles()``, calls ``answer`` every turn and ``close`` in shutdown."""

    def __init__(self, address: str, answer_timeout_s: float = _ANSWER_TIMEOUT_S):
        self.queue = ScrapeQueue()
        try:
            family, sockaddr = _resolve(address)
            self._httpd = _Server(sockaddr, family, self.queue, answer_timeout_s)
        except BaseException:
            self.queue.close()
            raise
        self._httpd.timeout = 0  # handle_request() after the selector said a connection waits
        self._httpd.socket.setblocking(False)  # one that was reset meanwhile is no blocked accept
        self.port = self._httpd.server_address[1]
        self._stop_read, self._stop_write = os.pipe2(os.O_CLOEXEC)
        self._thread: threading.Thread | None = None

    def serve(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="prefetchd-metrics", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:  # no idle wake-ups, and a stop that is immediate
            selector.register(self._httpd.socket, selectors.EVENT_READ)
            selector.register(self._stop_read, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj == self._stop_read:
                        return
                self._httpd.handle_request()

    # -- the master's side -------------------------------------------------------------------

    def wait_handles(self) -> list:
        return [self.queue.fileno()]

    def answer(self, take_snapshot) -> None:
        self.queue.answer(take_snapshot)

    def close(self) -> None:
        """Stop serving and free the port; scrapes still waiting get a 503."""
        if self._stop_write < 0:
            return
        os.write(self._stop_write, b"!")
        if self._thread is not None:
            self._thread.join(_STOP_TIMEOUT_S)
        self._httpd.server_close()
        self.queue.close()
        os.close(self._stop_read)
        os.close(self._stop_write)
        self._stop_write = -1


def _resolve(address: str) -> tuple[int, tuple]:
    """The socket family and address to bind ``HOST:PORT`` (checked in form by prefetchd.settings) to;
    ConfigError naming --metrics when the host does not resolve. A host that is not loopback is
    logged: everyone who can reach it reads the job's metrics."""
    host, _, port = address.rpartition(":")
    try:
        found = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(
            f"{_FLAG} {address}: cannot resolve the host {host!r} ({exc}); give an IP address or a name this "
            "node resolves, e.g. 127.0.0.1:9464 (the default host when only a port is given)"
        ) from None
    family, _, _, _, sockaddr = found[0]
    if not ipaddress.ip_address(sockaddr[0]).is_loopback:
        log.warning(
            "serving metrics on %s (%s), not a loopback address: everyone who can reach it reads the job's "
            "metrics (the job's name, sizes, positions, rates and counts)", address, sockaddr[0]
        )
    return family, sockaddr


def bind_metrics(address: str) -> MetricsServer:
    """The server bound on ``address``, not yet serving; ConfigError (exit 2) naming --metrics
    when prometheus_client is missing, the host does not resolve or the port is taken."""
    try:
        import prometheus_client  # noqa: F401 - the check; the modules that use it import it again
    except ImportError:
        raise ConfigError(f"{_FLAG} needs prometheus_client: pip install 'prefetchd[metrics]'") from None
    try:
        server = MetricsServer(address)
    except OSError as exc:
        raise ConfigError(
            f"{_FLAG}: cannot listen on {address}: {exc.strerror or exc}; choose another port (another job or "
            "program may hold this one)"
        ) from None
    log.info("serving metrics at http://%s/metrics", address)
    return server
