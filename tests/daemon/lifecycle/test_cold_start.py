"""Attacks on the cold start (a daemon launched before its job is known, workers forked from a
preloaded fork server, decoder = "turbojpeg"): a command that goes away or stops, a fork server
that is killed or stopped, hostile JPEG content. Nothing may be left running, nothing may hang,
and hostile content is a bad sample like any other."""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from PIL import Image

from prefetchd.cli import daemonlaunch, launch
from prefetchd.cli.datagen import make_image_folder
from prefetchd.config import load_config
from prefetchd.workers import roidecode, tjlib, workerserver
from prefetchd.workers.transforms import ImagePipeline
from prefetchd_client.layout import JobPaths
from prefetchd_client.locks import daemon_alive
from prefetchd_client.manifest import read_manifest
from tests.conftest import cli, start_job, wait_until, write_config
from tests.helpers import job_status, read_epoch, session, temp_leftovers

pytestmark = pytest.mark.timeout(120)


def family(pid: int) -> list[psutil.Process]:
    """``pid`` and every process below it (the daemon, its resource tracker, fork server, workers)."""
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


def gone(procs: list[psutil.Process]) -> bool:
    """All exited (a zombie whose parent is gone counts: nothing of it runs)."""
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:  # gone
            pass
    return True


def fork_server_of(daemon_pid: int) -> psutil.Process:
    def live_server():
        try:
            children = psutil.Process(daemon_pid).children()
        except psutil.NoSuchProcess:
            logs = list(Path(os.environ["PREFETCHD_ROOT"]).glob("*/daemon.log"))
            said = logs[0].read_text()[-3000:] if logs else "(no log)"
            raise AssertionError(f"the daemon (pid {daemon_pid}) is gone; its log ends:\n{said}") from None
        for child in children:
            try:
                if child.status() != psutil.STATUS_ZOMBIE and child.name() == workerserver.SERVER_NAME.decode():
                    return child
            except psutil.Error:  # the one just killed
                pass
        return None

    return wait_until(live_server, what="the daemon's fork server")


# -- the command's own descriptors ------------------------------------------------------------


@pytest.mark.parametrize("closed", ["<&- >&-", ">&-", "<&- >&- 2>&-"])
def test_a_start_with_its_stdio_closed_serves_and_says_so(tmp_path, jpeg_folder, job_root, closed):
    # Attack of the early launch: with stdin and stdout closed, the ready pipe the command opened
    # took descriptors 0 and 1, the daemon's stdout overwrote it, and `start` waited 30 s for a
    # line that went to the job's log, killed a serving daemon and left its folder (exit 1);
    # with stdout alone closed, it served but the command's last flush failed (a traceback, exit 1).
    config = write_config(tmp_path, jpeg_folder)
    command = f"{sys.executable} -m prefetchd start {config} {closed}; echo $? > {tmp_path / 'rc'}"
    subprocess.run(["bash", "-c", command], timeout=60, capture_output=True)
    assert (tmp_path / "rc").read_text().strip() == "0"
    paths = JobPaths.of("job")
    assert daemon_alive(paths) and job_status(paths)["workers"]["restarts"] == 0
    assert cli("stop", "job").returncode == 0 and list(job_root.iterdir()) == []


def test_the_daemon_and_its_processes_hold_no_descriptor_of_the_command(tmp_path, jpeg_folder, job_root):
    # Attack of the forked launch: a descriptor the command inherited above its soft limit (a
    # shell's `exec 100>&1`, then `ulimit -Sn 64`) stayed open in the daemon, its server and its
    # workers, which the old exec never let through; `$(prefetchd start ...)` then hung for the
    # job's whole life, its pipe held open. And 3..40 below the limit.
    config = write_config(tmp_path, jpeg_folder, workers=1)
    marker = tmp_path / "held-by-the-command"
    script = tmp_path / "start.sh"
    script.write_text(
        f'exec 100>"{marker}"\nfor fd in $(seq 3 40); do eval "exec $fd<{config}"; done\nulimit -Sn 64\n'
        f"{sys.executable} -m prefetchd start {config}\n"
    )
    # Captured as $(...) captures: returns only once every holder of the pipe has closed it.
    out = subprocess.run(["bash", "-c", f'out=$(bash {script}); echo "$out"'], timeout=60, capture_output=True)
    assert out.returncode == 0 and "serving" in out.stdout.decode(), out.stderr.decode()[-2000:]
    paths = JobPaths.of("job")
    wait_until(lambda: all(w["ready"] for w in job_status(paths)["workers"]["each"]), 60, what="the worker booted")
    daemon = psutil.Process(read_manifest(paths)["pid"])
    for proc in (daemon, *daemon.children(recursive=True)):
        held = set()
        for fd in os.listdir(f"/proc/{proc.pid}/fd"):
            with contextlib.suppress(FileNotFoundError):  # a batch's descriptor, closed since the listing
                held.add(os.readlink(f"/proc/{proc.pid}/fd/{fd}"))
        assert not held & {str(marker), str(config)}, f"{proc.name()} ({proc.pid}) holds {sorted(held)}"
    assert cli("stop", "job").returncode == 0


def test_a_command_with_a_second_thread_execs_its_daemon_rather_than_fork_it(tmp_path, jpeg_folder, job_root):
    # Attack of the forked launch: a thread a sitecustomize starts (an agent warming up numpy)
    # held numpy's import lock at the fork, and the forked daemon waited on it for ever (`start`
    # for 600 s; 4 of 4 tries). With a second thread the command execs its daemon, and the daemon
    # (which runs the same sitecustomize) execs its worker server.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
    )
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    started = cli("start", str(write_config(tmp_path, jpeg_folder, workers=1)), env=env)
    assert started.returncode == 0, started.stderr
    daemon = psutil.Process(read_manifest(JobPaths.of("job"))["pid"])
    assert "--ready-fd" in daemon.cmdline(), daemon.cmdline()  # exec'd: `python -c ... --ready-fd N`
    assert len(read_epoch("job")) > 0
    assert cli("stop", "job").returncode == 0


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root's unshare -m")
@pytest.mark.parametrize("flags", ["", "--foreground"])
def test_no_writable_temporary_folder_is_one_line_and_nothing_left(tmp_path, jpeg_folder, job_root, flags):
    # Attack of the forked launch: with every temporary folder read-only, `start --foreground`
    # printed a traceback (the worker server's socket folder), and a detached start said the
    # process limit might be used up.
    config = write_config(tmp_path, jpeg_folder)
    readonly = "; ".join(f"mount --bind {d} {d} && mount -o remount,ro,bind {d}" for d in ("/tmp", "/var/tmp"))
    script = f"{readonly} || exit 99; cd /var/tmp && exec {sys.executable} -m prefetchd start {config} {flags}"
    env = {k: v for k, v in os.environ.items() if k not in ("TMPDIR", "TEMP", "TMP")}
    done = subprocess.run(["unshare", "-m", "bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    if done.returncode == 99:
        pytest.skip(f"no read-only bind mounts here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 4, done.stderr
    assert "No usable temporary directory" in done.stderr and "TMPDIR" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert list(job_root.iterdir()) == []


# -- the command goes away: the launched daemon must not stay -----------------------------


def test_a_daemon_whose_command_never_sends_the_job_gives_up_and_says_why(monkeypatch):
    # As a `prefetchd start` stopped (Ctrl-Z, SIGSTOP) before it sent the job: the daemon, its
    # fork server and resource tracker must not wait for it for ever.
    entry = "import sys, prefetchd.master.daemon as d; d.ORDER_TIMEOUT_S = 1.5; sys.exit(d.main())"
    monkeypatch.setattr(daemonlaunch, "_DAEMON_ENTRY", entry)
    daemon = launch.DaemonLaunch()
    try:
        line = launch._read_line(daemon.ready_fd, 30.0)
        assert line is not None, "the daemon still waits for its job"
        message = json.loads(line)
        assert message["ok"] is False and message["error"]["exit_code"] == 4
        assert "sent no job within 2 s" in message["error"]["message"]
        assert daemon.proc.wait(timeout=30) == 4
        wait_until(lambda: not session(daemon.proc.pid), timeout_s=20, what="the daemon's session to end")
    finally:
        daemon.cancel()


@pytest.mark.parametrize("keep", [False, True])
def test_a_start_whose_command_is_gone_before_ready_is_undone(tmp_path, jpeg_folder, job_root, keep):
    # `prefetchd start` killed (or Ctrl-C) after it sent the job, before the daemon was ready:
    # its end of the ready pipe closes. The user saw no job start: none may serve.
    config = load_config(write_config(tmp_path, jpeg_folder, workers=2))
    paths = JobPaths(job_root / "job")
    daemon = launch.DaemonLaunch()
    try:
        daemon.send(config, paths, keep)
        os.close(daemon.ready_fd)
        daemon.ready_fd = -1
        assert daemon.proc.wait(timeout=60) == 4
        wait_until(lambda: not session(daemon.proc.pid), timeout_s=20, what="the daemon's session to end")
        assert not paths.dir.exists(), sorted(p.name for p in paths.dir.iterdir())
        assert cli("start", str(write_config(tmp_path, jpeg_folder)), "--workers", "1").returncode == 0
    finally:
        daemon.cancel()


@pytest.mark.parametrize("flags", [["--workers", "many"], ["--help"]])
def test_a_start_that_never_hands_over_its_daemon_leaves_no_temporary_folder(tmp_path, jpeg_folder, job_root, flags):
    # The daemon launched early boots a worker server, whose socket folder (pymp-*) lives in
    # $TMPDIR; the unused daemon is ended through its exit hooks, which remove it.
    result = cli("start", str(write_config(tmp_path, jpeg_folder)), *flags)
    assert result.returncode == (0 if flags == ["--help"] else 2), result.stderr
    assert temp_leftovers() == []
    assert list(job_root.iterdir()) == []


def test_a_tmpdir_too_long_for_a_socket_path_does_not_stop_start(tmp_path, jpeg_folder, job_root):
    # A batch scheduler's per-job $TMPDIR can be longer than a socket path may be (107 bytes).
    long = tmp_path / ("t" * 80)
    long.mkdir()
    result = cli("start", str(write_config(tmp_path, jpeg_folder)), env={"TMPDIR": str(long)})
    assert result.returncode == 0, result.stderr
    assert len(read_epoch("job")) == 12
    assert cli("stop", "job").returncode == 0
    assert list(long.iterdir()) == []


# -- the fork server: stopped, killed ----------------------------------------------------


def test_a_stopped_fork_server_dies_with_a_killed_daemon(tmp_path, jpeg_folder, job_root):
    paths = start_job(write_config(tmp_path, jpeg_folder, workers=2))
    daemon = read_manifest(paths)["pid"]
    server = fork_server_of(daemon)
    wait_until(lambda: len(server.children()) == 2, what="two workers")
    procs = family(daemon)
    server.send_signal(signal.SIGSTOP)
    try:
        os.kill(daemon, signal.SIGKILL)
        wait_until(lambda: gone(procs), timeout_s=30, what="fork server, workers and resource tracker to end")
    finally:
        if server.is_running():
            server.send_signal(signal.SIGCONT)
    # The daemon's main thread shows as a zombie while its other threads still exit, and they
    # share the file table that holds the lock: the kernel drops it once the last one is gone.
    wait_until(lambda: not daemon_alive(paths), timeout_s=10, what="the killed daemon's lock to be released")


# Long tier for now: in the full suite at -n 2 it timed out waiting for the replacements in 2 of 3
# runs on the development machine (never alone, nor alone under 4 busy loops); cause not found yet.
@pytest.mark.long
def test_a_stopped_fork_server_is_replaced_and_batches_stay_identical(tmp_path, jpeg_folder, serve):
    # In this process the fork server is the test process's own worker server (tests/inprocess.py).
    config = write_config(tmp_path, jpeg_folder, workers=2, batch_size=4)
    job = serve(config, {"worker_timeout": 2})
    paths = job.paths
    daemon = read_manifest(paths)["pid"]
    server = fork_server_of(daemon)
    workers = wait_until(lambda: len(server.children()) == 2 and server.children(), what="two workers")
    server.send_signal(signal.SIGSTOP)  # a spawn would block on it, and a death go unreported
    try:
        workers[0].kill()
        # Both replaced; the restart budget charges their fork server's death once (pool.charge_death).
        wait_until(lambda: job_status(paths)["totals"]["worker_restarts"] >= 2, timeout_s=30, what="workers replaced")
    finally:
        if server.is_running():
            server.send_signal(signal.SIGCONT)
    assert fork_server_of(daemon).pid != server.pid
    first = read_epoch("job", batch_size=4)
    assert daemon_alive(paths)
    job.stop()
    serve(config)
    again = read_epoch("job", batch_size=4)
    assert len(first) == len(again) == 12
    assert all(np.array_equal(a.arrays["image"], b.arrays["image"]) for a, b in zip(first, again))


def test_a_killed_fork_server_and_worker_are_replaced_without_stopping_the_daemon(tmp_path, jpeg_folder, serve):
    # In this process the fork server is the test process's own worker server (tests/inprocess.py).
    job = serve(write_config(tmp_path, jpeg_folder, workers=2, batch_size=4))
    paths = job.paths
    daemon = read_manifest(paths)["pid"]
    for _ in range(3):  # again at once: workers that die with their server while booting are no boot failure
        server = fork_server_of(daemon)
        server.kill()
        wait_until(lambda old=server.pid: fork_server_of(daemon).pid != old, timeout_s=30, what="a new fork server")
    new = fork_server_of(daemon)
    workers = wait_until(lambda: len(new.children()) == 2 and new.children(), timeout_s=30, what="new workers")
    workers[0].kill()
    wait_until(lambda: workers[0].pid not in job_status(paths)["workers"]["pids"], timeout_s=30, what="replaced")
    batches = read_epoch("job", batch_size=4)
    assert len(batches) == 12 and daemon_alive(paths) and job.exit_code is None
    result = cli("verify", "job", "--epoch", "0", "--step", "11")
    assert result.returncode == 0, result.stderr


def test_a_killed_fork_server_counts_once_against_the_restart_budget_however_many_workers_die(
    tmp_path, jpeg_folder, serve
):
    # 4 workers die with their server; a budget of 2 restarts would stop the daemon (exit 7)
    # were each counted: on a 40-core node a single kill of the server would stop it.
    job = serve(write_config(tmp_path, jpeg_folder, workers=4, batch_size=4), {"max_worker_restarts": 2})
    paths = job.paths
    daemon = read_manifest(paths)["pid"]
    server = fork_server_of(daemon)
    wait_until(lambda: len(server.children()) == 4, timeout_s=30, what="four workers")
    first = set(job_status(paths)["workers"]["pids"])
    server.kill()

    def replaced():
        s = job_status(paths)
        return s if s["totals"]["worker_restarts"] == 4 and first.isdisjoint(s["workers"]["pids"]) else None

    status = wait_until(replaced, timeout_s=30, what="four workers replaced")
    assert status["totals"]["worker_restarts"] == 4 and status["workers"]["restarts"] == 1
    assert len(read_epoch("job", batch_size=4)) == 12 and daemon_alive(paths) and job.exit_code is None


# -- hostile JPEG content ------------------------------------------------------------------

_QUALITY, _SUBSAMP, _PRECISION, _PROGRESSIVE, _ARITHMETIC, _LOSSLESS = 3, 4, 7, 12, 14, 15


def tj_encode(w: int, h: int, params=(), bits: int = 8) -> bytes:
    """A JPEG made by libjpeg-turbo itself (arithmetic, lossless, 12-bit: what Pillow cannot write)."""
    tjlib.load()
    lib = tjlib.lib
    out_args = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    for fn in (lib.tj3Compress8, lib.tj3Compress12):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int] * 4, *out_args]
    lib.tj3Free.argtypes = [ctypes.c_void_p]
    handle = lib.tj3Init(0)
    lib.tj3Set(handle, _QUALITY, 90)
    lib.tj3Set(handle, _SUBSAMP, 2)
    for key, value in params:
        lib.tj3Set(handle, key, value)
    rng = np.random.default_rng(0)
    if bits == 12:
        lib.tj3Set(handle, _PRECISION, 12)
        pixels, encode = rng.integers(0, 4096, (h, w, 3), dtype=np.uint16), lib.tj3Compress12
    else:
        pixels, encode = rng.integers(0, 256, (h, w, 3), dtype=np.uint8), lib.tj3Compress8
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    try:
        assert encode(handle, pixels.ctypes.data, w, 0, h, 0, ctypes.byref(buf), ctypes.byref(size)) == 0
        return ctypes.string_at(buf, size.value)
    finally:
        lib.tj3Free(buf)
        lib.tj3Destroy(handle)


def with_size(data: bytes, w: int, h: int) -> bytes:
    """``data`` with every frame header (SOFn) claiming w x h."""
    d, i = bytearray(data), 2
    while i + 9 < len(d) and d[i] == 0xFF:
        marker, length = d[i + 1], struct.unpack(">H", d[i + 2 : i + 4])[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            d[i + 5 : i + 9] = struct.pack(">HH", h, w)
        if marker == 0xDA:
            break
        i += 2 + length
    return bytes(d)


def scan_bomb(w: int, h: int, scans: int) -> bytes:
    """A small progressive JPEG claiming w x h, its last scan repeated: every scan costs a pass
    over the whole image in a decoder without a scan limit (Pillow's)."""
    prog = with_size(tj_encode(16, 16, [(_PROGRESSIVE, 1)]), w, h)
    last = prog[prog.rfind(b"\xff\xda") : -2]
    return prog[:-2] + last * scans + b"\xff\xd9"


def pil_jpeg(w: int, h: int, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    pixels = np.random.default_rng(1).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(pixels).convert(mode).save(out, "JPEG")
    return out.getvalue()


def hostile_files() -> dict[str, bytes]:
    base = pil_jpeg(64, 48)
    png = io.BytesIO()
    Image.new("RGB", (20, 20), "red").save(png, "PNG")
    return {
        "bomb_65500": with_size(base, 65500, 65500),
        "lies_9000": with_size(base, 9000, 9000),
        "lies_small": with_size(pil_jpeg(256, 256), 16, 16),
        "wide_65000x1": tj_encode(65000, 1),
        "one_px": tj_encode(1, 1),
        "truncated": base[: len(base) // 2],
        "soi_garbage": b"\xff\xd8" + bytes(np.random.default_rng(2).integers(0, 256, 3000, dtype=np.uint8)),
        "zero": b"",
        "png": png.getvalue(),
        "scan_bomb": scan_bomb(9000, 9000, 5000),
        "bits12": tj_encode(64, 48, bits=12),
        "cmyk": pil_jpeg(64, 48, "CMYK"),
        "arithmetic": tj_encode(64, 48, [(_ARITHMETIC, 1)]),
        "lossless": tj_encode(64, 48, [(_LOSSLESS, 1)]),
    }


@pytest.mark.parametrize("decoder", ["turbojpeg", "simplejpeg", "pillow"])
def test_a_scan_bomb_is_refused_by_every_decoder(tmp_path, decoder):
    # Pillow spends ~30 s on this 240 KB file (5,000 scans of 9000 x 9000): past a worker's
    # timeout, it would stop the daemon instead of being one bad sample.
    path = tmp_path / "bomb.jpg"
    path.write_bytes(scan_bomb(9000, 9000, 5000))
    pipe = ImagePipeline([{"op": "random_resized_crop", "size": 32}], decoder=decoder)
    started = time.monotonic()
    with pytest.raises(Image.DecompressionBombError, match="more than 500 scans"):
        pipe.apply(str(path), np.random.default_rng(0), np.zeros(pipe.output_shape, np.uint8), path.read_bytes())
    assert time.monotonic() - started < 5
    if decoder != "turbojpeg":
        return
    ordinary = tj_encode(64, 64, [(_PROGRESSIVE, 1)])  # a progressive file of ~10 scans decodes
    size = roidecode.jpeg_size(ordinary)
    assert roidecode.decode_resampled(ordinary, size, (0, 0, 64, 64), 32, 32).shape == (32, 32, 3)


@pytest.mark.parametrize("decoder", ["turbojpeg", "auto"])
def test_hostile_jpegs_are_bad_samples_and_every_rank_gets_its_batches(tmp_path, job_root, serve, decoder):
    data = make_image_folder(tmp_path / "data", classes=2, per_class=9, size=(40, 80), seed=5)
    hostile = hostile_files()
    for n, (name, content) in enumerate(hostile.items()):
        (data / f"class_0{n % 2}" / f"{name}.jpg").write_bytes(content)
    config = write_config(tmp_path, data, batch_size=4, world_size=2, workers=2, buffer="4M")
    os.mkfifo(data / "class_01" / "fifo.jpg")  # refused at the start: it would block its reader
    refused = cli("start", str(config), "--decoder", decoder)  # the command's exit code and words
    assert refused.returncode == 3 and "FIFO, not a regular file" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and list(job_root.iterdir()) == []
    (data / "class_01" / "fifo.jpg").unlink()
    os.symlink(data / "class_00" / "img_0000.jpg", data / "class_01" / "link.jpg")  # a sample, as in torchvision
    samples = 18 + len(hostile) + 1
    paths = serve(config, {"decoder": decoder, "worker_timeout": 20}).paths
    per_rank = samples // 8
    runs = [read_epoch("job", rank=r, world_size=2, batch_size=4, with_meta=True) for r in (0, 1)]
    assert [len(r) for r in runs] == [per_rank, per_rank]
    replaced = {os.path.basename(x["path"]) for run in runs for b in run for x in b.meta["replaced"]}
    unreadable = {"bomb_65500", "truncated", "soi_garbage", "zero", "scan_bomb", "bits12"}
    assert replaced <= {f"{n}.jpg" for n in unreadable}, replaced
    status = job_status(paths)
    assert daemon_alive(paths) and status["workers"]["restarts"] == 0
