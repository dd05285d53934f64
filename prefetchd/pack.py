"""``prefetchd pack``: an image folder or file list as WebDataset tar shards.

::

    OUT_DIR/shard-000000.tar   <key>.cls  the label, ASCII decimal ("3")
             shard-000001.tar   <key>.jpg  the image (.png, .webp ... for other formats)
             ...                key = the sample id, zero-padded to 9 digits ("000000042")
             pack.json          written last: its presence marks a complete pack

Samples are in id order, the ids and labels of prefetchd's own index (prefetchd.sources), so a
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
- OUT_DIR must be new or empty: pack never deletes or replaces a file it did not make. Shards
  are written under OUT_DIR/.partial and renamed into place at the end; on any failure,
  Ctrl-C included, what this run made is removed.
- a shard is closed before it would exceed --shard-size; a sample bigger than that on its own
  gets a shard of its own.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import tarfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from PIL import Image

from . import workerserver
from .errors import ConfigError, DataError, UserError
from .sizes import format_size, parse_size
from .sources import SampleIndex, find_classes, read_file_list, scan_image_folder
from .transforms import ALLOWED_FORMATS

FORMAT_VERSION = 1
KEY_DIGITS = 9
_MIN_SHARD_BYTES = tarfile.RECORDSIZE  # one tar record: the smallest file tarfile writes
_CHUNK = 16  # samples per task sent to a worker: amortises the pickling round trip
_EXTENSIONS = {"JPEG": "jpg", "PNG": "png", "TIFF": "tiff", "WEBP": "webp", "BMP": "bmp", "PPM": "ppm"}


@dataclass(frozen=True)
class PackOptions:
    shard_size: int
    max_short_side: int | None
    quality: int
    workers: int


def check_options(shard_size: str, max_short_side: int | None, quality: int, workers: int) -> PackOptions:
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
    return PackOptions(size, max_short_side, quality, workers)


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
    with ProcessPoolExecutor(opts.workers, mp_context=ctx) as pool:
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


class _ShardWriter:
    """Shards under ``partial``, each closed before it would exceed the bound."""

    def __init__(self, partial: Path, limit: int):
        self.partial, self.limit = partial, limit
        self.shards: list[dict] = []
        self.made: list[Path] = []  # files this run created under .partial
        self.moved: list[Path] = []  # ... and those already renamed into OUT_DIR
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
        path = self.partial / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self.made.append(path)
        self._tar = tarfile.open(fileobj=os.fdopen(fd, "wb"), mode="w", format=tarfile.USTAR_FORMAT)
        self.shards.append({"name": name, "samples": 0, "bytes": 0})
        self._offset = 0

    def close(self) -> None:
        if self._tar is not None:
            fileobj = self._tar.fileobj
            self._tar.close()  # tarfile does not close a fileobj it was given
            fileobj.close()
            self.shards[-1]["bytes"] = os.path.getsize(self.partial / self.shards[-1]["name"])
            self._tar = None


def _prepare_out_dir(out_dir: Path) -> bool:
    """Whether this run created ``out_dir``; refuses one that holds anything."""
    try:
        out_dir.mkdir(parents=True)
        return True
    except FileExistsError:
        pass
    except OSError as exc:
        raise UserError(f"cannot create output folder {out_dir}: {exc.strerror}") from None
    if not out_dir.is_dir():
        raise UserError(f"output folder {out_dir} exists and is not a folder; choose a new or empty folder")
    if any(out_dir.iterdir()):
        raise UserError(
            f"output folder {out_dir} is not empty; pack never replaces files: choose a new or empty folder"
        )
    return False


def pack(source: str, out_dir: Path, opts: PackOptions, progress=None) -> dict:
    """Pack ``source`` into ``out_dir``; returns the manifest written as pack.json.
    ``progress(done, total)`` is called after each sample."""
    index, kind, classes = load_source(source)
    created = _prepare_out_dir(out_dir)
    partial = out_dir / ".partial"
    writer = None
    try:
        partial.mkdir()
        writer = _ShardWriter(partial, opts.shard_size)
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
        (partial / "pack.json").write_text(json.dumps(manifest, indent=1) + "\n")
        writer.made.append(partial / "pack.json")
        for path in writer.made:  # pack.json last: a folder with it holds every shard
            os.rename(path, out_dir / path.name)
            writer.moved.append(out_dir / path.name)
        partial.rmdir()
        return manifest
    except BaseException:
        _remove_partial(out_dir, partial, writer, created)
        raise


def _remove_partial(out_dir: Path, partial: Path, writer: _ShardWriter | None, created: bool) -> None:
    if writer is not None:
        if writer._tar is not None:
            writer._tar.fileobj.close()
        for path in writer.made + writer.moved:
            if path.exists():
                path.unlink()
    for folder in (partial, out_dir) if created else (partial,):
        with contextlib.suppress(OSError):  # holds what is not ours: left as it is
            folder.rmdir()


def summary(m: dict) -> str:
    size = format_size(sum(s["bytes"] for s in m["shards"]))
    skipped = f", {len(m['skipped'])} unreadable skipped (listed in pack.json)" if m["skipped"] else ""
    return f"packed {m['samples']} samples into {len(m['shards'])} shard(s), {size}; {m['resized']} resized{skipped}"
