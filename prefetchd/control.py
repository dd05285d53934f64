"""The control socket: JSON messages over ZeroMQ at ``ipc://<jobdir>/daemon.sock``.

With ``[daemon] endpoint = "tcp://HOST:PORT"`` (``--endpoint``) the daemon listens there
instead: on a loopback host only, unless ``curve_secret_key`` and ``curve_authorized_keys``
are configured; then the socket is a CURVE server (encrypted, and a ZAP authenticator
thread admits only the listed client keys). The manifest records the endpoint and the
server's public key (``endpoint``, ``curve_public_key``); clients find both there
(prefetchd_client.transport).

The daemon binds a ROUTER socket. Peers send one JSON object per message (at most
MAX_MESSAGE_BYTES; ZeroMQ drops larger ones before they are read):

    {"op": "position", "rank": R, "epoch": E, "step": K}   trainer heartbeat, no reply; optionally
        + "consumer": NAME                                  which of several trainers of the job
                                                            (absent: the default consumer)
        + "wait_s", "waited_steps", "steps", "loader"      the trainer's waits for data, all four
                                                            (prefetchd_client.waits)
    {"op": "status"}                                        reply: the status object
    {"op": "stop", "keep": bool}                            reply: {"ok": true}
    {"op": "ping"}                                          reply: {"ok": true, "pid": P}

Nothing else is accepted: each message is checked against this schema before it is used,
and a malformed one is counted, logged and dropped. Never pickle.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from prefetchd.curve import load_authorized_keys
from prefetchd.errors import ConfigError
from prefetchd_client.layout import SOCKET, JobPaths, check_consumer_name, parse_tcp_endpoint
from prefetchd_client.manifest import read_manifest, valid_curve_key, valid_endpoint
from prefetchd_client.transport import client_curve, connect, load_secret_certificate

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

    from prefetchd.config import Config

log = logging.getLogger("prefetchd.control")  # a child of the daemon's logger: lands in daemon.log

MAX_MESSAGE_BYTES = 64 * 1024
HANDSHAKE_TIMEOUT_MS = 2000  # ZeroMQ's default is 30 s; a CURVE handshake here takes milliseconds
MAX_MESSAGES_PER_TURN = 256  # a flood of messages cannot starve the master's other duties
_SCHEMA = {
    "position": {"rank": int, "epoch": int, "step": int, "pid": int, "consumer": str}
    | {"wait_s": float, "waited_steps": int, "steps": int, "loader": int},
    "status": {},
    "stop": {"keep": bool},
    "ping": {},
}
_REQUIRED = {"position": {"rank", "epoch", "step"}}
WAIT_FIELDS = frozenset({"wait_s", "waited_steps", "steps", "loader"})  # all or none (prefetchd.ops.stalls checks them)


class BadMessage(ValueError):
    pass


def decode_message(data: bytes) -> dict:
    """Parse and schema-check one control message; BadMessage otherwise."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise BadMessage("not UTF-8 JSON") from None
    except RecursionError:  # 30,000 nested brackets fit the size cap: the parser gives up
        raise BadMessage("JSON nested too deeply") from None
    # type(...) is str first: an op that is a list or an object is not hashable
    if not isinstance(msg, dict) or type(msg.get("op")) is not str or msg["op"] not in _SCHEMA:
        raise BadMessage(f"unknown op; expected one of {sorted(_SCHEMA)}")
    schema = _SCHEMA[msg["op"]]
    for key, value in msg.items():
        if key == "op":
            continue
        if not _fits(schema.get(key), value):
            raise BadMessage(f"{msg['op']}: bad or unknown field {key!r}")
    missing = _REQUIRED.get(msg["op"], set()) - set(msg)
    if missing:
        raise BadMessage(f"{msg['op']}: missing {sorted(missing)}")
    if msg["op"] == "position" and not WAIT_FIELDS.isdisjoint(msg) and not WAIT_FIELDS <= set(msg):
        raise BadMessage(f"position: the wait fields come all together: {sorted(WAIT_FIELDS)}")
    if msg["op"] == "position" and "consumer" in msg:
        try:
            check_consumer_name(msg["consumer"])
        except ValueError as exc:
            raise BadMessage(f"position: {exc}") from None
    return msg


def _fits(kind: type | None, value) -> bool:
    """A field's value is of its schema type: an int is never a bool, and is not negative; a
    float may be written as an int, and is finite and not negative (Python's JSON reads NaN
    and Infinity)."""
    if kind is int:
        return type(value) is int and value >= 0
    if kind is float:
        return type(value) in (int, float) and 0 <= value < math.inf  # NaN fails both comparisons
    return kind is not None and type(value) is kind


@dataclass
class ControlServer:
    """The daemon's bound control socket, where clients reach it, and its authenticator."""

    socket: zmq.Socket
    endpoint: str  # what a client on this node connects to (the manifest's "endpoint")
    public_key: str | None = None  # the CURVE server key clients need; None without CURVE
    auth: ThreadAuthenticator | None = None

    def close(self) -> None:
        self.socket.close(linger=0)
        if self.auth is not None:
            self.auth.stop()  # joins its thread; the context cannot terminate while it runs


def bind_server(context: zmq.Context, paths: JobPaths, config: Config) -> ControlServer:
    """Bind the job's ROUTER: the ipc socket in the job directory, or the configured TCP
    endpoint (its host was checked by config: loopback, or CURVE configured)."""
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    # A connection that has not finished its ZeroMQ (and CURVE) handshake within this is
    # closed: idle raw TCP connections cannot pile up and take the daemon's descriptors.
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
    server = ControlServer(sock, paths.endpoint)
    try:
        if config.endpoint == "ipc":
            sock.bind(paths.endpoint)
            return server
        tcp = parse_tcp_endpoint(config.endpoint)
        sock.setsockopt(zmq.IPV6, tcp.ipv6)
        server.endpoint = tcp.connect_address()
        if config.curve_secret_key is not None:
            _serve_curve(context, server, config)
        try:
            sock.bind(tcp.bind_address())
        except zmq.ZMQError as exc:
            raise ConfigError(
                f"[daemon] endpoint / --endpoint: cannot listen on {tcp.bind_address()}: {exc.strerror}; "
                "choose another port (another job or program may hold this one)"
            ) from None
        warning = endpoint_warning(config)
        if warning:
            log.warning(warning)
        return server
    except BaseException:
        server.close()
        raise


def endpoint_warning(config: Config) -> str | None:
    """What ``start`` prints and the daemon logs for a TCP endpoint without CURVE; None otherwise.

    Config allows such an endpoint on loopback only, which keeps other machines out but not
    other users of this one: a TCP port, unlike the ipc socket in the 0700 job folder, is open
    to every local process, and without CURVE nothing tells them apart.
    """
    if config.endpoint == "ipc" or config.curve_secret_key is not None:
        return None
    return (
        f"the control endpoint {config.endpoint} has no authentication: every user of this node can "
        "connect to it, read the job's status, move its ranks' positions (which deletes their buffered "
        "batches) and stop the job. Use the default ipc endpoint (a socket inside your private job "
        "folder), or configure CURVE (--curve-secret-key and --curve-authorized-keys)"
    )


def _serve_curve(context: zmq.Context, server: ControlServer, config: Config) -> None:
    """Make the server's socket a CURVE server that admits only the authorised client keys.

    The authenticator answers ZeroMQ's ZAP requests for every socket of ``context``; it runs
    before the socket binds, so no client is ever admitted unchecked (without a ZAP handler
    ZeroMQ would accept any client key).
    """
    try:
        public, secret = load_secret_certificate(config.curve_secret_key)
        load_authorized_keys(config.curve_authorized_keys)
    except ValueError as exc:  # config checked them already; the files changed since
        raise ConfigError(f"[daemon] curve keys: {exc}") from None
    from zmq.auth.thread import ThreadAuthenticator  # here: it imports asyncio (~30 ms), CURVE only

    server.auth = ThreadAuthenticator(context, log=logging.getLogger("prefetchd.auth"))
    server.auth.start()
    # configure_curve reads the folder's *.key files again; had that failed it would log and
    # admit nobody (fail closed). The check above makes it a clear error instead.
    server.auth.configure_curve(domain="*", location=config.curve_authorized_keys)
    server.socket.curve_secretkey = secret
    server.socket.curve_publickey = public
    server.socket.curve_server = True
    server.public_key = public.decode("ascii")


def job_endpoint(paths: JobPaths, *, dir_fd: int | None = None) -> tuple[str, str | None]:
    """Where a job's daemon listens, and its CURVE public key (None without CURVE): from the
    manifest (read in the checked folder ``dir_fd``, see prefetchd_client.folders.open_job);
    the ipc socket while there is none yet, or when its values are not an endpoint and a key."""
    try:
        manifest = read_manifest(paths, dir_fd=dir_fd)
    except (OSError, ValueError):
        return paths.endpoint, None
    endpoint, key = manifest.get("endpoint"), manifest.get("curve_public_key")
    if not valid_endpoint(paths, endpoint):
        return paths.endpoint, None
    return endpoint, (key if valid_curve_key(key) else None)


def request_job(paths: JobPaths, msg: dict, timeout_s: float = 3.0, *, dir_fd: int | None = None) -> dict | None:
    """``request`` to the daemon of the job at ``paths``, wherever its manifest says it listens.

    Callers check the job's folders first (``open_job``) and pass its ``dir_fd``: the manifest
    of a folder that is not theirs could name anyone's endpoint."""
    endpoint, server_key = job_endpoint(paths, dir_fd=dir_fd)
    if endpoint == paths.endpoint and not _exists(SOCKET if dir_fd is not None else paths.socket, dir_fd):
        return None  # no socket, no daemon to answer: ZeroMQ would wait out the whole timeout
    return request(endpoint, msg, timeout_s, server_key=server_key, job=paths.name)


def _exists(path, dir_fd: int | None) -> bool:
    try:
        os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def request(
    endpoint: str,
    msg: dict,
    timeout_s: float = 3.0,
    *,
    server_key: str | None = None,
    curve_client_key: str | os.PathLike | None = None,
    job: str = "",
) -> dict | None:
    """Send one request and wait for its reply; None if none came within the timeout.

    With ``server_key`` (the daemon's CURVE public key) it authenticates with the client
    certificate ``curve_client_key``, else ``$PREFETCHD_CURVE_CLIENT_KEY``; AuthError
    (prefetchd_client.errors) when there is none or the daemon refuses it.
    """
    curve = client_curve(server_key, curve_client_key, job=job) if server_key is not None else None
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 16 * 1024 * 1024)
    deadline = time.monotonic() + timeout_s
    try:
        if not connect(sock, endpoint, curve, timeout_s):
            return None
        sock.send(json.dumps(msg).encode())
        if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            return None
        reply = json.loads(sock.recv())
        return reply if isinstance(reply, dict) else None
    finally:
        sock.close(linger=0)
        context.term()
