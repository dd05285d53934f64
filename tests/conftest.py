"""Shared fixtures: real JPEG folders, a private job root on the real tmpfs, and teardown
that stops every daemon a test started (by its pid) and checks nothing is left behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import hypothesis
import psutil
import pytest

from prefetchd.cli.datagen import make_image_folder
from prefetchd.cli.launch import stop_job
from prefetchd.workers import ONE_THREAD_PER_PROCESS
from prefetchd_client.layout import JobPaths
from prefetchd_client.locks import daemon_alive
from prefetchd_client.manifest import read_manifest
from tests.crossusers import ALICE, MALLORY, User, ensure_user, python_for, remove_path

REPO = Path(__file__).resolve().parent.parent  # the checkout: examples/, configs/, docs/, build/
SHM = "/dev/shm"
JOB_ROOT_PREFIX = "prefetchd-test-"  # each test's private job root under SHM
# The trainers and commands the tests start run one BLAS thread each, as the daemon's processes
# do: numpy's thread per core spins ~0.1 s of CPU at each import, hundreds of times in a run.
os.environ.update(ONE_THREAD_PER_PROCESS)
# Property tests check what a function returns, not how fast: hypothesis's 200 ms deadline per
# example failed them on this 2-core machine when a soak or the benchmark ran beside the suite.
# A hang is still caught (pytest-timeout).
hypothesis.settings.register_profile("prefetchd", deadline=None)
hypothesis.settings.load_profile("prefetchd")


def pytest_collection_modifyitems(items):
    """The heavy tests first: each takes as long as dozens of others, and one that starts last
    keeps one test process busy while the other has nothing left to run."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)  # stable: otherwise as collected


@pytest.fixture(scope="session")
def jpeg_folder(tmp_path_factory) -> Path:
    """4 classes x 12 real JPEGs of 64-160 px."""
    return make_image_folder(tmp_path_factory.mktemp("data") / "train", classes=4, per_class=12, size=(64, 160))


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, options: str):
    """A tmpfs mounted at the new folder ``mount`` (``mount -o options``) while the block runs;
    the test is skipped where this machine cannot mount one."""
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs of its own: its statvfs counts every page the job holds, mapped or not."""
    with mounted_tmpfs(tmp_path / "shm", "size=4m,mode=700") as mount:
        yield mount


@pytest.fixture
def job_root(monkeypatch) -> Path:
    root = Path(tempfile.mkdtemp(prefix=JOB_ROOT_PREFIX, dir=SHM))
    monkeypatch.setenv("PREFETCHD_ROOT", str(root))
    # The daemons' own temporary folders (the worker server's socket folder, pymp-*) go here: one
    # a test kills with SIGKILL cannot remove its own, and /tmp would keep it.
    temp = Path(tempfile.mkdtemp(prefix=JOB_ROOT_PREFIX + "tmp-", dir=SHM))
    monkeypatch.setenv("TMPDIR", str(temp))
    cache = Path(tempfile.mkdtemp(prefix=JOB_ROOT_PREFIX + "cache-", dir=SHM))  # shard indexes
    monkeypatch.setenv("PREFETCHD_CACHE", str(cache))
    yield root
    remove_root(root)
    shutil.rmtree(temp, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture
def serve(job_root):
    """Start a job's master in this process (tests/inprocess.py): ``serve(config, overrides)``
    returns the serving InProcessJob; each is stopped when the test ends, before its root goes."""
    from tests.inprocess import master_in_process

    with contextlib.ExitStack() as jobs:

        def start(config, overrides=None, **kwargs):
            return jobs.enter_context(master_in_process(config, overrides, **kwargs))

        yield start


@pytest.fixture
def node_roots(job_root) -> list[Path]:
    """Two job roots, as two nodes would have: the default one and a second, both removed after."""
    second = Path(tempfile.mkdtemp(prefix=JOB_ROOT_PREFIX, dir=SHM))
    yield [job_root, second]
    remove_root(second)


def remove_root(root: Path) -> None:
    """Stop what the test started under ``root`` (by the pids in its manifests), prove it is all
    gone, and remove the root."""
    for job in root.iterdir() if root.exists() else []:
        paths = JobPaths(job)
        if daemon_alive(paths):
            pids = daemon_family(paths)
            stop_job(paths, timeout_s=5)
            wait_pids_gone(pids)
    shutil.rmtree(root, ignore_errors=True)


def daemon_family(paths: JobPaths) -> list[int]:
    try:
        master = psutil.Process(read_manifest(paths)["pid"])
        return [master.pid] + [c.pid for c in master.children(recursive=True)]
    except (OSError, ValueError, KeyError, psutil.Error):
        return []


def wait_pids_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    _, alive = psutil.wait_procs([p for p in map(_proc, pids) if p], timeout=timeout_s)
    assert not alive, f"processes still alive: {[p.pid for p in alive]}"


def _proc(pid: int):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def write_config(
    folder: Path,
    data: Path | str,
    *,
    name: str = "job",
    batch_size: int = 4,
    world_size: int = 1,
    buffer: str = "1M",
    workers: int = 1,
    seed: int = 0,
    size: int = 32,
    extra: str = "",
    source: str | None = None,
) -> Path:
    """A job config; ``source``: the [[source]] table's keys (TOML lines), instead of an
    image_folder at ``data``."""
    source = f'kind = "image_folder"\nroot = "{data}"' if source is None else source
    path = folder / f"{name}.toml"
    path.write_text(
        textwrap.dedent(f"""\
        [job]
        name = "{name}"
        seed = {seed}
        world_size = {world_size}
        batch_size = {batch_size}

        [daemon]
        buffer = "{buffer}"
        workers = {workers}

        [[source]]
        {{source}}

        [[transform]]
        op = "random_resized_crop"
        size = {size}

        [[transform]]
        op = "hflip"
        """).replace("{source}", source)
        + extra
    )
    return path


def cli(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `prefetchd` command in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "prefetchd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def start_job(config: Path, *flags: str) -> JobPaths:
    result = cli("start", str(config), *flags)
    assert result.returncode == 0, result.stderr
    job_dir = next(line.split(": ", 1)[1] for line in result.stdout.splitlines() if line.startswith("job dir:"))
    return JobPaths(Path(job_dir))


def wait_until(condition, timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "condition"):
    """Poll ``condition`` until it returns something truthy; fail after the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


# -- two real users of one node (tests/crossusers.py) -----------------------------------------


@pytest.fixture(scope="session")
def users():
    """alice (the victim) and mallory (another user of the node), as real unprivileged users."""
    if os.geteuid() != 0:
        pytest.skip("the cross-user tests create two unprivileged users, which needs root")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is missing: cannot create the two unprivileged users")
    ids = {name: ensure_user(name) for name in (ALICE, MALLORY)}
    with python_for(*ids[ALICE]) as (python, env):
        yield {name: User(name, uid, gid, python, env) for name, (uid, gid) in ids.items()}


@pytest.fixture(scope="session")
def shared_data():
    """A data folder and a config folder every user can read (pytest's tmp_path is root's, 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="pfd-shared-", dir="/tmp"))
    folder.chmod(0o755)
    data = make_image_folder(folder / "train", classes=2, per_class=6, size=(32, 48))
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    config = write_config(folder, data, buffer="256K")
    config.chmod(0o644)
    yield config
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def alice_root(users):
    """alice's default root, absent before the test and removed after it, whoever made it."""
    root = users[ALICE].default_root
    remove_path(root)
    yield root
    remove_path(root)


@pytest.fixture
def processes():
    """Processes a test starts: each ended (by its pid) and reaped at teardown."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
