"""prefetchd.sources.kinds: one row per [[source]] kind, and every part that needs a kind goes
through it. A new kind is one module and one ``register`` call: shown here with a toy kind (a
module written by the test, its images back to back in one file), which config validation,
indexing and a worker's batches then serve like any other, the same bytes as the images as files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prefetchd.config import build_config
from prefetchd.errors import ConfigError
from prefetchd.master.job import build_index
from prefetchd.plan import Plan
from prefetchd.sources import kinds
from prefetchd.sources.index import SampleBytes, scan_image_folder
from prefetchd.workers.producer import BatchProducer
from prefetchd.workers.spec import ProducerSpec
from tests.conftest import REPO

TRANSFORMS = [{"op": "random_resized_crop", "size": 24}, {"op": "hflip"}]

# The whole of a new kind: its scan (the index) and its reader (a sample's bytes).
TOY_MODULE = '''
import json
import os

import numpy as np

from prefetchd.sources.index import SampleBytes, SampleIndex, open_data_file

PLACE = 7  # where a toy sample's bytes lie: (offset, size) in the blob file


def scan_blobs(source, where):
    """A blob file and its sidecar <blob>.json: [[offset, size, label], ...]."""
    rows = json.loads(open(source["path"] + ".json").read())
    members = [(offset, size) for offset, size, _ in rows]
    labels = [label for _, _, label in rows]
    return SampleIndex.in_containers([source["path"]], [len(rows)], PLACE, members, labels)


class Blobs(SampleBytes):
    def read_sample(self, path, a, b, options):
        fd, _ = open_data_file(path)
        try:
            return os.pread(fd, b, a)
        finally:
            os.close(fd)

    def where(self, path, a, b):
        return f"blob file {path} at byte {a}"
'''


@pytest.fixture
def toy_kind(tmp_path, monkeypatch):
    """The toy kind's module, importable, and its row registered for this test only."""
    (tmp_path / "toykind.py").write_text(TOY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    row = kinds.SourceKind("blobs", "path", "toykind:scan_blobs", "a blob", place=7, reader="toykind:Blobs")
    kinds.register(row)  # the one row
    try:
        yield row
    finally:
        del kinds.KINDS["blobs"]
        sys.modules.pop("toykind", None)


def _batches(config, steps: int) -> list[dict[str, np.ndarray]]:
    index, sizes = build_index(config.sources)
    plan = Plan(len(index), 1, config.batch_size, 0, True, sizes)
    spec = ProducerSpec(
        job_dir="/nonexistent",
        plan=plan.to_json(),
        source_names=[s["name"] for s in config.sources],
        transforms=list(config.transforms),
        pipeline=None,
        config_hash="",
        decoder=config.decoder,
        sources=[kinds.own_options(s) for s in config.sources],
    )
    producer = BatchProducer(spec, index=index)
    return [producer.regenerate(0, step, 0)[1] for step in range(steps)]


def test_a_new_kind_is_one_module_and_one_row(toy_kind, jpeg_folder, tmp_path):
    files = scan_image_folder(str(jpeg_folder), "test")
    blob, rows, offset = bytearray(), [], 0
    for i in range(len(files)):
        data = Path(files.path(i)).read_bytes()
        blob += data
        rows.append([offset, len(data), files.label(i)])
        offset += len(data)
    (tmp_path / "all.blob").write_bytes(blob)
    (tmp_path / "all.blob.json").write_text(json.dumps(rows))

    def config(source: dict):
        raw = {"source": [source], "transform": TRANSFORMS, "job": {"batch_size": 8}}
        return build_config(raw, base=tmp_path, default_name="toy")

    toy = config({"kind": "blobs", "path": "all.blob"})
    assert toy.sources[0]["path"] == str(tmp_path / "all.blob")  # resolved as any path key is
    with pytest.raises(ConfigError, match=r"\(blobs\).*label_key"):
        config({"kind": "blobs", "path": "all.blob", "label_key": "x"})  # keys are the row's
    made = _batches(toy, 3)
    as_files = _batches(config({"kind": "image_folder", "root": str(jpeg_folder)}), 3)
    for got, want in zip(made, as_files, strict=True):
        assert np.array_equal(got["image"], want["image"]) and np.array_equal(got["label"], want["label"])
    assert "toykind" in sys.modules  # its code ran: the batches came through the row


def test_a_place_is_read_by_one_reader_and_a_name_is_taken_once(toy_kind):
    with pytest.raises(ValueError, match="registered already"):
        kinds.register(toy_kind)
    with pytest.raises(ValueError, match="read by toykind:Blobs"):
        kinds.register(kinds.SourceKind("other", "path", toy_kind.scan, "x", place=toy_kind.place))


def test_every_rows_code_is_there_and_of_the_sources_layer():
    """A row names its code by "module:attribute" (loaded on first use, so the CLI checks a
    config without loading a reader): each must load, a scan function and a SampleBytes, in
    prefetchd/sources/ (the worker side reads them; tests/unit/test_structure.py cannot see a string)."""
    for kind in kinds.KINDS.values():
        assert callable(kind.scanner()), kind.scan
        assert issubclass(kind.reader_class(), SampleBytes), kind.reader
        for reference in (kind.scan, kind.reader):
            assert reference.startswith("prefetchd.sources."), reference


def test_checking_a_config_loads_no_reader_nor_numpy_nor_pillow():
    """`prefetchd start` checks the config before it hands over: no tar or Parquet code on that
    path, and neither numpy nor Pillow (~0.25 s of CPU in every start; the daemon imports them)."""
    source = "{'kind': 'parquet', 'path': 'x.parquet'}"
    code = (
        "import sys; from prefetchd.config import build_config; from pathlib import Path\n"
        f"raw = {{'source': [{source}], 'transform': [{{'op': 'center_crop', 'size': 8}}]}}\n"
        "build_config(raw, base=Path('.'), default_name='t')\n"
        "print(sorted(m for m in sys.modules if m.startswith('prefetchd.sources.') or m in ('numpy', 'PIL')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["prefetchd.sources.kinds", "prefetchd.sources.places"], out


def test_an_unknown_kind_names_the_registered_ones(tmp_path):
    registered = "file_list, image_folder, parquet, webdataset"
    with pytest.raises(ConfigError, match=f"kind must be one of {registered}, got 'zip'"):
        build_config({"source": [{"kind": "zip", "path": "x"}]}, base=tmp_path, default_name="t")
    with pytest.raises(ConfigError, match=r"kind must be one of .* got \['x'\]"):
        build_config({"source": [{"kind": ["x"], "path": "x"}]}, base=tmp_path, default_name="t")


def test_the_data_pages_table_is_the_registry():
    """docs/data.md's table of kinds is what kinds.data_md_table makes of the rows."""
    table = "\n".join(kinds.data_md_table())
    assert table in (REPO / "docs" / "data.md").read_text(), f"docs/data.md's table of kinds should read:\n{table}"
