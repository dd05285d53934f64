"""``prefetchd pack``: an image folder or file list as WebDataset tar shards.

::

    OUT_DIR/shard-000000.tar   <key>.cls  the label, ASCII decimal ("3")
             shard-000001.tar   <key>.jpg  the image (.png, .webp ... for other formats)
             ...                key = the sample id, zero-padded to 9 digits ("000000042")
             pack.json          written last: its presence marks a complete pack

Samples are in id order, the ids and labels of prefetchd's own index (prefetchd.sources.index), so a
packed set and the folder it came from name the same samples. The bytes depend only on the
input and on --shard-size, --max-short-side and --quality: tar members carry fixed metadata
(mtime 0, uid/gid 0, no user names, mode 0o644, ustar format), and --workers only spreads the
per-image work, whose results are written in id order.

Rules:
- an image whose shorter side exceeds --max-short-side is resized (LANCZOS) so that side is N;
  a JPEG stays a JPEG, re-encoded at --quality; any other format is re-encoded as PNG
  (lossless: no second loss on top of the resize, alpha and palette kept). Every image not
  resized goes in byte for byte.
- an unreadable sample (missing, not a regular file, not an image in a format the daemon
  decodes: transforms.ALLOWED_FORMATS) is skipped and recorded under "skipped" in pack.json,
  as the daemon records a replaced sample in its batch header; a pack where no sample is
  readable fails (exit 3). Files are opened with O_NONBLOCK and checked to be regular files
  before reading: a FIFO never blocks.
- OUT_DIR must be new or empty, and a folder of this user's that nobody else can write, under
  folders that only root or this user can change (sticky ones such as /tmp aside): the job
  root's rule (prefetchd_client.folders). In another user's folder, or one others can write,
  they could swap .partial or pack.json for a symlink between two steps and have this user's
  pack overwrite or delete this user's files. pack never deletes or replaces a file it did not
  make. It works relative to OUT_DIR's descriptor: each file is created O_EXCL|O_NOFOLLOW in
  OUT_DIR/.partial and linked into place at the end (pack.json last; renamed where the file
  system has no hard links); on any failure, Ctrl-C included, what this run made is removed,
  each file by its name in the folder held open and only while it is still the inode made.
  A pack killed outright (kill -9) cannot: it leaves OUT_DIR/.partial, which the next pack
  into that folder names (remove the folder), and its worker processes die with it. A full
  file system is the user's error (exit 1), what was made removed, not an internal one.
- files are written 0600 and folders pack creates (OUT_DIR and any missing one above it)
  0700, unless --mode says otherwise: --mode 644 shares the pack for reading (folders 0755:
  an x bit beside each r). No mode lets another user write; the umask does not apply.
- a shard is closed before it would exceed --shard-size; a sample bigger than that on its own
  gets a shard of its own.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import io
import json
import os
import re
import signal
import stat
import tarfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from PIL import Image

from prefetchd.errors import ConfigError, DataError, UserError
from prefetchd.sizes import format_size, parse_size
from prefetchd.sources import shards, tarformat
from prefetchd.sources.index import SampleIndex, find_classes, read_file_list, scan_image_folder
from prefetchd.workers import kernel, workerserver
from prefetchd.workers.transforms import ALLOWED_FORMATS
from prefetchd_client.errors import UnsafeFolder
from prefetchd_client.folders import DIR_FLAGS, make_private_dir

FORMAT_VERSION = 1
KEY_DIGITS = 9
_MIN_SHARD_BYTES = tarfile.RECORDSIZE  # one tar record: the smallest file tarfile writes
_CHUNK = 16  # samples per task sent to a worker: amortises the pickling round trip
_PARTIAL = ".partial"  # shards are written here and moved into OUT_DIR at the end
_FIX = "choose a folder of your own that only you can write (mode 700), under folders of yours or root's"
_OCTAL_MODE = re.compile(r"(?:0o)?([0-7]{1,12})", re.ASCII)  # 12: a bound, far past 7777
_EXTENSIONS = {"JPEG": "jpg", "PNG": "png", "TIFF": "tiff", "WEBP": "webp", "BMP": "bmp", "PPM": "ppm"}


@dataclass(frozen=True)
class PackOptions:
    shard_size: int
    max_short_side: int | None
    quality: int
    workers: int
    mode: int = 0o600  # of the files; a folder gets an x bit beside each r bit (dir_mode)

    @property
    def dir_mode(self) -> int:
        return self.mode | (self.mode & 0o444) >> 2


def parse_mode(text: str) -> int:
    """--mode: the permission bits of the files pack writes, in octal (600, 640, 644)."""
    # ASCII octal digits only, as chmod reads them (0o as in Python allowed): int() alone would
    # also take "६४४" (Devanagari digits), "6_44" and "+644" as 644.
    digits = _OCTAL_MODE.fullmatch(text.strip(" \t"))
    if digits is None:
        raise ConfigError(
            f"--mode {text!r} is not an octal mode; use e.g. 600 (only you) or 644 (all may read)"
        ) from None
    mode = int(digits[1], 8)
    if not 0 <= mode <= 0o777:
        raise ConfigError(f"--mode {text}: only read and write bits (000-777); no setuid, setgid or sticky bit")
    if mode & 0o022:
        raise ConfigError(
            f"--mode {text} lets other users write the shards, so they could replace them; use 644 (all may "
            "read) or 640 (your group may read)"
        )
    if mode & 0o111:
        raise ConfigError(f"--mode {text}: shards are not programs; no x bit (folders get one beside each r)")
    if mode & 0o600 != 0o600:
        raise ConfigError(f"--mode {text}: you must be able to read and write what you pack (6 first: 600, 644)")
    return mode


def check_options(
    shard_size: str, max_short_side: int | None, quality: int, workers: int, mode: str = "600"
) -> PackOptions:
    try:
        size = parse_size(shard_size)
    except ValueError as exc:
        raise ConfigError(f"--shard-size: {exc}") from None
    if size < _MIN_SHARD_BYTES:
        raise ConfigError(f"--shard-size {shard_size} is below one tar record ({_MIN_SHARD_BYTES} bytes); use e.g. 1G")
    if max_short_side is not None and max_short_side < 1:
        raise ConfigError(f"--max-short-side must be a positive number of pixels, not {max_short_side}")
    if not 1 <= quality <= 100:
        raise ConfigError(f"--quality must be in 1..100 (JPEG quality), not {quality}")
    if not 1 <= workers <= 256:
        raise ConfigError(f"--workers must be in 1..256, not {workers}")
    return PackOptions(size, max_short_side, quality, workers, parse_mode(mode))


def load_source(source: str) -> tuple[SampleIndex, str, list[str] | None]:
    """The index, the source's kind and its class names (None for a file list, whose labels
    are bare numbers)."""
    where = f"pack {source}"
    if os.path.isfile(source):
        return read_file_list(source, where), "file_list", None
    index = scan_image_folder(source, where)  # a missing path: its DataError
    # Label i is the i-th class folder (the scan fails when any is empty): the scan's own list.
    return index, "image_folder", find_classes(os.path.expanduser(source), where)


def encode_sample(path: str, max_short_side: int | None, quality: int) -> tuple[str, bytes, bool] | str:
    """(extension, bytes, resized) of one image, or why it cannot be packed. Runs in workers."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"cannot open: {exc.strerror}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a regular file"
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read()
    except OSError as exc:
        return f"cannot read: {exc.strerror}"
    finally:
        os.close(fd)
    try:
        with Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS) as im:  # the daemon's decoders, no rarer plugin
            kind = im.format or ""
            width, height = im.size
            short = min(width, height)
            if max_short_side is None or short <= max_short_side:
                return _EXTENSIONS.get(kind, kind.lower()), data, False
            long_side = max(1, round(max(width, height) * max_short_side / short))
            size = (max_short_side, long_side) if width <= height else (long_side, max_short_side)
            small = im.resize(size, Image.Resampling.LANCZOS)
            out = io.BytesIO()
            extra = {"icc_profile": im.info["icc_profile"]} if im.info.get("icc_profile") else {}
            if kind == "JPEG":
                small.save(out, "JPEG", quality=quality, **extra)
                return "jpg", out.getvalue(), True
            small.save(out, "PNG", **extra)
            return "png", out.getvalue(), True
    except Exception as exc:  # Pillow raises many kinds for a bad file; each is this sample's
        return f"not an image Pillow can read ({type(exc).__name__}: {str(exc)[:200]})"


def _encode_chunk(items: list[str], max_short_side: int | None, quality: int) -> list:
    return [encode_sample(p, max_short_side, quality) for p in items]


def _encoded(index: SampleIndex, opts: PackOptions):
    """encode_sample's result for each id, in id order; at most a few chunks per worker in
    flight, so memory stays bounded whatever the dataset's size."""
    chunks = ([index.path(i) for i in range(s, min(s + _CHUNK, len(index)))] for s in range(0, len(index), _CHUNK))
    if opts.workers == 1:
        for paths in chunks:
            yield from _encode_chunk(paths, opts.max_short_side, opts.quality)
        return
    ctx = get_context("forkserver")  # fork would copy the parent's threads (rich's refresher) mid-state
    workerserver.fit_socket_folder()
    # The server and the workers hold their own pipes open, so no EOF ends them when pack is
    # killed (kill -9, the OOM killer): they would wait for good. The server preloads
    # workerserver, which asks the kernel to kill it with its parent; each worker asks the same.
    ctx.set_forkserver_preload([workerserver.__name__])
    pool = ProcessPoolExecutor(opts.workers, mp_context=ctx, initializer=_die_with_the_pack, initargs=(os.getpid(),))
    with pool:
        pending = []
        try:
            for paths in chunks:
                pending.append(pool.submit(_encode_chunk, paths, opts.max_short_side, opts.quality))
                if len(pending) >= 4 * opts.workers:
                    yield from pending.pop(0).result()
            while pending:
                yield from pending.pop(0).result()
        finally:
            pool.shutdown(cancel_futures=True)


def _die_with_the_pack(pack_pid: int) -> None:
    """In a worker: SIGKILL when its parent (the fork server, which dies with pack) dies; and
    Ctrl-C, which a terminal sends to the whole group, left to pack (no traceback per worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    kernel.die_with_the_parent()  # not Linux: pack's pool ends its workers when it can
    # The pool forks a worker when work waits for one: forked just as pack died (and the server
    # with it), it asked for the signal too late to get it, and would wait for work for good.
    if _gone(pack_pid):
        os._exit(1)


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie not yet reaped included); False when /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] == b"Z"
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info, io.BytesIO(data)


def _tar_bytes(size: int) -> int:
    return tarfile.BLOCKSIZE + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def _closed_size(offset: int) -> int:
    """A tar's file size once closed: two zero blocks, then padding to a whole record."""
    return -(-(offset + 2 * tarfile.BLOCKSIZE) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


class _OutDir:
    """OUT_DIR, checked and held open: every file is made in it, moved and removed relative to
    a descriptor, never by a path that could name another folder by then.

    OUT_DIR must be this user's, writable by no one else, under folders no one else can
    change (prefetchd_client.folders: the rule of the job root); one that does not exist is
    made, with any missing folder above it, with the folder mode. A failed run removes what it
    made and nothing else: each file by its name in the folder it was made in, and only while
    that name is still the inode it made.
    """

    def __init__(self, out_dir: Path, opts: PackOptions):
        self.path, self.mode = out_dir, opts.mode
        try:
            self.fd, self.made_dirs = make_private_dir(out_dir, "output folder", mode=opts.dir_mode, fix=_FIX)
        except UnsafeFolder as exc:
            raise UserError(str(exc)) from None
        except OSError as exc:
            raise UserError(f"cannot create output folder {out_dir}: {exc.strerror}; choose another folder") from None
        self.partial_fd = -1
        self.partial_ino = 0
        self.files: list[tuple[str, int]] = []  # made in .partial: (name, inode)
        self.moved: list[tuple[str, int]] = []  # ... and already moved into OUT_DIR
        try:
            entries = os.listdir(self.fd)
            if entries:
                # .partial is pack's own: one left there is a run killed before it could remove it
                # (kill -9, a crash, the machine down); what it holds is incomplete.
                left = (
                    f"; it holds {_PARTIAL}, left by a pack that did not finish (killed before it could clean up): "
                    f"remove the folder (rm -r {out_dir}) and pack again"
                    if _PARTIAL in entries
                    else ""
                )
                raise UserError(
                    f"output folder {out_dir} is not empty; pack never replaces files: choose a new or empty "
                    f"folder{left}"
                )
            os.mkdir(_PARTIAL, 0o700, dir_fd=self.fd)  # inside a private folder: nobody else can swap it
            self.partial_fd = os.open(_PARTIAL, DIR_FLAGS, dir_fd=self.fd)
            self.partial_ino = os.fstat(self.partial_fd).st_ino
        except BaseException:
            self.remove()
            raise

    def create(self, name: str) -> int:
        """A new file ``name`` in .partial, with the files' mode; its descriptor, open for writing."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o600, dir_fd=self.partial_fd)
        self.files.append((name, os.fstat(fd).st_ino))
        os.fchmod(fd, self.mode)  # exactly --mode: the umask neither narrows nor widens it
        return fd

    def publish(self) -> None:
        """Move every file into OUT_DIR in the order made (pack.json last), and remove .partial."""
        for name, ino in list(self.files):
            # Noted first: a failure from here on finds it by its inode under either name.
            self.moved.append((name, ino))
            try:  # a link never replaces a name that is there; rename would
                os.link(name, name, src_dir_fd=self.partial_fd, dst_dir_fd=self.fd, follow_symlinks=False)
            except FileExistsError:
                raise UserError(f"{self.path / name} appeared while packing; pack never replaces files") from None
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                os.rename(name, name, src_dir_fd=self.partial_fd, dst_dir_fd=self.fd)  # no hard links here
            else:
                os.unlink(name, dir_fd=self.partial_fd)
            self.files.remove((name, ino))
        os.rmdir(_PARTIAL, dir_fd=self.fd)
        os.close(self.partial_fd)
        self.partial_fd = -1

    def remove(self) -> None:
        """What this run made, gone: its files, .partial, and the folders it created."""
        for dir_fd, made in ((self.fd, self.moved), (self.partial_fd, self.files)):
            for name, ino in made:
                _unlink_if(dir_fd, name, ino)
        if self.partial_fd >= 0:
            with contextlib.suppress(OSError):  # holds what is not ours: left as it is
                if os.stat(_PARTIAL, dir_fd=self.fd, follow_symlinks=False).st_ino == self.partial_ino:
                    os.rmdir(_PARTIAL, dir_fd=self.fd)
        self._close_folders()
        self.made_dirs.remove()

    def close(self) -> None:
        self._close_folders()
        self.made_dirs.close()

    def _close_folders(self) -> None:
        for fd in (self.partial_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.partial_fd = self.fd = -1


def _unlink_if(dir_fd: int, name: str, ino: int) -> None:
    """Unlink ``name`` only while it is still the inode this run made."""
    with contextlib.suppress(OSError):
        if dir_fd >= 0 and os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino == ino:
            os.unlink(name, dir_fd=dir_fd)


class _ShardWriter:
    """Shards in the output folder's .partial, each closed before it would exceed the bound."""

    def __init__(self, out: _OutDir, limit: int):
        self.out, self.limit = out, limit
        self.shards: list[dict] = []
        self._tar: tarfile.TarFile | None = None
        self._offset = 0

    def add(self, key: str, label: int, ext: str, data: bytes) -> None:
        cls = str(label).encode()
        grow = _tar_bytes(len(cls)) + _tar_bytes(len(data))
        if self._tar is not None and self.shards[-1]["samples"] and _closed_size(self._offset + grow) > self.limit:
            self.close()
        if self._tar is None:
            self._open()
        # sorted member order within a sample: .cls before .jpg
        for info, body in sorted((_member(f"{key}.cls", cls), _member(f"{key}.{ext}", data)), key=lambda m: m[0].name):
            self._tar.addfile(info, body)
        self._offset += grow
        self.shards[-1]["samples"] += 1

    def _open(self) -> None:
        name = f"shard-{len(self.shards):06d}.tar"
        fd = self.out.create(name)
        self._tar = tarfile.open(fileobj=os.fdopen(fd, "wb"), mode="w", format=tarfile.USTAR_FORMAT)
        self.shards.append({"name": name, "samples": 0, "bytes": 0})
        self._offset = 0

    def close(self) -> None:
        if self._tar is not None:
            fileobj = self._tar.fileobj
            try:
                self._tar.close()  # tarfile does not close a fileobj it was given
                fileobj.flush()
                self.shards[-1]["bytes"] = os.fstat(fileobj.fileno()).st_size
            finally:
                self._tar = None
                fileobj.close()
            self._write_index(self.shards[-1])

    def _write_index(self, shard: dict) -> None:
        """``<shard>.idx`` beside the shard: its table as `start` would index it, read back from
        the shard just written (so it is exactly what indexing the shard gives), for `start` to
        read instead of the shard, most of all where the shard lies in a store."""
        fd = os.open(shard["name"], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.out.partial_fd)
        with open(fd, "rb") as f:
            table = tarformat.index_tar(f, functools.partial(os.pread, fd), shard["name"], None)
            f.seek(0)
            md5 = hashlib.file_digest(f, "md5").hexdigest()  # what a bucket's ETag is, for a shard put whole
        data = shards.index_object_bytes(table, shard["bytes"], md5)
        with os.fdopen(self.out.create(shard["name"] + shards.INDEX_SUFFIX), "wb") as out:
            out.write(data)
        shard["index"] = shard["name"] + shards.INDEX_SUFFIX

    def discard(self) -> None:
        """Close an open shard unfinished (a failed run removes it)."""
        if self._tar is not None:
            with contextlib.suppress(OSError):
                self._tar.fileobj.close()
            self._tar = None


def pack(source: str, out_dir: Path, opts: PackOptions, progress=None) -> dict:
    """Pack ``source`` into ``out_dir``; returns the manifest written as pack.json.
    ``progress(done, total)`` is called after each sample."""
    index, kind, classes = load_source(source)
    try:
        out = _OutDir(out_dir, opts)  # removes what it made when it fails
    except OSError as exc:
        _raise_if_full(exc, out_dir)
        raise
    writer = _ShardWriter(out, opts.shard_size)
    try:
        skipped, resized = [], 0
        for i, result in enumerate(_encoded(index, opts)):
            if isinstance(result, str):
                skipped.append({"id": i, "path": index.path(i), "reason": result})
            else:
                ext, data, was_resized = result
                writer.add(f"{i:0{KEY_DIGITS}d}", index.label(i), ext, data)
                resized += was_resized
            if progress is not None:
                progress(i + 1, len(index))
        writer.close()
        if not writer.shards:
            raise DataError(
                f"pack {source}: none of its {len(index)} samples is a readable image: {skipped[0]['reason']}"
            )
        manifest = {
            "format": "prefetchd-pack",
            "version": FORMAT_VERSION,
            "source": {"kind": kind, "path": os.path.abspath(source)},
            "samples": len(index) - len(skipped),
            "indexed": len(index),
            "resized": resized,
            "skipped": skipped,
            "classes": classes,
            "shards": writer.shards,
            "options": {"shard_size": opts.shard_size, "max_short_side": opts.max_short_side, "quality": opts.quality},
        }
        with os.fdopen(out.create(shards.PACK_MANIFEST), "wb") as f:
            f.write((json.dumps(manifest, indent=1) + "\n").encode())
        out.publish()  # pack.json last: a folder with it holds every shard
        out.close()
        return manifest
    except BaseException as exc:
        writer.discard()
        out.remove()
        _raise_if_full(exc, out_dir)
        raise


def _raise_if_full(exc: BaseException, out_dir: Path) -> None:
    """A full file system (no blocks, no inodes, the quota) is the place, not a bug: a UserError
    that says so, not an internal error (exit 70). Called once what was made is removed."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise UserError(
            f"no space left for the pack in output folder {out_dir} ({exc.strerror}); what it wrote there is "
            "removed: free space there (or raise your quota), or choose a folder on another file system"
        ) from None


def summary(m: dict) -> str:
    size = format_size(sum(s["bytes"] for s in m["shards"]))
    skipped = f", {len(m['skipped'])} unreadable skipped (listed in pack.json)" if m["skipped"] else ""
    return f"packed {m['samples']} samples into {len(m['shards'])} shard(s), {size}; {m['resized']} resized{skipped}"
