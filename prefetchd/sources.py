"""Sample indexes: which file and label each sample id names.

The index is kept in numpy arrays, not Python lists (a list of 1.28 M path strings costs
hundreds of MB per process and dirties copy-on-write pages): all paths concatenated into
one byte array plus offsets, and an int64 label array. The master writes them once as
``.npy`` files in the job directory; workers map them read-only.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError

# torchvision's ImageFolder extensions.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_FILES = ("paths.npy", "offsets.npy", "labels.npy")


@dataclass(frozen=True)
class SampleIndex:
    paths: np.ndarray  # uint8, every path's UTF-8 bytes back to back
    offsets: np.ndarray  # int64, len + 1: path i is paths[offsets[i]:offsets[i + 1]]
    labels: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, i: int) -> str:
        return self.paths[self.offsets[i] : self.offsets[i + 1]].tobytes().decode()

    def label(self, i: int) -> int:
        return int(self.labels[i])

    @classmethod
    def from_lists(cls, paths: list[str], labels: list[int]) -> SampleIndex:
        encoded = [p.encode() for p in paths]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets, np.asarray(labels, dtype=np.int64))

    @classmethod
    def concat(cls, parts: list[SampleIndex]) -> SampleIndex:
        if len(parts) == 1:
            return parts[0]
        shifts = np.cumsum([0] + [len(p.paths) for p in parts[:-1]])
        offsets = np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, shifts)])
        return cls(np.concatenate([p.paths for p in parts]), offsets, np.concatenate([p.labels for p in parts]))

    def fingerprint(self) -> str:
        """Identifies the sample list: a resume on changed data must not pass as exact."""
        h = hashlib.sha256()
        for a in (self.paths, self.offsets, self.labels):
            h.update(a.tobytes())
        return h.hexdigest()[:16]

    def save(self, folder: Path) -> None:
        folder.mkdir(mode=0o700, exist_ok=True)
        for name, a in zip(_FILES, (self.paths, self.offsets, self.labels)):
            np.save(folder / name, a, allow_pickle=False)

    @classmethod
    def load(cls, folder: Path) -> SampleIndex:
        return cls(*(np.load(folder / name, mmap_mode="r", allow_pickle=False) for name in _FILES))


def scan_image_folder(root: str, where: str) -> SampleIndex:
    """torchvision ImageFolder order: sorted class folders, then sorted file names."""
    fix = "set root in [[source]] or pass --data FOLDER"
    if not os.path.exists(root):
        raise DataError(f"{where}: data folder {root} does not exist; {fix}")
    if not os.path.isdir(root):
        raise DataError(f"{where}: {root} is not a folder; image_folder expects <root>/<class>/<image>; {fix}")
    try:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    except OSError as exc:
        raise DataError(f"{where}: cannot list {root}: {exc.strerror}") from None
    if not classes:
        raise DataError(f"{where}: {root} has no class sub-folders; image_folder expects <root>/<class>/<image>")
    paths, labels, empty = [], [], []
    for label, cls in enumerate(classes):
        folder = os.path.join(root, cls)
        names = sorted(e.name for e in os.scandir(folder) if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS))
        if not names:
            empty.append(cls)
        paths.extend(os.path.join(folder, n) for n in names)
        labels.extend([label] * len(names))
    if empty:
        shown = ", ".join(empty[:5]) + (" ..." if len(empty) > 5 else "")
        raise DataError(
            f"{where}: {len(empty)} class folder(s) under {root} hold no images ({shown}); "
            f"remove them or add images with one of {', '.join(IMAGE_EXTENSIONS)}"
        )
    return SampleIndex.from_lists(paths, labels)


def read_file_list(path: str, where: str) -> SampleIndex:
    """Lines of ``path,label``; relative paths resolve against the list's folder; id = line number."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise DataError(f"{where}: cannot read file list {path}: {exc.strerror}; set path in [[source]]") from None
    except UnicodeDecodeError:
        raise DataError(f"{where}: file list {path} is not UTF-8 text") from None
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


def build_index(sources: tuple[dict, ...]) -> tuple[SampleIndex, tuple[int, ...]]:
    """One index over all sources, in config order (sample ids continue across sources),
    and the number of samples of each source."""
    parts = []
    for i, src in enumerate(sources):
        where = f"[[source]] #{i + 1} ({src['kind']})"
        if src["kind"] == "image_folder":
            parts.append(scan_image_folder(src["root"], where))
        else:
            parts.append(read_file_list(src["path"], where))
    return SampleIndex.concat(parts), tuple(len(p) for p in parts)
