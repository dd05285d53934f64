"""Hostile and unusual tar headers in a WebDataset shard: GNU and pax sparse members, sizes that
are not sizes, chains of long-name headers, a header that does not parse. Each is one bad sample
or the end of the shard, never a crash, a hang, a shifted id or a neighbour's bytes."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from prefetchd.errors import DataError
from tests.component.test_shards import (  # private_cache: the autouse fixture, each test's own index cache
    good,
    jpeg,
    private_cache,  # noqa: F401
    read_all,
    scan,
    webdataset_samples,
    write_members,
    write_shard,
)

pytestmark = pytest.mark.timeout(60)


def gnu_tar(folder: Path, out: Path, fmt: str, names: list[str]) -> Path:
    subprocess.run(["tar", "--sparse", f"--format={fmt}", "-cf", str(out), "-C", str(folder), *names], check=True)
    return out


def sparse_folder(folder: Path, n: int = 6, sparse: tuple[int, ...] = (2, 4)) -> list[bytes]:
    """Samples 000000... as .jpg and .cls files; the images in ``sparse`` have real holes (blocks the
    file system never wrote, which GNU tar --sparse stores as a hole): after the JPEG's end, where
    decoders stop, then more bytes (2) or the file's end (4). Returns each image as read back."""
    folder.mkdir()
    images = []
    for i in range(n):
        path = folder / f"{i:06d}.jpg"
        with open(path, "wb") as f:
            f.write(jpeg(i))
            if i % 4 == 2 and i in sparse:
                f.seek(4 * 4096)
                f.write(b"\x01" * 1000)
            elif i in sparse:
                f.truncate(5 * 4096 + 123)
        (folder / f"{i:06d}.cls").write_text(str(i % 3))
        images.append(path.read_bytes())
    return images


@pytest.mark.parametrize("fmt", ["gnu", "posix", "oldgnu"])
def test_sparse_members_from_gnu_tar_are_read_whole_and_the_shard_goes_on(tmp_path, fmt):
    images = sparse_folder(tmp_path / "src")
    shard = gnu_tar(tmp_path / "src", tmp_path / "s.tar", fmt, sorted(os.listdir(tmp_path / "src")))
    with tarfile.open(shard) as tar:
        assert [m.name for m in tar.getmembers() if m.issparse()] == ["000002.jpg", "000004.jpg"]
    assert [(s["jpg"], int(s["cls"])) for s in webdataset_samples(shard)] == [
        (im, i % 3) for i, im in enumerate(images)
    ]
    assert read_all(scan(str(shard))) == [(im, i % 3) for i, im in enumerate(images)]


def test_a_sparse_member_whose_map_lies_or_expands_past_any_image_is_bad_and_the_shard_goes_on(tmp_path):
    images = sparse_folder(tmp_path / "src")
    with open(tmp_path / "src" / "000004.jpg", "r+b") as f:
        f.truncate(3 << 30)  # 3 GiB, nearly all hole: stored in a few KiB, never expanded in memory
    shard = gnu_tar(tmp_path / "src", tmp_path / "s.tar", "posix", sorted(os.listdir(tmp_path / "src")))
    with tarfile.open(shard) as tar:
        lying = tar.getmember("000002.jpg")
    data = bytearray(shard.read_bytes())
    map_block = data[lying.offset_data - 512 : lying.offset_data]  # pax 1.0: the map precedes the data
    assert map_block.startswith(b"3\n0\n4096\n16384\n1000\n")
    data[lying.offset_data - 512 : lying.offset_data - 512 + 15] = b"3\n0\n4096\n99999\n"  # a segment past the end
    shard.write_bytes(bytes(data))
    served = read_all(scan(str(shard)))
    assert len(served) == 6
    assert all(served[i] == (images[i], i % 3) for i in (0, 1, 3, 5))
    assert "sparse map is out of order or runs past" in served[2][0] and "'000002.jpg'" in served[2][0]
    assert "expands to 3,221,225,472 bytes, more than prefetchd reads" in served[4][0]


def pax_sparse(name: str, realsize: int, segments: list[tuple[int, int]], stored: bytes) -> tarfile.TarInfo:
    """A hand-made GNU pax 1.0 sparse member: its map as text in the first block(s) of its data."""
    numbers = [str(len(segments))] + [str(v) for seg in segments for v in seg]
    text = ("\n".join(numbers) + "\n").encode()
    data = text + bytes(-len(text) % 512) + stored
    info = tarfile.TarInfo(f"GNUSparseFile.0/{name}")
    info.size, info.pax_headers = (
        len(data),
        {
            "GNU.sparse.major": "1",
            "GNU.sparse.minor": "0",
            "GNU.sparse.name": name,
            "GNU.sparse.realsize": str(realsize),
        },
    )
    return info, data


@pytest.mark.parametrize(
    "realsize, segments, stored, phrase",
    [
        (5000, [(0, 10), (4000, 10)], b"a" * 10 + b"b" * 10, None),  # a map as GNU tar writes it: read whole
        (5000, [(4000, 10), (0, 10)], b"a" * 20, "out of order"),
        (5000, [(0, 10), (5, 10)], b"a" * 20, "out of order"),
        (5000, [(0, 10), (4995, 10)], b"a" * 20, "runs past"),
        (5000, [(0, 10), (4000, 3000)], b"a" * 20, "runs past"),
        (9000, [(0, 10), (4000, 3000)], b"a" * 20, "more than the member stores"),
        (200_000, [(2 * i, 1) for i in range(70_000)], b"a" * 70_000, "70,000 segments, more than 65,536"),
    ],
    ids=[
        "as GNU tar writes one",
        "out of order",
        "overlapping",
        "past the end",
        "longer than the file",
        "more than stored",
        "too many segments",
    ],
)
def test_a_hand_made_sparse_map_is_read_only_when_the_member_vouches_for_it(
    tmp_path, realsize, segments, stored, phrase
):
    info, data = pax_sparse("000001.jpg", realsize, segments, stored)
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for i in (0, 1, 2):
            if i == 1:
                tar.addfile(info, io.BytesIO(data))
            else:
                add = tarfile.TarInfo(f"{i:06d}.jpg")
                add.size = 2
                tar.addfile(add, io.BytesIO(b"J%d" % i))
            cls = tarfile.TarInfo(f"{i:06d}.cls")
            cls.size = 1
            tar.addfile(cls, io.BytesIO(b"%d" % i))
    served = read_all(scan(str(path)))
    assert served[0] == (b"J0", 0) and served[2] == (b"J2", 2)
    if phrase is None:
        assert served[1] == (b"a" * 10 + bytes(3990) + b"b" * 10 + bytes(990), 1)
        assert webdataset_samples(path)[1]["jpg"] == served[1][0]
    else:
        assert isinstance(served[1][0], str) and phrase in served[1][0], served[1]


def test_a_member_whose_pax_size_runs_past_its_data_is_bad_never_its_neighbours_bytes(tmp_path):
    # Found by the fuzz: a pax header's GNU.sparse.realsize (a flipped byte took away the
    # GNU.sparse.major beside it) sets the member's size past the data its header stores.
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(3):
            for ext, data in (("jpg", b"J%d" % i), ("cls", b"%d" % i)):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                if (i, ext) == (1, "jpg"):
                    info.pax_headers = {"GNU.sparse.realsize": "5000"}
                tar.addfile(info, io.BytesIO(data))
    served = read_all(scan(str(path)))
    assert served[0] == (b"J0", 0) and served[2] == (b"J2", 2)
    assert isinstance(served[1][0], str) and "other members' bytes" in served[1][0], served[1]


def test_thousands_of_chained_long_name_headers_end_the_shard_not_the_start(tmp_path):
    # tarfile reads each GNU long-name header by calling itself: 3,000 in a row raised RecursionError
    shard = write_members(tmp_path / "s.tar", [("000000.jpg", b"J0"), ("000000.cls", b"0"), ("x" * 200 + ".jpg", b"J")])
    raw = shard.read_bytes()
    long_name = raw[2048 : 2048 + 1024]  # the 'L' header and its block of name
    shard.write_bytes(raw[:2048] + long_name * 3000 + raw[2048 + 1024 :])
    assert read_all(scan(str(shard))) == [(b"J0", 0)]
    first = tmp_path / "first.tar"
    first.write_bytes(long_name * 3000 + raw[2048 + 1024 :])
    with pytest.raises(DataError, match="not a readable tar file"):
        scan(str(first))


def test_a_header_that_does_not_parse_in_the_middle_is_logged_not_a_silent_end(tmp_path, caplog):
    shard = write_shard(tmp_path / "s.tar", good(6))
    index = scan(str(shard))
    data = bytearray(shard.read_bytes())
    data[index.member(3)[0] - 512 + 148] ^= 0x01  # the checksum of sample 3's first header
    shard.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="prefetchd.sources"):
        assert len(scan(str(shard))) == 3  # tarfile (and so webdataset) ends the shard there
    assert "damaged after 3 samples" in caplog.text and "not a tar header" in caplog.text


def _pax_members(path: Path, samples: int, odd: dict[tuple[int, str], dict[str, str]]) -> Path:
    """A pax tar of ``samples`` samples (a small .jpg and a .cls each); ``odd`` gives some members
    pax headers of their own."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(samples):
            for ext, data in (("jpg", b"J%d" % i), ("cls", b"%d" % i)):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size, info.pax_headers = len(data), odd.get((i, ext), {})
                tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("key", ["GNU.sparse.size", "GNU.sparse.realsize"])
@pytest.mark.parametrize("value", ["-5", str(10**20)])
def test_a_sparse_size_that_is_not_a_size_is_one_bad_sample_and_the_shard_goes_on(tmp_path, key, value):
    # tarfile still finds the next header (its offset follows the member's own header), as
    # webdataset does: a negative size ended the shard, a size past 2**63 crashed the indexing.
    path = _pax_members(tmp_path / "s.tar", 4, {(1, "jpg"): {key: value}})
    if value == "-5":  # webdataset yields an empty image, and the rest
        assert [s["__key__"] for s in webdataset_samples(path)] == ["000000", "000001", "000002", "000003"]
    else:  # webdataset cannot read the member (OverflowError, or "unexpected end of data")
        with pytest.raises((OverflowError, tarfile.ReadError)):
            webdataset_samples(path)
    served = read_all(scan(str(path)))
    assert len(served) == 4 and [served[i] for i in (0, 2, 3)] == [(b"J0", 0), (b"J2", 2), (b"J3", 3)]
    assert isinstance(served[1][0], str) and value in served[1][0].replace(",", ""), served[1]


def test_a_shard_with_a_member_of_negative_size_is_indexed_once_then_cached(tmp_path):
    path = _pax_members(tmp_path / "s.tar", 3, {(1, "jpg"): {"GNU.sparse.size": "-5"}})
    first = scan(str(path))
    (cached,) = (tmp_path / "cache").iterdir()
    written = os.stat(cached)
    again = scan(str(path))  # a cache refused (a negative size in it) is written anew
    assert (os.stat(cached).st_ino, os.stat(cached).st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    assert first.members.tolist() == again.members.tolist() and len(again) == 3
