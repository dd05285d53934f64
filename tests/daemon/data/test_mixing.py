"""Weighted mixing served by a job's master (run in the test's process): header counts, realised
proportions, exact coverage."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from prefetchd import control
from prefetchd.cli.datagen import make_image_folder
from prefetchd_client import PrefetchLoader
from prefetchd_client.batchfile import map_batch
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)


def mix_config(tmp_path, big, small, weights, rule, name="mix"):
    path = tmp_path / f"{name}.toml"
    path.write_text(
        textwrap.dedent(f"""\
        [job]
        name = "{name}"
        batch_size = 8
        [daemon]
        workers = 2
        buffer = "32M"
        [mix]
        epoch = "{rule}"
        [[source]]
        name = "big"
        kind = "image_folder"
        root = "{big}"
        weight = {weights[0]}
        [[source]]
        name = "small"
        kind = "image_folder"
        root = "{small}"
        weight = {weights[1]}
        [[transform]]
        op = "center_crop"
        size = 16
        """)
    )
    return path


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("small") / "data", classes=2, per_class=6, size=(40, 60), seed=5)


def test_weighted_mix_records_sources_per_batch_and_status_shows_realised_shares(
    tmp_path, jpeg_folder, small_folder, serve
):
    # 48 + 12 samples, weights 3:1 (need not sum to 1), cycle: 64 samples an epoch, 8 batches
    paths = serve(mix_config(tmp_path, jpeg_folder, small_folder, (3, 1), "cycle")).paths
    manifest = json.loads(paths.manifest.read_text())
    assert manifest["batches_per_epoch"] == 8
    loader = PrefetchLoader("mix", as_tensors=False)
    ids, headers = [], []
    for step, batch in enumerate(loader):
        ids += batch["index"].tolist()
        headers.append(map_batch(paths.batch(0, step, 0))[0]["meta"]["sources"])
    loader.close()
    big = [i for i in ids if i < 48]
    small = [i for i in ids if i >= 48]
    assert sorted(big) == list(range(48)), "cycle: every sample of the largest source once"
    assert len(small) == 16 and set(small) == set(range(48, 60))  # the small one cycles (12 + 4)
    assert [h["big"] + h["small"] for h in headers] == [8] * 8
    assert sum(h["small"] for h in headers) == 16
    assert all(1 <= h["small"] <= 3 for h in headers), f"not stratified: {headers}"

    def shares() -> dict | None:
        # A worker publishes a batch before the master hears of it: the count may lag a moment.
        by_name = {s["name"]: s for s in control.request(paths.endpoint, {"op": "status"})["sources"]}
        produced = by_name["big"]["samples_produced"] + by_name["small"]["samples_produced"]
        return by_name if produced >= 64 else None

    by_name = wait_until(shares, what="the epoch's 64 samples counted")
    assert by_name["big"]["configured_share"] == 0.75 and by_name["small"]["configured_share"] == 0.25
    assert abs(by_name["small"]["realised_share"] - 0.25) < 0.05


def test_first_exhausted_and_all_once(tmp_path, jpeg_folder, small_folder, serve):
    serve(mix_config(tmp_path, jpeg_folder, small_folder, (0.5, 0.5), "first_exhausted", name="fe"))
    ids = np.concatenate([b["index"] for b in PrefetchLoader("fe", as_tensors=False)])
    assert len(ids) == 24 and len(set(ids.tolist())) == 24  # 12 + 12, nothing repeats
    assert (ids >= 48).sum() == 12
    serve(mix_config(tmp_path, jpeg_folder, small_folder, (0.9, 0.1), "all_once", name="ao"))
    ids = np.concatenate([b["index"] for b in PrefetchLoader("ao", as_tensors=False)])
    assert len(ids) == 56 and len(set(ids.tolist())) == 56 and ids.max() < 60  # 60 once; drop_last drops 4


def test_a_weight_change_on_resume_is_accepted_and_applies_from_there(tmp_path, jpeg_folder, small_folder, serve):
    job = serve(mix_config(tmp_path, jpeg_folder, small_folder, (3, 1), "cycle", name="w"))
    loader = PrefetchLoader("w", as_tensors=False)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    loader.close()
    job.stop()
    serve(mix_config(tmp_path, jpeg_folder, small_folder, (1, 1), "cycle", name="w"))
    resumed = PrefetchLoader("w", as_tensors=False)
    resumed.load_state_dict(state)  # weights are not part of the content identity
    assert len(resumed) == 12  # 1:1 cycle: 48 + 48 samples
    rest = [b for b in resumed]
    assert len(rest) == 12 - 2
    later = np.concatenate([b["index"] for b in resumed])  # epoch 1 follows the new weights exactly
    assert (later >= 48).sum() == 48
