"""How a client reaches a job's control socket: the endpoint, and CURVE when the job uses it.

A job listens on ``ipc://<jobdir>/daemon.sock`` unless it was started with
``--endpoint tcp://HOST:PORT``; the manifest's ``endpoint`` says where. A daemon with CURVE
keys (required for a host that is not loopback) also writes its public key to the manifest
as ``curve_public_key``; a client then encrypts and authenticates with its own secret
certificate (a ``*.key_secret`` file as written by ``zmq.auth.create_certificates``): the
``curve_client_key`` argument, else ``$PREFETCHD_CURVE_CLIENT_KEY``.

The daemon shares this module (it parses endpoints and checks secret certificates the same
way), so it needs only pyzmq and the standard library.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass

import zmq

from .errors import AuthError

CLIENT_KEY_ENV = "PREFETCHD_CURVE_CLIENT_KEY"
_KEY_CHARS = 40  # a CURVE key in Z85 text
# What the client side of a CURVE handshake can end in; None: it succeeded.
_HANDSHAKE = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: None,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused this client's CURVE key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "broke off the CURVE handshake (protocol error)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "broke off the CURVE handshake (is the manifest's server key current?)",
}
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def load_secret_certificate(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public key, secret key) of a ZeroMQ secret certificate; ValueError says what is wrong.

    It holds a private key, so it must be a regular file of this user that nobody else can
    read or write (as ssh insists for its keys). It is read through the descriptor it was
    checked on, so it cannot be swapped in between.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO must not block us
    except OSError as exc:
        hint = " (a symlink: give the file itself)" if os.path.islink(path) else ""
        raise ValueError(f"cannot open {path}: {exc.strerror}{hint}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        keys = _certificate_keys(f.read(64 * 1024))
    # What it holds first: a public certificate given by mistake needs another file, not a chmod.
    if "secret-key" not in keys:
        raise ValueError(
            f"{path} holds no secret key: give the secret certificate (the .key_secret file "
            "zmq.auth.create_certificates writes), not the public .key"
        )
    if "public-key" not in keys:
        raise ValueError(f"{path} holds no public key: not a ZeroMQ certificate")
    if st.st_uid != os.getuid():
        raise ValueError(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()})")
    if st.st_mode & 0o077:
        raise ValueError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: a secret key must be yours alone; run chmod 600 {path}"
        )
    return keys["public-key"], keys["secret-key"]


def load_public_certificate(path: str | os.PathLike) -> bytes:
    """The public key of a ZeroMQ (public or secret) certificate; ValueError otherwise."""
    with open(path, "rb") as f:
        keys = _certificate_keys(f.read(64 * 1024))
    if "public-key" not in keys:
        raise ValueError(f"{path} holds no public key: not a ZeroMQ certificate")
    return keys["public-key"]


def _certificate_keys(data: bytes) -> dict[str, bytes]:
    """``public-key = "..."`` and ``secret-key = "..."`` lines of a certificate (ZPL text, the
    format zmq.auth.load_certificate reads), each checked to be a 40-character Z85 key."""
    keys = {}
    for line in data.splitlines():
        name, sep, value = line.strip().partition(b"=")
        name = name.strip().decode("ascii", "replace")
        if sep and name in ("public-key", "secret-key"):
            value = value.strip(b" \t'\"")
            if len(value) != _KEY_CHARS:
                raise ValueError(f"the {name} is {len(value)} characters, not {_KEY_CHARS} (Z85)")
            keys[name] = value
    return keys


@dataclass(frozen=True)
class ClientCurve:
    """What a client socket needs to talk CURVE to one daemon."""

    server_key: bytes  # the daemon's public key, from its manifest
    public_key: bytes
    secret_key: bytes
    path: str  # the client's secret certificate, named in errors

    def apply(self, socket: zmq.Socket) -> None:
        socket.curve_serverkey = self.server_key
        socket.curve_publickey = self.public_key
        socket.curve_secretkey = self.secret_key


def client_curve(server_key: str, client_key: str | os.PathLike | None = None, *, job: str = "") -> ClientCurve:
    """The CURVE keys for talking to the daemon whose public key is ``server_key``; AuthError
    when there is no usable client certificate (argument, else $PREFETCHD_CURVE_CLIENT_KEY)."""
    path = client_key or os.environ.get(CLIENT_KEY_ENV)
    what = f"job {job!r}" if job else "this daemon"
    if not path:
        raise AuthError(
            f"{what} requires CURVE authentication: set ${CLIENT_KEY_ENV} (or pass curve_client_key=) "
            "to your secret certificate, whose public .key is in the daemon's curve_authorized_keys folder"
        )
    try:
        public, secret = load_secret_certificate(path)
    except ValueError as exc:
        source = "curve_client_key" if client_key else f"${CLIENT_KEY_ENV}"
        raise AuthError(f"{source}: {exc}") from None
    return ClientCurve(server_key.encode("ascii"), public, secret, str(path))


def connect(socket: zmq.Socket, endpoint: str, curve: ClientCurve | None = None, timeout_s: float = 3.0) -> bool:
    """Connect ``socket`` to ``endpoint``. Without CURVE that is all (ZeroMQ connects in the
    background). With CURVE, wait for the handshake, so that a refused key is a clear error
    and not silence: True once it succeeded, False if it did not end within ``timeout_s``,
    AuthError if the daemon refused it."""
    if endpoint.startswith("tcp://["):
        socket.setsockopt(zmq.IPV6, 1)
    if curve is None:
        socket.connect(endpoint)
        return True
    curve.apply(socket)
    from zmq.utils.monitor import recv_monitor_message  # here: it imports asyncio (~30 ms), CURVE only

    monitor = socket.get_monitor_socket(_HANDSHAKE_EVENTS)
    try:
        socket.connect(endpoint)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and monitor.poll(max(1, int(left * 1000))):
            failure = _HANDSHAKE[recv_monitor_message(monitor)["event"]]
            if failure is None:
                return True
            raise AuthError(
                f"the daemon at {endpoint} {failure} ({curve.path}): copy the matching public certificate "
                "(its .key file) into the daemon's curve_authorized_keys folder and restart the daemon, "
                f"or use an authorised key (curve_client_key= or ${CLIENT_KEY_ENV})"
            )
        return False
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)
