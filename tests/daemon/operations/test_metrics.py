"""`--metrics HOST:PORT`: the Prometheus /metrics server of a job's master (in the test's process,
or a real daemon where the test kills or stops it, or checks what `prefetchd start` says).

Scrapes are parsed with prometheus_client's own parser; the figures must be those of the status
snapshot and move as a trainer reads; hostile values and a port in use fail the start with exit
2 and leave nothing; a stopped master costs a scrape its timeout, never a hang; a flood of
requests and garbage bytes leave the daemon serving. Loopback only, ports picked free."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefetchd.config import load_config
from prefetchd.errors import ConfigError
from prefetchd.ops import metrics
from prefetchd.ops.metrics_http import MetricsServer
from prefetchd_client.manifest import read_manifest
from tests.conftest import REPO, daemon_family, start_job, wait_pids_gone, wait_until, write_config
from tests.helpers import free_port, job_status, read_epoch

pytestmark = pytest.mark.timeout(90)

TYPES = {name: kind for name, kind, _, _ in metrics.METRICS}
LABELS = {name: {"job", *labels} for name, _, labels, _ in metrics.METRICS}
SCRAPE_ERRORS = (OSError, urllib.error.URLError, ConnectionError)  # refused, reset, timed out


def scrape(port: int, timeout: float = 5.0) -> dict:
    """name -> family of one scrape of http://127.0.0.1:PORT/metrics (counters by their name with _total)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        found[family.name + ("_total" if family.type == "counter" else "")] = family
    return found


def value(families: dict, name: str, **labels) -> float:
    [sample] = [s for s in families[name].samples if labels.items() <= s.labels.items()]
    return sample.value


def scrape_when_serving(port: int, timeout_s: float = 20.0) -> dict:
    def attempt():
        try:
            return scrape(port)
        except SCRAPE_ERRORS:
            return None

    return wait_until(attempt, timeout_s=timeout_s, what=f"a scrape of 127.0.0.1:{port}")


def serve_with_metrics(serve, tmp_path, jpeg_folder, name: str = "met", **config) -> tuple:
    """(the serving InProcessJob, its /metrics port)."""
    port = free_port()
    job = serve(write_config(tmp_path, jpeg_folder, name=name, **config), {"metrics": f"127.0.0.1:{port}"})
    return job, port


# -- what a scrape shows ------------------------------------------------------------------------


def test_a_scrape_is_the_status_snapshot_and_moves_as_a_trainer_reads(tmp_path, jpeg_folder, serve):
    job, port = serve_with_metrics(serve, tmp_path, jpeg_folder, buffer="1M")
    paths = job.paths
    first = scrape_when_serving(port)
    assert set(TYPES) <= set(first), f"missing: {set(TYPES) - set(first)}"
    for name, family in first.items():
        assert name.startswith("prefetchd_") and family.type == TYPES[name], name
        for sample in family.samples:
            assert sample.labels.keys() == LABELS[name], (name, sample.labels)
            assert sample.labels["job"] == "met"
    states = {s.labels["state"] for s in first["prefetchd_buffer_bytes"].samples}
    assert states == {"ready", "in_flight", "pinned", "spare"}
    assert value(first, "prefetchd_up") == 1
    assert value(first, "prefetchd_buffer_bound_bytes") == 1 << 20

    scrapes, stop = [], threading.Event()

    def keep_scraping():  # while the trainer reads: every scrape must hold the invariants below
        while not stop.is_set():
            scrapes.append(scrape(port))

    scraper = threading.Thread(target=keep_scraping)
    scraper.start()
    try:
        batches = read_epoch("met")
    finally:
        stop.set()
        scraper.join(10)
    assert len(batches) == 12 and len(scrapes) >= 2
    last = wait_until(
        lambda: (s := scrape(port)) and value(s, "prefetchd_consumed_images_total") >= 44 and s,
        what="the trainer's reads counted",
    )
    for earlier, later in zip([first, *scrapes], [*scrapes, last]):
        for name in ("prefetchd_produced_images_total", "prefetchd_consumed_images_total"):
            assert value(later, name) >= value(earlier, name), f"{name} went down"
    for s in [first, *scrapes, last]:
        by_state = sum(sample.value for sample in s["prefetchd_buffer_bytes"].samples)
        assert by_state == value(s, "prefetchd_buffer_used_bytes") <= value(s, "prefetchd_buffer_bound_bytes")
    status = job_status(paths)  # the same figures as `prefetchd status`, taken a moment later
    assert value(last, "prefetchd_consumed_images_total") == value(last, "prefetchd_rank_consumed_batches_total") * 4
    assert value(last, "prefetchd_produced_images_total") > value(first, "prefetchd_produced_images_total")
    assert value(last, "prefetchd_produced_batches_total") <= status["totals"]["produced"]
    assert value(last, "prefetchd_rank_position_epoch", rank="0") == 1  # the epoch was read to its end
    assert value(last, "prefetchd_workers") == status["workers"]["count"] == 1
    waits = last["prefetchd_trainer_steps_total"].samples
    if waits:  # a loader that reports its waits (the ZeroMQ heartbeat): counted for its rank
        assert value(last, "prefetchd_trainer_steps_total", rank="0") >= 11
        assert value(last, "prefetchd_trainer_waited_steps_total", rank="0") <= value(
            last, "prefetchd_trainer_steps_total", rank="0"
        )


def snapshot(ranks: list[dict]) -> dict:
    """A status snapshot as job_status makes it, for the parts /metrics reads."""
    return {
        "job": "j",
        "uptime_s": 3.5,
        "buffer": {
            "bound_bytes": 1000,
            "used_bytes": 700,
            "files_bytes": 700,
            "pinned_bytes": 100,
            "spare_batches": 2,
            "peak_bytes": 800,
            "batch_bytes": 100,
        },
        "ranks": ranks,
        "workers": {"count": 2, "busy": 1, "restarts": 0},
        "backing_off_no_space": False,
        "totals": {
            "produced": 9,
            "produced_images": 36,
            "consumed_images": 8,
            "deleted": 2,
            "bad_samples": 1,
            "bad_messages": 0,
            "refused": {"position": 3},
            "worker_restarts": 4,
        },
    }


def test_trainer_waits_are_series_only_for_ranks_that_report_them():
    rank = {"epoch": 0, "step": 2, "ready": 3, "in_flight": 1, "consumed": 2, "trainer": "alive"}
    ranks = [
        {
            **rank,
            "rank": 0,
            "last_report_s_ago": 0.2,
            "wait": {"seconds_total": 1.5, "waited_steps_total": 3, "steps_total": 10, "last_minute_share": 0.25},
        },
        {**rank, "rank": 1, "last_report_s_ago": None, "wait": None},  # a progress-file trainer
        {**rank, "rank": 2, "last_report_s_ago": None},  # a daemon from before the field
    ]
    found = {f.name + ("_total" if f.type == "counter" else ""): f for f in metrics.families(snapshot(ranks))}
    assert [s.labels["rank"] for s in found["prefetchd_trainer_wait_seconds_total"].samples] == ["0"]
    assert value(found, "prefetchd_trainer_wait_seconds_total", rank="0") == 1.5
    assert value(found, "prefetchd_trainer_waited_steps_total", rank="0") == 3
    assert [s.labels["rank"] for s in found["prefetchd_rank_batches_ahead"].samples] == ["0", "1", "2"]
    assert value(found, "prefetchd_buffer_bytes", state="ready") == 900  # 3 ranks x 3 batches x 100 bytes
    assert value(found, "prefetchd_buffer_bytes", state="pinned") == 100
    assert value(found, "prefetchd_buffer_bytes", state="spare") == 200
    assert value(found, "prefetchd_refused_total", kind="message") == 0  # there before the first refusal
    assert value(found, "prefetchd_worker_restarts_total") == 4


# -- refused values, a port in use --------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "0",
        "65536",
        "-1",
        "http",
        ":",
        "127.0.0.1:",
        "1.2.3.4:5:6",
        "*:9464",
        "[zz]:9464",
        "a b:9464",
        "x" * 100_000,
        "9464\n",
        "١٢٣",
    ],
)
def test_a_bad_metrics_address_is_a_config_error_naming_the_flag(address, tmp_path):
    with pytest.raises(ConfigError, match=r"^\[daemon\] metrics / --metrics: .*(1-65535|expected)") as caught:
        load_config(None, {"data": str(tmp_path), "metrics": address})
    assert len(str(caught.value)) < 400


def test_metrics_addresses_default_to_loopback(tmp_path):
    def address(value):
        return load_config(None, {"data": str(tmp_path), "metrics": value}).metrics

    assert address("9464") == address(":9464") == "127.0.0.1:9464"
    assert address("[::1]:80") == "[::1]:80" and address("0.0.0.0:9464") == "0.0.0.0:9464"
    assert load_config(None, {"data": str(tmp_path)}).metrics is None  # off by default


@pytest.mark.parametrize(
    "address, phrase",
    [(b"\xff\xfe:9464", "expected HOST:PORT"), (b"no-such-host.invalid:9464", "cannot resolve the host")],
    ids=["not-utf8", "unresolvable"],
)
def test_start_refuses_a_hostile_metrics_value_with_exit_2_leaving_nothing(
    address, phrase, tmp_path, jpeg_folder, job_root
):
    config = write_config(tmp_path, jpeg_folder, name="bad")
    result = subprocess.run(
        [sys.executable, "-m", "prefetchd", "start", str(config), "--metrics", address],
        capture_output=True,
        timeout=60,
    )
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 2, stderr
    assert "--metrics" in stderr and phrase in stderr and "Traceback" not in stderr
    assert list(job_root.iterdir()) == [], "a refused start left its job folder"


def test_a_port_in_use_fails_the_restart_and_keeps_the_warm_buffer(tmp_path, jpeg_folder, job_root):
    config = write_config(tmp_path, jpeg_folder, name="busy")
    paths = start_job(config)
    wait_until(lambda: len(list(paths.batch_dir.iterdir())) >= 4, timeout_s=30, what="4 batches made")
    pids = daemon_family(paths)
    for pid in pids:  # a crash: the next start finds the warm buffer
        os.kill(pid, signal.SIGKILL)
    wait_pids_gone(pids)
    batches = {p.name for p in paths.batch_dir.iterdir()}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "prefetchd", "start", str(config), "--metrics", f":{port}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "choose another port" in result.stderr
    assert "--metrics" in result.stderr and "Traceback" not in result.stderr
    assert {p.name for p in paths.batch_dir.iterdir()} == batches, "the warm buffer was deleted"
    left = {p.name for p in paths.dir.iterdir()}
    assert not left & {"manifest.json", "daemon.sock", "index", "tmp"}, f"the failed start left {left}"
    start_job(config)  # the port free: the buffer is still warm


# -- a stopped master, a flood, garbage -----------------------------------------------------------


def test_a_scrape_of_a_stopped_daemon_fails_within_its_timeout_and_it_serves_on(tmp_path, jpeg_folder, job_root):
    port = free_port()
    paths = start_job(write_config(tmp_path, jpeg_folder, name="met"), "--metrics", f"127.0.0.1:{port}")
    scrape_when_serving(port)
    pid = read_manifest(paths)["pid"]
    os.kill(pid, signal.SIGSTOP)  # the whole process: its HTTP thread too, the kernel still accepts
    try:
        began = time.monotonic()
        with pytest.raises(SCRAPE_ERRORS):
            scrape(port, timeout=1.0)
        assert time.monotonic() - began < 3.0
    finally:
        os.kill(pid, signal.SIGCONT)
    after = scrape_when_serving(port, timeout_s=10)
    assert value(after, "prefetchd_up") == 1
    assert job_status(paths)["pid"] == pid


def test_a_loop_that_does_not_answer_gives_a_503_not_a_hung_scrape():
    server = MetricsServer("127.0.0.1:0", answer_timeout_s=0.3)  # no master: nobody answers its queue
    server.serve()
    try:
        began = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
        assert caught.value.code == 503 and time.monotonic() - began < 2.0
        assert b"did not answer" in caught.value.read()
        answering = threading.Event()

        def loop():  # as the master's loop does, every turn
            while not answering.is_set():
                server.answer(lambda: snapshot([]))
                time.sleep(0.01)

        turns = threading.Thread(target=loop)
        turns.start()
        try:
            assert value(scrape(server.port), "prefetchd_worker_restarts_total") == 4
        finally:
            answering.set()
            turns.join(5)
    finally:
        server.close()
    with socket.socket() as again:  # closed: the port is free (TIME_WAIT aside)
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", server.port))


def test_a_flood_of_requests_and_garbage_bytes_do_not_stop_the_daemon(tmp_path, jpeg_folder, serve):
    job, port = serve_with_metrics(serve, tmp_path, jpeg_folder)
    scrape_when_serving(port)
    process = psutil.Process()  # the master's: its loop and HTTP server are this test's threads
    threads_before = process.num_threads()
    answered = []

    def flood():
        for _ in range(25):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
                answered.append(1)
            except (*SCRAPE_ERRORS, Exception):  # refused beyond the connection cap: a flood's due
                pass

    def garbage(payload: bytes):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
        except OSError:
            pass

    payloads = [
        os.urandom(4096),
        b"GET /" + b"A" * 200_000 + b" HTTP/1.1\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01",
        b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n",
        b"POST /metrics HTTP/1.0\r\n\r\n",
        b"GET /../../etc/passwd HTTP/1.0\r\n\r\n",
        b"",
        b"\r\n" * 1000,
    ]
    workers = [threading.Thread(target=flood) for _ in range(8)]
    workers += [threading.Thread(target=garbage, args=(p,)) for p in payloads * 3]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert answered, "no request of the flood was answered"
    assert job.thread.is_alive() and job.master.stop_reason is None, "the flood stopped the master"
    assert value(scrape_when_serving(port), "prefetchd_up") == 1
    assert job_status(job.paths)["workers"]["count"] == 1
    # Handler threads end with their connections: the thread count comes back down.
    wait_until(lambda: process.num_threads() <= threads_before + 1, timeout_s=10, what="the handler threads gone")


# -- the docs and the dashboard -------------------------------------------------------------------


def test_the_docs_table_is_the_metrics_table():
    text = (REPO / "docs" / "operations.md").read_text()
    assert metrics.markdown_table() in text, (
        "docs/operations.md's metrics table differs from prefetchd.ops.metrics.METRICS: regenerate it with "
        "python -c 'from prefetchd.ops.metrics import markdown_table; print(markdown_table())'"
    )


def test_the_dashboard_plots_only_metrics_that_exist():
    board = json.loads((REPO / "docker" / "grafana-dashboard.json").read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "prefetchd_up" in variables["job"]["query"]["query"]
    known = {name + suffix for name in TYPES for suffix in ("", "_bucket")}
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bprefetchd_[a-z_]+", target["expr"]))
            assert names and names <= known, (panel["title"], names - known)
            assert 'job=~"$job"' in target["expr"], panel["title"]
