"""Attack: a `<shard>.idx` left from an earlier version of its shard of the same size (the shard
re-made with corrected labels, .cls "3" -> "4", and only the .tar uploaded again). The index
object names the shard's size only, and a read checks the member header's size only, so the old
labels are served with the new shard's images. docs/data.md: "each read checks the member's own
tar header besides, so a wrong index serves no wrong bytes" -- the labels come from the index."""

from __future__ import annotations

import pytest

from prefetchd.sources import shards
from tests.component.test_attack_objects_noetag import IMAGES, shard
from tests.objectstores import MotoS3

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def s3(monkeypatch, tmp_path):
    with MotoS3(bucket="attack-staleidx") as store:
        for key, value in store.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("PREFETCHD_CACHE", str(tmp_path / "cache"))
        yield store


def test_an_index_object_of_an_earlier_version_of_its_shard_does_not_serve_its_labels(s3):
    old = shard([1, 2, 3, 4], IMAGES)
    s3.put("wds/train-000.tar", old)
    table = shards.scan_webdataset({"urls": s3.url("wds/train-000.tar")}, "src")
    s3.put("wds/train-000.tar.idx", shards.index_object_bytes(
        __import__("numpy").column_stack([table.members, table.labels]), len(old)))
    new = shard([5, 6, 7, 8], IMAGES)  # relabelled, same size, new ETag
    assert len(new) == len(old)
    s3.put("wds/train-000.tar", new)
    assert shards.scan_webdataset({"urls": s3.url("wds/train-000.tar")}, "src").labels.tolist() == [5, 6, 7, 8]
