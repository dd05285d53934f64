"""Which Ray cluster a start may join: only one of the user's own.

Connecting to a Ray cluster means running code the cluster sends (see ``rayresults``), so
``--ray-address auto`` resolves only to a cluster whose head runs as this user, and an address
on this node is used only when the process listening there is this user's (or root's). The
checks need no Ray: the master runs them too.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket

import psutil

from prefetchd.remote.raycluster import RayBootError

# -- which cluster: only one of the user's own ---------------------------------------------------
#
# Ray's own "auto" takes $RAY_ADDRESS, then /tmp/ray/ray_current_cluster (written by whoever ran
# `ray start` last, any user), then any raylet in the process table whatever its owner. Here it is
# resolved before Ray sees it, and Ray is handed the concrete address.

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def resolve_address(address: str, environ=os.environ) -> str:
    """The address to hand Ray for ``--ray-address``: ``local``, or a concrete HOST:PORT of a
    head's GCS (never ray://: Ray Client unpickles). RayBootError when it would be a cluster of
    another user's on this node.

    ``auto``: $RAY_ADDRESS when set (the user's own choice), else the one cluster whose raylet on
    this node runs as this user. An address that names this node is accepted only when the port's
    listener is this user's (or root's): a head of the user's that died may have left its port to
    another user's."""
    if address == "auto":
        chosen = environ.get("RAY_ADDRESS", "").strip()
        if chosen and chosen != "auto":
            return chosen if chosen == "local" else check_owner(chosen, "$RAY_ADDRESS")
        return check_owner(_own_cluster(), "--ray-address auto")
    if address == "local":
        return address
    return check_owner(address, "--ray-address")


def _own_cluster() -> str:
    uid = os.getuid()
    mine, others = set(), set()
    for owner, gcs in _raylets():
        if owner == uid:
            mine.add(gcs)
        else:
            others.add(owner)
    if len(mine) == 1:
        return next(iter(mine))
    if mine:
        raise RayBootError(
            f"--ray-address auto: several Ray clusters of yours run on this node ({', '.join(sorted(mine))}); "
            "pass --ray-address HOST:PORT of the one to use"
        )
    uids = ", ".join(map(str, sorted(others)))
    theirs = f" (Ray runs here as uid {uids}: another user's cluster, never joined: its code would run as you)"
    theirs = theirs if others else ""
    raise RayBootError(
        f"--ray-address auto found no Ray cluster of yours on this node{theirs}. Start your own (`ray start --head`), "
        "or pass --ray-address HOST:PORT (or set RAY_ADDRESS) of a cluster you trust, or use --ray-address local"
    )


def _raylets() -> list[tuple[int, str]]:
    """(owner uid, GCS address) of each raylet on this node: a head's and a worker node's alike
    (`ray start` runs one; its command line names the cluster's GCS)."""
    found = []
    for p in psutil.process_iter(["uids", "cmdline"]):
        cmdline, uids = p.info["cmdline"], p.info["uids"]
        if not cmdline or uids is None or os.path.basename(cmdline[0]) != "raylet":
            continue
        gcs = next((a.split("=", 1)[1] for a in cmdline if a.startswith("--gcs-address=")), None)
        if gcs and uids.real == uids.effective:
            found.append((uids.real, gcs))
    return found


def check_owner(address: str, what: str) -> str:
    """``address`` as given, once the listener at its port, when it is on this node, is this
    user's (or root's), and no raylet of another user's on this node belongs to that cluster:
    RayBootError naming the owner otherwise. A head on another machine cannot be checked from
    here: it is the user's word."""
    if "://" in address:
        # ray:// is Ray Client, whose driver unpickles what its server answers (a failed put's
        # error, every get); another scheme makes ray.init import the module the scheme names.
        raise RayBootError(
            f"{what} {address!r}: prefetchd connects only to the HOST:PORT of the cluster's head (its GCS, "
            "`ray start --head --port P`), never through Ray Client (ray://, which unpickles what the server "
            "sends) or another scheme"
        )
    host, port = _host_port(address)
    if host is None:
        raise RayBootError(f"{what} {address!r} is not HOST:PORT (nor auto or local)")
    if _is_this_node(host):
        _check_listener(address, what, port)
    # A raylet of another user's on this node that joined that cluster (a head here or on another
    # machine) runs the tasks scheduled there as that user, with that user's code, and the driver
    # may attach to it as this node's raylet: its results would pass every check of ours.
    joined = sorted({uid for uid, gcs in _raylets() if uid not in (os.getuid(), 0) and _same_gcs(gcs, host, port)})
    if joined:
        raise RayBootError(
            f"{what} {address}: a raylet of uid {', '.join(map(str, joined))} on this node is part of that cluster "
            f"(another user's node, not yours, uid {os.getuid()}): tasks sent there would run that user's code. "
            "Stop that node, or start a head of your own on another port, or use --ray-address local"
        )
    return address


def _check_listener(address: str, what: str, port: int) -> None:
    listeners = _listeners(port)
    if not listeners:  # Ray would retry the port for CONNECT_TIMEOUT_S: time for another user to bind it
        raise RayBootError(
            f"cannot connect to the Ray cluster at {address}: nothing listens on port {port} of this node. "
            "Start your own (`ray start --head --port P`) and pass its address, or use --ray-address local"
        )
    strangers = sorted(listeners - {os.getuid(), 0})  # root's: root can run code as anyone anyway
    if strangers:
        raise RayBootError(
            f"{what} {address} is a Ray cluster of another user (port {port} on this node is uid "
            f"{', '.join(map(str, strangers))}'s, not yours, uid {os.getuid()}): joining it would run its code as you. "
            "Start your own (`ray start --head --port P`) and pass its address, or use --ray-address local"
        )


def _same_gcs(gcs: str, host: str, port: int) -> bool:
    """Whether a raylet's --gcs-address names the GCS at ``host``:``port``: the same port, and
    both on this node or resolving to a common address."""
    their_host, their_port = _host_port(gcs)
    if their_host is None or their_port != port:
        return False
    if _is_this_node(host):
        return _is_this_node(their_host)
    return bool(_addresses(their_host) & _addresses(host))


def _addresses(host: str) -> set[str]:
    try:
        return {info[4][0].split("%")[0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return {host}


def _host_port(address: str) -> tuple[str | None, int]:
    match = re.fullmatch(r"\[?([^\[\]/]+?)\]?:(\d{1,5})", address)
    if match is None or not 0 < int(match[2]) < 65536:
        return None, 0
    return match[1], int(match[2])


def _is_this_node(host: str) -> bool:
    found = [ip for ip in map(_plain_ip, _addresses(host)) if ip is not None]
    if not found:
        return False  # a name that does not resolve: Ray's connect says so, with its own words
    here = {_plain_ip(a.address.split("%")[0]) for addrs in psutil.net_if_addrs().values() for a in addrs}
    # 0.0.0.0 and :: reach this node too (a connect to the unspecified address goes to the host
    # itself), as does an IPv4 address written as IPv6 (::ffff:127.0.0.1, which Python 3.11 does
    # not call loopback).
    return any(ip in here or ip.is_loopback or ip.is_unspecified for ip in found)


def _plain_ip(text: str):
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:  # an interface address psutil shows otherwise (a MAC address)
        return None
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


def _listeners(port: int) -> set[int]:
    """The uids of the sockets listening on TCP ``port`` on this node (this network namespace)."""
    uids = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
            if len(fields) > 7 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                uids.add(int(fields[7]))
    return uids
