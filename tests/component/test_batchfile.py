"""The batch file format: round trip without copies, and a parser that refuses bad files."""

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefetchd_client.batchfile import (
    MAGIC,
    PREAMBLE,
    VERSION,
    BatchFormatError,
    BatchLayout,
    FieldSpec,
    content_digest,
    map_batch,
    parse_header,
)
from prefetchd_client.batchwriter import BatchBuffer, BatchWriter

FIELDS = [
    FieldSpec("image", "uint8", (2, 4, 4, 3)),
    FieldSpec("label", "int64", (2,)),
    FieldSpec("index", "int64", (2,)),
]


def read_parts(data) -> dict:
    """The header of a batch file as plain values, to be changed and written back."""
    _, _, tlen, mlen, _, epoch, step, rank = PREAMBLE.unpack_from(data)
    table = json.loads(data[PREAMBLE.size : PREAMBLE.size + tlen])
    meta = json.loads(data[PREAMBLE.size + tlen : PREAMBLE.size + tlen + mlen])
    return {"epoch": epoch, "step": step, "rank": rank, "fields": table, "meta": meta}


def pack_parts(data: bytearray, header: dict) -> int:
    """Write ``header`` into ``data`` (grown if it must be); returns where the header ends."""
    table, meta = json.dumps(header["fields"]).encode(), json.dumps(header["meta"]).encode()
    position = (header["epoch"], header["step"], header["rank"])
    head = PREAMBLE.pack(MAGIC, VERSION, len(table), len(meta), 0, *position) + table + meta
    if len(head) > len(data):
        data.extend(b"\0" * (len(head) - len(data)))
    data[: len(head)] = head
    return len(head)


def write(path, meta=None):
    writer = BatchWriter(path, BatchLayout.plan(FIELDS))
    writer.arrays["image"][:] = np.arange(96, dtype=np.uint8).reshape(2, 4, 4, 3)
    writer.arrays["label"][:] = [3, 4]
    writer.arrays["index"][:] = [10, 11]
    writer.finish(1, 2, 0, meta)
    return path


def test_round_trip_maps_without_copy(tmp_path):
    header, arrays = map_batch(write(tmp_path / "b", {"config_hash": "abc"}))
    assert (header["epoch"], header["step"], header["rank"], header["meta"]) == (1, 2, 0, {"config_hash": "abc"})
    assert arrays["image"].reshape(-1).tolist() == list(range(96))
    assert arrays["label"].tolist() == [3, 4] and arrays["index"].dtype == np.int64
    assert not arrays["image"].flags.owndata  # a view of the map, not a copy
    assert arrays["image"].ctypes.data % 64 == 0
    arrays["image"][0] = 0  # private map: writable, and the file is unchanged
    assert map_batch(tmp_path / "b")[1]["image"].reshape(-1)[1] == 1


def test_writer_refuses_to_overwrite(tmp_path):
    write(tmp_path / "b")
    with pytest.raises(FileExistsError):
        BatchWriter(tmp_path / "b", BatchLayout.plan(FIELDS))


def test_a_reused_buffer_carries_nothing_of_the_last_batch_into_the_next(tmp_path):
    """A worker fills one BatchBuffer for every batch: a shorter header must not leave the
    tail of a longer one behind, and each file holds exactly its own batch."""
    layout = BatchLayout.plan(FIELDS)
    buffer = BatchBuffer(layout)
    first = BatchWriter(tmp_path / "a", layout, buffer)
    first.arrays["image"][:] = 200
    first.finish(0, 0, 0, {"note": "x" * 500})
    second = BatchWriter(tmp_path / "b", layout, buffer)
    second.arrays["image"][:] = 9
    second.finish(0, 1, 0, {})
    data = (tmp_path / "b").read_bytes()
    _, _, tlen, mlen, *_ = PREAMBLE.unpack_from(data)
    assert set(data[PREAMBLE.size + tlen + mlen : layout.data_start]) == {0}
    header, arrays = map_batch(tmp_path / "b")
    assert header["step"] == 1 and header["meta"] == {} and set(arrays["image"].reshape(-1).tolist()) == {9}
    assert set(map_batch(tmp_path / "a")[1]["image"].reshape(-1).tolist()) == {200}
    with pytest.raises(ValueError, match="another layout"):
        BatchWriter(tmp_path / "c", BatchLayout.plan(FIELDS[:1]), buffer)
    assert not (tmp_path / "c").exists()


def test_the_content_digest_sees_one_flipped_bit(tmp_path):
    header, arrays = map_batch(write(tmp_path / "b"))
    before = content_digest(arrays, header["fields"])
    arrays["image"][1, 2, 3, 0] ^= 1  # the private map: the file is untouched
    assert content_digest(arrays, header["fields"]) != before
    assert content_digest(map_batch(tmp_path / "b")[1], header["fields"]) == before


def test_the_client_maps_batches_without_xxhash_and_names_it_for_a_digest(tmp_path):
    """The digest's package is the daemon's dependency, not the client's (numpy and pyzmq): a
    client without it maps batches, and only a digest (verify mode) asks for it, by name."""
    path = write(tmp_path / "b")
    code = (
        "import sys; sys.modules['xxhash'] = None\n"  # `import xxhash` raises ImportError from here on
        "from prefetchd_client import PrefetchLoader, batchfile\n"
        f"header, arrays = batchfile.map_batch({str(path)!r})\n"
        "try:\n    batchfile.content_digest(arrays, header['fields'])\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install xxhash" in out, out


def rewrite_header(path, mutate):
    data = bytearray(path.read_bytes())
    header = read_parts(data)
    mutate(header)
    pack_parts(data, header)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda h: h["fields"][0].update(dtype="object"), "dtype 'object' not allowed"),
        (lambda h: h["fields"][1].update(offset=h["fields"][0]["offset"]), "overlap"),
        (lambda h: h["fields"][0].update(shape=[2, 4, 4, 3000]), "runs past the end"),
        (lambda h: h["fields"][0].update(shape=[-1, 4]), "non-negative"),
        (lambda h: h["fields"][0].update(offset=8), "misaligned or inside the header"),
        (lambda h: h["fields"][2].update(name="image"), "repeated name"),
        (lambda h: h.update(fields=[]), "1 to 64"),
        (lambda h: h.update(epoch=2**63), "out of range"),
    ],
)
def test_parser_rejects_bad_headers(tmp_path, mutate, message):
    path = write(tmp_path / "b")
    rewrite_header(path, mutate)
    with pytest.raises(BatchFormatError, match=message):
        map_batch(path)


def test_parser_rejects_bad_preambles(tmp_path):
    path = write(tmp_path / "b")
    good = path.read_bytes()
    for bad, message in [
        (b"", "shorter"),
        (b"NOTABATCH" + good[9:], "bad magic"),
        (good[:8] + struct.pack("<I", 1) + good[12:], "version 1"),
        # the format before this one (zlib's CRC-32 as its digest): refused with the same words
        (
            good[:8] + struct.pack("<I", VERSION - 1) + good[12:],
            f"version {VERSION - 1}, this reader understands {VERSION}",
        ),
        (good[:12] + struct.pack("<I", 10**9) + good[16:], "length out of range"),
        (good[:16] + struct.pack("<I", 1) + good[20:], "length out of range"),
        (good[:20] + struct.pack("<I", 7) + good[24:], "length out of range"),  # the reserved word
        (good[:12] + struct.pack("<I", len(good)) + good[16:], "runs past the end"),
    ]:
        path.write_bytes(bad)
        with pytest.raises(BatchFormatError, match=message):
            map_batch(path)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_truncation_and_bit_flips_raise_only_the_documented_error(tmp_path_factory, data):
    path = write(tmp_path_factory.mktemp("fuzz") / "b")
    good = bytearray(path.read_bytes())
    cut = data.draw(st.integers(0, len(good)))
    buf = good[:cut]
    for _ in range(data.draw(st.integers(0, 4))):
        if buf:
            i = data.draw(st.integers(0, len(buf) - 1))
            buf[i] ^= 1 << data.draw(st.integers(0, 7))
    try:
        header = parse_header(bytes(buf), len(buf))
    except BatchFormatError:
        return
    for f in header["fields"]:  # whatever passed stays inside the buffer
        assert f["offset"] + f["nbytes"] <= len(buf)


# Values a hostile or broken writer might put in any header field: huge, negative, of the
# wrong type, or taken from another field (offsets that overlap).
ANY_VALUE = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 63, 64, 4096, 2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=80),
    st.lists(st.integers(-(2**40), 2**40), max_size=12),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)
FIELD_KEYS = ["name", "dtype", "shape", "offset", "extra"]
VALID_FIELD = {"name": "image", "dtype": "uint8", "shape": [2, 4, 4, 3], "offset": 4096}


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_hostile_header_values_raise_only_the_documented_error(tmp_path_factory, data):
    path = write(tmp_path_factory.mktemp("fuzz") / "b")
    data_bytes = bytearray(path.read_bytes())
    parse_header(bytes(data_bytes), len(data_bytes))  # the good table is the parser's memo now
    header = read_parts(data_bytes)
    for _ in range(data.draw(st.integers(1, 4))):
        target = data.draw(st.sampled_from(["top", "position", "field", "overlap", "fields"]))
        if target == "top":
            header[data.draw(st.sampled_from(["fields", "meta"]))] = data.draw(ANY_VALUE)
        elif target == "position":  # binary u64 in the preamble
            header[data.draw(st.sampled_from(["epoch", "step", "rank"]))] = data.draw(st.integers(0, 2**64 - 1))
        elif target == "field" and isinstance(header.get("fields"), list) and header["fields"]:
            f = header["fields"][data.draw(st.integers(0, len(header["fields"]) - 1))]
            if isinstance(f, dict):
                f[data.draw(st.sampled_from(FIELD_KEYS))] = data.draw(ANY_VALUE)
        elif target == "overlap" and isinstance(header.get("fields"), list) and len(header["fields"]) > 1:
            a, b = header["fields"][0], header["fields"][-1]
            if isinstance(a, dict) and isinstance(b, dict) and type(a.get("offset")) is int:
                b["offset"] = a["offset"] + data.draw(st.integers(-128, 128))
        elif target == "fields":
            header["fields"] = data.draw(st.lists(st.builds(lambda: dict(VALID_FIELD)), max_size=70))
    header_end = pack_parts(data_bytes, header)
    try:
        parsed = parse_header(bytes(data_bytes), len(data_bytes))
        assert type(parsed["meta"]) is dict  # read lazily: its errors are the documented one too
    except BatchFormatError:
        return
    assert max(parsed["epoch"], parsed["step"], parsed["rank"]) < 2**63
    extents = sorted((f["offset"], f["offset"] + f["nbytes"]) for f in parsed["fields"])
    for (start, end), nxt in zip(extents, extents[1:] + [(len(data_bytes), None)]):
        assert header_end <= start <= end <= nxt[0] <= len(data_bytes)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda h: h["fields"][0].update(shape=[2.0, 4, 4, 3]), "dimension must be a non-negative integer"),
        (lambda h: h["fields"][1].update(offset=float(h["fields"][1]["offset"])), "offset must be"),
        (lambda h: h["fields"][2].update(shape=[True]), "dimension must be a non-negative integer"),
        (lambda h: h["meta"].update(pad="x" * 5000), "inside the header"),  # the header grew over field 0
    ],
)
def test_a_table_equal_to_the_last_good_one_is_still_checked_strictly(tmp_path, mutate, message):
    """The parser skips re-checking a field table equal to the last one it passed; Python's ==
    (2.0 == 2, True == 1) and what depends on the file (header length) must not slip through."""
    good = write(tmp_path / "good")
    map_batch(good)
    bad = write(tmp_path / "bad")
    data = bytearray(bad.read_bytes())
    header = read_parts(data)
    mutate(header)
    pack_parts(data, header)
    with pytest.raises(BatchFormatError, match=message):
        parse_header(bytes(data), len(data))


def test_a_file_shorter_than_the_last_good_table_is_refused(tmp_path):
    map_batch(write(tmp_path / "good"))
    data = (tmp_path / "good").read_bytes()
    with pytest.raises(BatchFormatError, match="runs past the end"):
        parse_header(data[:-4096], len(data) - 4096)


def test_meta_is_read_when_asked_and_a_bad_one_raises_the_documented_error(tmp_path):
    path = write(tmp_path / "b", {"config_hash": "abc"})
    data = bytearray(path.read_bytes())
    _, _, tlen, mlen, *_ = PREAMBLE.unpack_from(data)
    data[PREAMBLE.size + tlen : PREAMBLE.size + tlen + mlen] = b"[" + b" " * (mlen - 1)  # not an object
    header = parse_header(bytes(data), len(data))  # the training path never reads meta
    assert header["step"] == 2 and [f["name"] for f in header["fields"]] == ["image", "label", "index"]
    with pytest.raises(BatchFormatError, match="meta is not UTF-8 JSON"):
        header["meta"]
    with pytest.raises(KeyError):
        header["nothing"]


def test_the_table_is_the_same_bytes_in_every_batch_and_checked_once(tmp_path):
    """The reader's fast path: a table byte-equal to the last one checked is not parsed again,
    and still refused when this file is too short for it."""
    first, second = write(tmp_path / "a"), write(tmp_path / "b", {"config_hash": "other"})
    a, b = first.read_bytes(), second.read_bytes()
    tlen = PREAMBLE.unpack_from(a)[2]
    assert a[PREAMBLE.size : PREAMBLE.size + tlen] == b[PREAMBLE.size : PREAMBLE.size + tlen]
    fields = map_batch(first)[0]["fields"]
    assert map_batch(second)[0]["fields"] is fields  # the memo's checked list, shared
