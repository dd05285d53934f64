"""The layering rules of the design, checked on the real modules."""

import re
import subprocess
import sys

from tests.conftest import REPO

DAEMON_MODULES = [
    "prefetchd.cli.app",
    "prefetchd.master.daemon",
    "prefetchd.master.loop",
    "prefetchd.workers.worker",
    "prefetchd.cli.demo",
]


def imported_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return {m.split(".")[0] for m in out.split()}


def test_the_daemon_never_imports_torch():
    modules = imported_after("\n".join(f"import {m}" for m in DAEMON_MODULES))
    assert "prefetchd" in modules and "torch" not in modules


def test_the_master_loads_no_image_library_and_the_launch_nothing_of_prefetchd_but_its_own():
    """What a detached daemon imports before it serves is a cold start's path: the worker side's
    Pillow and decoders are the fork server's (preloaded beside it), psutil is only for
    --node-cpus. And `prefetchd start` launches its daemon before any import of its own but the
    launch's (cli.daemonlaunch: the standard library and prefetchd's top package)."""
    master = imported_after("import prefetchd.master.daemon, prefetchd.config, prefetchd.master.startup")
    assert not {"PIL", "cv2", "simplejpeg", "turbojpeg", "psutil", "torch"} & master
    launch = imported_after("import prefetchd.stopsignals, prefetchd.cli.daemonlaunch")
    assert not {"numpy", "zmq", "typer", "rich", "PIL"} & launch


def test_the_client_needs_only_numpy_and_pyzmq():
    modules = imported_after("from prefetchd_client import PrefetchLoader")
    assert {"numpy", "zmq"} <= modules
    assert not {"torch", "PIL", "prefetchd", "watchdog", "typer"} & modules


def test_workers_and_the_command_pay_nothing_for_the_loader():
    """The package's names load on first use: a worker and `prefetchd start` import parts of the
    client (the batch format, the job's folders), never the loader, ZeroMQ's asyncio or Ray."""
    for code in ("import prefetchd.workers.worker", "import prefetchd.cli.app, prefetchd.cli.launch"):
        modules = imported_after(code)
        assert not {"asyncio", "torch", "ray"} & modules, code
    assert "zmq" not in imported_after("import prefetchd.workers.worker")


def test_stop_and_status_load_no_numpy_or_pillow():
    """Only `start` reads a config (numpy, Pillow: ~0.3 s of CPU at each command): `stop` and
    `status`, which tests and scripts run after every job, go without (0.85 s -> 0.55 s here)."""
    modules = imported_after("import prefetchd.cli.app, prefetchd.cli.launch")
    assert not {"numpy", "PIL"} & modules


def test_a_start_reads_its_config_without_opencv(tmp_path):
    """`prefetchd start` checks the decoder is installed without importing it: OpenCV alone is
    ~0.2 s of CPU (the command's 0.66 -> 0.52 s here); the workers import it when they boot."""
    for decoder in ("auto", "simplejpeg", "turbojpeg"):
        flags = {"data": str(tmp_path), "decoder": decoder}
        code = f"from prefetchd.config import load_config\nload_config(None, {flags!r})"
        assert not {"cv2", "simplejpeg"} & imported_after(code), decoder


def test_a_command_loads_no_pydantic():
    """typer 0.29 builds every parameter through pydantic: +0.2 s of CPU at each `prefetchd` call
    (stop 0.44 -> 0.28 s, start 0.88 -> 0.66 s of the command's CPU without it), which tests,
    scripts and `start` pay. pyproject.toml keeps typer below 0.29; this fails if one comes in."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "prefetchd", "status", "no-such-job"],
        capture_output=True, text=True, timeout=60,
    )
    assert "no such job" in result.stderr or "no job" in result.stderr, result.stderr[-2000:]
    assert "| pydantic" not in result.stderr


def test_no_pickle_where_a_peer_can_write():
    pattern = re.compile(r"import pickle|cPickle|recv_pyobj|send_pyobj|allow_pickle\s*=\s*True|torch\.load\(")
    offenders = [
        f"{path.relative_to(REPO)}:{i}"
        for folder in ("prefetchd", "client")
        for path in (REPO / folder).rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
