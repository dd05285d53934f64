"""WebDataset shards as a source: indexing, its cache, and damaged or hostile shards, which
are bad samples (never a crash, never a shifted id) or a data error naming the shard."""

from __future__ import annotations

import io
import itertools
import json
import os
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from prefetchd.cli.datagen import make_image
from prefetchd.errors import DataError
from prefetchd.sources import shards, tarformat, tarmembers
from prefetchd.sources.index import NO_LABEL
from prefetchd.sources.places import TAR_MEMBER
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
    reader = tarmembers.TarMembers()
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
    reader = tarmembers.TarMembers()
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
    reader = tarmembers.TarMembers()
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
    reader = tarmembers.TarMembers()
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
    reader, out = tarmembers.TarMembers(), []
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
            assert tarformat.key_ext(name) == (None if want == (None, None) else want), repr(name)
    # webdataset's regex takes ~20 s on a 60 KB name of slashes; a pax name may be far longer
    shard = write_members(
        tmp_path / "s.tar", [("a/" * 100_000 + "x.jpg", b"J"), ("a/" * 100_000 + "x.cls", b"1")], fmt=tarfile.PAX_FORMAT
    )
    started = time.monotonic()
    assert read_all(scan(str(shard))) == [(b"J", 1)]
    assert time.monotonic() - started < 5


def test_a_few_random_shards_agree_with_webdataset_or_are_bad_samples(tmp_path):
    """The differential fuzz of test_fuzz_webdataset.py (long tier), a few seeds of it."""
    tally = run_seeds(range(30), tmp_path)
    assert tally["agree"] >= 30 and tally["bad sample"] >= 30 and tally["intact shards"] >= 5, tally


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


@pytest.mark.parametrize("pattern", ["shard-{0..3", "shard-{0..3}}", "{a,b"])
def test_a_pattern_with_unbalanced_braces_is_a_data_error_naming_it(tmp_path, pattern):
    """Before: braceexpand's UnbalancedBracesError reached `start` as an internal error (exit 70)."""
    with pytest.raises(DataError, match="has unbalanced braces"):
        list(shards.expand_urls(pattern, str(tmp_path)))
