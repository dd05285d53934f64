"""The kinds of ``[[source]]``: one row each, declared once.

A row says what a kind's table holds (the key naming its data, its own further keys and their
defaults), how its samples are indexed, where a sample's bytes lie and what reads them there,
and what one sample is (for docs/data.md). Config validation (prefetchd.config), indexing
(master/job.py), the worker's sample reader (samplereader.py) and docs/data.md's table all go
through KINDS, so a new kind is one module (its scan function, and a SampleBytes reader when its
samples live inside containers) and one ``register`` call here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import cache

from prefetchd.sources.places import FILE, PARQUET_ROW, TAR_MEMBER

COMMON_KEYS = ("kind", "name", "weight")  # what every kind's table may hold besides its own keys


@dataclass(frozen=True)
class SourceKind:
    """A kind's row. ``scan`` and ``reader`` name their code as "module:attribute", imported on
    first use: the CLI checks a config with the rows alone, without loading a Parquet or tar
    reader (kept off the command's start-up time)."""

    name: str  # kind = "<name>"
    data_key: str  # the key that says where its data is: what --data replaces
    scan: str  # "module:function": (its checked table, how messages name it) -> its SampleIndex, or its parts in order
    one_sample: str  # what one sample is, for docs/data.md
    options: dict[str, str | None] = field(default_factory=dict)  # its own string keys: defaults (None: unset)
    patterns: bool = False  # data_key takes brace patterns or a list of them; scan resolves them against "base"
    place: int = FILE  # where its samples' bytes lie (SampleIndex.kinds): FILE, a file of its own, or a container
    reader: str = "prefetchd.sources.index:OwnFiles"  # "module:class", a SampleBytes: one per worker and place
    # "module:function": (its checked table) -> the class names, label i named by the i-th, or None
    # where the source has none (the client's classes and class_to_idx)
    class_names: str | None = None

    def scanner(self):
        return _load(self.scan)

    def reader_class(self):
        return _load(self.reader)

    def names_of_classes(self, source: dict) -> list[str] | None:
        return None if self.class_names is None else _load(self.class_names)(source)


@cache
def _load(reference: str):
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


KINDS: dict[str, SourceKind] = {}


def register(kind: SourceKind) -> SourceKind:
    """Add a kind: one call per kind, below (a test registers a toy one). Two kinds may share a
    place only with the same reader: the index records the place, not the kind."""
    if kind.name in KINDS:
        raise ValueError(f"a source kind {kind.name!r} is registered already")
    for other in KINDS.values():
        if other.place == kind.place and other.reader != kind.reader:
            raise ValueError(f"place {kind.place} is read by {other.reader} ({other.name!r}) already")
    KINDS[kind.name] = kind
    return kind


def reader_for(place: int):
    """The SampleBytes class that reads the samples at ``place``; None for a place of no kind."""
    return next((kind.reader_class() for kind in KINDS.values() if kind.place == place), None)


def own_options(source: dict) -> dict:
    """What a worker needs of a checked [[source]] table: its kind and its own keys."""
    kind = KINDS[source["kind"]]
    return {"kind": kind.name, **{key: source.get(key) for key in kind.options}}


def data_md_table() -> list[str]:
    """The table of kinds at the top of docs/data.md (tests/component/test_kinds.py checks the page)."""
    rows = ["| kind | keys | one sample is |", "|---|---|---|"]
    for kind in KINDS.values():
        own = [f'`{key}` (`"{value}"`)' if value is not None else f"`{key}`" for key, value in kind.options.items()]
        rows.append(f"| `{kind.name}` | {', '.join([f'`{kind.data_key}`', *own])} | {kind.one_sample} |")
    return rows


register(
    SourceKind(
        "image_folder",
        "root",
        "prefetchd.sources.index:index_image_folder",
        "a file under a class folder (torchvision's `ImageFolder` order)",
        class_names="prefetchd.sources.index:folder_class_names",
    )
)
register(SourceKind("file_list", "path", "prefetchd.sources.index:index_file_list", "a `path,label` line"))
register(
    SourceKind(
        "webdataset",
        "urls",
        "prefetchd.sources.shards:webdataset_parts",
        "the members of a tar shard that share a key",
        options={"label_key": None, "cache": None, "cache_size": None},
        patterns=True,
        place=TAR_MEMBER,
        reader="prefetchd.sources.tarmembers:TarMembers",
        class_names="prefetchd.sources.shards:packed_class_names",
    )
)
register(
    SourceKind(
        "parquet",
        "path",
        "prefetchd.sources.parquetsource:scan_parquet",
        "a row",
        options={"image_column": "image", "label_column": "label"},
        place=PARQUET_ROW,
        reader="prefetchd.sources.parquetrows:ParquetRows",
        class_names="prefetchd.sources.parquetsource:parquet_class_names",
    )
)
