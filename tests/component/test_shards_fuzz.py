"""Differential fuzz of WebDataset shards: what prefetchd serves against what the webdataset
library yields, shard by shard.

Each seed makes one shard with a real writer (webdataset's TarWriter; Python's tarfile in GNU,
pax or ustar format; GNU tar, sparse members included) from random samples with odd names,
keys that repeat and labels that are not labels, then mutates its bytes (flips, often in a
header; a cut; a zeroed block; garbage after the end). prefetchd indexes it as ``start`` does
(scan_webdataset) and reads every sample as a worker does (TarMembers.read, and the label the
index holds); webdataset reads it with a handler that keeps going and remembers what it
refused. Sample ``i`` of one is compared with sample ``i`` of the other (webdataset keeps
shards apart, and prefetchd's ids are its order): prefetchd either serves what webdataset
yields (the first image member by prefetchd's order, and the label as webdataset decodes it),
or records a bad sample, or refuses the shard — never another value. An unmutated shard of a
real writer is indexed whole: as many samples as webdataset yields.

A failure names its seed; ``check_seed(seed, folder)`` makes and compares that shard again.

Campaign (issue 24, seeds 0-2999): on the code before it, 1,292 of 3,000 shards diverged —
291 intact shards (GNU tar --sparse) indexed short, 637 served a sample whose key repeats
(webdataset: "duplicate file name"), 359 served other image bytes (sparse members read at
their expanded size from the stored offset; names like "d/.x.jpg" grouped otherwise), 5 other
labels. It also found a member whose pax GNU.sparse.realsize (its GNU.sparse.major flipped)
made its size run past its data into the next members' bytes. After: 0 of 3,000.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import subprocess
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from prefetchd.errors import DataError
from prefetchd.sources import shards, tarformat, tarmembers
from prefetchd.sources.index import NO_LABEL

pytestmark = pytest.mark.timeout(600)

WRITERS = ("webdataset", "tarfile-gnu", "tarfile-pax", "tarfile-ustar", "gnutar-gnu", "gnutar-posix", "gnutar-oldgnu")
EXTENSIONS = ("jpg", "jpeg", "png", "webp", "JPG", "cls", "json", "txt", "cls.txt", "jpg.gz")
LABEL_TEXTS = (b"3", b" 12\n", b"-1", b"x", b"1_0", b"", b"9" * 30, b"\xd9\xa3", b"0x1", b"7\x00\x00")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFETCHD_CACHE", str(tmp_path / "cache"))


def random_key(rng: random.Random, i: int) -> str:
    """Mostly plain keys; sometimes a folder, a long name (GNU long name, pax path, ustar
    prefix), non-ASCII, a dot folder, a hidden or meta-looking name."""
    plain = f"{i:06d}"
    return rng.choice(
        [plain] * 12
        + [
            f"dir/sub.d/{plain}",
            "x" * rng.randint(90, 160) + plain,
            f"{'deep/' * 25}{plain}",
            f"é€{plain}",
            f"\udcff\udcfe{plain}",  # bytes that are not UTF-8, as os.fsdecode gives them
            f"d/.{plain}",
            f"d/._{plain}",
            f"__{plain}__",
            f".{plain}",
            f"{plain}/",
        ]
    )


def random_data(rng: random.Random) -> bytes:
    """Bytes that stand for an image (the reader never decodes): sometimes with long zero runs,
    which GNU tar --sparse stores as holes when the file system has them as holes."""
    head = rng.randbytes(rng.randint(0, 3000))
    if rng.random() < 0.3:
        return head + b"\0" * rng.choice([4096, 3 * 4096, 5 * 4096 + 7]) + rng.randbytes(rng.randint(0, 200))
    return head


def random_members(rng: random.Random, label_key: str | None) -> list[tuple[str, bytes]]:
    members: list[tuple[str, bytes]] = []
    for i in range(rng.randint(0, 12)):
        key = random_key(rng, i)
        exts = rng.sample(EXTENSIONS, rng.randint(1, 4))
        if rng.random() < 0.7:
            exts = ["jpg", "json" if label_key else "cls", *[e for e in exts if e not in ("jpg", "cls", "json")]]
        for ext in exts:
            if ext == "cls":
                data = str(rng.randint(0, 9)).encode() if rng.random() < 0.8 else rng.choice(LABEL_TEXTS)
            elif ext == "json":
                value = rng.choice([rng.randint(0, 9), rng.randint(0, 9), -1, "7", None, True, 2**70, 1.5])
                data = json.dumps({label_key or "label": value} if rng.random() < 0.9 else [value]).encode()
            else:
                data = random_data(rng)
            members.append((f"{key}.{ext}", data))
    for _ in range(rng.choice([0, 0, 0, 1, 2])):  # a key that repeats: right after itself, or later on
        if members:
            at = rng.randrange(len(members))
            name, _ = members[at]
            members.insert(rng.choice([at + 1, rng.randint(0, len(members))]), (name, random_data(rng)))
    return members


def write_shard(rng: random.Random, writer: str, members: list[tuple[str, bytes]], path: Path) -> None:
    if writer == "webdataset":
        import webdataset as wds

        # TarWriter takes a sample at a time: consecutive members of one key are one sample, and a
        # key again later is a sample of its own (a repeated extension within one is dropped).
        with wds.TarWriter(str(path)) as sink:
            sample: dict = {}
            for name, data in members:
                key, _, ext = name.partition(".")
                if "/" in ext or not key or ext.startswith("_"):  # TarWriter's split; "_x": its metadata
                    continue
                if sample and (sample["__key__"] != key or ext in sample):
                    sink.write(sample)
                    sample = {}
                sample.setdefault("__key__", key)
                sample[ext] = data
            if sample:
                sink.write(sample)
        return
    if writer.startswith("tarfile-"):
        fmt = {"gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT, "ustar": tarfile.USTAR_FORMAT}[writer[8:]]
        with tarfile.open(path, "w", format=fmt) as tar:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), rng.randint(0, 2**33)
                if rng.random() < 0.05:  # a member that is not a file among them
                    info.type, info.size, info.linkname = rng.choice([tarfile.DIRTYPE, tarfile.SYMTYPE]), 0, "x"
                    data = b""
                try:
                    tar.addfile(info, io.BytesIO(data))
                except ValueError:  # a name ustar cannot hold
                    continue
        return
    # GNU tar from a folder: one file per member, zero runs written as holes (seek), in order.
    folder = path.with_suffix(".src")
    folder.mkdir()
    names = []
    for j, (name, data) in enumerate(members):
        target = folder / f"{j:04d}" / name
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "xb") as f:
                _write_with_holes(f, data)
        except (OSError, ValueError):  # a name no file can have ("x/", "/", too long)
            continue
        names += ["-C", str(folder / f"{j:04d}"), name]  # each from its own folder: names may repeat
    args = ["tar", "--sparse", f"--format={writer[7:]}", "-cf", str(path), "-T", "/dev/null", *names]  # none: empty
    subprocess.run(args, check=True, capture_output=True)


def _write_with_holes(f, data: bytes) -> None:
    """``data``, its 4 KiB blocks of zeros left as holes (the file system's, as tar --sparse sees)."""
    for at in range(0, len(data), 4096):
        block = data[at : at + 4096]
        if block.count(0) == len(block) and len(block) == 4096:
            f.seek(4096, os.SEEK_CUR)
        else:
            f.write(block)
    f.truncate(len(data))


def mutate(rng: random.Random, data: bytes) -> tuple[bytes, list[str]]:
    done = []
    out = bytearray(data)
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        if not out:
            break
        what = rng.choice(["flip", "flip header", "cut", "zero block", "garbage after"])
        if what == "flip":
            at = rng.randrange(len(out))
            out[at] ^= 1 << rng.randrange(8)
        elif what == "flip header":  # a byte of a header block: its name, size, type, checksum or map
            block = rng.randrange(max(len(out) // 512, 1)) * 512
            at = min(block + rng.choice([0, 5, 99, 124, 130, 135, 148, 156, 345, 386, 483]), len(out) - 1)
            out[at] = rng.randrange(256)
        elif what == "cut":
            del out[rng.randrange(len(out)) :]
        elif what == "zero block":
            block = rng.randrange(max(len(out) // 512, 1)) * 512
            out[block : block + 512] = bytes(len(out[block : block + 512]))
        else:
            out += rng.randbytes(rng.randint(1, 2000))
        done.append(what)
    return bytes(out), done


def webdataset_view(shard: Path, seekable: bool = False) -> tuple[list[dict], list[bool]]:
    """webdataset's samples of one shard, undecoded, and per sample whether webdataset refused
    part of it ("duplicate file name": with its default handler the whole iteration would end).

    webdataset reads a shard as a stream: after a member whose size overruns its data it
    cannot seek back to the next header, and stops. ``seekable``: its grouping (group_by_keys)
    over the members as tarfile reads them from a seekable file, which does go on; what
    prefetchd serves past where the stream stopped is compared with that."""
    import webdataset as wds

    errors: list[str] = []

    def keep_going(exc: Exception) -> bool:
        errors.append(str(exc))
        return True

    if seekable:
        stream = wds.tariterators.group_by_keys(_seekable_members(shard, keep_going), handler=keep_going)
    else:
        stream = wds.tariterators.tarfile_samples([{"url": str(shard)}], handler=keep_going)
    samples, repeated = [], []
    while True:
        before = len(errors)
        try:
            sample = next(stream)
        except StopIteration:
            break
        samples.append(sample)
        # the error came while this sample was being grouped: it is yielded at the next key
        repeated.append(any("duplicate file name" in e for e in errors[before:]))
    return samples, repeated


def _seekable_members(shard: Path, keep_going):
    """webdataset's tar_file_iterator (its skips included), reading from a seekable tarfile:
    webdataset's own always opens its stream with mode "r|*"."""
    try:
        with tarfile.open(shard, "r:") as tar:
            for info in tar:
                name = info.name
                if not info.isreg() or ("/" not in name and name[:2] == name[-2:] == "__"):
                    continue
                if re.match(r"__[^/]*__($|/)", name):
                    continue
                try:
                    yield {"fname": name, "data": tar.extractfile(info).read(), "__url__": str(shard)}
                except Exception as exc:  # noqa: BLE001 - as webdataset's handler: the member is left out
                    keep_going(exc)
    except (tarfile.TarError, OSError, ValueError) as exc:
        keep_going(exc)


def webdataset_label(sample: dict, label_key: str | None):
    """The label as webdataset's own decoders read it (autodecode.decoders); None: none."""
    try:
        if label_key is None:
            return int(sample["cls"])
        return json.loads(sample["json"])[label_key]
    except Exception:  # noqa: BLE001 - whatever webdataset's decoder would fail on is no label
        return None


def check_seed(seed: int, folder: Path) -> Counter:
    """Make shard ``seed`` and compare; an AssertionError names the seed and what differed."""
    rng = random.Random(seed)
    label_key = "label" if rng.random() < 0.3 else None
    writer = rng.choice(WRITERS)
    members = random_members(rng, label_key)
    shard = folder / f"shard-{seed}.tar"
    write_shard(rng, writer, members, shard)
    mutated, mutations = mutate(rng, shard.read_bytes())
    shard.write_bytes(mutated)
    where = f"seed {seed} ({writer}, mutations {mutations}, label_key {label_key})"
    tally = Counter()
    try:
        index = shards.scan_webdataset({"urls": str(shard), "label_key": label_key}, where)
    except DataError:
        tally["shard refused"] += 1
        return tally
    theirs, repeated = webdataset_view(shard)
    seekable, seekable_repeated = webdataset_view(shard, seekable=True)
    reader = tarmembers.TarMembers()
    try:
        for i in range(len(index)):
            label = index.label(i)
            try:
                reader.check_refused(index.path(i), index.member(i)[0])
                image = reader.read(index.path(i), *index.member(i))
            except ValueError:
                tally["bad sample"] += 1
                continue
            if label == NO_LABEL:
                tally["bad sample"] += 1
                continue
            if i < len(theirs):
                sample, refused = theirs[i], repeated[i]
            else:  # past where webdataset's stream stopped
                assert i < len(seekable), f"{where}: sample {i} served, webdataset yields only {len(seekable)}"
                sample, refused = seekable[i], seekable_repeated[i]
                tally["agree past webdataset's stream"] += 1
            assert not refused, f"{where}: sample {i} served, webdataset refused it: {sorted(sample)}"
            first = next((sample[k] for k in tarformat.IMAGE_KEYS if k in sample), None)
            assert image == first, f"{where}: sample {i} ({sample['__key__']!r}): other image bytes"
            assert label == webdataset_label(sample, label_key), f"{where}: sample {i}: label {label}"
            tally["agree"] += 1
    finally:
        reader.close()
    if not mutations and len(index) != len(theirs):
        raise AssertionError(f"{where}: an intact shard: {len(index)} samples indexed, webdataset yields {len(theirs)}")
    if not mutations:
        tally["intact shards"] += 1
    return tally


def run_seeds(seeds: range, folder: Path) -> Counter:
    tally = Counter()
    for seed in seeds:
        tally += check_seed(seed, folder)
    return tally


@pytest.mark.long
def test_twelve_hundred_random_shards_agree_with_webdataset_or_are_bad_samples(tmp_path):
    tally = run_seeds(range(1000, 2200), tmp_path)
    print(dict(tally))
    assert tally["agree"] > 1000 and tally["bad sample"] > 100, tally
