"""systemd's notification protocol, spoken by a real `prefetchd start --foreground` to a fake
service manager: a real AF_UNIX datagram socket bound in a temporary folder (or at an abstract
address), as systemd binds $NOTIFY_SOCKET.

READY=1 comes once the job serves (its manifest is there when the datagram arrives), WATCHDOG=1
every $WATCHDOG_USEC / 2 from the master's loop (so a stopped master stops beating, and a
trainer reading at full speed does not delay the beats), STOPPING=1 when it stops; the workers
never see the socket, and a socket that is not there costs the daemon nothing.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from prefetchd.ops.sdnotify import ENV_NAMES, SILENT, Notifier
from prefetchd_client import PrefetchLoader
from prefetchd_client.layout import JobPaths
from tests.conftest import daemon_family, wait_pids_gone, wait_until, write_config

pytestmark = pytest.mark.timeout(120)

WATCHDOG_USEC = 200_000  # a beat every 100 ms: small, so a test sees many
BEAT_S = WATCHDOG_USEC / 2 / 1e6


class FakeManager:
    """The service manager's end: a datagram socket that records what arrives, and when."""

    def __init__(self, address: str | None = None):
        self._folder = None
        if address is None:  # a short path: sun_path holds 108 bytes, pytest's tmp_path can be longer
            self._folder = tempfile.mkdtemp(prefix="pfd-notify-")
            address = os.path.join(self._folder, "notify")
        self.address = address
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(b"\0" + address[1:].encode() if address.startswith("@") else address)

    def env(self, watchdog_usec: int | None = WATCHDOG_USEC) -> dict:
        env = {"NOTIFY_SOCKET": self.address}
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        return env

    def receive(self, timeout_s: float, on_arrival=None) -> tuple[float, str, object] | None:
        """The next message: (arrival time, text, ``on_arrival()`` called the moment it arrived),
        or None when none came within ``timeout_s``."""
        self.socket.settimeout(timeout_s)
        try:
            data = self.socket.recv(4096)
        except TimeoutError:
            return None
        seen = on_arrival() if on_arrival else None
        return time.monotonic(), data.decode(), seen

    def wait_for(self, prefix: str, timeout_s: float, on_arrival=None) -> tuple[float, str, object]:
        """The first message starting with ``prefix``; fails after the deadline."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            got = self.receive(left, on_arrival)
            if got is not None and got[1].startswith(prefix):
                return got
        raise AssertionError(f"no {prefix!r} from the daemon within {timeout_s} s")

    def beats(self, until, timeout_s: float) -> list[float]:
        """Arrival times of WATCHDOG=1 until ``until()`` is true (checked between datagrams)."""
        times = []
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, f"still collecting beats after {timeout_s} s"
            got = self.receive(1.0)
            assert got is not None, "no datagram for 1 s: the beats stopped"
            assert got[1] == "WATCHDOG=1", f"unexpected message while serving: {got[1]!r}"
            times.append(got[0])
        return times

    def drain(self) -> list[str]:
        self.socket.setblocking(False)
        messages = []
        try:
            while True:
                messages.append(self.socket.recv(4096).decode())
        except BlockingIOError:
            return messages
        finally:
            self.socket.setblocking(True)

    def close(self) -> None:
        self.socket.close()
        if self._folder is not None:
            os.unlink(self.address)
            os.rmdir(self._folder)


@pytest.fixture
def manager():
    fake = FakeManager()
    yield fake
    fake.close()


class ForegroundDaemon:
    """`prefetchd start CONFIG --foreground` as systemd runs it: its own process, our env."""

    def __init__(self, argv: list[str], env: dict, log_folder: Path):
        self.stderr_path = log_folder / "foreground.stderr"
        with open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen(
                argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=stderr, text=True
            )
        self.family: list[int] = []

    @classmethod
    def of_config(cls, config: Path, env: dict, log_folder: Path) -> ForegroundDaemon:
        return cls([sys.executable, "-m", "prefetchd", "start", str(config), "--foreground"], env, log_folder)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def close(self) -> None:
        """Whatever happened: the daemon and its family gone (by their pids)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a test that stopped it may have failed before SIGCONT
            self.proc.kill()
            self.proc.wait(10)
        wait_pids_gone(self.family)


def _intervals(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def _manifest_exists(paths: JobPaths):
    return lambda: paths.manifest.exists()


# -- the Notifier alone -------------------------------------------------------------------


def test_the_environment_is_read_once_and_taken_away():
    pid = str(os.getpid())
    env = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "3000000", "WATCHDOG_PID": pid, "PATH": "/bin"}
    notifier = Notifier.from_environment(env)
    assert env == {"PATH": "/bin"}, "the variables must not reach the worker server and its workers"
    assert (notifier.address, notifier.interval_s) == ("/run/systemd/notify", 1.5)
    assert Notifier.from_environment(env).address is None  # read once: a second call finds nothing

    def watchdog_of(**extra):
        return Notifier.from_environment({"NOTIFY_SOCKET": "@sd", **extra}).interval_s

    assert watchdog_of(WATCHDOG_USEC="3000000", WATCHDOG_PID="1") is None  # another process's watchdog
    for usec in ("0", "-5", "1e6", "soon", ""):
        assert watchdog_of(WATCHDOG_USEC=usec) is None, usec
    assert Notifier.from_environment({"NOTIFY_SOCKET": "@sd"}).address == b"\0sd"
    assert Notifier.from_environment({"NOTIFY_SOCKET": "vsock:2:1234", "WATCHDOG_USEC": "1000"}).interval_s is None
    assert Notifier.from_environment({}).address is None


def test_beats_keep_their_grid_and_start_afresh_after_a_stall(manager):
    now = [100.0]
    notifier = Notifier(manager.address, 1.0, clock=lambda: now[0])  # a beat every 0.5 s
    try:
        notifier.ready("serving")
        assert manager.receive(1)[1].startswith("READY=1\nMAINPID=")
        sent = []
        for turn in range(40):  # turns of 0.07 s: beats due at 100.5, 101.0, ... sent at the first turn after
            now[0] = 100.0 + 0.07 * turn
            notifier.beat()
            sent += [now[0]] * len(manager.drain())
        assert len(sent) == 5 and all(abs(b - a - 0.5) < 0.071 for a, b in zip(sent, sent[1:])), sent
        now[0] += 30  # a stall (SIGSTOP): one beat, and the next one an interval later, not a burst
        notifier.beat()
        notifier.beat()
        assert manager.drain() == ["WATCHDOG=1"]
    finally:
        notifier.close()


def test_without_a_manager_nothing_is_sent_and_nothing_fails():
    assert SILENT.address is None and SILENT.send("READY=1") is False
    SILENT.ready("x")
    SILENT.beat()
    SILENT.stopping()
    gone = Notifier("/nonexistent-folder/notify", 1.0)
    assert gone.send("WATCHDOG=1") is False  # logged once, never raised
    gone.beat()
    gone.close()


# -- a real daemon ------------------------------------------------------------------------


def test_ready_after_the_manifest_then_beats_a_stopped_master_goes_silent_stopping_on_sigterm(
    tmp_path, jpeg_folder, job_root, manager
):
    paths = JobPaths(job_root / "job")
    daemon = ForegroundDaemon.of_config(write_config(tmp_path, jpeg_folder, workers=2), manager.env(), tmp_path)
    try:
        arrived, ready, manifest_there = manager.wait_for("READY=1", 60, on_arrival=_manifest_exists(paths))
        assert manifest_there, "READY=1 came before the manifest was written"
        fields = dict(line.split("=", 1) for line in ready.splitlines())
        assert fields["MAINPID"] == str(daemon.proc.pid) and "serving job job" in fields["STATUS"]
        daemon.family = daemon_family(paths)
        for pid in daemon.family[1:]:  # the worker server and the workers: never the manager's socket
            leaked = set(psutil.Process(pid).environ()) & set(ENV_NAMES)
            assert not leaked, f"pid {pid} ({psutil.Process(pid).name()}) inherited {leaked}"

        first_beat = manager.wait_for("WATCHDOG=1", 1)[0]
        assert first_beat - arrived < 2 * BEAT_S
        until = first_beat + 1.5
        intervals = _intervals([first_beat, *manager.beats(lambda: time.monotonic() > until, timeout_s=10)])
        assert 0.8 * BEAT_S < statistics.median(intervals) < 1.3 * BEAT_S, intervals
        assert max(intervals) < WATCHDOG_USEC / 1e6, intervals

        master = psutil.Process(daemon.proc.pid)
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # hung: systemd must hear nothing
        wait_until(lambda: master.status() == psutil.STATUS_STOPPED, timeout_s=5, what="the master stopped")
        manager.drain()  # a beat sent just before the stop
        assert manager.receive(3 * WATCHDOG_USEC / 1e6) is None, "a stopped master kept beating"
        os.kill(daemon.proc.pid, signal.SIGCONT)
        assert manager.wait_for("WATCHDOG=1", 2)  # it beats again as soon as its loop turns

        assert daemon.stop(signal.SIGTERM) == 0, daemon.stderr()
        stopping = [m for m in manager.drain() if m != "WATCHDOG=1"]
        assert stopping == ["STOPPING=1\nSTATUS=stopping: signal"], stopping
        wait_pids_gone(daemon.family)
        assert not paths.dir.exists()
    finally:
        daemon.close()


READER = textwrap.dedent("""
    import sys, time
    from prefetchd_client import PrefetchLoader
    loader = PrefetchLoader(sys.argv[1], timeout=60, as_tensors=False)
    end, batches = time.monotonic() + float(sys.argv[2]), 0
    while time.monotonic() < end:
        for batch in loader:
            batches += 1
    loader.close()
    print(batches)
""")


def test_beats_hold_while_a_trainer_reads_at_full_speed(tmp_path, jpeg_folder, job_root, manager):
    """Two workers busy and a trainer reading as fast as they make batches, on 2 cores: the
    beats keep to WATCHDOG_USEC / 2, and never come near WATCHDOG_USEC, when systemd would act."""
    paths = JobPaths(job_root / "job")
    config = write_config(tmp_path, jpeg_folder, workers=2, size=128, buffer="4M")
    daemon = ForegroundDaemon.of_config(config, manager.env(), tmp_path)
    trainer = None
    try:
        manager.wait_for("READY=1", 60)
        daemon.family = daemon_family(paths)
        trainer = subprocess.Popen([sys.executable, "-c", READER, "job", "2"], stdout=subprocess.PIPE, text=True)
        times = manager.beats(lambda: trainer.poll() is not None, timeout_s=60)
        read = int(trainer.communicate(timeout=10)[0])
        assert trainer.returncode == 0 and read > 24, f"the trainer read {read} batches"
        intervals = _intervals(times)
        median, longest = statistics.median(intervals), max(intervals)
        print(
            f"\nwatchdog under load: {len(intervals)} intervals, median {median * 1e3:.1f} ms, "
            f"max {longest * 1e3:.1f} ms, requested {BEAT_S * 1e3:.0f} ms; trainer read {read} batches"
        )
        assert 0.8 * BEAT_S < median < 1.3 * BEAT_S, intervals
        assert longest < WATCHDOG_USEC / 1e6, intervals
        assert daemon.stop(signal.SIGTERM) == 0, daemon.stderr()
        wait_pids_gone(daemon.family)
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
        daemon.close()


def test_an_abstract_address_works(tmp_path, jpeg_folder, job_root):
    fake = FakeManager(f"@prefetchd-test-{os.getpid()}-{time.monotonic_ns()}")
    paths = JobPaths(job_root / "job")
    daemon = ForegroundDaemon.of_config(write_config(tmp_path, jpeg_folder), fake.env(), tmp_path)
    try:
        fake.wait_for("READY=1", 60)
        daemon.family = daemon_family(paths)
        fake.wait_for("WATCHDOG=1", 1)
        # Read while the command runs: a manager's queue holds 10 datagrams (net.unix.max_dgram_qlen),
        # the beats fill it within a second, and past that the daemon's sends (MSG_DONTWAIT: a
        # manager that does not read must not block the loop) are dropped, STOPPING=1 among them.
        # `prefetchd stop` takes longer than that on a loaded machine.
        stop = subprocess.Popen(
            [sys.executable, "-m", "prefetchd", "stop", "job"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            assert fake.wait_for("STOPPING=1", 60)[1] == "STOPPING=1\nSTATUS=stopping: stop requested"
        finally:
            _, stop_err = stop.communicate(timeout=60)
        assert stop.returncode == 0, stop_err
        assert daemon.proc.wait(30) == 0, daemon.stderr()
        wait_pids_gone(daemon.family)
    finally:
        daemon.close()
        fake.close()


def test_a_notify_socket_that_is_not_there_does_not_hurt(tmp_path, jpeg_folder, job_root):
    paths = JobPaths(job_root / "job")
    env = {"NOTIFY_SOCKET": str(tmp_path / "nobody-listens"), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    daemon = ForegroundDaemon.of_config(write_config(tmp_path, jpeg_folder), env, tmp_path)
    try:
        wait_until(lambda: paths.manifest.exists() or daemon.proc.poll() is not None, timeout_s=60, what="serving")
        daemon.family = daemon_family(paths)
        with_loader = PrefetchLoader("job", timeout=30, as_tensors=False)
        try:
            assert [len(b["index"]) for b in with_loader] == [4] * 12  # served through many failed beats
        finally:
            with_loader.close()
        assert daemon.proc.poll() is None
        assert daemon.stop(signal.SIGTERM) == 0, daemon.stderr()
        wait_pids_gone(daemon.family)
    finally:
        daemon.close()


# -- a stop the moment the job serves (the sweep over the whole start: test_stop_during_start.py) --


def test_sigterm_as_soon_as_ready_arrives_is_a_clean_stop(tmp_path, jpeg_folder, job_root, manager):
    # systemd may stop the unit the moment it hears READY=1: the master, not the default
    # action, must handle it (exit 0, STOPPING=1, its workers ended, nothing left).
    paths = JobPaths(job_root / "job")
    daemon = ForegroundDaemon.of_config(write_config(tmp_path, jpeg_folder, workers=2), manager.env(), tmp_path)
    try:

        def stop_at_once() -> list[int]:
            family = daemon_family(paths)
            os.kill(daemon.proc.pid, signal.SIGTERM)
            return family

        daemon.family = manager.wait_for("READY=1", 60, on_arrival=stop_at_once)[2]
        assert len(daemon.family) >= 3, daemon.family  # the master, its worker server, workers
        assert daemon.proc.wait(30) == 0, daemon.stderr()
        wait_pids_gone(daemon.family)
        assert manager.wait_for("STOPPING=1", 5)[1] == "STOPPING=1\nSTATUS=stopping: signal"
        assert not paths.dir.exists()
    finally:
        daemon.close()
