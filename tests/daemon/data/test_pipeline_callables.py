"""A [pipeline] callable that misbehaves in ways beyond hanging (found by an attack run): it
crashes its worker every time, forks, drops a key, or is slow but progressing."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from prefetchd.cli.verify import verify_batch
from prefetchd.errors import ExitCode, JobError, UserError
from prefetchd_client import DaemonDied, PrefetchLoader
from tests.conftest import cli, wait_until
from tests.daemon.lifecycle.test_worker_liveness import digests, pipeline_job
from tests.helpers import job_status, read_epoch

pytestmark = pytest.mark.timeout(180)

PIPELINE = """
import os
import signal
import time

import numpy as np

def make(source, rng):
    i = source["index"]
    {body}
    return {{"pixels": np.full(8, i, np.int16) + rng.integers(0, 100, 8).astype(np.int16),
             "aux": np.full(2, i, np.int32)}}
"""


def job_with(tmp_path, data, monkeypatch, body: str, name: str = "job"):
    """The job's config; its module is found by a daemon `start` launches (PYTHONPATH) and by
    the workers of a job served in this process, which take this process's sys.path when they
    are forked (multiprocessing sends it with every process it starts)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return pipeline_job(tmp_path, data, monkeypatch, f"pipe_{name}", PIPELINE.format(body=body), name=name)


def test_a_sample_that_crashes_its_worker_every_time_stops_the_daemon_naming_the_batch(
    tmp_path, jpeg_folder, serve, monkeypatch
):
    # Below any restart rate: only the deaths of one batch can stop this loop.
    config = job_with(tmp_path, jpeg_folder, monkeypatch, "if i == 5: os.kill(os.getpid(), signal.SIGSEGV)")
    serve(config, {"max_worker_restarts": 1000})
    started = time.monotonic()
    with pytest.raises(DaemonDied, match="died 5 times"):
        read_epoch("job", timeout=60)
    print(f"\n[figure] a sample that crashes its worker: daemon stopped after {time.monotonic() - started:.1f} s")


def test_a_callable_that_forks_and_returns_in_both_processes_does_not_stop_the_daemon(
    tmp_path, jpeg_folder, serve, monkeypatch
):
    forked = tmp_path / "forked-pid"
    body = (
        f"if i == 5 and not os.path.exists({str(forked)!r}):\n"
        f"        if os.fork() == 0:\n"
        f"            open({str(forked)!r}, 'w').write(str(os.getpid()))"
    )
    # The child shares its worker's pipe; it may take tasks, or block forever on a lock the
    # fork copied held (the heartbeat's): then the worker's task stops moving, and the worker
    # is replaced after --worker-timeout.
    job = serve(job_with(tmp_path, jpeg_folder, monkeypatch, body), {"worker_timeout": 3})
    try:
        got = digests(read_epoch("job", epochs=2, timeout=60))
        assert "internal error" not in job.paths.log.read_text()
        job.stop()
    finally:
        text = forked.read_text() if forked.exists() else ""
        if text.isdigit() and int(text) > 1:  # the callable's child: not the daemon's to stop
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(text), signal.SIGKILL)
    serve(job_with(tmp_path, jpeg_folder, monkeypatch, "pass", name="ref"))
    assert got == digests(read_epoch("ref", epochs=2, timeout=40))


def test_a_key_left_out_by_a_later_sample_is_a_bad_sample_not_the_last_batchs_bytes(
    tmp_path, jpeg_folder, serve, monkeypatch
):
    body = "if i == 5:\n        return {'pixels': np.zeros(8, np.int16)}"
    paths = serve(job_with(tmp_path, jpeg_folder, monkeypatch, body)).paths
    loader = PrefetchLoader("job", as_tensors=False, verify=True, timeout=40)
    try:
        batches = [b for b in loader]
    finally:
        loader.close()
    assert 5 not in {int(i) for b in batches for i in b["index"]}  # replaced
    # Logged by the master once it hears the batch's report, which may come after the trainer
    # read the batch (published first): waited for, not assumed.
    wait_until(lambda: "returned keys" in paths.log.read_text(), timeout_s=10, what="the bad sample logged")
    for step in range(len(batches)):  # what `prefetchd verify` does (its command: test_daemon.py), here
        try:
            report = verify_batch(paths, 0, step, 0)
        except JobError as exc:
            assert "not in the buffer" in str(exc)  # consumed and deleted already
            continue
        assert report["identical"], report


def test_a_slow_but_progressing_worker_is_not_killed(tmp_path, jpeg_folder, serve, monkeypatch):
    # Each sample takes 80 % of --worker-timeout: progress is heard only once a heartbeat (1 s).
    config = job_with(tmp_path, jpeg_folder, monkeypatch, "if i < 12: time.sleep(1.6)")
    paths = serve(config, {"worker_timeout": 2, "batch_size": 2}).paths
    loader = PrefetchLoader("job", as_tensors=False, timeout=60)
    try:
        it = iter(loader)
        for _ in range(4):
            next(it)
    finally:
        loader.close()
    assert job_status(paths)["workers"]["restarts"] == 0, paths.log.read_text()


def test_a_bad_first_sample_is_replaced_when_the_batch_shapes_are_learnt(tmp_path, jpeg_folder, serve, monkeypatch):
    """issue 24 finding 9: the callable runs on sample 0 to learn the batch's shapes, and a bad
    sample 0 stopped `start` (exit 5, "a worker could not start: ValueError: ..."). Now it is
    replaced there as in a batch: the same draw, so every worker learns the same shapes, and the
    batches are those of a job where sample 0 alone is replaced."""
    bad = "if i == 0: raise ValueError('the sample has no label')"
    runs = {}
    for workers in (1, 3):
        config = job_with(tmp_path, jpeg_folder, monkeypatch, bad, name=f"bad{workers}")
        job = serve(config, {"workers": workers})
        runs[workers] = read_epoch(f"bad{workers}", epochs=2, with_meta=True, timeout=60)
        job.stop()
    assert digests(runs[1]) == digests(runs[3])
    serve(job_with(tmp_path, jpeg_folder, monkeypatch, "pass", name="good"))
    good = read_epoch("good", epochs=2, timeout=60)
    # Each sample's values are keyed by (seed, epoch, sample): a stand-in carries its own.
    made = {
        (b.epoch, i): (b.arrays["pixels"][s], b.arrays["aux"][s]) for b in good for s, i in enumerate(b.arrays["index"])
    }
    records = [r for b in runs[1] for r in b.meta["replaced"]]
    assert [r["index"] for r in records] == [0, 0]  # once an epoch
    assert all(r["error"] == "ValueError: the sample has no label" for r in records)
    for b in runs[1]:
        assert 0 not in b.arrays["index"].tolist()
        for s, i in enumerate(b.arrays["index"].tolist()):
            pixels, aux = made[(b.epoch, i)]
            assert (b.arrays["pixels"][s] == pixels).all() and (b.arrays["aux"][s] == aux).all()
    assert [r["replacement"] for r in records] == [
        int(b.arrays["index"][r["slot"]]) for b in runs[1] for r in b.meta["replaced"]
    ]


def test_a_callable_that_fails_on_every_sample_stops_start_with_its_words(tmp_path, jpeg_folder, serve, monkeypatch):
    # The same refusal through `prefetchd start`'s exit code and stderr: test_a_cause_with_newlines...
    config = job_with(tmp_path, jpeg_folder, monkeypatch, "raise ValueError(f'cannot decode sample {i}')")
    with pytest.raises(UserError) as refused:
        serve(config)
    assert refused.value.exit_code == ExitCode.WORKER_BOOT == 5, refused.value
    assert "ValueError: cannot decode sample 0" in str(refused.value), refused.value
    assert "10 replacements" in str(refused.value), refused.value


@pytest.mark.parametrize("raised", ["SystemExit(3)", "KeyboardInterrupt('stop')", "GeneratorExit('gen')"])
def test_an_exit_raised_by_the_callable_is_a_bad_sample_with_its_words(
    tmp_path, jpeg_folder, serve, monkeypatch, raised
):
    """Attack of issue 24 finding 4: these are no Exception, so `except Exception` let them end
    the worker; it died 5 times and the daemon stopped (exit 7) saying only "a [pipeline]
    callable that exits", never what it raised. The worker ignores SIGINT (the master decides),
    so a KeyboardInterrupt there is the callable's own."""
    name = "exit" + raised[0].lower()
    serve(job_with(tmp_path, jpeg_folder, monkeypatch, f"if i == 5: raise {raised}", name=name))
    records = [r for b in read_epoch(name, with_meta=True, timeout=60) for r in b.meta["replaced"]]
    kind = raised.partition("(")[0]
    assert [r["index"] for r in records] == [5], records
    assert f"pipe_{name}:make raised {kind}" in records[0]["error"], records


def test_a_cause_with_newlines_and_escapes_travels_as_one_line(tmp_path, jpeg_folder, serve, monkeypatch):
    """Attack of issue 24 finding 4: a cause is one line wherever it goes. A newline in it forged
    a line of daemon.log, and in a stop it cut the message: the worker's error travels as its
    last line, so `start` said "a worker could not start: <the cause's last line>", without
    the sample or its place. Control characters and unpaired surrogates are shown escaped."""
    cause = r"raise ValueError(f'{i}\nforged line\x1b[2J\udcff')"
    paths = serve(job_with(tmp_path, jpeg_folder, monkeypatch, f"if i == 5: {cause}", name="oneline")).paths
    records = [r for b in read_epoch("oneline", with_meta=True, timeout=60) for r in b.meta["replaced"]]
    assert [r["error"] for r in records] == [r"ValueError: 5\nforged line\x1b[2J\xff"], records

    def logged():  # the batch is in batches/ before its worker's report reaches the master, which logs it
        return [line for line in paths.log.read_text(errors="replace").splitlines() if "forged line" in line]

    lines = wait_until(logged, timeout_s=20, what="the bad sample's line in daemon.log")
    assert all("WARNING bad sample 5 (" in line for line in lines), lines  # none a line of its own
    # Through the real command: the cause, one line, in what `prefetchd start` prints.
    result = cli("start", str(job_with(tmp_path, jpeg_folder, monkeypatch, cause, name="oneline_stop")))
    assert result.returncode == 5, result.stderr
    assert "sample 0 (file " in result.stderr, result.stderr
    assert r"ValueError: 0\nforged line\x1b[2J\xff" in result.stderr, result.stderr


@pytest.mark.long  # ~30 s: a batch of 40,000 samples
def test_a_batch_with_thousands_of_long_causes_is_reported_and_counted(tmp_path, jpeg_folder, serve, monkeypatch):
    """Attack of issue 24 finding 4: a worker reports every replaced sample with its place and
    cause, and the master refuses a report over 16 MiB. 10,000 bad samples in a batch of 40,000,
    each with 300 characters of a CJK cause (\\uXXXX in JSON: 6 bytes each), made a 19.1 MB
    report: the master killed the worker after every batch (3 restarts in 3 batches), and status
    said "0 bad samples replaced", so --max-bad-rate could never stop the job. The details a
    report carries are bounded; every bad sample is still counted."""
    code = (
        "import numpy as np\n"
        "def make(source, rng):\n"
        "    i = source['index']\n"
        "    if i % 4 == 1:\n"
        "        raise ValueError(f'{i} ' + chr(0x5B57 + i % 1000) * 400)\n"
        "    return {'x': np.full(2, i, np.int32)}\n"
    )
    image = next(jpeg_folder.rglob("*.jpg"))
    (tmp_path / "train.txt").write_text(f"{image},0\n" * 40_000)
    monkeypatch.syspath_prepend(str(tmp_path))  # for the workers of a job served in this process
    config = pipeline_job(tmp_path, jpeg_folder, monkeypatch, "pipe_long_causes", code, name="long")
    text = config.read_text().replace("batch_size = 4", "batch_size = 40000")
    text = text.replace(
        f'kind = "image_folder"\nroot = "{jpeg_folder}"', f'kind = "file_list"\npath = "{tmp_path}/train.txt"'
    )
    config.write_text(text)
    paths = serve(config, {"buffer": "1G", "max_bad_rate": 0.5}).paths
    assert len(read_epoch("long", timeout=60)) == 1
    totals = wait_until(lambda: (t := job_status(paths)["totals"])["produced"] and t, timeout_s=30, what="a report")
    assert totals["bad_samples"] == 10_000 and totals["worker_restarts"] == 0, totals
    log = paths.log.read_text()
    assert "unreadable message from worker" not in log
    assert "ValueError: 1 " + chr(0x5B57 + 1) * 10 in log or "ValueError: 5 " in log  # the first causes, logged


def test_an_exception_whose_text_exits_is_still_a_bad_sample(tmp_path, jpeg_folder, serve, monkeypatch):
    """Attack of issue 24 finding 4: the cause is made with str(exc); an exception whose __str__
    raises SystemExit ended the worker there, 5 times, and the daemon stopped (exit 7)."""
    body = (
        "if i == 5:\n"
        "        class Mute(Exception):\n"
        "            def __str__(self):\n"
        "                raise SystemExit('no text')\n"
        "        raise Mute()"
    )
    serve(job_with(tmp_path, jpeg_folder, monkeypatch, body, name="mute"))
    records = [r for b in read_epoch("mute", with_meta=True, timeout=60) for r in b.meta["replaced"]]
    assert [(r["index"], r["error"]) for r in records] == [(5, "Mute: (its text could not be made)")], records
