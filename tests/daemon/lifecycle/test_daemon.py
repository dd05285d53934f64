"""A real daemon on the real tmpfs, real worker processes, real ZeroMQ, real JPEG files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

from prefetchd.plan import Plan
from prefetchd.workers import ONE_THREAD_PER_PROCESS
from prefetchd_client import DaemonDied, JobNotRunning, PlanMismatch, PrefetchLoader
from prefetchd_client.layout import JobPaths, parse_batch_name, write_progress
from prefetchd_client.locks import daemon_alive
from prefetchd_client.manifest import read_manifest
from tests.conftest import cli, daemon_family, start_job, wait_pids_gone, wait_until, write_config
from tests.daemon.lifecycle.test_worker_liveness import pipeline_job
from tests.helpers import job_status, read_epoch, temp_leftovers, workers_of

pytestmark = pytest.mark.timeout(120)

READER = textwrap.dedent("""
    import json, sys
    from prefetchd_client import PrefetchLoader
    job, rank, world, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    loader = PrefetchLoader(job, rank=rank, world_size=world, timeout=60, as_tensors=False)
    out = []
    for epoch in range(epochs):
        out.append([b["index"].tolist() for b in loader])
    loader.close()
    print(json.dumps(out))
""")


def batch_files(paths) -> list[tuple[int, int, int]]:
    return sorted(filter(None, map(parse_batch_name, os.listdir(paths.batch_dir))))


def test_two_ranks_read_two_epochs_disjoint_and_within_the_bound(tmp_path, jpeg_folder, serve):
    # 48 images, 2 ranks x 4 = 6 steps per epoch; a batch of 4x32x32x3 is ~16 KiB: the
    # 64 KiB... bound below holds 3 batches per rank, so the daemon must delete to go on.
    cfg = write_config(tmp_path, jpeg_folder, world_size=2, batch_size=4, buffer="120K", workers=1)
    paths = serve(cfg).paths
    manifest = read_manifest(paths)
    bound, batch_bytes = manifest["buffer_bytes"], manifest["batch_bytes"]
    assert bound // batch_bytes < 2 * manifest["batches_per_epoch"], "the bound must force deletion"
    readers = [
        subprocess.Popen([sys.executable, "-c", READER, "job", str(r), "2", "2"], stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    peak_files = 0
    while any(p.poll() is None for p in readers):  # sample the real bytes on the tmpfs meanwhile
        blocks = {}  # by inode: a batch being published has two names for a moment
        for folder in (paths.batch_dir, paths.tmp_dir, paths.retired_dir):
            for name in os.listdir(folder):
                try:
                    st = os.stat(folder / name)
                    blocks[st.st_ino] = st.st_blocks * 512
                except FileNotFoundError:
                    pass
        peak_files = max(peak_files, sum(blocks.values()))
        time.sleep(0.002)
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in readers]
    assert all(p.returncode == 0 for p in readers)
    assert 0 < peak_files <= bound
    s = job_status(paths)
    assert s["buffer"]["peak_bytes"] <= bound
    plan = Plan(48, 2, 4, seed=0)
    for epoch in range(2):
        ranks = [sum(outs[r][epoch], []) for r in range(2)]
        assert len(ranks[0]) == len(ranks[1]) == 24
        assert not set(ranks[0]) & set(ranks[1]), "ranks overlap"
        for r in range(2):  # exactly the plan, in order
            expected = [plan.sample_ids(epoch, k, r).tolist() for k in range(plan.batches_per_epoch)]
            assert outs[r][epoch] == expected
    # Both ranks finished epoch 1: all is deleted but the last `retain` batches of each rank.
    first_kept = 2 * plan.batches_per_epoch - manifest["retain"]
    wait_until(
        lambda: all(plan.linear(e, k) >= first_kept for e, k, _ in batch_files(paths)), what="consumed batches deleted"
    )
    assert {(e, k) for e, k, _ in batch_files(paths) if e < 2} == {(1, 4), (1, 5)}
    assert s["totals"]["deleted"] >= 2 * 12 - 2 * (bound // batch_bytes)
    assert [(r["epoch"], r["step"]) for r in job_status(paths)["ranks"]] == [(2, 0), (2, 0)]


def test_progress_file_trainer_gets_deletion_and_refill(tmp_path, jpeg_folder, serve):
    """A trainer in any language: it reads files by name and writes progress/rank-0 only."""
    cfg = write_config(tmp_path, jpeg_folder, batch_size=4, buffer="100K")
    paths = serve(cfg).paths
    manifest = read_manifest(paths)
    window, retain, per_epoch = manifest["window_per_rank"], manifest["retain"], manifest["batches_per_epoch"]
    assert window + retain < per_epoch

    def linear_files():
        return [e * per_epoch + k for e, k, _ in batch_files(paths)]

    wait_until(lambda: linear_files() == list(range(window)), what="window filled")
    write_progress(paths.progress(0), 0, 2)  # batches 0, 1 consumed: kept as the `retain` ones
    expected = list(range(2 - retain, 2 + window))
    wait_until(lambda: linear_files() == expected, what="deletion and refill after a progress file")
    # Across the epoch boundary; what lies behind the new position is not remade.
    write_progress(paths.progress(0), 1, 2)
    expected = list(range(per_epoch + 2, per_epoch + 2 + window))
    wait_until(lambda: linear_files() == expected, what="refill in the next epoch")
    assert job_status(paths)["ranks"][0]["epoch"] == 1


def test_batches_are_identical_for_any_worker_count(tmp_path, jpeg_folder, serve):
    images = {}
    for workers in (1, 2):
        cfg = write_config(tmp_path, jpeg_folder, name=f"w{workers}", batch_size=6, workers=workers, seed=11)
        job = serve(cfg)
        loader = PrefetchLoader(f"w{workers}", as_tensors=False, timeout=60)
        images[workers] = [b["image"].copy() for b in loader]
        loader.close()
        job.stop()
    assert len(images[1]) == 8
    assert all(np.array_equal(a, b) for a, b in zip(images[1], images[2], strict=True))
    assert not np.array_equal(images[1][0], images[1][1])


def test_state_dict_resumes_at_the_exact_batch(tmp_path, jpeg_folder, serve):
    serve(write_config(tmp_path, jpeg_folder, batch_size=4))
    loader = PrefetchLoader("job", as_tensors=False)
    assert len(loader) == 12
    reference = [b["index"].tolist() for b in loader] + [b["index"].tolist() for b in loader]
    loader = PrefetchLoader("job", as_tensors=False)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch"] == 0 and state["samples_consumed"] == 20
    resumed = PrefetchLoader("job", as_tensors=False)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the usual call at the top of the epoch keeps the mid-epoch position
    got = [b["index"].tolist() for b in resumed] + [b["index"].tolist() for b in resumed]
    assert got == reference[5:]
    other = dict(state, config_hash="0" * 16, config={**state["config"], "seed": 5})
    with pytest.raises(PlanMismatch, match="another config \\(seed: state has 5, job has 0\\)"):
        resumed.load_state_dict(other)
    # a state taken before the plan's order 2 (its config has no order): refused, saying why
    order_1 = dict(state, config_hash="0" * 16, config={k: v for k, v in state["config"].items() if k != "order"})
    with pytest.raises(PlanMismatch, match=r"order: state has None, job has 2 \(order: how an epoch's samples are"):
        resumed.load_state_dict(order_1)


def test_tensors_when_torch_is_present(tmp_path, jpeg_folder, serve):
    torch = pytest.importorskip("torch")
    serve(write_config(tmp_path, jpeg_folder, batch_size=4, size=24))
    batch = next(iter(PrefetchLoader("job")))
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (4, 24, 24, 3)
    assert batch["label"].dtype == torch.int64 and batch["index"].dtype == torch.int64


def test_status_json_and_stop_removes_the_job(tmp_path, jpeg_folder, job_root):
    paths = start_job(write_config(tmp_path, jpeg_folder))
    result = cli("status", "job", "--json")
    assert result.returncode == 0, result.stderr
    s = json.loads(result.stdout)
    assert s["state"] == "serving" and s["buffer"]["bound_bytes"] == 1 << 20
    assert {"rank", "epoch", "step", "ready"} <= set(s["ranks"][0])
    assert "produced_images_per_s" in s["rates"]
    text = cli("status").stdout
    assert "job: serving" in text and "rank" in text
    pids = daemon_family(paths)  # master, 1 worker, and multiprocessing's resource tracker
    workers = job_status(paths)["workers"]["pids"]
    assert len(workers) == 1 and set(workers) <= set(pids[1:])
    result = cli("stop", "job")
    assert result.returncode == 0 and "stopped" in result.stdout
    wait_pids_gone(pids)
    assert not paths.dir.exists()


def test_stop_keep_leaves_the_directory(tmp_path, jpeg_folder, job_root):
    paths = start_job(write_config(tmp_path, jpeg_folder))
    assert cli("stop", "job", "--keep").returncode == 0
    assert paths.batch_dir.exists() and not daemon_alive(paths)


def test_second_daemon_is_refused_and_does_not_disturb_the_first(tmp_path, jpeg_folder, job_root):
    cfg = write_config(tmp_path, jpeg_folder)
    paths = start_job(cfg)
    before = read_manifest(paths)
    result = cli("start", str(cfg))
    assert result.returncode != 0
    assert "already running" in result.stderr and f"pid {before['pid']}" in result.stderr
    assert "Traceback" not in result.stderr
    assert read_manifest(paths) == before and paths.socket.exists()
    assert job_status(paths)["pid"] == before["pid"]
    assert len(next(iter(PrefetchLoader("job", as_tensors=False)))["index"]) == 4


def test_client_for_a_job_that_is_not_running(job_root):
    started = time.monotonic()
    with pytest.raises(JobNotRunning, match="prefetchd start") as raised:
        PrefetchLoader("nothing-here")
    assert time.monotonic() - started < 3
    assert f"under {job_root} ($PREFETCHD_ROOT); no job is there" in str(raised.value)


def test_a_client_of_a_job_that_is_not_running_is_told_which_root_and_the_jobs_there(
    tmp_path, jpeg_folder, serve, monkeypatch
):
    serve(write_config(tmp_path, jpeg_folder, name="imagenet"))
    with pytest.raises(JobNotRunning) as raised:
        PrefetchLoader("imagnet")  # a typo
    assert "jobs there: imagenet;" in str(raised.value) and "($PREFETCHD_ROOT)" in str(raised.value)
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(JobNotRunning) as raised:
        PrefetchLoader("imagenet", root=elsewhere)
    assert f"under {elsewhere} (the root given); no job is there" in str(raised.value)
    monkeypatch.delenv("PREFETCHD_ROOT")
    with pytest.raises(JobNotRunning, match=r"\(the default; \$PREFETCHD_ROOT or root= name another\)"):
        PrefetchLoader(f"none-{os.getpid()}")  # under the user's real default root: a name nobody runs


def test_client_with_the_wrong_world_size_or_rank(tmp_path, jpeg_folder, serve, monkeypatch):
    serve(write_config(tmp_path, jpeg_folder, world_size=2))
    with pytest.raises(PlanMismatch, match="world size 3, .* world_size = 2"):
        PrefetchLoader("job", rank=0, world_size=3)
    with pytest.raises(PlanMismatch, match="rank 2 is outside"):
        PrefetchLoader("job", rank=2, world_size=2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert PrefetchLoader("job").rank == 1


def test_daemon_death_while_a_client_waits_raises_within_the_timeout(tmp_path, jpeg_folder, job_root):
    paths = start_job(write_config(tmp_path, jpeg_folder))
    pids = daemon_family(paths)
    master = pids[0]
    os.kill(master, signal.SIGSTOP)  # nothing more gets scheduled
    loader = PrefetchLoader("job", timeout=30, restart_grace=1, as_tensors=False)
    loader.load_state_dict({**loader.state_dict(), "epoch": 400})  # a batch that does not exist yet
    os.kill(master, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(DaemonDied, match="stopped while rank 0 waited"):
        next(iter(loader))
    assert time.monotonic() - started < 5
    wait_pids_gone(pids)  # the workers notice their master is gone and exit
    assert cli("stop", "job").returncode == 0  # cleans the stale directory
    assert not paths.dir.exists()


def test_user_pipeline_callable(tmp_path, jpeg_folder, job_root):
    (tmp_path / "mypipe.py").write_text(
        textwrap.dedent("""
        import numpy as np
        def make(source, rng):
            return {"feature": np.full((5,), source["index"], np.float32) + rng.random(5, dtype=np.float32),
                    "size": np.int32(len(source["path"]))}
    """)
    )
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[job]\nname="cb"\nbatch_size=4\n[[source]]\nkind="image_folder"\nroot="{jpeg_folder}"\n'
        '[pipeline]\ncallable="mypipe:make"\n'
    )
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = cli("start", str(cfg), "--workers", "1", env=env)
    assert result.returncode == 0, result.stderr
    batch = next(iter(PrefetchLoader("cb", as_tensors=False)))
    assert batch["feature"].shape == (4, 5) and batch["feature"].dtype == np.float32
    assert np.all(np.floor(batch["feature"][:, 0]) == batch["index"])
    assert batch["size"].dtype == np.int32
    assert cli("stop", "cb").returncode == 0


def test_worker_that_cannot_start_stops_the_daemon(tmp_path, jpeg_folder, job_root):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[job]\nname="cb"\n[[source]]\nkind="image_folder"\nroot="{jpeg_folder}"\n'
        '[pipeline]\ncallable="no_such_module_here:make"\n'
    )
    started = time.monotonic()
    result = cli("start", str(cfg), "--workers", "2")
    assert result.returncode == 5
    assert "a worker could not start" in result.stderr and "no_such_module_here" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 30
    assert list(job_root.iterdir()) == []


def test_foreground_daemon_stops_cleanly_on_sigint(tmp_path, jpeg_folder, job_root):
    cfg = write_config(tmp_path, jpeg_folder)
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefetchd", "start", str(cfg), "--foreground"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        paths = wait_until(lambda: _serving(job_root / "job"), timeout_s=30, what="foreground daemon serving")
        pids = daemon_family(paths)
        assert pids[0] == proc.pid
        assert len(next(iter(PrefetchLoader("job", as_tensors=False)))["index"]) == 4
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert "serving at" in stderr and "Traceback" not in stderr
    wait_pids_gone(pids)
    assert not paths.dir.exists()
    assert temp_leftovers() == []  # the worker server's socket folder too, though the command ends in os._exit


def _serving(job_dir):
    paths = JobPaths(job_dir)
    return paths if paths.manifest.exists() and daemon_alive(paths) else None


def test_stop_kills_a_daemon_that_does_not_answer(tmp_path, jpeg_folder, job_root):
    paths = start_job(write_config(tmp_path, jpeg_folder))
    pids = daemon_family(paths)
    os.kill(pids[0], signal.SIGSTOP)  # hung: cannot answer or exit
    started = time.monotonic()
    result = cli("stop", "job", "--timeout", "1")
    assert result.returncode == 0, result.stderr
    assert f"killed pid {pids[0]}" in result.stdout
    assert time.monotonic() - started < 15
    wait_pids_gone(pids)
    assert not paths.dir.exists()


def test_verify_regenerates_a_published_batch_bit_for_bit(tmp_path, jpeg_folder, serve):
    paths = serve(write_config(tmp_path, jpeg_folder, workers=2, seed=21)).paths
    wait_until(lambda: paths.batch(0, 3, 0).exists(), what="batch e0 s3 published")
    result = cli("verify", "job", "--epoch", "0", "--step", "3")
    assert result.returncode == 0, result.stderr
    assert "identical: e000000-s00000003-r0000.batch" in result.stdout
    missing = cli("verify", "job", "--epoch", "900", "--step", "0")  # beyond the window
    assert missing.returncode == 4 and "not in the buffer" in missing.stderr
    outside = cli("verify", "job", "--epoch", "0", "--step", "99")
    assert outside.returncode == 4 and "steps are 0..11" in outside.stderr
    # a tampered batch is caught: flip one pixel byte in place
    path = paths.batch(0, 3, 0)
    data = bytearray(path.read_bytes())
    data[4096 + 100] ^= 0xFF  # a byte of the first field (the header area is the first page)
    path.write_bytes(bytes(data))
    tampered = cli("verify", "job", "--epoch", "0", "--step", "3")
    assert tampered.returncode == 1 and "differs" in tampered.stderr


@pytest.mark.parametrize("policy", ["keep", "release"])
def test_a_gone_trainer_is_told_from_a_paused_one(tmp_path, jpeg_folder, serve, policy):
    paths = serve(write_config(tmp_path, jpeg_folder, buffer="200K"), {"on_trainer_exit": policy}).paths
    window = read_manifest(paths)["window_per_rank"]
    paused = PrefetchLoader("job", as_tensors=False)  # alive, reads nothing: a long evaluation
    wait_until(lambda: job_status(paths)["ranks"][0]["trainer"] == "alive", what="trainer seen alive")
    wait_until(lambda: len(batch_files(paths)) == window, what="window filled while paused")
    paused.close()  # this process is the trainer: ending the loader is its exit
    wait_until(lambda: job_status(paths)["ranks"][0]["trainer"] == "gone", what="trainer seen gone")
    if policy == "keep":
        assert len(batch_files(paths)) == window  # warm for the restart
    else:
        wait_until(lambda: batch_files(paths) == [], what="window released")
    back = PrefetchLoader("job", as_tensors=False)  # the restarted trainer
    assert sum(1 for _ in back) == 12
    wait_until(lambda: job_status(paths)["ranks"][0]["trainer"] == "alive", what="trainer seen alive again")
    back.close()


def test_the_fast_decoders_are_deterministic_and_hashed_apart_from_pillow(tmp_path, jpeg_folder, serve):
    config = write_config(tmp_path, jpeg_folder, seed=5)
    streams, hashes = {}, {}
    for name, decoder in [("fast1", "turbojpeg"), ("fast2", "turbojpeg"), ("whole", "simplejpeg"), ("pil", "pillow")]:
        job = serve(config, {"name": name, "decoder": decoder})
        hashes[name] = read_manifest(job.paths)["config_hash"]
        loader = PrefetchLoader(name, as_tensors=False, verify=True)
        streams[name] = [b["image"].copy() for b in loader]
        loader.close()
        job.stop()
    assert len(streams["fast1"]) == 12
    assert all(np.array_equal(a, b) for a, b in zip(streams["fast1"], streams["fast2"]))
    assert not all(np.array_equal(a, b) for a, b in zip(streams["fast1"], streams["pil"]))
    assert hashes["fast1"] == hashes["fast2"]
    assert len({hashes["fast1"], hashes["whole"], hashes["pil"]}) == 3  # a resume never mixes decoders
    bad = cli("start", str(config), "--decoder", "libjpeg")
    assert bad.returncode == 2 and "--decoder must be one of auto, pillow, simplejpeg, turbojpeg" in bad.stderr


def test_verify_mode_refuses_a_batch_whose_bytes_were_changed(tmp_path, jpeg_folder, serve):
    """The client's test mode recomputes the digest the worker recorded: one flipped bit in a
    published batch is a BatchFormatError naming the file, not a silently wrong step."""
    from prefetchd_client import BatchFormatError
    from prefetchd_client.batchfile import map_batch

    paths = serve(write_config(tmp_path, jpeg_folder)).paths
    first = paths.batch(0, 0, 0)
    wait_until(first.exists, what="first batch published")
    offset = map_batch(first, pin=False)[0]["fields"][0]["offset"]
    fd = os.open(first, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset + 5)
        os.pwrite(fd, bytes([byte[0] ^ 1]), offset + 5)
    finally:
        os.close(fd)
    loader = PrefetchLoader("job", as_tensors=False, verify=True)
    with pytest.raises(BatchFormatError, match=f"{first.name}.*do not match the digest"):
        next(iter(loader))
    loader.close()


def test_workers_run_below_the_trainer_one_thread_each(tmp_path, jpeg_folder, job_root):
    """Workers take [daemon] worker_nice (default 10), so a waking trainer thread gets a core first;
    and one thread each, whatever the shell set for the trainer (numpy's BLAS would start one per core)."""
    many = {name: "8" for name in ONE_THREAD_PER_PROCESS}
    started = cli("start", str(write_config(tmp_path, jpeg_folder, workers=2)), env=many)
    assert started.returncode == 0, started.stderr
    paths = JobPaths.of("job")
    # `start` returns once one worker has booted; a worker lowers itself as it boots.
    booted = lambda: all(w["ready"] for w in job_status(paths)["workers"]["each"])  # noqa: E731
    wait_until(booted, timeout_s=60, what="both workers booted")
    assert [w.nice() for w in workers_of(paths)] == [10, 10]
    master = psutil.Process(read_manifest(paths)["pid"])
    assert master.nice() == os.nice(0)  # the master is not lowered
    threads_of_many = master.num_threads()
    assert cli("stop", "job").returncode == 0
    paths = start_job(write_config(tmp_path, jpeg_folder, name="low", workers=1), "--worker-nice", "19")
    assert [w.nice() for w in workers_of(paths)] == [19]
    # The master, asked for 8 threads per runtime, runs as many threads as one started with 1 (the
    # test's environment): no BLAS pool of a thread per core beside its own. Counted, not read
    # from /proc/<pid>/environ: a daemon forked from `prefetchd start` shows the environment the
    # command was started with there. (The workers fork from a server whose threads they lose.)
    assert threads_of_many == psutil.Process(read_manifest(paths)["pid"]).num_threads()
    bad = cli("start", str(write_config(tmp_path, jpeg_folder, name="bad")), "--worker-nice", "25")
    assert bad.returncode == 2 and "worker_nice" in bad.stderr and "0 (as the trainer) to 19" in bad.stderr


HEAP_PROBE = """
import resource

import numpy as np

def make(source, rng):
    # Three 1 MiB buffers, each touched and freed, as a decode's are: the page faults of the last.
    # glibc's dynamic threshold serves it from the heap the first one was freed to (a handful);
    # a threshold fixed below it maps it afresh (256, one a page).
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        block = np.ones(1 << 20, np.uint8)
        del block
    return {"faults": np.array([resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before], np.int64)}
"""


@pytest.mark.parametrize("how", ["start", "start --foreground"])
def test_workers_keep_glibcs_dynamic_heap_the_master_fixes_its_own(tmp_path, jpeg_folder, job_root, monkeypatch, how):
    # The master's heap thresholds are fixed (a week-long run's memory stays flat, kernel.py); a
    # worker's must not be: its per-image buffers would each be mapped and faulted in again, 13-19 %
    # of its images/s. Both starts: the detached daemon forks the server, --foreground execs it.
    config = pipeline_job(tmp_path, jpeg_folder, monkeypatch, "heap_probe", HEAP_PROBE)
    if how == "start":
        start_job(config)
    else:
        daemon = subprocess.Popen([sys.executable, "-m", "prefetchd", "start", str(config), "--foreground"])
        wait_until(lambda: JobPaths.of("job").manifest.exists() or daemon.poll() is not None, 60, what="serving")
    try:
        faults = np.concatenate([b.arrays["faults"].ravel() for b in read_epoch("job")])
        assert len(faults) > 8 and faults.max() < 64, faults.tolist()
    finally:
        assert cli("stop", "job").returncode == 0
        if how != "start":
            assert daemon.wait(timeout=30) == 0
