"""WebDataset shards as a source: indexing, its cache, and damaged or hostile shards, which
are bad samples (never a crash, never a shifted id) or a data error naming the shard."""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from prefetchd.cli.datagen import make_image
from prefetchd.errors import DataError
from prefetchd.sources import shards
from prefetchd.sources.index import NO_LABEL, TAR_MEMBER
from tests.component.test_shards_fuzz import run_seeds

pytestmark = pytest.mark.timeout(60)


def jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    make_image(np.random.default_rng(seed), 64, 48).save(buf, "JPEG")
    return buf.getvalue()


def write_shard(path: Path, samples: list[dict[str, bytes]]) -> Path:
    """A tar of samples: each a dict of extension -> member bytes, keyed 000000, 000001, ..."""
    with tarfile.open(path, "w") as tar:
        for i, sample in enumerate(samples):
            for ext, data in sample.items():
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size, info.mtime = len(data), 0
                tar.addfile(info, io.BytesIO(data))
    return path


def good(n: int, first_label: int = 0) -> list[dict[str, bytes]]:
    return [{"jpg": jpeg(i), "cls": str((first_label + i) % 3).encode()} for i in range(n)]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFETCHD_CACHE", str(tmp_path / "cache"))


def scan(urls, **keys):
    return shards.scan_webdataset({"urls": urls, **keys}, "[[source]] #1 (webdataset)")


def test_brace_patterns_name_the_shards_in_order_and_members_read_back(tmp_path):
    for j in range(3):
        write_shard(tmp_path / f"a-{j:02d}.tar", good(4, first_label=j))
    write_shard(tmp_path / "b.tar", good(2))
    index = scan([str(tmp_path / "a-{00..02}.tar"), str(tmp_path / "b.tar")])
    assert len(index) == 14 and (index.kinds == TAR_MEMBER).all()
    assert [os.path.basename(index.path(i)) for i in (0, 4, 8, 12)] == ["a-00.tar", "a-01.tar", "a-02.tar", "b.tar"]
    assert index.labels[:8].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    reader = shards.TarMembers()
    try:
        assert reader.read(index.path(5), *index.member(5)) == jpeg(1)
    finally:
        reader.close()


def test_labels_from_a_json_key_and_what_is_not_a_label(tmp_path):
    samples = [
        {"jpg": jpeg(0), "json": json.dumps({"label": 7}).encode()},
        {"jpg": jpeg(1), "json": b'{"label": "seven"}'},
        {"jpg": jpeg(2), "json": b"[" * 100_000},
        {"jpg": jpeg(3), "json": b'{"label": -1}'},
        {"jpg": jpeg(4), "json": b"\xff\xfe not json"},
        {"jpg": jpeg(5)},
    ]
    index = scan(str(write_shard(tmp_path / "s.tar", samples)), label_key="label")
    assert index.labels.tolist() == [7] + [NO_LABEL] * 5
    cls = scan(str(write_shard(tmp_path / "c.tar", [{"jpg": jpeg(0), "cls": b" 12\n"}, {"jpg": jpeg(1), "cls": b"x"}])))
    assert cls.labels.tolist() == [12, NO_LABEL]


def test_the_first_image_kind_wins_and_a_sample_without_one_has_none(tmp_path):
    samples = [{"png": b"PNG", "jpg": b"JPG", "cls": b"1"}, {"txt": b"only text", "cls": b"2"}]
    index = scan(str(write_shard(tmp_path / "s.tar", samples)))
    reader = shards.TarMembers()
    try:
        assert reader.read(index.path(0), *index.member(0)) == b"JPG"
        with pytest.raises(ValueError, match="no image member"):
            reader.read(index.path(1), *index.member(1))
    finally:
        reader.close()


@pytest.mark.parametrize(
    "make, phrase",
    [
        (lambda p: None, "cannot read shard"),
        (lambda p: os.mkfifo(p), "not a regular file"),
        (lambda p: os.mkdir(p), "not a regular file"),
        (lambda p: p.write_bytes(b"this is not a tar file at all" * 100), "not a readable tar file"),
    ],
)
def test_a_missing_or_unreadable_shard_is_a_data_error_naming_it(tmp_path, make, phrase):
    path = tmp_path / "train-000001.tar"
    make(path)
    with pytest.raises(DataError, match=phrase) as err:
        scan(str(path))
    assert str(path) in str(err.value)


def test_a_truncated_shard_keeps_its_ids_and_its_cut_member_is_unreadable(tmp_path):
    whole = write_shard(tmp_path / "whole.tar", good(6)).read_bytes()
    index = scan(str(tmp_path / "whole.tar"))
    offset, size = index.member(4)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole[: offset + size // 2])  # in the middle of sample 4's image
    truncated = scan(str(cut))  # sample 4's .cls came after its image: it has no label either
    assert len(truncated) == 5 and truncated.labels.tolist() == [*index.labels[:4].tolist(), NO_LABEL]
    reader = shards.TarMembers()
    try:
        assert reader.read(str(cut), *truncated.member(3)) == jpeg(3)
        with pytest.raises(ValueError, match="truncated"):
            reader.read(str(cut), *truncated.member(4))
    finally:
        reader.close()
    header_cut = tmp_path / "header.tar"  # in the middle of a member's header: the rest is dropped
    header_cut.write_bytes(whole[: offset - 512 + 100])
    assert scan(str(header_cut)).labels.tolist() == index.labels[:4].tolist()


def test_the_index_cache_is_reused_while_the_shard_is_unchanged_and_never_trusted_blindly(tmp_path):
    shard = write_shard(tmp_path / "s.tar", good(4))
    first = scan(str(shard))
    (cache,) = (tmp_path / "cache").iterdir()
    table = np.load(cache)
    table[:, 2] = 2  # a planted label: read back only if the cache is used
    np.save(cache, table)
    assert scan(str(shard)).labels.tolist() == [2, 2, 2, 2]
    os.utime(shard, ns=(0, 10**9))  # another mtime: indexed again, into another cache file
    assert scan(str(shard)).labels.tolist() == first.labels.tolist()
    assert len(list((tmp_path / "cache").iterdir())) == 2
    for garbage in (b"not npy", None):
        for f in (tmp_path / "cache").iterdir():
            f.unlink()
        scan(str(shard))
        (f,) = (tmp_path / "cache").iterdir()
        if garbage is None:  # a well-formed table pointing past the shard's end
            bad = np.load(f)
            bad[:, 0] = 10**12
            np.save(f, bad)
        else:
            f.write_bytes(garbage)
        assert scan(str(shard)).labels.tolist() == first.labels.tolist()


def test_a_fifo_swapped_in_after_indexing_is_unreadable_not_a_hang(tmp_path):
    shard = write_shard(tmp_path / "s.tar", good(2))
    index = scan(str(shard))
    shard.unlink()
    os.mkfifo(shard)
    reader = shards.TarMembers()
    try:
        with pytest.raises(ValueError, match="no longer a regular file"):
            reader.read(str(shard), *index.member(0))
    finally:
        reader.close()


def test_a_pax_header_with_a_negative_size_ends_the_shard_instead_of_looping(tmp_path):
    # tarfile would read the same member again and again, keeping each (CPython's CVE-2025-8194).
    path = tmp_path / "loop.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for i, sample in enumerate(good(3)):
            for ext, data in sample.items():
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                if i == 2 and ext == "jpg":
                    info.pax_headers = {"size": "-1536"}
                tar.addfile(info, io.BytesIO(data))
    assert len(scan(str(path))) == 2


def test_urls_resolve_each_shard_after_expansion_against_the_configs_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    write_shard(tmp_path / "sub" / "a.tar", good(2))
    write_shard(tmp_path / "b.tar", good(3))
    inside = f"{{{tmp_path / 'sub' / 'a.tar'},{tmp_path / 'b.tar'}}}"  # absolute paths inside the braces
    assert len(scan(inside)) == 5
    relative = shards.scan_webdataset({"urls": "{sub/a,b}.tar", "base": str(tmp_path)}, "test")
    assert len(relative) == 5 and relative.path(0) == str(tmp_path / "sub" / "a.tar")


def test_a_brace_range_of_millions_is_refused_before_it_is_expanded(tmp_path):
    with pytest.raises(DataError, match="names 100,000,000 shards, more than 1,000,000"):
        scan(str(tmp_path / "x-{0..99999999}.tar"))
    with pytest.raises(DataError, match="names 1,003,002 shards"):
        scan(str(tmp_path / "x-{0..1000}-{0..1000..2}-{1..2}.tar"))
    with pytest.raises(DataError, match="cannot read shard .*x-0.tar"):  # the first missing one, at once
        scan(str(tmp_path / "x-{0..999999}.tar"))


@pytest.mark.parametrize("trouble", ["cache is a file", "header claims 10**12 rows"])
def test_a_cache_that_cannot_be_used_costs_an_indexing_not_the_start(tmp_path, monkeypatch, trouble):
    shard = write_shard(tmp_path / "s.tar", good(3))
    if trouble == "cache is a file":
        (tmp_path / "not-a-folder").write_bytes(b"")
        monkeypatch.setenv("PREFETCHD_CACHE", str(tmp_path / "not-a-folder"))
    else:
        scan(str(shard))
        (cache,) = (tmp_path / "cache").iterdir()
        data = cache.read_bytes()
        cache.write_bytes(data.replace(b"(3, 3)", b"(1000000000000, 3)", 1))
    assert scan(str(shard)).labels.tolist() == [0, 1, 2]


# -- readers that never guess: keys that repeat, sparse members (issue 24, findings 7 and 8) ------


def write_members(path: Path, members: list[tuple[str, bytes]], fmt: int = tarfile.GNU_FORMAT) -> Path:
    """A tar of exactly these (name, data) members, in this order, names repeating as given."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return path


def webdataset_samples(shard: Path) -> list[dict]:
    """What the webdataset library yields for one shard, undecoded, in order."""
    import webdataset as wds

    return list(wds.WebDataset(str(shard), shardshuffle=False))


def read_all(index) -> list[tuple[bytes | str, int]]:
    """(image bytes, label) of every sample, or (the reader's error, label) for a bad one."""
    reader, out = shards.TarMembers(), []
    try:
        for i in range(len(index)):
            try:
                out.append((reader.read(index.path(i), *index.member(i)), index.label(i)))
            except ValueError as exc:
                out.append((str(exc), index.label(i)))
    finally:
        reader.close()
    return out


def test_a_key_that_repeats_is_one_bad_sample_never_the_first_image_with_the_second_label(tmp_path):
    shard = write_members(
        tmp_path / "s.tar",
        [("003.jpg", jpeg(3)), ("003.cls", b"0")]
        + [("004.jpg", jpeg(4)), ("004.cls", b"1"), ("004.jpg", jpeg(40)), ("004.cls", b"2")]
        + [("005.jpg", jpeg(5)), ("005.cls", b"2"), ("006.png", b"PNG6"), ("006.cls", b"0"), ("006.PNG", b"PNG7")],
    )
    with pytest.raises(ValueError, match="duplicate file name"):  # what webdataset says of sample 004
        webdataset_samples(shard)
    index = scan(str(shard))
    assert len(index) == 4  # grouped as webdataset groups: one sample per run of one key
    served = read_all(index)
    assert served[0] == (jpeg(3), 0) and served[2] == (jpeg(5), 2)
    for bad, key in ((served[1], "004"), (served[3], "006")):  # an extension repeats, whatever its case
        assert isinstance(bad[0], str) and "repeats" in bad[0] and repr(key) in bad[0], bad[0]


def test_keys_group_as_webdataset_groups_them_hidden_meta_and_odd_names_included(tmp_path):
    members = [
        ("a.jpg", b"Ja"),
        ("b.jpg", b"Jb"),
        ("a.cls", b"1"),  # a key again later: another sample, as webdataset
        ("__meta__", b"skipped"),
        ("c.jpg", b"Jc"),
        ("__x__/c.cls", b"skipped"),
        ("c.cls", b"2"),
        ("d/.jpg", b"Jd"),
        ("d/.cls", b"0"),  # webdataset's key "d/": a sample
        ("e.jpg", b"Je"),
        ("e/._e.jpg", b"AppleDouble"),
        ("e.cls", b"1"),  # key "e/" between: e is split
        ("f.tar.gz.jpg", b"not this"),
        ("f.JPG", b"Jf"),
        (".hidden.jpg", b"no key"),
        ("f.cls", b"2"),
    ]
    shard = write_members(tmp_path / "s.tar", members)
    expected = [
        (s.get("jpg", "no image"), int(s["cls"]) if "cls" in s else NO_LABEL) for s in webdataset_samples(shard)
    ]
    served = [
        (b if isinstance(b, bytes) else "no image" if "no image" in b else b, label)
        for b, label in read_all(scan(str(shard)))
    ]
    assert served == expected


def test_keys_split_as_webdatasets_base_plus_ext_on_every_short_name_and_a_long_name_in_linear_time(tmp_path):
    from webdataset.tariterators import base_plus_ext

    for n in range(7):
        for chars in itertools.product("a./\n", repeat=n):
            name = "".join(chars)
            want = base_plus_ext(name)
            assert shards._key_ext(name) == (None if want == (None, None) else want), repr(name)
    # webdataset's regex takes ~20 s on a 60 KB name of slashes; a pax name may be far longer
    shard = write_members(
        tmp_path / "s.tar", [("a/" * 100_000 + "x.jpg", b"J"), ("a/" * 100_000 + "x.cls", b"1")], fmt=tarfile.PAX_FORMAT
    )
    started = time.monotonic()
    assert read_all(scan(str(shard))) == [(b"J", 1)]
    assert time.monotonic() - started < 5


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
    with caplog.at_level("WARNING", logger="prefetchd.sources.shards"):
        assert len(scan(str(shard))) == 3  # tarfile (and so webdataset) ends the shard there
    assert "damaged after 3 samples" in caplog.text and "not a tar header" in caplog.text


def test_a_few_random_shards_agree_with_webdataset_or_are_bad_samples(tmp_path):
    """The differential fuzz of test_fuzz_webdataset.py (long tier), a few seeds of it."""
    tally = run_seeds(range(30), tmp_path)
    assert tally["agree"] >= 30 and tally["bad sample"] >= 30 and tally["intact shards"] >= 5, tally


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


def test_a_shard_rewritten_in_place_after_indexing_never_serves_bytes_from_elsewhere(tmp_path):
    # The same members in another order: same size, mtime set back (as cp -p does). An offset of
    # the index then points into another member, or at another member of another size.
    images = [jpeg(i) + b"x" * i for i in range(6)]  # sizes all different
    path = write_shard(tmp_path / "s.tar", [{"jpg": im, "cls": b"%d" % (i % 3)} for i, im in enumerate(images)])
    before = os.stat(path)
    index = scan(str(path))
    write_shard(path, [{"jpg": im, "cls": b"0"} for im in reversed(images)])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size
    served = read_all(index)
    for i, (got, _) in enumerate(served):
        assert got == images[i] or (isinstance(got, str) and "changed" in got), (i, got[:40])
    assert sum(isinstance(got, str) for got, _ in served) >= 4  # only a member left in place is served


def test_a_shard_with_a_member_of_negative_size_is_indexed_once_then_cached(tmp_path):
    path = _pax_members(tmp_path / "s.tar", 3, {(1, "jpg"): {"GNU.sparse.size": "-5"}})
    first = scan(str(path))
    (cached,) = (tmp_path / "cache").iterdir()
    written = os.stat(cached)
    again = scan(str(path))  # a cache refused (a negative size in it) is written anew
    assert (os.stat(cached).st_ino, os.stat(cached).st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    assert first.members.tolist() == again.members.tolist() and len(again) == 3


@pytest.mark.parametrize("pattern", ["shard-{0..3", "shard-{0..3}}", "{a,b"])
def test_a_pattern_with_unbalanced_braces_is_a_data_error_naming_it(tmp_path, pattern):
    """Before: braceexpand's UnbalancedBracesError reached `start` as an internal error (exit 70)."""
    with pytest.raises(DataError, match="has unbalanced braces"):
        list(shards.expand_urls(pattern, str(tmp_path)))
