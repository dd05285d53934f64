"""issue 27: the loader names the classes where the data does (torchvision's ``classes`` and
``class_to_idx``): an image folder's class folders, what `prefetchd pack` kept, a Parquet file's
Hugging Face ClassLabel; None where it names none or its sources disagree."""

from __future__ import annotations

import json
import os

import pytest

from prefetchd_client import PrefetchLoader
from tests.component.test_parquet import jpegs, pa, pq
from tests.conftest import cli, write_config


def loader_of(tmp_path, serve, source: str) -> PrefetchLoader:
    serve(write_config(tmp_path, "", batch_size=4, source=source))
    return PrefetchLoader("job", as_tensors=False)


def test_an_image_folder_names_its_class_folders_as_torchvision_does(tmp_path, serve, jpeg_folder):
    loader = loader_of(tmp_path, serve, f'kind = "image_folder"\nroot = "{jpeg_folder}"')
    names = sorted(e.name for e in os.scandir(jpeg_folder) if e.is_dir())
    assert loader.classes == names and loader.class_to_idx == {n: i for i, n in enumerate(names)}
    loader.close()


def test_packed_shards_name_the_classes_pack_kept(tmp_path, serve, jpeg_folder):
    packed = tmp_path / "packed"
    assert cli("pack", str(jpeg_folder), str(packed)).returncode == 0
    count = len(json.loads((packed / "pack.json").read_text())["shards"])
    urls = f"{packed}/shard-{{000000..{count - 1:06d}}}.tar"
    loader = loader_of(tmp_path, serve, f'kind = "webdataset"\nurls = "{urls}"')
    assert loader.classes == sorted(e.name for e in os.scandir(jpeg_folder) if e.is_dir())
    loader.close()


@pytest.mark.parametrize("metadata", ["classlabel", "none", "garbage"])
def test_a_parquet_file_names_its_classes_where_its_hugging_face_metadata_does(tmp_path, serve, metadata):
    images = jpegs(8)
    table = pa.table({"image": pa.array(images, pa.binary()), "label": pa.array([i % 2 for i in range(8)])})
    features = {"label": {"names": ["cat", "dog"], "_type": "ClassLabel"}}
    meta = {
        "classlabel": {b"huggingface": json.dumps({"info": {"features": features}}).encode()},
        "none": None,
        "garbage": {b"huggingface": b'{"info": [' * 50},
    }[metadata]
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "train.parquet")
    loader = loader_of(tmp_path, serve, f'kind = "parquet"\npath = "{tmp_path / "train.parquet"}"')
    assert loader.classes == (["cat", "dog"] if metadata == "classlabel" else None)
    assert loader.class_to_idx == ({"cat": 0, "dog": 1} if metadata == "classlabel" else None)
    loader.close()


def test_a_file_list_or_sources_that_disagree_name_none(tmp_path, serve, jpeg_folder):
    listed = tmp_path / "list.txt"
    listed.write_text("".join(f"{p},0\n" for p in sorted(jpeg_folder.rglob("*.jpg"))[:8]))
    two = f'kind = "image_folder"\nroot = "{jpeg_folder}"\n\n[[source]]\nkind = "file_list"\npath = "{listed}"'
    loader = loader_of(tmp_path, serve, two)
    assert loader.classes is None and loader.class_to_idx is None
    loader.close()
