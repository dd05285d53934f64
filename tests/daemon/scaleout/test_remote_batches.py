"""A batch made on another machine (--executor ray) arrives as its file's bytes; the bridge
publishes it only once it is proven to be the batch asked for, of this plan, whole. These
checks run without Ray: the bytes come from the same producer a Ray node runs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from prefetchd.remote.raybridge import not_this_batch
from prefetchd.sources.index import SampleIndex
from prefetchd.workers.producer import BatchProducer
from prefetchd.workers.spec import PRODUCER_SPEC, ProducerSpec
from prefetchd_client.batchfile import map_batch
from tests.conftest import start_job, write_config
from tests.helpers import read_epoch

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def job(job_root, jpeg_folder, tmp_path):
    """A serving job, the producer a Ray node would build from its spec and index, and the layout."""
    paths = start_job(write_config(tmp_path, jpeg_folder, batch_size=4))
    spec = ProducerSpec.from_json(json.loads((paths.dir / PRODUCER_SPEC).read_text()))
    index = SampleIndex.load(paths.dir / "index")
    # As raytask builds it: the index passed in as arrays, not read from the job folder.
    remote = BatchProducer(spec, index=SampleIndex(*(np.array(a) for a in (index.paths, index.offsets, index.labels))))
    return paths, spec, remote


def test_a_batch_made_in_memory_is_the_published_file_byte_for_byte(job):
    paths, spec, remote = job
    read_epoch("job", epochs=1)  # the buffer holds published batches now (retain keeps the last ones)
    published = sorted(paths.batch_dir.iterdir())
    assert published, "nothing published"
    for path in published[-2:]:
        header, _ = map_batch(path, pin=False)
        position = (header["epoch"], header["step"], header["rank"])
        data, _ = remote.make_in_memory(*position)
        assert bytes(data) == path.read_bytes(), f"{path.name}: made in memory differs from the file"
        assert not_this_batch(bytes(data), position, remote.layout, spec) is None


def test_a_batch_that_is_not_the_one_asked_for_is_refused(job):
    _, spec, remote = job
    data = bytes(remote.make_in_memory(0, 1, 0)[0])
    assert "it is batch (0, 1, 0), not (0, 2, 0)" in not_this_batch(data, (0, 2, 0), remote.layout, spec)
    other_plan = dataclasses.replace(spec, plan_digest="0" * 16)
    assert "another plan" in not_this_batch(data, (0, 1, 0), remote.layout, other_plan)
    assert "invalid batch file" in not_this_batch(data[:40], (0, 1, 0), remote.layout, spec)
    assert "invalid batch file" in not_this_batch(b"", (0, 1, 0), remote.layout, spec)
    longer = data + bytes(64)
    assert not_this_batch(longer, (0, 1, 0), remote.layout, spec) is not None
    garbage = np.random.default_rng(0).integers(0, 256, len(data), np.uint8).tobytes()
    assert not_this_batch(garbage, (0, 1, 0), remote.layout, spec) is not None
    # The decoder fingerprint a Ray node must match: deterministic, and moved by what moves pixels.
    assert remote.fingerprint() == remote.fingerprint()
    other = BatchProducer(dataclasses.replace(spec, transforms=[{"op": "random_resized_crop", "size": 16}]))
    assert other.fingerprint() != remote.fingerprint()
