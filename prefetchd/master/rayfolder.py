"""A private Ray instance's temp folder (--ray-address local), never the shared /tmp/ray (another
user's session folders there, which Ray makes 0777): ``s`` in a 0700 folder of this user's:
``<job>/ray``, or, when the job's path is too long for Ray's sockets, a fresh one (mkdtemp:
nobody can have made it first) in $XDG_RUNTIME_DIR, else in the temp folder ($TMPDIR, /tmp).
Ray chmods its temp folder 0777: the 0700 folder above keeps others out."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

from prefetchd.errors import DaemonStop, ExitCode, JobError
from prefetchd.master.jobdir import ensure_private_dir
from prefetchd_client.errors import UnsafeFolder

log = logging.getLogger("prefetchd")

RAY_FOLDER = "ray"  # <job>/ray (0700): a private Ray instance's temp folder is <job>/ray/s
_RUNTIME_PREFIX = "prefetchd-ray"  # in $XDG_RUNTIME_DIR or $TMPDIR, when <job>/ray/s is too long for Ray's sockets
_TEMP_SUFFIX = "/s"


def temp_of(folder: Path) -> str:
    """Ray's temp folder in ``folder``."""
    return str(folder) + _TEMP_SUFFIX


def make_private(job_dir: Path) -> Path:
    """The folder for a private instance's temp folder, made (0700) and checked; DaemonStop when
    no candidate leaves room for Ray's socket paths."""
    from prefetchd.remote import raycluster

    bases = [b for b in (os.environ.get("XDG_RUNTIME_DIR", ""), tempfile.gettempdir()) if os.path.isabs(b)]
    candidates = [job_dir / RAY_FOLDER, *(Path(b) / _RUNTIME_PREFIX for b in bases)]
    for folder in candidates:
        fresh = folder.parent != job_dir
        if not raycluster.fits_ray_sockets(str(folder) + ("-xxxxxxxx" if fresh else "") + _TEMP_SUFFIX):
            continue
        try:
            if fresh:
                folder = Path(tempfile.mkdtemp(prefix=folder.name + "-", dir=folder.parent))
            os.close(ensure_private_dir(folder, "Ray's temp folder"))  # and the folders above it: checked
        except (UnsafeFolder, JobError, OSError) as exc:
            log.warning("not using %s for Ray's temp folder: %s", folder, exc)
            continue
        return folder
    raise DaemonStop(
        f"the Ray executor could not start: a private Ray instance's socket paths under {job_dir} "
        f"would exceed {raycluster.MAX_SOCKET_PATH_BYTES} bytes (AF_UNIX's limit), and under $XDG_RUNTIME_DIR "
        "and the temp folder too; use a shorter --root or job name, or set XDG_RUNTIME_DIR or TMPDIR to a short "
        "folder of yours (0700)",
        ExitCode.WORKER_BOOT,
    )


def end_instance(folder: Path) -> None:
    """End every process of the private Ray instance (those that hold a file in its folder,
    however they are titled or re-parented) and remove the folder."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):  # a symlink: what it names is not the instance's
            log.warning("%s is not a folder: left as it is, and no process is ended for it", folder)
            return
    except FileNotFoundError:
        return
    from prefetchd.remote.rayinstance import end_instance as end_processes  # psutil: only where one was

    ended = end_processes(str(folder))
    if ended:
        log.info("ended %d processes of the private Ray instance: %s", len(ended), ended[:20])
    shutil.rmtree(folder, ignore_errors=True)
