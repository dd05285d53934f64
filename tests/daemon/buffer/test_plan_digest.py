"""A batch belongs to a job only if its plan made it. The config hash leaves out world size,
batch size and weights (so resume states stay elastic); the plan digest in every batch's meta
leaves out nothing that decides its bytes. After `kill -9` and a restart with any such
parameter changed, the daemon adopts none of the old batches and serves a fresh job's bytes;
verify mode and `prefetchd verify` refuse a batch of another plan."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import textwrap

import pytest

from prefetchd.cli.datagen import make_image_folder
from prefetchd.cli.verify import verify_batch
from prefetchd.workers.producer import BatchProducer
from prefetchd.workers.spec import PRODUCER_SPEC, ProducerSpec
from prefetchd_client import PrefetchLoader
from prefetchd_client.batchfile import BatchFormatError
from prefetchd_client.manifest import read_manifest
from tests.conftest import cli, daemon_family, start_job, wait_pids_gone, wait_until

pytestmark = pytest.mark.timeout(120)

_FIELDS = ("image", "label", "index")
# Each case: (job A's settings, job B's) — one parameter that decides a batch's bytes changed.
# 50 samples: 50 % 8 leaves a partial step, so drop_last changes the last batch.
_CHANGES = {
    "world_size": ({"world_size": 2}, {"world_size": 1}),
    "batch_size": ({"batch_size": 8}, {"batch_size": 9}),  # the same file size once page-rounded
    "drop_last": ({"drop_last": True}, {"drop_last": False}),
    "weights": ({"weights": (3, 1)}, {"weights": (1, 1)}),
    "transforms": ({"hflip": True}, {"hflip": False}),
    "decoder": ({"decoder": "pillow"}, {"decoder": "simplejpeg"}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two tiny real ImageFolders: 5 x 10 and 2 x 6 JPEGs of 24-48 px."""
    data = tmp_path_factory.mktemp("digest")
    return (
        make_image_folder(data / "main", classes=5, per_class=10, size=(24, 48), seed=11),
        make_image_folder(data / "extra", classes=2, per_class=6, size=(24, 48), seed=12),
    )


def job_config(
    path, folders, *, world_size=1, batch_size=8, drop_last=True, decoder="pillow", weights=None, hflip=True
):
    """A config of job "job" (whatever the file's name): 16 px crops, one worker, a 400 KiB buffer."""
    if weights is None:
        sources = f'[[source]]\nkind = "image_folder"\nroot = "{folders[0]}"\n'
    else:
        sources = "".join(
            f'[[source]]\nname = "{name}"\nkind = "image_folder"\nroot = "{folder}"\nweight = {weight}\n'
            for name, folder, weight in zip(("main", "extra"), folders, weights)
        )
    path.write_text(
        textwrap.dedent(f"""\
        [job]
        name = "job"
        seed = 3
        world_size = {world_size}
        batch_size = {batch_size}
        drop_last = {str(drop_last).lower()}
        decoder = "{decoder}"

        [daemon]
        buffer = "400K"
        workers = 1

        [[transform]]
        op = "random_resized_crop"
        size = 16
        """)
        + ('[[transform]]\nop = "hflip"\n' if hflip else "")
        + sources
    )
    return path


def fill_and_kill(paths) -> list[int]:
    """Let the daemon fill every rank's window, then kill -9 it and its workers at once.
    Returns the sizes of the batch files it left."""
    manifest = read_manifest(paths)
    wanted = manifest["window_per_rank"] * manifest["world_size"]
    wait_until(lambda: len(os.listdir(paths.batch_dir)) >= wanted, timeout_s=60, what=f"{wanted} batches")
    family = daemon_family(paths)
    for pid in family:
        os.kill(pid, signal.SIGKILL)
    wait_pids_gone(family)
    return [os.stat(paths.batch_dir / name).st_size for name in os.listdir(paths.batch_dir)]


def fresh_batch(producer: BatchProducer, step: int) -> dict:
    """Batch (0, step, 0) as a fresh job makes it: remade in this process from the job's producer.json."""
    return producer.regenerate(0, step, 0)[1]


def kept_by_restart(paths) -> int:
    kept = re.findall(r"kept (\d+) batches from a previous daemon", paths.log.read_text())
    assert kept, "the restarted daemon found no leftovers: the test killed nothing"
    return int(kept[-1])


# The quick tier restarts a daemon for two of the parameters (a batch of the same file size, and
# a decoder); the long tier for each. That every one of them is in the digest is the next test's.
_RESTARTED_QUICK = ("batch_size", "decoder")


def test_every_parameter_that_decides_a_batchs_bytes_changes_the_plan_digest(tmp_path, folders):
    """What a master's build_job writes into every batch's meta, for each case above: no daemon."""
    from prefetchd.config import load_config
    from prefetchd.master.job import build_job
    from prefetchd_client.layout import JobPaths

    def digest(name: str, settings: dict) -> str:
        config = load_config(job_config(tmp_path / f"{name}.toml", folders, **settings), {})
        (tmp_path / name / "index").mkdir(parents=True)
        return build_job(config, JobPaths(tmp_path / name)).plan_digest

    for parameter, (before, after) in _CHANGES.items():
        assert digest(f"{parameter}-a", before) != digest(f"{parameter}-b", after), parameter
    assert digest("same-a", {}) == digest("same-b", {}), "one config, one digest"


@pytest.mark.parametrize(
    "parameter", [p if p in _RESTARTED_QUICK else pytest.param(p, marks=pytest.mark.long) for p in _CHANGES]
)
def test_a_daemon_restarted_with_a_changed_parameter_adopts_nothing_and_serves_a_fresh_jobs_bytes(
    tmp_path, folders, job_root, parameter
):
    before, after = _CHANGES[parameter]
    paths = start_job(job_config(tmp_path / "a.toml", folders, **before))
    leftovers = fill_and_kill(paths)
    start_job(job_config(tmp_path / "b.toml", folders, **after))  # the same job name and root

    producer = BatchProducer(ProducerSpec.from_json(json.loads((paths.dir / PRODUCER_SPEC).read_text())))
    loader = PrefetchLoader("job", verify=True, as_tensors=False, timeout=60)
    try:
        wrong = []
        for step, batch in enumerate(loader):
            fresh = fresh_batch(producer, step)
            if any(batch[k].shape != fresh[k].shape or batch[k].tobytes() != fresh[k].tobytes() for k in _FIELDS):
                wrong.append(step)
        served = step + 1
    finally:
        loader.close()
    assert served == read_manifest(paths)["batches_per_epoch"]
    assert wrong == [], f"after the restart with another {parameter}, steps {wrong} are not a fresh job's batches"
    assert kept_by_restart(paths) == 0
    # The old files had exactly the new layout's size: the size check alone could not tell them apart.
    assert set(leftovers) == {read_manifest(paths)["batch_bytes"]}
    print(f"\n[figure] {parameter}: kept 0 of {len(leftovers)} leftovers; {served} batches equal a fresh job's")


def test_a_daemon_restarted_with_the_same_plan_keeps_every_leftover_and_serves_them_verified(
    tmp_path, folders, job_root
):
    config = job_config(tmp_path / "job.toml", folders, world_size=2)
    paths = start_job(config)
    left = len(fill_and_kill(paths))
    start_job(config)
    assert kept_by_restart(paths) == left > 0

    producer = BatchProducer(ProducerSpec.from_json(json.loads((paths.dir / PRODUCER_SPEC).read_text())))
    loader = PrefetchLoader("job", rank=0, world_size=2, verify=True, as_tensors=False, timeout=60)
    try:
        for step, batch in enumerate(loader):
            fresh = fresh_batch(producer, step)
            assert all(batch[k].tobytes() == fresh[k].tobytes() for k in _FIELDS), f"step {step}"
    finally:
        loader.close()


def plant(source, target) -> None:
    """Put a copy of ``source`` in ``target``'s place atomically, as a same-user program could."""
    tmp = target.with_name(target.name + ".planted")
    shutil.copyfile(source, tmp)
    os.replace(tmp, target)


def test_a_planted_batch_of_another_plan_is_refused_by_verify_mode_and_reported_by_prefetchd_verify(
    tmp_path, folders, serve
):
    # Job "other" differs in world size only: the same config hash, the same file size. Its
    # step 1 of rank 0 holds samples that our step 2 holds: an adopted leftover would look so.
    paths = serve(job_config(tmp_path / "job.toml", folders, world_size=1)).paths
    other = job_config(tmp_path / "other.toml", folders, world_size=2)
    other.write_text(other.read_text().replace('name = "job"', 'name = "other"'))
    other_paths = serve(other).paths
    wait_until(lambda: paths.batch(0, 1, 0).exists() and other_paths.batch(0, 1, 0).exists(), what="both batches")
    ours, theirs = read_manifest(paths), read_manifest(other_paths)
    assert (ours["config_hash"], ours["batch_bytes"]) == (theirs["config_hash"], theirs["batch_bytes"])
    plant(other_paths.batch(0, 1, 0), paths.batch(0, 1, 0))

    result = cli("verify", "job", "--epoch", "0", "--step", "1")
    assert result.returncode == 1 and "differs" in result.stderr, result.stderr
    report = verify_batch(paths, 0, 1, 0)
    assert not report["identical"] and report["differing_fields"] == ["image", "index", "label"]
    assert "made by another plan" in report["reason"]
    assert theirs["plan_digest"] in report["reason"] and ours["plan_digest"] in report["reason"]

    loader = PrefetchLoader("job", verify=True, as_tensors=False, timeout=30)
    try:
        with pytest.raises(BatchFormatError, match="made by another plan"):
            for _ in loader:  # step 0 is ours; step 1 is the planted one
                pass
    finally:
        loader.close()
