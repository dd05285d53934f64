"""The batch file format: round trip without copies, and a parser that refuses bad files."""

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefetchd_client.batchfile import (
    PREAMBLE,
    BatchFormatError,
    BatchLayout,
    BatchWriter,
    FieldSpec,
    map_batch,
    parse_header,
)

FIELDS = [
    FieldSpec("image", "uint8", (2, 4, 4, 3)),
    FieldSpec("label", "int64", (2,)),
    FieldSpec("index", "int64", (2,)),
]


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


def rewrite_header(path, mutate):
    data = bytearray(path.read_bytes())
    _, _, hlen = PREAMBLE.unpack_from(data)
    header = json.loads(data[16 : 16 + hlen])
    mutate(header)
    new = json.dumps(header).encode()
    data[8:16] = struct.pack("<II", 1, len(new))
    data[16 : 16 + len(new)] = new
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
        (lambda h: h.update(epoch=-3), "epoch must be a non-negative integer"),
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
        (good[:8] + struct.pack("<II", 2, 10) + good[16:], "version 2"),
        (good[:12] + struct.pack("<I", 10**9) + good[16:], "header length"),
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
