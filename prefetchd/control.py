"""The control socket: JSON messages over ZeroMQ at ``ipc://<jobdir>/daemon.sock``.

The daemon binds a ROUTER socket. Peers send one JSON object per message (at most
MAX_MESSAGE_BYTES; ZeroMQ drops larger ones before they are read):

    {"op": "position", "rank": R, "epoch": E, "step": K}   trainer heartbeat, no reply
    {"op": "status"}                                        reply: the status object
    {"op": "stop", "keep": bool}                            reply: {"ok": true}
    {"op": "ping"}                                          reply: {"ok": true, "pid": P}

Nothing else is accepted: each message is checked against this schema before it is used,
and a malformed one is counted, logged and dropped. Never pickle.
"""

from __future__ import annotations

import json

import zmq

MAX_MESSAGE_BYTES = 64 * 1024
_SCHEMA = {
    "position": {"rank": int, "epoch": int, "step": int, "pid": int},
    "status": {},
    "stop": {"keep": bool},
    "ping": {},
}
_REQUIRED = {"position": {"rank", "epoch", "step"}}


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
    if not isinstance(msg, dict) or msg.get("op") not in _SCHEMA:
        raise BadMessage(f"unknown op; expected one of {sorted(_SCHEMA)}")
    schema = _SCHEMA[msg["op"]]
    for key, value in msg.items():
        if key == "op":
            continue
        kind = schema.get(key)
        if kind is None or type(value) is not kind or (kind is int and value < 0):
            raise BadMessage(f"{msg['op']}: bad or unknown field {key!r}")
    missing = _REQUIRED.get(msg["op"], set()) - set(msg)
    if missing:
        raise BadMessage(f"{msg['op']}: missing {sorted(missing)}")
    return msg


def bind_server(context: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.bind(endpoint)
    return sock


def request(endpoint: str, msg: dict, timeout_s: float = 3.0) -> dict | None:
    """Send one request and wait for its reply; None if none came within the timeout."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 16 * 1024 * 1024)
    try:
        sock.connect(endpoint)
        sock.send(json.dumps(msg).encode())
        if not sock.poll(int(timeout_s * 1000)):
            return None
        reply = json.loads(sock.recv())
        return reply if isinstance(reply, dict) else None
    finally:
        sock.close(linger=0)
        context.term()
