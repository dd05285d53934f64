"""The shard index cache: a shard's index table, kept between starts in a folder of the user's own.

One file per shard and label option, ``<cache>/<32 hex digits>.npy``: the name is a hash of the
shard's real path, size, mtime, inode, ctime and label option, so anyone who can ``stat`` the
shard can compute it. What is in the file decides which label each image is served with, so a
cache is used only where nobody else can have written it:

- the folder (``$PREFETCHD_CACHE``, else ``$XDG_CACHE_HOME/prefetchd/shards``, else
  ``~/.cache/prefetchd/shards``; none for a user without a home, which is logged once) is
  opened without following a symlink and must be this user's and not writable by group or
  others, and every folder above it must be root's or this user's
  and writable by no one else unless sticky (prefetchd_client.folders). Otherwise it is not
  used at all: the log says why, once per process, and every shard is indexed afresh.
- a file in it is opened relative to that folder's descriptor, without following a symlink or
  blocking (a FIFO), and is used only if it is a regular file of this user's that group and
  others cannot write, whose ``.npy`` header declares an ``int64`` (rows, 3) table of exactly
  the file's size, with sizes >= 0, images inside the shard and labels >= -1.
- a file is written ``0600`` under a new name (``O_EXCL``, no symlink followed) and renamed over
  the old one, both relative to the folder's descriptor; a missing folder is made ``0700``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import stat
from pathlib import Path

import numpy as np

from prefetchd.sources.index import NO_LABEL
from prefetchd_client.errors import UnsafeFolder
from prefetchd_client.folders import FILE_FLAGS, is_private, make_private_dir, open_private_dir

log = logging.getLogger(__name__)

# Part of every cache file's name: raise it whenever tarformat.index_tar would index a shard
# differently (3: issue 24's repeated keys and sparse members), or old tables are served.
_CACHE_VERSION = 3
_WHAT = "shard index cache"
_FIX = "set PREFETCHD_CACHE to a folder of your own that only you can write (mode 700)"
_ROW_BYTES = 3 * 8
_MAX_IDENTITY_BYTES = 4096
# Stands for the cache folder of a user without a home: never opened (refused, logged once).
_NO_HOME = Path("/nonexistent/prefetchd-user-without-a-home")
_logged_refusals: set[str] = set()  # cache folders already logged as refused: once per process, not per shard


def _cache_root() -> Path:
    env = os.environ.get("PREFETCHD_CACHE")
    if env:
        return Path(env)
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "prefetchd" / "shards"
    try:
        home = Path.home()
    except (RuntimeError, KeyError):  # no $HOME and a uid without a passwd entry (a container's)
        _refused(_NO_HOME, f"no home folder to keep it in ($HOME is unset and uid {os.getuid()} has none); {_FIX}")
        return _NO_HOME
    return home / ".cache" / "prefetchd" / "shards"


def _cache_file(shard: str, st: os.stat_result, label_key: str | None) -> Path:
    # The inode and ctime too: a shard rewritten in place with its mtime set back (cp -p, rsync -a)
    # changes its ctime, and one replaced by rename its inode.
    return _named([os.path.realpath(shard), label_key, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns])


def _object_cache_file(url: str, info, label_key: str | None) -> Path:
    """A shard in a store: by URL, size, ETag and Last-Modified (objects.ObjectInfo: an object
    rewritten gets another ETag, or on a server without ETags another Last-Modified), and for
    s3:// the endpoint: one bucket name on two S3-compatible stores is two buckets."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    return _named([url, endpoint if url.startswith("s3://") else "", label_key, *info.to_json()])


def _named(identity: list) -> Path:
    ident = json.dumps([_CACHE_VERSION, *identity])
    return _cache_root() / (hashlib.sha256(ident.encode()).hexdigest()[:32] + ".npy")


def _refused(folder: Path, exc: Exception | str) -> None:
    if str(folder) not in _logged_refusals:
        _logged_refusals.add(str(folder))
        log.warning("shard index cache not used, every shard is indexed afresh: %s", exc)


def _open_folder(folder: Path, *, create: bool) -> int | None:
    """A descriptor of the checked cache folder; None when it is missing (and not to be made)
    or refused."""
    if folder == _NO_HOME:
        return None
    try:
        if create:
            fd, made = make_private_dir(folder, _WHAT, fix=_FIX)
            made.close()
            return fd
        return open_private_dir(folder, _WHAT, fix=_FIX)
    except FileNotFoundError:
        return None
    except (UnsafeFolder, OSError) as exc:
        _refused(folder, exc)
        return None


def _load_cached(cache: Path, shard_size: int) -> np.ndarray | None:
    """The table cached for a shard of ``shard_size`` bytes, or None: not there, or not one to trust."""
    table = _read_private(cache, lambda f, size: read_table(f, size))
    return table if table is not None and table_fits(table, shard_size) else None


def _last_known_file(url: str, label_key: str | None) -> Path:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    return _named(["last known", url, endpoint if url.startswith("s3://") else "", label_key]).with_suffix(".json")


def remember_object(url: str, identity: list, label_key: str | None) -> None:
    """Keep the identity (objects.ObjectInfo.to_json) a shard in a store was indexed with: a start
    while the store does not answer serves it with that identity and its cached table."""
    data = json.dumps(identity).encode()
    _write_private(_last_known_file(url, label_key), lambda f: f.write(data))


def last_known_object(url: str, label_key: str | None) -> list | None:
    """What remember_object kept for ``url``, or None."""

    def read(f, size: int):
        return json.loads(f.read(_MAX_IDENTITY_BYTES)) if size <= _MAX_IDENTITY_BYTES else None

    return _read_private(_last_known_file(url, label_key), read)


def _read_private(cache: Path, read):
    """``read(file, size)`` of a file of the cache folder, or None: not there, or not one to trust."""
    dir_fd = _open_folder(cache.parent, create=False)
    if dir_fd is None:
        return None
    try:
        fd = os.open(cache.name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError:  # absent, a symlink (ELOOP), unreadable: indexed again
        return None
    finally:
        os.close(dir_fd)
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not (stat.S_ISREG(st.st_mode) and is_private(st)):
                log.info(
                    "shard index cache file %s not used: not a regular file of yours, or others can write it", cache
                )
                return None
            return read(f, st.st_size)
    except Exception:  # noqa: BLE001 - whatever is wrong with a cache file, it is indexed again
        return None


def table_fits(table: np.ndarray, shard_size: int) -> bool:
    """Whether an index table can be a shard's of ``shard_size`` bytes: sizes >= 0, images
    inside the shard, labels >= -1 (each read checks the member's own header besides)."""
    offsets, sizes, labels = table.T
    has_image = offsets >= 0
    return not (
        (sizes < 0).any() or (offsets[has_image] + sizes[has_image] > shard_size).any() or (labels < NO_LABEL).any()
    )


def read_table(f, file_size: int) -> np.ndarray | None:
    """An int64 (rows, 3) table, read only once the header's claim matches the file's size: a
    header that claims 10**12 rows is refused before anything is allocated for them."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        return None
    if dtype != np.dtype("<i8") or fortran or len(shape) != 2 or shape[1] != 3:
        return None
    if file_size - f.tell() != shape[0] * _ROW_BYTES:
        return None
    data = f.read(shape[0] * _ROW_BYTES)
    return np.frombuffer(data, dtype="<i8").reshape(shape).astype(np.int64)


def _save_cached(cache: Path, table: np.ndarray) -> None:
    """Best effort: a cache that cannot be written costs the next start an indexing, nothing more."""
    _write_private(cache, lambda f: np.save(f, np.ascontiguousarray(table, dtype="<i8"), allow_pickle=False))


def _write_private(cache: Path, write) -> None:
    """``write(file)`` into a new file of the cache folder, renamed over ``cache``; best effort."""
    dir_fd = _open_folder(cache.parent, create=True)
    if dir_fd is None:
        return
    tmp = f".{cache.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # the umask may not narrow it; nothing widens it either
            write(f)
        os.replace(tmp, cache.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        log.info("shard index cache not written (%s): %s", cache, exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
