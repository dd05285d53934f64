"""The files a daemon leaves for its clients: the manifest (what the job serves and where its
control socket is) and ``stopped.json`` (why it stopped on an error). Both are read as
hostile input: a client checks every value it uses before it uses it.
"""

from __future__ import annotations

import json

from .errors import PlanMismatch
from .folders import read_regular_file
from .layout import MANIFEST, MAX_RANK, MAX_STEP, STOPPED, JobPaths, parse_tcp_endpoint
from .ranks import format_ranks, parse_ranks

_MAX_MANIFEST_BYTES = 1 << 20
# The manifest's own format. The daemon (package prefetchd) writes it and the client (package
# prefetchd-client) reads it; they are installed separately, so a client checks it first.
# 2: "ranks", the ranks a daemon serves; 3: position reports carry the trainer's waits; 4: the
# daemon reuses consumed batch files, so a reader checks that the name still leads to the file
# it locked (an older client would not).
MANIFEST_VERSION = 4
_CURVE_KEY_CHARS = 40  # a CURVE public key in Z85 text


# Its message is at most 8,192 characters (prefetchd.errors.MAX_MESSAGE_CHARS), at most 6 bytes each as JSON.
_MAX_STOPPED_BYTES = 64 << 10
_STOPPED_KEYS = {"type", "message", "exit_code", "stopped_at"}


def read_stopped(paths: JobPaths, *, dir_fd: int | None = None) -> dict | None:
    """Why the job's daemon stopped on an error, as it left it in stopped.json: ``{"type",
    "message", "exit_code", "stopped_at"}``. None when there is none, or when the file is not
    one a daemon writes (not JSON, other keys or types, a symlink, a FIFO): anyone who can
    write in the folder could plant it, and a trainer must neither block on it nor fail for it.
    With ``dir_fd`` (``OpenJob.dir_fd``) it is read in the folder that was checked."""
    try:
        data = read_regular_file(STOPPED if dir_fd is not None else paths.stopped, _MAX_STOPPED_BYTES, dir_fd=dir_fd)
        stopped = json.loads(data)
    except (OSError, ValueError, RecursionError):  # RecursionError: a few thousand nested '['
        return None
    if not isinstance(stopped, dict) or set(stopped) != _STOPPED_KEYS:
        return None
    code, at = stopped["exit_code"], stopped["stopped_at"]
    valid = (
        isinstance(stopped["type"], str)
        and isinstance(stopped["message"], str)
        and type(code) is int
        and 0 < code < 256  # a daemon leaves stopped.json only when it ends with a non-zero exit status
        and type(at) in (int, float)
        and 0 <= at < 2**34  # before the year 2514: a time that time.localtime can show
    )
    return stopped if valid else None


def read_manifest(paths: JobPaths, *, dir_fd: int | None = None) -> dict:
    """The manifest as a dict; FileNotFoundError when the job is not serving, ValueError for
    anything that is not a regular file holding one JSON object (deep nesting included).

    With ``dir_fd`` (``OpenJob.dir_fd``) it is read in the folder that was checked. Its
    values are not checked here: ``check_manifest`` does, for those who use them.
    """
    data = read_regular_file(MANIFEST if dir_fd is not None else paths.manifest, _MAX_MANIFEST_BYTES, dir_fd=dir_fd)
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: a few thousand nested '['
        raise ValueError(f"{paths.manifest} is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{paths.manifest} is not a JSON object")
    return manifest


def _count_up_to(most: int):
    return lambda value: type(value) is int and 0 < value <= most, f"an integer from 1 to {most}"


# What a client reads from a manifest, and what each value must be (the bounds: what batch
# names can hold, what a sample count can be, the kernel's largest pid).
_MANIFEST_VALUES = {
    "world_size": _count_up_to(MAX_RANK + 1),
    "batch_size": _count_up_to(2**40),
    "global_batch": _count_up_to(2**50),
    "batches_per_epoch": _count_up_to(MAX_STEP + 1),
    "pid": _count_up_to(2**22),
    "config_hash": (lambda v: isinstance(v, str), "a string"),
    "config": (lambda v: isinstance(v, dict), "an object"),
}


class VersionMismatch(ValueError):
    """A file of the job written by another prefetchd version than this client's."""


def check_manifest(paths: JobPaths, manifest: dict) -> dict:
    """``manifest`` if every value a client uses has its type, its endpoint is one this job
    can have and its CURVE key is a key; ValueError naming the first that is not
    (VersionMismatch when another prefetchd version wrote it)."""
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        raise VersionMismatch(
            f"{paths.manifest} is of manifest version {str(manifest.get('manifest_version'))[:20]}, and this "
            f"prefetchd-client reads version {MANIFEST_VERSION}: the daemon that wrote it and this client are "
            "different prefetchd versions; install the same version of both "
            "(pip install -U prefetchd prefetchd-client) and restart the job"
        )
    for key, (valid, kind) in _MANIFEST_VALUES.items():
        if not valid(manifest.get(key)):
            raise ValueError(f"{paths.manifest}: {key!r} must be {kind}, found {manifest.get(key)!r:.60}")
    if not _valid_ranks(manifest.get("ranks"), manifest["world_size"]):
        raise ValueError(f"{paths.manifest}: 'ranks' must be ranks of the world, found {manifest.get('ranks')!r:.60}")
    if not valid_endpoint(paths, manifest.get("endpoint")):
        raise ValueError(
            f"{paths.manifest}: 'endpoint' must be {paths.endpoint} or tcp://HOST:PORT, "
            f"found {manifest.get('endpoint')!r:.80}"
        )
    if not valid_curve_key(manifest.get("curve_public_key")):
        raise ValueError(f"{paths.manifest}: 'curve_public_key' must be null or a {_CURVE_KEY_CHARS}-character key")
    return manifest


def check_plan(manifest: dict, paths: JobPaths, rank: int, world_size: int) -> None:
    """PlanMismatch unless the checked ``manifest``'s daemon serves ``rank`` of ``world_size``."""
    world = manifest["world_size"]
    if world_size != world:
        raise PlanMismatch(
            f"this trainer has world size {world_size}, but job {paths.name!r} was planned "
            f"for world_size = {world}: restart the job with --world-size {world_size}, "
            f"or pass world_size={world}"
        )
    if not 0 <= rank < world:
        raise PlanMismatch(f"rank {rank} is outside 0..{world - 1} of job {paths.name!r}")
    served = manifest["ranks"]
    if rank not in served:
        raise PlanMismatch(
            f"rank {rank} is not served by the daemon of job {paths.name!r} under "
            f"{paths.dir.parent}: it serves ranks {format_ranks(served)} of {world} (--ranks). Run this "
            "rank on the node whose daemon serves it, or start this node's daemon with its ranks"
        )


def _valid_ranks(ranks, world_size: int) -> bool:
    """The ranks the daemon serves: sorted, distinct, each of the world."""
    try:
        return isinstance(ranks, list) and list(parse_ranks(ranks)) == ranks and ranks[-1] < world_size
    except ValueError:
        return False


def valid_endpoint(paths: JobPaths, endpoint) -> bool:
    """An endpoint this job's daemon can listen on: its own ipc socket, or a TCP address."""
    if endpoint == paths.endpoint:
        return True
    try:
        tcp = parse_tcp_endpoint(endpoint)
    except ValueError:
        return False
    return not tcp.wildcard  # a bind address; a daemon writes where to connect


def valid_curve_key(key) -> bool:
    """None (no CURVE), or a public key in Z85 text (printable ASCII)."""
    if key is None:
        return True
    return isinstance(key, str) and len(key) == _CURVE_KEY_CHARS and key.isascii() and key.isprintable()
