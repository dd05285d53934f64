"""Where a job lives, and the names of everything in its directory.

The daemon and the client share this module, so a trainer started with the same
environment finds a job by its name alone::

    <root>/<job>/
      manifest.json      plan summary the client needs (written once the daemon serves)
      daemon.lock        flock held by the daemon for its whole life
      daemon.sock        ZeroMQ ipc endpoint (a TCP job has none: the manifest names its endpoint)
      daemon.log
      stopped.json       why the daemon stopped on an error: {type, message, exit_code, stopped_at}
      progress/rank-<r>  "<epoch> <step>": the next batch rank r will read (rank-<r>.<consumer>:
                         a named consumer's, one of several trainers reading the job)
      batches/           finished batches, e<epoch>-s<step>-r<rank>.batch
      tmp/               batches being written; spare-<n>: consumed batches' files, kept to be
                         overwritten by later ones
      retired/           consumed batches a client may still map (freed once unmapped)
      trainers/rank-<r>  flock held (shared) by every live loader of rank r (rank-<r>.<consumer>)

root is the ``root`` argument, else ``$PREFETCHD_ROOT``, else ``/dev/shm/prefetchd-<uid>``.

Every entry point (daemon, client, CLI) opens the root and the job folder with ``open_job``
(or ``open_private_dir``): a symlink, a folder of another user's or one that others can
write is refused (UnsafeFolder) before anything in it is read, signalled or deleted.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT_ENV = "PREFETCHD_ROOT"
MANIFEST = "manifest.json"
LOCK = "daemon.lock"
SOCKET = "daemon.sock"
LOG = "daemon.log"
STOPPED = "stopped.json"
PROGRESS_DIR = "progress"
BATCH_DIR = "batches"
TMP_DIR = "tmp"
TRAINERS_DIR = "trainers"
RETIRED_DIR = "retired"

_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # fullmatch: "job\n" is no name
_BATCH_NAME = re.compile(r"e(\d{6})-s(\d{8})-r(\d{4})\.batch", re.ASCII)  # fullmatch: no "\n" after
_CONSUMER = r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}"  # no ".": it follows the rank in file names
_CONSUMER_NAME = re.compile(_CONSUMER, re.ASCII)
_PROGRESS_NAME = re.compile(rf"rank-(\d{{1,4}})(?:\.({_CONSUMER}))?", re.ASCII)
DEFAULT_CONSUMER = ""  # a loader that names no consumer: the one a job has unless several trainers read it
MAX_CONSUMERS = 16  # named by reports per job: more are refused (a peer cannot grow the daemon's ledger)


def default_root(uid: int | None = None) -> Path:
    """The root of this user's jobs (or of user ``uid``'s) when none is named."""
    return Path(f"/dev/shm/prefetchd-{os.getuid() if uid is None else uid}")


def resolve_root(root: str | os.PathLike | None = None) -> Path:
    if root:
        return Path(root)
    env = os.environ.get(ROOT_ENV)
    return Path(env) if env else default_root()


def root_source(root: str | os.PathLike | None = None) -> str:
    """Where resolve_root(root) took the folder from, for a message that sends the user there."""
    if root:
        return "the root given"
    if os.environ.get(ROOT_ENV):
        return f"${ROOT_ENV}"
    return f"the default; ${ROOT_ENV} or root= name another"


_LISTED_JOBS = 10  # names shown by jobs_under: a root with thousands would flood the message


def jobs_under(root: Path) -> list[str]:
    """The job folders (those holding a manifest) directly under ``root``, sorted, at most
    _LISTED_JOBS of them; none where it cannot be read. Names only: nothing in them is read."""
    try:
        with os.scandir(root) as entries:
            names = sorted(
                e.name
                for e in entries
                if e.is_dir(follow_symlinks=False) and os.path.lexists(os.path.join(e.path, MANIFEST))
            )
    except OSError:
        return []
    return names[:_LISTED_JOBS] + ([f"... {len(names) - _LISTED_JOBS} more"] if len(names) > _LISTED_JOBS else [])


def check_job_name(name: str) -> str:
    """Job names become directory names: keep them to one safe path component."""
    if not isinstance(name, str) or not _JOB_NAME.fullmatch(name):
        raise ValueError(
            f"invalid job name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def check_consumer_name(name: str) -> str:
    """Consumer names become part of file names: "" (the default) or one safe word."""
    if not isinstance(name, str) or not (name == DEFAULT_CONSUMER or _CONSUMER_NAME.fullmatch(name)):
        raise ValueError(
            f"invalid consumer name {name!r:.60}: use 1-32 letters, digits, '_' or '-', starting with a letter or digit"
        )
    return name


def _consumer_suffix(consumer: str) -> str:
    return f".{check_consumer_name(consumer)}" if consumer else ""


@dataclass(frozen=True)
class JobPaths:
    dir: Path

    @classmethod
    def of(cls, job: str, root: str | os.PathLike | None = None) -> JobPaths:
        return cls(resolve_root(root) / check_job_name(job))

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def manifest(self) -> Path:
        return self.dir / MANIFEST

    @property
    def lock(self) -> Path:
        return self.dir / LOCK

    @property
    def socket(self) -> Path:
        return self.dir / SOCKET

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.socket}"

    @property
    def log(self) -> Path:
        return self.dir / LOG

    @property
    def stopped(self) -> Path:
        return self.dir / STOPPED

    @property
    def progress_dir(self) -> Path:
        return self.dir / PROGRESS_DIR

    @property
    def batch_dir(self) -> Path:
        return self.dir / BATCH_DIR

    @property
    def tmp_dir(self) -> Path:
        return self.dir / TMP_DIR

    def batch(self, epoch: int, step: int, rank: int) -> Path:
        return self.batch_dir / batch_name(epoch, step, rank)

    def batch_file(self, epoch: int, step: int, rank: int) -> str:
        """``batch()`` as a str, for the paths made once a batch: pathlib interns every name it
        parses (sys.intern), and a new name a batch made the interpreter grow its table of
        interned strings again and again (a daemon's heap ~1 MB more every ~10k batches)."""
        return f"{self.dir}/{BATCH_DIR}/{batch_name(epoch, step, rank)}"

    def tmp_file(self, epoch: int, step: int, rank: int, pid: int) -> str:
        """Where process ``pid`` writes a batch before publishing it (the master sweeps a dead
        writer's files by the ``.<pid>`` suffix, and leaves a spare there for it to overwrite)."""
        return f"{self.dir}/{TMP_DIR}/{batch_name(epoch, step, rank)}.{pid}"

    @property
    def retired_dir(self) -> Path:
        return self.dir / RETIRED_DIR

    @property
    def trainers_dir(self) -> Path:
        return self.dir / TRAINERS_DIR

    def trainer_lock(self, rank: int, consumer: str = DEFAULT_CONSUMER) -> Path:
        return self.trainers_dir / f"rank-{rank}{_consumer_suffix(consumer)}"

    def progress(self, rank: int, consumer: str = DEFAULT_CONSUMER) -> Path:
        return self.progress_dir / f"rank-{rank}{_consumer_suffix(consumer)}"


# What a batch name holds (six digits of epoch, eight of step, four of rank): a position past
# these is outside every plan.
MAX_EPOCH, MAX_STEP, MAX_RANK = 10**6 - 1, 10**8 - 1, 10**4 - 1


def batch_name(epoch: int, step: int, rank: int) -> str:
    return f"e{epoch:06d}-s{step:08d}-r{rank:04d}.batch"


def parse_batch_name(name: str) -> tuple[int, int, int] | None:
    """(epoch, step, rank) of a batch file name, or None for anything else."""
    m = _BATCH_NAME.fullmatch(name)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def parse_progress_name(name: str) -> tuple[int, str] | None:
    """(rank, consumer) of a progress file's name, or None for anything else."""
    m = _PROGRESS_NAME.fullmatch(name)
    return (int(m[1]), m[2] or DEFAULT_CONSUMER) if m else None


def parse_progress(text: str) -> tuple[int, int]:
    """Parse "<epoch> <step>"; raises ValueError on anything else."""
    parts = text.split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"expected '<epoch> <step>' (two non-negative integers), got {text[:40]!r}")
    return int(parts[0]), int(parts[1])


def write_progress(path: Path, epoch: int, step: int) -> None:
    """Write a progress file atomically: a reader sees the old or the new position, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{epoch} {step}\n".encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


# -- TCP endpoints: what a manifest and [daemon] endpoint may name ----------------------------

WILDCARD = "*"


@dataclass(frozen=True)
class TcpEndpoint:
    host: str  # an IP address (IPv6 without brackets), "localhost" or "*"
    port: int

    @property
    def ipv6(self) -> bool:
        return ":" in self.host

    @property
    def loopback(self) -> bool:
        return self.host == "localhost" or (self.host != WILDCARD and ipaddress.ip_address(self.host).is_loopback)

    @property
    def wildcard(self) -> bool:
        return self.host == WILDCARD or (self.host != "localhost" and ipaddress.ip_address(self.host).is_unspecified)

    def bind_address(self) -> str:
        return f"tcp://[{self.host}]:{self.port}" if self.ipv6 else f"tcp://{self.host}:{self.port}"

    def connect_address(self) -> str:
        """Where a client on this node connects: a wildcard bind is reached over loopback."""
        if not self.wildcard:
            return self.bind_address()
        return f"tcp://[::1]:{self.port}" if self.ipv6 else f"tcp://127.0.0.1:{self.port}"


def parse_tcp_endpoint(text: str) -> TcpEndpoint:
    """``tcp://HOST:PORT``: HOST an IP address (IPv6 in brackets), ``localhost`` or ``*``, PORT
    1-65535. ValueError otherwise."""
    if not isinstance(text, str) or not text.startswith("tcp://"):
        raise ValueError(f"not a tcp:// endpoint: {text!r}")
    host, sep, port = text[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"no port 1-65535 in {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise ValueError(f"brackets are for IPv6 addresses only: {text!r}")
    elif ":" in host:
        raise ValueError(f"write an IPv6 host in brackets, e.g. tcp://[::1]:{port}")
    if host not in ("localhost", WILDCARD):
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"host {host!r} is not an IP address, localhost or *") from None
    return TcpEndpoint(host, int(port))
