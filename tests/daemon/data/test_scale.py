"""A dataset of 10^8 samples (10^4 shards of 10^4, tests/scaledata.py) served by a real daemon:
each batch holds the samples the plan names, at the start of the epoch and near its end (a
resume there), while no process's memory grows with the dataset: each daemon process stays
under 300 MB of RSS, the index is counted once in `status`. 10^6 samples in the quick tier."""

from __future__ import annotations

import json

import numpy as np
import psutil
import pytest

from prefetchd.plan import Plan
from prefetchd.workers.spec import PRODUCER_SPEC
from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import JobPaths
from tests.conftest import cli, daemon_family, write_config
from tests.scaledata import expected_label, make_scaled_shards

pytestmark = pytest.mark.timeout(600)
PER_SHARD = 10_000
BATCH = 64
MAX_RSS = 300 << 20


@pytest.mark.parametrize(
    "shards", [pytest.param(100, id="1e6-samples"), pytest.param(10_000, id="1e8-samples", marks=pytest.mark.long)]
)
def test_a_dataset_of_many_samples_is_served_exactly_in_bounded_memory(tmp_path, job_root, shards):
    urls = make_scaled_shards(tmp_path / "data", shards, PER_SHARD)
    source = f'kind = "webdataset"\nurls = "{urls}"'
    config = write_config(tmp_path, "", name="scale", batch_size=BATCH, buffer="8M", source=source, size=16)
    result = cli("start", str(config), timeout=300)
    assert result.returncode == 0, result.stderr
    paths = JobPaths.of("scale")
    plan = Plan.from_json(json.loads((paths.dir / PRODUCER_SPEC).read_text())["plan"])
    assert plan.num_samples == shards * PER_SHARD
    loader = PrefetchLoader("scale", as_tensors=False)
    try:
        check_batches(loader, plan, epoch=0, first_step=0)
        last_steps = plan.batches_per_epoch - 20
        loader.load_state_dict({**loader.state_dict(), "samples_consumed": last_steps * BATCH})
        check_batches(loader, plan, epoch=0, first_step=last_steps)
        for process in map(psutil.Process, daemon_family(paths)):
            rss = process.memory_info().rss
            assert rss < MAX_RSS, f"{' '.join(process.cmdline())[:80]}: {rss >> 20} MB"
        status = json.loads(cli("status", "scale", "--json").stdout)
        index_files = sum(f.stat().st_size for f in (paths.dir / "index").iterdir())
        assert status["index"] == {"samples": plan.num_samples, "bytes": index_files}
        assert index_files > 25 * plan.num_samples  # 25 bytes a sample: the index is in the tmpfs, once
    finally:
        loader.close()
        assert cli("stop", "scale").returncode == 0


def check_batches(loader: PrefetchLoader, plan: Plan, epoch: int, first_step: int, count: int = 20) -> None:
    """The next ``count`` batches hold the labels of the samples the plan names for them."""
    batches = iter(loader)
    for step in range(first_step, first_step + count):
        batch = next(batches)
        ids = plan.sample_ids(epoch, step, 0)
        assert np.asarray(batch["index"]).tolist() == ids.tolist(), step
        assert np.asarray(batch["label"]).tolist() == [expected_label(i, PER_SHARD) for i in ids.tolist()], step
