"""A WebDataset of 10^8 samples on a laptop's disk: one real shard, and its index object, under
every shard name of the dataset as hard links.

Each name is a shard as `prefetchd start` sees it (a regular tar file with its `.idx` beside
it, newer than it), so indexing, planning and serving run as for 10^4 different shards, while
the disk holds one shard of tiny JPEGs (~12 MB) and one index object. Sample ``i`` is member
``i % per_shard`` of its shard, labelled ``(i % per_shard) % CLASSES``.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

from prefetchd.sources import shards
from prefetchd.sources.tarformat import index_tar

CLASSES = 1000
SIDE = 32  # the images' width and height


def make_scaled_shards(folder: Path, count: int, per_shard: int) -> str:
    """``count`` shard names of ``per_shard`` samples each in ``folder``; the urls pattern naming them."""
    folder.mkdir(parents=True, exist_ok=True)
    first = folder / "train-000000.tar"
    _write_shard(first, per_shard)
    with open(first, "rb") as f:
        table = index_tar(f, lambda n, at: os.pread(f.fileno(), n, at), str(first), None)
        f.seek(0)
        md5 = hashlib.file_digest(f, "md5").hexdigest()
    index = Path(str(first) + shards.INDEX_SUFFIX)
    index.write_bytes(shards.index_object_bytes(table, first.stat().st_size, md5))
    for i in range(1, count):
        for suffix in ("", shards.INDEX_SUFFIX):
            os.link(str(first) + suffix, folder / f"train-{i:06d}.tar{suffix}")
    return f"{folder}/train-{{000000..{count - 1:06d}}}.tar"


def expected_label(sample_id: int, per_shard: int) -> int:
    return (sample_id % per_shard) % CLASSES


def _write_shard(path: Path, per_shard: int) -> None:
    rng = np.random.default_rng(0)
    images = []
    for _ in range(16):  # a few distinct images, repeated: decoding is not what is measured here
        pixels = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, "JPEG", quality=80)
        images.append(out.getvalue())
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for j in range(per_shard):
            for ext, data in ((".jpg", images[j % len(images)]), (".cls", str(j % CLASSES).encode())):
                member = tarfile.TarInfo(f"{j:08d}{ext}")
                member.size, member.mtime = len(data), 0
                tar.addfile(member, io.BytesIO(data))
