"""Attacks on the operations features (issue 15) that broke them, kept as regressions.

- Hostile systemd variables: a WATCHDOG_USEC that str.isdigit() accepts but int() refuses
  ("²"), or of thousands of digits, raised out of `prefetchd start --foreground` before anything
  served; an abstract NOTIFY_SOCKET that is not UTF-8 did the same.
- Slowloris on /metrics: eight connections sending their request a byte at a time held every
  slot for as long as they liked, and every scrape was closed unread.
- `prefetchd status` of a root with two or more job folders (and so `--watch` without a job).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import urllib.error

import pytest

from prefetchd.ops.sdnotify import Notifier
from prefetchd_client.layout import JobPaths
from tests.conftest import cli, daemon_family, wait_pids_gone, wait_until, write_config
from tests.daemon.lifecycle.test_sdnotify import FakeManager, ForegroundDaemon
from tests.daemon.operations.test_metrics import scrape
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(120)


# -- systemd's variables ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "usec",
    ["²", "١٢", "9" * 5000, "9" * 400, "1e9", "-5", "0", "abc", " 5"],
    ids=["superscript", "arabic-indic", "5000-digits", "400-digits", "1e9", "negative", "zero", "abc", "space"],
)
def test_a_watchdog_usec_that_is_not_a_microsecond_count_is_no_watchdog(usec):
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": "/nonexistent/notify", "WATCHDOG_USEC": usec})
    assert notifier.interval_s is None


def test_an_abstract_notify_socket_that_is_not_utf8_is_used_as_its_bytes():
    env = {"NOTIFY_SOCKET": os.fsdecode(b"@prefetchd-\xff\xfe")}  # as os.environ holds such bytes
    notifier = Notifier.from_environment(env)
    assert notifier.address == b"\0prefetchd-\xff\xfe"
    assert notifier.send("READY=1\nSTATUS=" + os.fsdecode(b"/run/\xff")) is False  # nobody listens: no exception
    notifier.close()


def test_the_daemon_serves_and_is_ready_under_a_watchdog_usec_int_refuses(tmp_path, jpeg_folder, job_root):
    fake = FakeManager()
    paths = JobPaths(job_root / "job")
    daemon = ForegroundDaemon.of_config(
        write_config(tmp_path, jpeg_folder), {**fake.env(None), "WATCHDOG_USEC": "²"}, tmp_path
    )
    try:
        fake.wait_for("READY=1", 60)
        daemon.family = daemon_family(paths)
        assert fake.receive(0.5) is None, "no watchdog was asked for: no beats"
        assert daemon.stop(signal.SIGTERM) == 0, daemon.stderr()
        wait_pids_gone(daemon.family)
        assert "Traceback" not in daemon.stderr()
    finally:
        daemon.close()
        fake.close()


# -- /metrics -----------------------------------------------------------------------------------


def test_slow_senders_holding_every_connection_slot_do_not_lock_scrapes_out(tmp_path, jpeg_folder, serve):
    port = free_port()
    serve(write_config(tmp_path, jpeg_folder, name="met"), {"metrics": f"127.0.0.1:{port}"})
    wait_until(lambda: _scrapes(port), timeout_s=20, what="a first scrape")
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    stop = threading.Event()
    slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(12)]  # more than the 8 slots

    def trickle():  # a byte per connection every 0.2 s, never the end of the headers
        for byte in request:
            for s in slow:
                try:
                    s.send(bytes([byte]))
                except OSError:
                    pass  # cut by the server: what it is meant to do
            if stop.wait(0.2):
                return

    sender = threading.Thread(target=trickle)
    sender.start()  # the server accepts the 12 first: they are in its backlog before the scrapes
    try:
        for _ in range(3):
            assert _scrapes(port), "a scrape was locked out by connections sending a byte at a time"
    finally:
        stop.set()
        sender.join(10)
        for s in slow:
            s.close()


def _scrapes(port: int) -> bool:
    try:
        return "prefetchd_up" in scrape(port, timeout=5)
    except (OSError, urllib.error.URLError):
        return False


# -- status of a root with many jobs ------------------------------------------------------------


def test_status_of_a_root_with_many_jobs_lists_them_all(job_root):
    for name in ("alpha", "beta", "gamma"):
        (job_root / name).mkdir(mode=0o700)
    result = cli("status")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert all(f"{name}: not running" in result.stdout for name in ("alpha", "beta", "gamma"))
