"""What one benchmark run owns (its data folder, its job root, every daemon it started), and the
systems it compares, opened fresh for each measurement."""

from __future__ import annotations

import contextlib
import itertools
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
from rich.console import Console
from torch.utils.data import DataLoader

from prefetchd.bench.common import OTHER, RECIPES, Settings
from prefetchd.bench.dataloader import JpegFolder
from prefetchd.cli.launch import start_detached, stop_job
from prefetchd.config import build_config
from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import JobPaths
from prefetchd_client.locks import daemon_alive
from prefetchd_client.manifest import read_manifest


class Run:
    """What one benchmark run owns: the data folder, the job root and every daemon started
    in it. close() stops the daemons (prefetchd stop, then their recorded pids) and removes
    both folders, whatever state the run is in."""

    def __init__(self, s: Settings, console: Console):
        self.s, self.console = s, console
        self.data = Path(tempfile.mkdtemp(prefix="prefetchd-bench-data-"))
        # The packed rows' shards and their second image folder: beside the data, not in it (a
        # folder in the image folder would be one more class to it).
        self.packs = Path(tempfile.mkdtemp(prefix="prefetchd-bench-packs-"))
        self.root = Path(tempfile.mkdtemp(prefix="prefetchd-bench-", dir="/dev/shm"))
        self.jobs: list[JobPaths] = []
        # Every daemon master and worker this run saw, with its start time: a pid the kernel
        # has given to another process since is never killed.
        self.pids: dict[int, float] = {}
        self.files: list[tuple[str, int]] = []
        self._names = itertools.count()

    def log(self, text: str) -> None:
        self.console.log(text, highlight=False)

    def start_job(
        self, recipe: str, tag: str, decoder: str | None = None, source: dict | None = None, **overrides
    ) -> tuple[JobPaths, int]:
        """Start a prefetchd daemon serving `recipe` on `source` (a [[source]] table; this run's
        image folder by default); returns (paths, master pid)."""
        s = self.s
        name = f"{tag}-{next(self._names)}"
        raw = {
            "job": {"decoder": decoder or s.decoder},
            "source": [source or {"kind": "image_folder", "root": str(self.data)}],
            "transform": RECIPES[recipe],
        }
        settings = {"batch_size": s.batch_size, "workers": s.workers, "buffer": s.buffer, **overrides}
        cfg = build_config(raw, base=Path.cwd(), default_name=name, overrides=settings)
        paths = JobPaths.of(name, self.root)
        self.jobs.append(paths)
        pid = int(start_detached(cfg, paths)["pid"])
        self.remember(pid)
        return paths, pid

    def remember(self, master_pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            master = psutil.Process(master_pid)
            for proc in (master, *master.children(recursive=True)):
                self.pids[proc.pid] = proc.create_time()

    def stop_job(self, paths: JobPaths) -> None:
        if paths.dir.exists():
            with contextlib.suppress(Exception):
                stop_job(paths, timeout_s=10)

    def close(self) -> None:
        # A daemon interrupted while it started has no manifest yet: it is our child, and its
        # command line names a job folder under our private root.
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children():
                with contextlib.suppress(psutil.Error):
                    if f"--job-dir {self.root}/" in " ".join(child.cmdline()):
                        self.remember(child.pid)
        # Every job folder under our root: ours, and the restart row's (prefetchd.bench.restart's).
        found = self.root.iterdir() if self.root.exists() else ()
        jobs = {*self.jobs, *(JobPaths(d) for d in found if d.is_dir())}
        for paths in jobs:
            if daemon_alive(paths):
                with contextlib.suppress(Exception):
                    self.remember(int(read_manifest(paths)["pid"]))
            self.stop_job(paths)
        # Belt and braces: a daemon that did not answer `stop` is killed by the pid we saw.
        procs = []
        for pid, started in self.pids.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
                    procs.append(proc)
        psutil.wait_procs(procs, timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.data, ignore_errors=True)
        shutil.rmtree(self.packs, ignore_errors=True)


@contextlib.contextmanager
def open_system(run: Run, system: str, recipe: str, tag: str, source: dict | None = None) -> Iterator[tuple]:
    """Yield (loader, paths, master pid) ready to iterate; paths and pid are None for DataLoader.
    The daemon is started fresh (empty buffer), on `source` where given (prefetchd only), and
    stopped on the way out."""
    s = run.s
    if system.startswith("prefetchd"):
        decoder = system.removeprefix(OTHER) if system != "prefetchd" else None
        paths, pid = run.start_job(recipe, tag, decoder=decoder, source=source)
        loader = PrefetchLoader(paths.name, root=run.root, rank=0, world_size=1, timeout=120)
        try:
            yield loader, paths, pid
        finally:
            loader.close()
            run.stop_job(paths)
        return
    loader = DataLoader(
        JpegFolder(run.files, recipe),
        batch_size=s.batch_size,
        shuffle=True,
        num_workers=s.workers,
        persistent_workers=system == "dataloader_persistent",
        pin_memory=False,
        drop_last=True,  # prefetchd's default too: every batch full
    )
    yield loader, None, None
