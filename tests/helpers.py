"""Helpers the daemon tests share: read an epoch through the real client, ask a live daemon for
its status, find its worker processes. (Fixtures and the `prefetchd` runner are in conftest.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from prefetchd import control
from prefetchd_client import PrefetchLoader
from prefetchd_client.batchfile import map_batch
from prefetchd_client.layout import JobPaths
from prefetchd_client.manifest import read_manifest
from tests.conftest import cli


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (bound and released; another
    process may take it before the test does, which the tests that use it tolerate)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ReadBatch:
    epoch: int
    step: int
    arrays: dict[str, np.ndarray]  # copies, valid after the loader is closed
    meta: dict | None  # the batch header's meta, when asked for


def importing_first(folder: Path) -> dict:
    """The environment change that makes a child Python import from ``folder`` before anything
    installed (a hostile or broken package planted there)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def without_modules(folder: Path, *names: str) -> dict:
    """The environment change that makes ``names`` absent from a child Python: a sitecustomize
    (which `site` runs at every start) in ``folder`` marks them so in sys.modules, so both
    ``import`` and ``find_spec`` say they are missing, in that process and in those it starts."""
    folder.mkdir(parents=True, exist_ok=True)
    absent = "".join(f"sys.modules[{name!r}] = None\n" for name in names)
    (folder / "sitecustomize.py").write_text(f"import sys\n\n{absent}")
    return importing_first(folder)


def read_epoch(
    job: str,
    *,
    epochs: int = 1,
    rank: int | None = None,
    world_size: int | None = None,
    batch_size: int | None = None,
    with_meta: bool = False,
    timeout: float = 60.0,
    **loader_options,
) -> list[ReadBatch]:
    """Every batch of ``epochs`` epochs from the loader's start, read by a real PrefetchLoader as a
    trainer would (numpy arrays). ``batch_size`` checks that every batch has that many samples;
    ``with_meta`` also reads each batch file's header meta while the batch is still in the buffer
    (the daemon keeps ``retain`` consumed batches). ``loader_options`` go to PrefetchLoader."""
    loader = PrefetchLoader(job, rank=rank, world_size=world_size, timeout=timeout, as_tensors=False, **loader_options)
    paths = JobPaths.of(job, loader_options.get("root"))
    batches = []
    try:
        for _ in range(epochs):
            epoch, first = loader.position
            for step, batch in enumerate(loader, start=first):
                if batch_size is not None:
                    assert len(batch["index"]) == batch_size, f"batch {epoch}/{step}: {len(batch['index'])} samples"
                meta = map_batch(paths.batch(epoch, step, loader.rank))[0]["meta"] if with_meta else None
                batches.append(ReadBatch(epoch, step, {k: v.copy() for k, v in batch.items()}, meta))
    finally:
        loader.close()
    return batches


def job_status(
    paths: JobPaths,
    *,
    endpoint: str | None = None,
    through_cli: bool = False,
    env: dict | None = None,
    timeout_s: float = 10.0,
) -> dict:
    """The daemon's status: over the control socket (the manifest's endpoint, or ``endpoint``), or
    with ``through_cli`` what `prefetchd status JOB --json` prints (``env``: extra environment, such
    as a CURVE client key; a job the CLI may not read is ``"state": "refused"``, with no pid). A
    status that names a pid must name the daemon that holds the job: the manifest's."""
    if through_cli:
        result = cli("status", paths.name, "--json", env=env, timeout=timeout_s + 50)
        assert result.returncode == 0, result.stderr
        reply = json.loads(result.stdout)
    else:
        reply = control.request(endpoint or paths.endpoint, {"op": "status"}, timeout_s=timeout_s)
        assert reply is not None, "the daemon did not answer status"
    if "pid" in reply:
        assert reply["pid"] == read_manifest(paths)["pid"], "a status from another process than the job's daemon"
    return reply


def workers_of(paths: JobPaths) -> list[psutil.Process]:
    """The job's live worker processes, by the pids its status reports (a killed worker may
    linger there as a zombie until the master reaps it: it is left out)."""
    found = []
    for pid in job_status(paths)["workers"]["pids"]:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            pass
    return found


def temp_leftovers() -> list[str]:
    """What the test's daemons and commands left in their $TMPDIR (job_root gives each test its own)."""
    return sorted(p.name for p in Path(os.environ["TMPDIR"]).iterdir())


def session(sid: int) -> list[psutil.Process]:
    """The live processes of session ``sid``: a launched daemon starts its own, and its resource
    tracker, fork server and workers stay in it (zombies left out: nothing of them runs)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (OSError, psutil.Error):
            pass
    return found


def as_a_terminal_starts_it() -> None:
    """``preexec_fn`` for a command a test stops with Ctrl-C: SIGINT at its default and not
    blocked, as a shell starts a foreground job. A test process (an xdist worker, after the
    tests before it) may have it ignored or blocked, and a child inherits both across exec."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def signal_state(pid: int) -> str:
    """The blocked and ignored signal masks of ``pid`` (for a message when Ctrl-C did nothing)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return " ".join(line.strip() for line in f if line.startswith(("SigBlk", "SigIgn")))
    except OSError:
        return "gone"
