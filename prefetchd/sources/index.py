"""Sample indexes: which file and label each sample id names.

The index is kept in numpy arrays, not Python lists (a list of 1.28 M path strings costs
hundreds of MB per process and dirties copy-on-write pages): all paths concatenated into
one byte array plus offsets, and an int64 label array. The master writes them once as
``.npy`` files in the job directory; workers map them read-only.

Paths are kept as the file system's bytes (``os.fsencode``), not as UTF-8 text: Linux allows
any bytes in a file name, and a name that is not UTF-8 is a valid image all the same. It
comes back as Python's surrogate-escaped ``str`` (``os.fsdecode``), the very string that
``os.scandir`` and torchvision's ImageFolder give for it, and ``open`` takes it as it is.
For UTF-8 names the bytes are those of ``str.encode()``, so fingerprints of existing
indexes do not change.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from prefetchd import stopsignals
from prefetchd.errors import DataError
from prefetchd.sources.indexfiles import (
    CONTAINER_COLUMNS,
    FILE_COLUMNS,
    OBJECTS_FILE,
    ColumnFile,
    IndexWriter,
    column_chunks,
)
from prefetchd.sources.objects import ObjectInfo
from prefetchd.sources.places import FILE
from prefetchd.sources.progress import IndexingProgress

# torchvision's ImageFolder extensions.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_MAX_OBJECTS_BYTES = 256 << 20
_MAX_STARTS_BYTES = 1 << 30  # starts is read whole: a place per file of a folder, or a container's

NO_LABEL = -1  # a container sample without a label: a bad sample when it is read
NEVER = 1 << 62  # the next use of a sample the plan does not place (a stand-in for a bad one)


@dataclass(frozen=True)
class SampleIndex:
    """Each sample's label and place. A *place* is a file of its own or a container (a tar
    shard, a Parquet file), its path ``paths[offsets[p]:offsets[p + 1]]``. Files only: sample i
    is place i. With containers, ``starts[p]`` is the first sample of place p (its samples are
    consecutive), so a shard's path is kept once, not once per sample. The columns are numpy
    arrays, or indexfiles.ColumnFile once loaded from a job folder."""

    paths: np.ndarray  # uint8, every place's path as file-system bytes (os.fsencode) back to back
    offsets: np.ndarray  # int64, places + 1
    labels: np.ndarray  # int64, a label per sample
    # Only where some sample lives in a container (tar shard, Parquet file), else None (so the
    # fingerprints of files-only indexes stay as they were): uint8 (n,) kind and int64 (n, 2)
    # place in its container of each sample, and int64 (places + 1,) the first sample of each place.
    kinds: np.ndarray | None = None
    members: np.ndarray | None = None
    starts: np.ndarray | None = None
    # Only where some container is an object in a store: url -> its identity as indexed
    # (objects.ObjectInfo.to_json), which every read of it checks; None otherwise, fingerprints unchanged.
    objects: dict[str, list] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def kind(self, i: int) -> int:
        return FILE if self.kinds is None else int(self.kinds[i])

    def member(self, i: int) -> tuple[int, int]:
        a, b = self.members[i]
        return int(a), int(b)

    def path(self, i: int) -> str:
        p = i if self.starts is None else int(np.searchsorted(self.starts, i, side="right")) - 1
        a, b = self.offsets[p : p + 2]
        return os.fsdecode(bytes(self.paths[int(a) : int(b)]))

    def label(self, i: int) -> int:
        return int(self.labels[i])

    @classmethod
    def from_lists(cls, paths: list[str], labels: list[int]) -> SampleIndex:
        encoded = [os.fsencode(p) for p in paths]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets, np.asarray(labels, dtype=np.int64))

    @classmethod
    def in_containers(
        cls, containers: list[str], counts: list[int], kind: int, members, labels, objects: dict | None = None
    ) -> SampleIndex:
        """Samples that live in containers: ``counts[j]`` consecutive samples in ``containers[j]``,
        each at ``members`` (n, 2) of ``kind``; ``objects``: the identity of those in a store."""
        n = int(sum(counts))
        encoded = [os.fsencode(c) for c in containers]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        starts = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        paths = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        members = np.asarray(members, dtype=np.int64).reshape(n, 2)
        labels = np.asarray(labels, dtype=np.int64)
        return cls(paths, offsets, labels, np.full(n, kind, np.uint8), members, starts, objects or None)

    @classmethod
    def concat(cls, parts: list[SampleIndex]) -> SampleIndex:
        """The parts' samples one after the other, in memory (IndexWriter writes them to files)."""
        if len(parts) == 1:
            return parts[0]
        with tempfile.TemporaryDirectory(prefix="prefetchd-index-") as folder:
            writer = IndexWriter(Path(folder) / "index")
            for part in parts:
                writer.add(part)
            writer.finish()
            loaded = cls.load(Path(folder) / "index")
            return loaded.in_memory()

    def in_memory(self) -> SampleIndex:
        """The same index with every column an array in this process's memory."""
        arrays = [None if a is None else np.array(a) for a in self._columns()]
        return SampleIndex(*arrays, objects=self.objects)

    def _columns(self) -> tuple:
        return self.paths, self.offsets, self.labels, self.kinds, self.members, self.starts

    def _arrays(self) -> tuple[tuple[str, np.ndarray], ...]:
        columns = self._columns()
        if self.kinds is None:
            return tuple(zip(FILE_COLUMNS, columns[:3]))
        return tuple(zip(FILE_COLUMNS + CONTAINER_COLUMNS, columns))

    def fingerprint(self) -> str:
        """Identifies the sample list: a resume on changed data must not pass as exact."""
        h = hashlib.sha256()
        for _, column in self._arrays():
            for chunk in column_chunks(column):
                h.update(chunk)
        if self.objects:  # an object rewritten in the store (another ETag) is other data
            h.update(json.dumps(self.objects, sort_keys=True).encode())
        return h.hexdigest()[:16]

    def save(self, folder: Path) -> None:
        writer = IndexWriter(folder)
        writer.add(self)
        writer.finish()

    @classmethod
    def load(cls, folder: Path) -> SampleIndex:
        """The index saved in ``folder``, its columns read by row (indexfiles.ColumnFile)."""
        containers = os.path.lexists(folder / CONTAINER_COLUMNS[0])
        columns = [ColumnFile(folder / name) for name in FILE_COLUMNS + (CONTAINER_COLUMNS if containers else ())]
        if not containers:
            return cls(*columns)
        starts = columns.pop()
        if starts.nbytes > _MAX_STARTS_BYTES:
            raise ValueError(f"{folder / CONTAINER_COLUMNS[2]} is too big for an index's places")
        return cls(*columns, np.asarray(starts), _load_objects(folder / OBJECTS_FILE))


def _load_objects(path: Path) -> dict[str, list] | None:
    """The index's objects.json, checked: url -> [size, etag, modified]; None when it is not there."""
    try:
        fd, st = open_data_file(str(path))
    except FileNotFoundError:
        return None
    with open(fd, "rb") as f:
        if st.st_size > _MAX_OBJECTS_BYTES:
            raise ValueError(f"{path} has {st.st_size} bytes, more than an index of objects holds")
        objects = json.loads(f.read())
    if not isinstance(objects, dict):
        raise ValueError(f"{path} is not a map of url to [size, etag, modified]")
    for identity in objects.values():
        ObjectInfo.from_json(identity)  # ValueError or TypeError for anything else
    return objects


def open_data_file(path: str) -> tuple[int, os.stat_result]:
    """``path`` opened for reading, and its stat. What the index names may since have been
    replaced by a FIFO or a device, which a plain open would block on or read without end: it
    is opened without blocking and refused (ValueError, the fd closed) unless a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValueError(f"{path} is no longer a regular file")
    return fd, st


MAX_FILE_BYTES = 1 << 30  # no image prefetchd decodes is bigger: a larger file is not read into memory


def read_image_file(path: str) -> bytes:
    """The bytes of the image file ``path``: a regular file (open_data_file) of a sane size."""
    fd, st = open_data_file(path)
    try:
        if st.st_size > MAX_FILE_BYTES:
            raise ValueError(f"{path} has {st.st_size} bytes, more than any image ({MAX_FILE_BYTES})")
        # A read of the size it has, then on to its end (one that grew since its stat: up to the
        # limit). A buffered read(MAX_FILE_BYTES + 1) mapped, faulted and shrank 1 GiB of address
        # space per image: 93 us against 64.
        data, chunk = b"", os.read(fd, st.st_size + 1)
        while chunk:
            data += chunk  # the first: no copy (b"" + chunk is chunk)
            if len(data) > MAX_FILE_BYTES:
                raise ValueError(f"{path} grew past {MAX_FILE_BYTES} bytes while it was read, more than any image")
            chunk = os.read(fd, 1 << 16)
        return data
    finally:
        os.close(fd)


class SampleBytes:
    """A worker's reader of the samples of one place kind (FILE, TAR_MEMBER, ...): its own open
    files and caches. ``path`` and ``(a, b)`` are what the index holds for the sample (``a, b``
    its ``members`` row: where in the container), ``options`` its [[source]]'s own keys
    (sources.kinds: a Parquet source's image_column). Raising ValueError makes a bad sample.
    ``objects_indexed``: the index's url -> [size, etag, modified] of containers in a store (set by the
    SampleReader that makes it), which every read of them checks."""

    objects_indexed: Mapping[str, list] = MappingProxyType({})
    # Where the plan uses the sample being read now and where it needs it next (plan.Plan.uses),
    # for a local cache's eviction (sources.membercache); set by the SampleReader before each read.
    now: int = 0
    next_use: int = NEVER

    def read_sample(self, path: str, a: int, b: int, options: dict) -> bytes:
        """The sample's encoded image."""
        raise NotImplementedError

    def where(self, path: str, a: int, b: int) -> str:
        """The sample's place, as a batch records it."""
        return path

    def why_no_label(self, path: str, a: int, b: int, options: dict) -> str:
        """Why a sample the index left without a label has none, in its source's words."""
        return "the sample has no label"

    def will_need(self, places: list[tuple]) -> None:
        """The coming samples' places, (path, a, b, options) each as read_sample takes them: a
        reader may ask for their bytes now (read-ahead)."""

    def io_totals(self) -> dict[str, list]:
        """Each object store's counters since the reader was made (sources.objects.IO_FIELDS)."""
        return {}

    def close(self) -> None:
        pass


class OwnFiles(SampleBytes):
    """Samples that are files of their own (image_folder, file_list)."""

    def read_sample(self, path: str, a: int, b: int, options: dict) -> bytes:
        return read_image_file(path)


def index_image_folder(source: dict, where: str) -> SampleIndex:
    """A ``kind = "image_folder"`` source's samples (sources.kinds)."""
    return scan_image_folder(source["root"], where)


def index_file_list(source: dict, where: str) -> SampleIndex:
    """A ``kind = "file_list"`` source's samples (sources.kinds)."""
    return read_file_list(source["path"], where)


def folder_class_names(source: dict) -> list[str]:
    """An image folder's classes: its class folders' names, label i the i-th (find_classes)."""
    return find_classes(os.path.expanduser(source["root"]), "image_folder")


def scan_image_folder(root: str, where: str) -> SampleIndex:
    """torchvision's ``ImageFolder(root).samples``, path for path and label for label.

    The same rules as torchvision's ``find_classes`` and ``make_dataset`` (folder.py, 0.28):
    the classes are the sorted names of every sub-folder of ``root``, hidden ones and
    symlinked ones included; each class folder is walked like ``os.walk(..., followlinks=True)``,
    the folders visited in sorted order of their paths, the files of each in sorted order of
    their names, and a file counts when its name ends, in any case, in one of
    IMAGE_EXTENSIONS. Where torchvision would go on silently with a wrong list (a folder it
    cannot list, a symlink loop it follows until the kernel's ELOOP, an image name that is not
    a regular file and would fail or block at read time), the scan stops with a DataError
    naming the path instead.
    """
    root = os.path.expanduser(root)
    _check_data_folder(root, where)
    classes = find_classes(root, where)
    # A link back to the root loops too: counting the root as an ancestor names that link.
    above = (_folder_identity(root, where),)
    paths, labels, empty = [], [], []
    progress = IndexingProgress(len(classes), where, "class folders")
    for label, cls in enumerate(classes):
        stopsignals.check_starting()  # a folder of millions of files takes a while: a stop need not wait
        progress.done_one()
        files = _image_files(os.path.join(root, cls), above, where)
        if not files:
            empty.append(cls)
        paths.extend(files)
        labels.extend([label] * len(files))
    if empty:
        raise DataError(_empty_classes_message(root, empty, where))
    return SampleIndex.from_lists(paths, labels)


def _shown(path: str) -> str:
    """A path fit for a message: the bytes of a name that is not UTF-8 as \\xNN escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _check_data_folder(root: str, where: str) -> None:
    fix = "set root in [[source]] or pass --data FOLDER"
    if not os.path.exists(root):
        raise DataError(f"{where}: data folder {_shown(root)} does not exist; {fix}")
    if not os.path.isdir(root):
        raise DataError(
            f"{where}: {_shown(root)} is not a folder; image_folder expects <root>/<class>/<image>; {fix}"
        )


def find_classes(root: str, where: str) -> list[str]:
    """torchvision's find_classes: every entry that is a folder once symlinks are followed."""
    classes = []
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                if _is_class_folder(entry, where):
                    classes.append(entry.name)
    except OSError as exc:
        raise DataError(f"{where}: cannot list {_shown(root)}: {exc.strerror}") from None
    if not classes:
        raise DataError(
            f"{where}: {_shown(root)} has no class sub-folders; image_folder expects <root>/<class>/<image>"
        )
    return sorted(classes)


def _is_class_folder(entry: os.DirEntry, where: str) -> bool:
    # DirEntry.is_dir() answers False for a dangling symlink but raises for any other stat
    # error (ELOOP, EACCES); torchvision lets that escape, the scan names the entry.
    try:
        return entry.is_dir()
    except OSError as exc:
        raise DataError(f"{where}: cannot tell whether {_shown(entry.path)} is a folder: {exc.strerror}") from None


def _image_files(class_folder: str, above: tuple, where: str) -> list[str]:
    """The image paths under one class folder, in make_dataset's order.

    make_dataset sorts the tuples of ``os.walk``, that is the folders by their whole path
    ("a/b-c" before "a/b/x", since "-" < "/"), not in the order the walk visits them.
    """
    folders = sorted(_walk(class_folder, above, where))
    return [os.path.join(folder, name) for folder, names in folders for name in sorted(names)]


def _walk(top: str, above: tuple, where: str) -> list[tuple[str, list[str]]]:
    """(folder, names of its images) for ``top`` and every folder below it, as
    ``os.walk(top, followlinks=True)`` sees them, but loud where os.walk is silent: it skips
    a folder it cannot list, and it follows a link back to a folder it is inside of until the
    kernel refuses the path (ELOOP), listing the same images some forty times over."""
    found = []
    pending = [(top, above)]
    while pending:
        folder, ancestors = pending.pop()
        identity = _folder_identity(folder, where)
        if identity in ancestors:
            raise DataError(
                f"{where}: {_shown(folder)} leads back into a folder that contains it (a symlink loop); "
                "torchvision would list its images again and again: remove the link"
            )
        subfolders, images = _list_folder(folder, where)
        found.append((folder, images))
        pending.extend((os.path.join(folder, sub), (*ancestors, identity)) for sub in subfolders)
    return found


def _folder_identity(folder: str, where: str) -> tuple[int, int]:
    try:
        st = os.stat(folder)
    except OSError as exc:
        raise DataError(f"{where}: cannot read {_shown(folder)}: {exc.strerror}") from None
    return st.st_dev, st.st_ino


def _list_folder(folder: str, where: str) -> tuple[list[str], list[str]]:
    """Names of the sub-folders, split from the rest as os.walk splits them, and of the images.

    torchvision tests the extension on the whole path, lower-cased; testing the name is the
    same, since str.lower() maps character by character (only a final sigma looks at its
    neighbours, and no extension ends in one).
    """
    subfolders, images = [], []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if _walk_is_folder(entry):
                    subfolders.append(entry.name)
                elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                    _check_image_is_file(entry, where)
                    images.append(entry.name)
    except OSError as exc:
        raise DataError(f"{where}: cannot list {_shown(folder)}: {exc.strerror}") from None
    return subfolders, images


def _walk_is_folder(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False  # as os.walk does: the entry goes with the files


def _check_image_is_file(entry: os.DirEntry, where: str) -> None:
    """An image name must be a regular file once symlinks are followed: torchvision lists a
    dangling link, a FIFO or a device too, and reading it later fails or blocks forever."""
    try:
        if entry.is_file():
            return
        what = _kind_of(os.stat(entry.path).st_mode)
    except FileNotFoundError:
        what = "a symbolic link to nothing"
    except OSError as exc:
        what = f"unreadable ({exc.strerror})"
    raise DataError(
        f"{where}: {_shown(entry.path)} is named like an image but is {what}, not a regular file; "
        "remove it or put the image there"
    )


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
)


def _kind_of(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def _empty_classes_message(root: str, empty: list[str], where: str) -> str:
    shown = ", ".join(_shown(c) for c in empty[:5]) + (" ..." if len(empty) > 5 else "")
    hidden = (
        "; hidden folders count as classes, as in torchvision's ImageFolder"
        if any(c.startswith(".") for c in empty)
        else ""
    )
    return (
        f"{where}: {len(empty)} class folder(s) under {_shown(root)} hold no images ({shown}); "
        f"remove them or add images with one of {', '.join(IMAGE_EXTENSIONS)}{hidden}"
    )


def read_file_list(path: str, where: str) -> SampleIndex:
    """Lines of ``path,label``; relative paths resolve against the list's folder; id = line number."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise DataError(f"{where}: cannot read file list {path}: {exc.strerror}; set path in [[source]]") from None
    lines = _utf8_text(data, path).splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    base = os.path.dirname(os.path.abspath(path))
    paths, labels = [], []
    for lineno, line in enumerate(lines, 1):
        file, sep, label = line.rpartition(",")
        if not sep or not file.strip() or not label.strip().isdigit():
            raise DataError(f"{path}:{lineno}: expected 'path,label' with a non-negative integer label, got {line!r}")
        paths.append(os.path.join(base, file.strip()))
        labels.append(int(label))
    if not paths:
        raise DataError(f"{where}: file list {path} is empty; it needs one 'path,label' line per sample")
    return SampleIndex.from_lists(paths, labels)


def _utf8_text(data: bytes, path: str) -> str:
    """File lists are UTF-8 only; a file whose name is not UTF-8 is served by image_folder."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        raise DataError(
            f"{path}:{lineno}: file lists must be UTF-8 text, but byte {exc.start} (0x{data[exc.start]:02x}) "
            'is not; rename the file it names, or serve that folder with kind = "image_folder", '
            "which takes any file name"
        ) from None
