"""`[job] mode = "eval"`: every sample exactly once across the ranks, in order, unaugmented,
the last step padded and marked by `valid`; a metric over the valid rows is the dataset's."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefetchd.config import load_config
from prefetchd.errors import ConfigError
from prefetchd.plan import Plan
from prefetchd.sources.index import read_image_file, scan_image_folder
from prefetchd.workers.transforms import ImagePipeline
from tests.conftest import start_job, write_config
from tests.daemon.resume.test_examples import EXAMPLES, run_example
from tests.helpers import read_epoch

EVAL_TRANSFORMS = '[[transform]]\nop = "resize_short"\nsize = 40\n\n[[transform]]\nop = "center_crop"\nsize = 32\n'


def eval_config(
    folder: Path, data: Path, *, name="val", world_size=2, batch_size=5, transforms=EVAL_TRANSFORMS, extra_job=""
) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(
        textwrap.dedent(f"""\
        [job]
        name = "{name}"
        mode = "eval"
        world_size = {world_size}
        batch_size = {batch_size}
        {extra_job}
        [daemon]
        buffer = "2M"
        workers = 1

        [[source]]
        kind = "image_folder"
        root = "{data}"

        """)
        + transforms
    )
    return path


@given(n=st.integers(1, 300), world=st.integers(1, 8), batch=st.integers(1, 16))
def test_an_evaluation_plan_counts_every_sample_once_on_equal_steps(n, world, batch):
    plan = Plan(n, world, batch, seed=3, drop_last=False, source_sizes=(n,), evaluation=True)
    steps = plan.batches_per_epoch
    assert steps == -(-n // (world * batch))
    seen = []
    for step in range(steps):
        for rank in range(world):
            ids, valid = plan.sample_ids(0, step, rank), plan.batch_valid(step, rank)
            assert len(ids) == batch
            assert valid.all() or step == steps - 1, "only the last step is padded"
            seen += ids[valid].tolist()
            np.testing.assert_array_equal(ids, plan.sample_ids(5, step, rank))  # every epoch alike
    assert seen == list(range(n))  # in order, each once


def test_a_training_plans_digest_does_not_change_with_evaluation_plans():
    assert "evaluation" not in Plan(10, 1, 2).to_json()
    assert Plan.from_json(Plan(10, 1, 2, evaluation=True).to_json()).evaluation


@pytest.mark.parametrize(
    "transforms, named",
    [
        ('[[transform]]\nop = "random_resized_crop"\nsize = 32\n', "transform #1 (random_resized_crop)"),
        (EVAL_TRANSFORMS + '\n[[transform]]\nop = "hflip"\n', "transform #3 (hflip)"),
        (
            '[[transform]]\nop = "resize_short"\nmin = 40\nmax = 48\n[[transform]]\nop = "center_crop"\nsize = 32\n',
            "transform #1 (resize_short)",
        ),
        (EVAL_TRANSFORMS + '\n[[transform]]\nop = "color_jitter"\nbrightness = 0.1\n', "transform #3 (color_jitter)"),
    ],
)
def test_a_random_transform_in_an_evaluation_job_is_a_config_error_naming_it(tmp_path, transforms, named):
    with pytest.raises(ConfigError, match=r"is random, but \[job\] mode = \"eval\"") as err:
        load_config(eval_config(tmp_path, tmp_path, transforms=transforms))
    assert str(err.value).startswith(named)
    assert "center_crop" in str(err.value)


def test_unrandom_settings_of_random_ops_are_allowed_and_the_flag_alone_picks_the_eval_view(tmp_path):
    ok = EVAL_TRANSFORMS + '\n[[transform]]\nop = "hflip"\np = 0.0\n'
    assert load_config(eval_config(tmp_path, tmp_path, transforms=ok)).mode == "eval"
    flagged = load_config(None, {"data": str(tmp_path), "mode": "eval"})
    assert [t["op"] for t in flagged.transforms] == ["resize_short", "center_crop"]


def test_weights_in_an_evaluation_job_are_a_config_error(tmp_path):
    path = tmp_path / "w.toml"
    path.write_text(
        '[job]\nmode = "eval"\n[[source]]\nkind = "image_folder"\nroot = "a"\nname = "a"\nweight = 1\n'
        '[[source]]\nkind = "image_folder"\nroot = "b"\nname = "b"\nweight = 2\n' + EVAL_TRANSFORMS
    )
    with pytest.raises(ConfigError, match="remove the \\[\\[source\\]\\] weights"):
        load_config(path)


def test_a_served_evaluation_reads_every_sample_once_and_every_epoch_alike(tmp_path, jpeg_folder, serve):
    serve(eval_config(tmp_path, jpeg_folder))  # 48 samples, 2 ranks x 5: 5 steps, 2 padded rows
    epochs = [read_epoch("val", rank=r, world_size=2, epochs=2, batch_size=5) for r in range(2)]
    seen, padded = [], 0
    for rank in range(2):
        first, second = epochs[rank][:5], epochs[rank][5:]
        for a, b in zip(first, second):
            for field in ("index", "label", "valid", "image"):
                np.testing.assert_array_equal(a.arrays[field], b.arrays[field])
        for batch in first:
            assert batch.arrays["valid"].dtype == np.bool_
            seen += batch.arrays["index"][batch.arrays["valid"]].tolist()
            padded += int((~batch.arrays["valid"]).sum())
    assert sorted(seen) == list(range(48)) and padded == 2


@pytest.mark.long  # 30 CPU-s; the quick tier keeps Lightning in test_examples.py (its DDP resume)
def test_an_evaluation_job_beside_a_training_job_in_lightning_gives_the_datasets_metric(
    tmp_path, jpeg_folder, job_root
):
    start_job(write_config(tmp_path, jpeg_folder, name="train", world_size=2, batch_size=4, size=32, buffer="256K"))
    val = eval_config(tmp_path, jpeg_folder)
    start_job(val)
    record, weights = tmp_path / "val.jsonl", tmp_path / "net.pt"
    run_example(
        "lightning_eval.py",
        "train",
        "val",
        "--epochs",
        "1",
        "--devices",
        "2",
        "--num-classes",
        "4",
        "--timeout",
        "60",
        "--record",
        str(record),
        "--weights",
        str(weights),
    )
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert sorted(line["rank"] for line in lines) == [0, 1]  # one validation (after the epoch), not the sanity one
    ids = sorted(i for line in lines for i in line["ids"])
    assert ids == list(range(48)), "every sample exactly once across the ranks"
    result = lines[0]
    assert result["samples"] == 48 and result["rows"] == 50  # the padding is read, and not counted

    # The same metric, computed here over the dataset's images as the daemon transforms them.
    import torch

    sys.path.insert(0, str(EXAMPLES))
    try:
        from lightning_ddp import tiny_cnn
    finally:
        sys.path.remove(str(EXAMPLES))
    net = tiny_cnn(4)
    net.load_state_dict(torch.load(weights, weights_only=True))
    net.eval()
    config = load_config(val)
    pipeline = ImagePipeline(list(config.transforms), config.decoder)
    index = scan_image_folder(str(jpeg_folder), "test")
    images = np.zeros((len(index), 32, 32, 3), np.uint8)
    for i in range(len(index)):
        pipeline.apply(index.path(i), np.random.default_rng(0), images[i], read_image_file(index.path(i)))
    with torch.no_grad():
        logits = net(torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255))
    labels = torch.from_numpy(index.labels.copy())
    assert result["correct"] == (logits.argmax(1) == labels).sum().item()
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert result["loss"] == pytest.approx(loss, rel=1e-5)


def test_a_pipeline_callable_may_serve_an_evaluation(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(
        '[job]\nmode = "eval"\n[pipeline]\ncallable = "mypkg.eval:make_sample"\n'
        f'[[source]]\nkind = "image_folder"\nroot = "{tmp_path}"\n'
    )
    assert load_config(path).pipeline == "mypkg.eval:make_sample"


def test_a_replaced_sample_is_not_counted_twice_in_an_evaluation(tmp_path, serve):
    from tests.component.test_shards import good, write_shard

    samples = good(7)
    samples[3] = {"jpg": b"not an image", "cls": b"0"}
    shard = write_shard(tmp_path / "val.tar", samples)
    path = eval_config(tmp_path, tmp_path, world_size=1, batch_size=3)
    path.write_text(
        path.read_text()
        .replace(f'kind = "image_folder"\nroot = "{tmp_path}"', f'kind = "webdataset"\nurls = "{shard}"')
        .replace("[daemon]", "[daemon]\nmax_bad_rate = 1.0")
    )
    serve(path)
    batches = read_epoch("val", world_size=1, with_meta=True)
    valid = [i for b in batches for i, ok in zip(b.arrays["index"].tolist(), b.arrays["valid"].tolist()) if ok]
    assert valid == [0, 1, 2, 4, 5, 6]  # sample 3's stand-in is counted where it stands itself
    assert [r["index"] for b in batches for r in b.meta["replaced"]] == [3]
