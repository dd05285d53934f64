"""A private Ray instance's processes (--ray-address local): which they are, and ending them.

Ray's agents ignore SIGTERM and outlive their raylet by a minute, waiting on a dead GCS, and
their titles (ray::IDLE, ray::DashboardAgent) and parents (re-parented once the raylet dies) say
nothing trustworthy. Two facts do, for a process of this user's:

- the instance's mark (raycluster.instance_mark) in the environment it started with: the bridge
  sets it before ray.init, and every process Ray starts inherits it. It shows from the process's
  exec on, before it opens any file (an agent the raylet started a moment before it was killed);
  but a process that later rewrites its title (setproctitle: Ray's agents do) may overwrite the
  copy /proc shows, so the mark alone misses some agents (seen: 1 cancelled start in 6);
- a file under the instance's folder open for writing: every Ray process writes its logs there.
  A process of the user's that only reads them (`tail -f`, `less`) is spared.

Either makes a process the instance's. The bridge's guard, a small process started before
ray.init and carrying no mark, ends what is left of its instance once the bridge is gone.
"""

from __future__ import annotations

import os
import time

import psutil

from prefetchd.remote import raycluster

END_TIMEOUT_S = 10.0  # to end a private instance's processes, SIGKILLed: they are gone within milliseconds
SWEEP_PAUSE_S = 0.2  # between two sweeps for them
# The guard sweeps in the background until none was seen for this long: a process the bridge
# forked just before it died shows the bridge's environment (no mark) until its exec.
GUARD_QUIET_S = 3.0

_GUARD = """
import os, shutil, stat, sys
sys.stdin.buffer.read()  # end of file: the bridge is gone, killed or not
folder, elsewhere, quiet_s = sys.argv[1], sys.argv[2] == "elsewhere", float(sys.argv[3])
from prefetchd.remote.rayinstance import end_instance
end_instance(folder, quiet_s=quiet_s, same_folder=True)
try:  # ours, a folder, closed to others: the pool may have removed it and another user made one
    st = os.lstat(folder) if elsewhere else None  # of that name since (ours stays ours: /tmp is sticky)
except OSError:
    st = None
if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
    shutil.rmtree(folder, ignore_errors=True)
"""


def start_guard(folder: str, elsewhere: bool):
    """Start the guard of the instance in ``folder``: once its stdin closes (the bridge that
    started it is gone, however it went: a kill -9 of the master or the bridge, mid-boot
    included), it ends every process of the instance. ``elsewhere``: the instance's fresh folder
    is outside the job's (a job path too long for Ray's sockets), and the guard removes it then:
    no later start or stop knows its name. A folder in the job's is left to the next start there."""
    import subprocess
    import sys

    unmarked = {k: v for k, v in os.environ.items() if k != raycluster.INSTANCE_MARK}  # not one to end
    return subprocess.Popen(
        [sys.executable, "-c", _GUARD, folder, "elsewhere" if elsewhere else "job", str(GUARD_QUIET_S)],
        stdin=subprocess.PIPE,
        close_fds=True,
        env=unmarked,
    )


def instance_processes(folder: str) -> list[psutil.Process]:
    """This user's processes of the private instance in ``folder`` (the module's docstring)."""
    ((name, value),) = raycluster.instance_mark(folder).items()
    mark = os.fsencode(f"{name}={value}")
    inside = os.path.join(value, "")  # the folder itself, not where a link of that name points
    uid, me, found = os.getuid(), os.getpid(), []
    for p in psutil.process_iter(["uids"]):
        uids = p.info["uids"]
        if p.pid == me or uids is None or uids.real != uid:
            continue
        if mark in _environment(p.pid) or _writes_under(p.pid, inside):
            found.append(p)
    return found


def end_instance(
    folder: str, timeout_s: float = END_TIMEOUT_S, quiet_s: float = SWEEP_PAUSE_S, same_folder: bool = False
) -> list[int]:
    """SIGKILL every process of the private instance in ``folder`` until none has been seen for
    ``quiet_s``, or the deadline; the pids that were ended. ``same_folder``: stop as soon as the
    folder is another than it was at the first sweep (removed, or made anew by a later start,
    whose instance is not this caller's to end)."""
    deadline, ended, quiet_since = time.monotonic() + timeout_s, [], None
    first = _identity(folder)
    while time.monotonic() < deadline:
        if same_folder and _identity(folder) != first:
            break
        left = instance_processes(folder)
        if not left:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= quiet_s:
                break
            time.sleep(SWEEP_PAUSE_S)
            continue
        quiet_since = None
        for p in left:
            try:
                p.kill()  # psutil checks the pid still names the process it found
                ended.append(p.pid)
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=max(0.0, min(2.0, deadline - time.monotonic())))
    return ended


def _identity(folder: str) -> tuple[int, int, int] | None:
    """The folder as one made, not as its name: a folder made anew may get the inode number of
    the one removed a moment before, never its change time (nothing is added to the instance's
    folder itself once Ray runs: it writes inside ``s``)."""
    try:
        st = os.lstat(folder)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _environment(pid: int) -> list[bytes]:
    """The NAME=VALUE entries a process started with (/proc/<pid>/environ); [] when it is gone
    or not readable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def _writes_under(pid: int, inside: str) -> bool:
    """Whether the process holds a file under ``inside`` open for writing (its fdinfo's flags)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith(inside):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                flags = next((int(line.split()[1], 8) for line in info if line.startswith("flags:")), 0)
        except (OSError, ValueError):
            continue
        if flags & os.O_ACCMODE != os.O_RDONLY:
            return True
    return False
