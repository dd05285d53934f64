"""Only Ray clusters the user trusts (issue 24, findings 1 and 10).

Ray's own ``auto`` joins whatever cluster it finds: $RAY_ADDRESS, /tmp/ray/ray_current_cluster
(whoever ran `ray start` last), then any raylet in the process table, whatever its owner; and
``ray.get`` unpickles what the cluster returns. Here another user (mallory) runs a head of her
own and alice's `--ray-address auto` must refuse it; a private instance (``local``) must live in
a 0700 folder of alice's, not the shared /tmp/ray, and go whole with a cancelled start; and the
bridge must read results as bytes, never through Ray's deserialiser.

Every Ray process a test starts is ended by its pid (found by the files it holds open in the
test's own temp folder), never by `ray stop`, which would end other tests' clusters.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from prefetchd.remote import rayaddress, raycluster, rayresults
from tests.conftest import cli, wait_until, write_config
from tests.crossusers import ALICE, MALLORY, no_traceback
from tests.helpers import free_port

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray")]


def _holding_files_under(folder: Path, uid: int) -> list[psutil.Process]:
    """``uid``'s processes with a file open under ``folder``: a Ray instance's, whatever their titles."""
    prefix = os.path.join(os.path.realpath(folder), "")
    found = []
    for p in psutil.process_iter(["uids"]):
        if p.info["uids"] is None or p.info["uids"].real != uid:
            continue
        try:
            links = [os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{p.pid}/fd")]
        except OSError:
            continue
        if any(link.startswith(prefix) for link in links):
            found.append(p)
    return found


def _kill_all(processes: list[psutil.Process]) -> None:
    for p in processes:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(processes, timeout=10)


# -- the address: never another user's cluster ---------------------------------------------------


@pytest.fixture
def mallorys_head(users):
    """A Ray head of mallory's, started as she would to lure others: `ray start --head` with token
    authentication off, its temp folder open to all (Ray makes its session folders 0777 anyway).
    Ended by the pids that hold files in that folder."""
    mallory = users[MALLORY]
    folder = Path(tempfile.mkdtemp(prefix="pfd-mallory-ray-", dir="/tmp"))
    os.chown(folder, mallory.uid, mallory.gid)
    folder.chmod(0o755)
    port = free_port()
    env = {"RAY_AUTH_MODE": "disabled", "HOME": str(folder)}
    started = mallory.run(
        mallory.python, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())",
        "start", "--head", f"--port={port}", f"--temp-dir={folder}/r", "--num-cpus=1", "--include-dashboard=false",
        env=env, timeout=180,
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield folder, port
    finally:
        _kill_all(_holding_files_under(folder, mallory.uid))
        shutil.rmtree(folder, ignore_errors=True)


def test_auto_never_joins_another_users_cluster(users, alice_root, shared_data, mallorys_head):
    """Before: alice's `start --ray-address auto` joined mallory's head (found in the process
    table) and served batches made by mallory's workers, her bridge unpickling their results."""
    alice, mallory = users[ALICE], users[MALLORY]
    folder, port = mallorys_head
    try:
        result = alice.run(
            alice.python, "-m", "prefetchd", "start", str(shared_data), "--executor", "ray", "--ray-address", "auto",
            "--workers", "0", "--ray-workers", "1", timeout=180,
        )  # fmt: skip
    finally:
        alice.prefetchd("stop", "job", "--timeout", "5")  # the old code's job, had it joined
    assert result.returncode == 5, (result.returncode, result.stdout, result.stderr)  # WORKER_BOOT
    assert "found no Ray cluster of yours on this node" in result.stderr, result.stderr
    assert f"uid {mallory.uid}" in result.stderr, result.stderr
    assert no_traceback(result), result.stderr
    # Ray writes a driver's logs into the session it joins: nothing of alice's may be in mallory's.
    alices = [p for p in folder.rglob("*") if p.lstat().st_uid == alice.uid]
    assert not alices, f"alice's driver joined mallory's cluster: {alices[:5]}"

    # Named outright, her head is refused too: its port on this node is hers, not alice's.
    named = alice.prefetchd(
        "start", str(shared_data), "--executor", "ray", "--ray-address", f"127.0.0.1:{port}", "--workers", "0",
        "--ray-workers", "1",
    )  # fmt: skip
    assert named.returncode == 5 and f"is uid {mallory.uid}'s, not yours" in named.stderr, named.stderr
    assert no_traceback(named), named.stderr


def test_an_address_on_this_node_is_checked_against_its_listener(mallorys_listener):
    """The owner check alone, on a real listener of mallory's and one of ours (no Ray start)."""
    mallory, theirs = mallorys_listener
    with pytest.raises(raycluster.RayBootError, match=f"is uid {mallory.uid}'s, not yours"):
        rayaddress.check_owner(f"127.0.0.1:{theirs}", "--ray-address")
    with pytest.raises(raycluster.RayBootError, match="another user"):
        rayaddress.resolve_address("auto", {"RAY_ADDRESS": f"localhost:{theirs}"})
    with socket.socket() as ours:
        ours.bind(("127.0.0.1", 0))
        ours.listen()
        mine = f"127.0.0.1:{ours.getsockname()[1]}"
        assert rayaddress.resolve_address(mine) == mine
        assert rayaddress.resolve_address("auto", {"RAY_ADDRESS": mine}) == mine
    assert rayaddress.resolve_address("10.255.255.1:6379") == "10.255.255.1:6379"  # another machine: the user's word
    assert rayaddress.resolve_address("local", {"RAY_ADDRESS": f"127.0.0.1:{theirs}"}) == "local"
    with pytest.raises(raycluster.RayBootError, match="is not HOST:PORT"):
        rayaddress.resolve_address("no-port-here")


@pytest.fixture
def mallorys_listener(users):
    """A TCP listener of mallory's on every address of this node (as `ray start --head` binds
    its GCS), its port; no Ray start."""
    mallory = users[MALLORY]
    listener = mallory.popen(
        mallory.python, "-c",
        "import socket, sys; s = socket.create_server(('::', 0), family=socket.AF_INET6, dualstack_ipv6=True); "
        "print(s.getsockname()[1], flush=True); sys.stdin.read()",
    )  # fmt: skip
    try:
        yield mallory, int(listener.stdout.readline())
    finally:
        listener.stdin.close()
        listener.wait(timeout=10)
        listener.stdout.close()


# -- a private instance: its own folder, and nothing left by a cancelled start -------------------


def _ray_processes_of(start: psutil.Process) -> dict[int, psutil.Process]:
    """Every process below `prefetchd start` (the daemon, its bridge, the instance), and every
    process in the daemon's session (re-parented ones too)."""
    found = {}
    try:
        below = start.children(recursive=True)
    except psutil.Error:
        return found
    sessions = set()
    for p in below:
        found[p.pid] = p
        try:
            if os.getsid(p.pid) == p.pid:
                sessions.add(p.pid)
        except OSError:
            pass
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) in sessions:
                found[p.pid] = p
        except (OSError, psutil.Error):
            continue
    return found


def _session_dir(processes) -> str | None:
    """The session folder Ray's processes write their logs in (<session>/logs/...)."""
    for p in processes:
        try:
            files = [os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{p.pid}/fd")]
        except OSError:
            continue
        for f in files:
            parts = f.split("/logs/")
            if len(parts) == 2 and os.path.basename(parts[0]).startswith("session_"):
                return parts[0]
    return None


def _named(processes, name: str) -> bool:
    for p in processes:
        try:
            if p.name() == name or (p.cmdline() and os.path.basename(p.cmdline()[0]) == name):
                return True
        except psutil.Error:
            continue
    return False


def _cancel_local_start(config: Path, when: str) -> tuple[subprocess.CompletedProcess, dict, str | None, float]:
    """Start with --ray-address local, SIGTERM `start` once process ``when`` of the instance runs;
    (the start's result, every process seen under it, the raylet's session folder, seconds the
    start took to return after the signal)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefetchd", "start", str(config), "--executor", "ray", "--ray-address", "local",
         "--workers", "0", "--ray-workers", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    start, seen = psutil.Process(proc.pid), {}
    try:
        session = None

        def reached():
            nonlocal session
            seen.update(_ray_processes_of(start))
            session = session or _session_dir(seen.values())
            return _named(seen.values(), when) or proc.poll() is not None

        wait_until(reached, timeout_s=120, interval_s=0.01, what=f"the private instance's {when}")
        session = session or _session_dir(seen.values())
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while proc.poll() is None:  # every process seen before `start` returns
            seen.update(_ray_processes_of(start))
            time.sleep(0.01)
        took = time.monotonic() - signalled
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), seen, session, took


def _alive(processes) -> list[psutil.Process]:
    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.Error:
            continue
    return left


@pytest.mark.long  # 15 CPU-s of a private Ray instance booted and cancelled
def test_a_cancelled_local_start_leaves_no_ray_process_and_used_a_private_folder(job_root, jpeg_folder, tmp_path):
    """Before: the instance lived in the shared /tmp/ray (session folders 0777), and a SIGTERM
    to `start` while Ray booted left ray::DashboardAgent and ray::RuntimeEnvAgent behind (2 of 4
    trials, alive 40 s later)."""
    config = write_config(tmp_path, jpeg_folder, workers=0)
    result, seen, session, took = _cancel_local_start(config, "raylet")
    try:
        left = _alive(seen.values())
        if left:  # a SIGKILLed process may take a moment to be gone; the guard sweeps for 3 s, then exits
            _, left = psutil.wait_procs(left, timeout=10)
            left = _alive(left)  # an orphan that exited may stay a zombie until PID 1 reaps it
        assert result.returncode != 0, result.stdout
        assert no_traceback(result), result.stderr
        assert not left, f"left behind by a cancelled start: {[(p.pid, p.name()) for p in left]}"
        private = job_root / "job" / "ray"
        assert session is not None and session.startswith(f"{private}/"), f"Ray's session folder was {session}"
        assert took < 20, f"`start` took {took:.1f} s to return after SIGTERM"
        assert not private.exists(), "the private instance's folder outlived the start"
    finally:
        _kill_all(_alive(seen.values()))


@pytest.mark.long
@pytest.mark.parametrize("when", ["gcs_server", "ray::DashboardAgent", "ray::IDLE"])
def test_a_local_start_cancelled_at_any_point_leaves_no_ray_process(job_root, jpeg_folder, tmp_path, when):
    config = write_config(tmp_path, jpeg_folder, workers=0)
    result, seen, _, _ = _cancel_local_start(config, when)
    try:
        _, left = psutil.wait_procs(_alive(seen.values()), timeout=10)  # the guard sweeps for 3 s, then exits
        left = _alive(left)  # an orphan that exited may stay a zombie until PID 1 reaps it
        assert not left, f"left behind by a start cancelled at {when}: {[(p.pid, p.name()) for p in left]}"
        assert no_traceback(result), result.stderr
    finally:
        _kill_all(_alive(seen.values()))


@pytest.mark.long  # Ray gives its GCS ~40 s before it says it failed
def test_a_ray_that_cannot_boot_says_rays_own_reason(job_root, jpeg_folder, tmp_path):
    """Before: "no worker booted within 120 s" (or Ray's first line, without its reason)."""
    config = write_config(tmp_path, jpeg_folder, workers=0)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli(
            "start", str(config), "--executor", "ray", "--ray-address", "local", "--workers", "0", "--ray-workers", "1",
            env={"RAY_GCS_SERVER_PORT": str(port)}, timeout=200,
        )  # fmt: skip
    assert result.returncode == 5, (result.returncode, result.stderr)
    assert "Ray's own words" in result.stderr and f"port is {port}" in result.stderr, result.stderr
    assert no_traceback(result), result.stderr


# -- results: bytes, never unpickled ---------------------------------------------------------------

_READ_RESULTS = r"""
import os, sys
import ray
from prefetchd.remote import raycluster, rayresults

folder, bombed = sys.argv[1], sys.argv[2]
options = dict(local_cpus=1, store_bytes=80 << 20, plasma_dir="/tmp", ray_temp=folder + "/s")
raycluster.connect(ray, "local", options, print)

class Bomb:  # what a hostile node returns: unpickling it runs its code as the driver's user
    def __reduce__(self):
        return (open, (bombed, "w"))

@ray.remote(max_retries=0)
def bomb():
    return Bomb()

@ray.remote(max_retries=0)
def raises():
    raise ValueError("the reader said no")

@ray.remote(max_retries=0, num_returns=2)
def batch():
    return b'{"ok": true}', b"\x00\xff" * 4

try:
    rayresults.get_plain(ray, [bomb.remote()], 60)
    print("READ the bomb")
except rayresults.NotPlainData as exc:
    print("REFUSED", exc)
print("BOMBED" if os.path.exists(bombed) else "NOT BOMBED")
try:
    rayresults.get_plain(ray, [raises.remote()], 60)
except rayresults.RayTaskFailed as exc:
    print("FAILED", exc)
print("BYTES", [bytes(v) for v in rayresults.get_plain(ray, list(batch.remote()), 60)])
ray.get(bomb.remote())  # what Ray's own get does with it
print("RAY.GET", "BOMBED" if os.path.exists(bombed) else "NOT BOMBED")
"""


def test_results_from_ray_are_read_as_bytes_and_never_unpickled(tmp_path):
    """ray.get runs pickle.loads on whatever a node returns as "PYTHON": the bridge reads past it."""
    folder = Path(tempfile.mkdtemp(prefix="pfd-rt-", dir="/dev/shm"))
    script = tmp_path / "read_results.py"
    script.write_text(textwrap.dedent(_READ_RESULTS))
    bombed = tmp_path / "bombed"
    try:
        result = subprocess.run(
            [sys.executable, str(script), str(folder), str(bombed)], capture_output=True, text=True, timeout=240
        )
    finally:
        _kill_all(_holding_files_under(folder, os.getuid()))
        shutil.rmtree(folder, ignore_errors=True)
    out = result.stdout
    assert "REFUSED a Ray task returned a 'PYTHON' object" in out and "NOT BOMBED" in out, out + result.stderr
    assert "FAILED TASK_EXECUTION_EXCEPTION: ValueError: the reader said no" in out, out
    assert "BYTES [b'{\"ok\": true}', b'\\x00\\xff\\x00\\xff\\x00\\xff\\x00\\xff']" in out, out
    assert "RAY.GET BOMBED" in out, "the bomb is live: Ray's own get runs it"


@pytest.mark.parametrize(
    "report, why",
    [
        (b'{"ok": true, "per_source": [4], "replaced": [], "longest_bad_run": true}', "not a int"),
        (b'{"ok": 1, "per_source": [4], "replaced": [], "longest_bad_run": 0}', "fields"),
        (b'{"ok": true, "per_source": [4], "replaced": [], "longest_bad_run": 0, "x": 1}', "fields"),
        (b'{"ok": false, "sample": false, "error": ["a"]}', "not a str"),
        (b'{"ok": false, "mismatch": {"pillow": {"nested": 1}}}', "not a few names"),
        (b"[1, 2]", "not a JSON object"),
        (b"\xff\xfe", "not JSON"),
        (b"[" * 100_000, "not JSON"),
        (b" " * ((1 << 20) + 1), "more than"),  # rayresults.MAX_REPORT_BYTES + 1
    ],
)
def test_a_task_report_is_checked_field_by_field(report, why):
    with pytest.raises(rayresults.NotPlainData, match=why):
        rayresults.task_report(memoryview(report))


def test_a_good_task_report_passes():
    report = b'{"ok": true, "per_source": [4], "replaced": [], "longest_bad_run": 0}'
    assert rayresults.task_report(report)["per_source"] == [4]
    assert rayresults.fingerprint_report(b'{"fingerprint": "ab", "facts": {"pillow": "11", "x": null}}')[0] == "ab"


def test_paths_too_long_for_rays_sockets_are_refused_before_ray_starts(job_root, jpeg_folder, tmp_path, monkeypatch):
    """<job>/ray/s, and a folder in $TMPDIR (job_root's: 36 bytes), too long for Ray's sockets."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert len(os.environ["TMPDIR"]) + len("/prefetchd-ray-xxxxxxxx/s") + raycluster.SOCKET_SUFFIX_BYTES > 107
    config = write_config(tmp_path, jpeg_folder, name="longer-name", workers=0)
    result = cli("start", str(config), "--executor", "ray", "--ray-address", "local", "--workers", "0")
    assert result.returncode == 5, (result.returncode, result.stderr)
    assert "would exceed 107 bytes" in result.stderr and "XDG_RUNTIME_DIR" in result.stderr, result.stderr
    assert no_traceback(result), result.stderr


def test_a_symlink_where_the_private_folder_goes_is_not_followed(job_root, jpeg_folder, tmp_path, monkeypatch):
    """<job>/ray planted as a symlink (by the user, unluckily): the processes holding files where
    it points are not ended as the instance's, nor is anything there removed."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("mine")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; f = open(sys.argv[1]); sys.stdin.read()", str(elsewhere / "keep")],
        stdin=subprocess.PIPE,
    )
    try:
        wait_until(lambda: _holding_files_under(elsewhere, os.getuid()), what="the holder to open its file")
        (job_root / "job").mkdir(mode=0o700)
        (job_root / "job" / "ray").symlink_to(elsewhere)
        config = write_config(tmp_path, jpeg_folder, workers=0)
        result = cli("start", str(config), "--executor", "ray", "--ray-address", "local", "--workers", "0")
        assert result.returncode == 5 and no_traceback(result), result.stderr
        assert holder.poll() is None, "a process holding a file where the symlink points was ended"
        assert (elsewhere / "keep").read_text() == "mine"
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)


# -- the address, attacked again: forms that name this node without saying so ---------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "0", "[::]", "[::ffff:127.0.0.1]", "[::ffff:7f00:2]"])
def test_an_address_that_reaches_this_node_in_another_form_is_checked_too(mallorys_listener, host):
    """Before: 0.0.0.0, ``::`` and an IPv4-mapped loopback were taken for another machine's
    address (the user's word, unchecked), yet a connect to each reaches this node: alice's
    start would join mallory's head. Each is checked against the port's listener now."""
    mallory, port = mallorys_listener
    address = f"{host}:{port}"
    with socket.create_connection((host.strip("[]"), port), timeout=5):
        pass  # the form does reach mallory's listener on this node
    with pytest.raises(raycluster.RayBootError, match=f"is uid {mallory.uid}'s, not yours"):
        rayaddress.check_owner(address, "--ray-address")
    with pytest.raises(raycluster.RayBootError, match="another user"):
        rayaddress.resolve_address("auto", {"RAY_ADDRESS": address})


def test_a_port_of_this_node_that_nobody_listens_on_is_refused_at_once():
    """Before: accepted (no listener, so no stranger), and Ray then retried the port for 45 s,
    time for another user to bind it and be joined. Now refused before Ray is asked."""
    with socket.socket() as s:  # a port that was free a moment ago, and is not listened on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        for address in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
            with pytest.raises(raycluster.RayBootError, match=f"nothing listens on port {port} of this node"):
                rayaddress.resolve_address(address)


def test_a_cluster_of_ours_that_another_users_raylet_on_this_node_joined_is_refused(users):
    """A raylet of mallory's on this node that names our head's GCS: tasks scheduled there run
    her code and return what she likes (as finding 1's flipped labels passed every check).
    Before: the head's listener alone was checked, and it is ours."""
    mallory = users[MALLORY]
    with socket.create_server(("127.0.0.1", 0)) as ours:
        port = ours.getsockname()[1]
        address = f"127.0.0.1:{port}"
        assert rayaddress.check_owner(address, "--ray-address") == address  # no raylet of another's yet
        raylet = mallory.popen(
            "/bin/bash", "-c", f'exec -a raylet {mallory.python} -c "import sys; sys.stdin.read()" '
            f"--gcs-address=localhost:{port} --node-ip-address=127.0.0.1",
        )  # fmt: skip
        try:
            wait_until(
                lambda: (mallory.uid, f"localhost:{port}") in rayaddress._raylets(), what="mallory's raylet to run"
            )
            with pytest.raises(raycluster.RayBootError, match=f"a raylet of uid {mallory.uid} on this node"):
                rayaddress.check_owner(address, "--ray-address")
        finally:
            raylet.stdin.close()
            raylet.wait(timeout=10)
    # A head on another machine: a raylet of hers here that joined it is refused the same way
    # (the driver would attach to it as this node's raylet).
    remote = "10.255.255.1:6379"
    assert rayaddress.check_owner(remote, "--ray-address") == remote
    raylet = mallory.popen(
        "/bin/bash", "-c", f'exec -a raylet {mallory.python} -c "import sys; sys.stdin.read()" --gcs-address={remote}'
    )
    try:
        wait_until(lambda: (mallory.uid, remote) in rayaddress._raylets(), what="mallory's raylet to run")
        with pytest.raises(raycluster.RayBootError, match=f"a raylet of uid {mallory.uid} on this node"):
            rayaddress.check_owner(remote, "--ray-address")
        assert rayaddress.check_owner("10.255.255.1:6380", "--ray-address") == "10.255.255.1:6380"  # another cluster
    finally:
        raylet.stdin.close()
        raylet.wait(timeout=10)


@pytest.mark.parametrize("address", ["ray://10.255.255.1:10001", "ray://127.0.0.1:10001", "anyscale://x:1"])
def test_a_ray_client_address_is_refused_before_ray_connects(address):
    """Before: accepted ("the user's word" off this node, owner-checked on it). A ray:// address
    is Ray Client, whose driver unpickles the server's answers (ray.util.client: a failed put's
    error is cloudpickle.loads'ed, and every get), and another scheme makes Ray import the module
    the scheme names. The bridge reads results as bytes only through a cluster's GCS address."""
    for given in (
        lambda: rayaddress.resolve_address(address),
        lambda: rayaddress.resolve_address("auto", {"RAY_ADDRESS": address}),
    ):
        with pytest.raises(raycluster.RayBootError, match="HOST:PORT of the cluster's head"):
            given()


def test_only_the_private_instances_processes_are_ended_not_others_holding_its_files(tmp_path):
    """The clean-up of a private instance SIGKILLs this user's processes that carry the
    instance's mark (every Ray process inherits it from the bridge: GCS, raylet, both agents,
    the workers, 8 of 8 with Ray 2.60) or write a file under its folder. Before issue 24: any
    process holding a file there, so the user's own `tail -f <job>/ray/s/session_latest/logs/
    raylet.err` (or `less`) was SIGKILLed at every stop. Then: marked processes holding a file
    there, so an agent still starting (no log open yet) outlived a cancelled start (CI). Then:
    marked processes, which missed agents whose title rewrite had overwritten the environment
    /proc shows (1 cancelled start in 6). A reader of the logs is spared."""
    from prefetchd.remote.rayinstance import end_instance

    folder = tmp_path / "ray"
    (folder / "s" / "logs").mkdir(parents=True)
    log = folder / "s" / "logs" / "raylet.err"
    log.write_text("")
    hold = "import sys; f = open(sys.argv[1], sys.argv[2]); sys.stdin.read()"
    marked = {**os.environ, **raycluster.instance_mark(str(folder))}
    unmarked = {k: v for k, v in os.environ.items() if k != raycluster.INSTANCE_MARK}

    def holding(mode: str, env: dict) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", hold, str(log), mode], stdin=subprocess.PIPE, env=env)

    reader, ray_like, writer = holding("r", unmarked), holding("r", marked), holding("a", unmarked)
    wait = "import sys; sys.stdin.read()"  # marked, no file held: an agent still starting
    starting = subprocess.Popen([sys.executable, "-c", wait], stdin=subprocess.PIPE, env=marked)
    processes = (reader, ray_like, writer, starting)
    try:
        wait_until(lambda: len(_holding_files_under(folder, os.getuid())) == 3, what="three to open the log")
        ended = end_instance(str(folder), timeout_s=10)
        assert sorted(ended) == sorted([ray_like.pid, writer.pid, starting.pid])
        for p in processes[1:]:
            p.wait(timeout=10)  # ended (and reaped by end_instance: its code reads 0 here)
        assert reader.poll() is None, "the user's own reader of Ray's log was SIGKILLed"
    finally:
        for p in processes:
            p.stdin.close()
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def test_a_guard_ends_nothing_in_a_folder_a_later_start_made_anew(tmp_path):
    """A guard sweeps for seconds after its bridge is gone; a start that follows at once removes
    the folder and makes it anew, and the processes there are the new instance's: not the old
    guard's to end."""
    from prefetchd.remote.rayinstance import end_instance

    folder = tmp_path / "ray"
    folder.mkdir()
    marked = {**os.environ, **raycluster.instance_mark(str(folder))}
    code = "import sys; sys.stdin.read()"
    new_instance = None
    try:
        def remade():
            nonlocal new_instance
            folder.rmdir()
            folder.mkdir()
            new_instance = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, env=marked)

        timer = threading.Timer(0.3, remade)  # while the guard waits out its quiet period
        timer.start()
        assert end_instance(str(folder), timeout_s=10, quiet_s=2.0, same_folder=True) == []
        timer.join()
        assert new_instance.poll() is None, "the new start's process was ended by the old guard"
    finally:
        if new_instance is not None:
            new_instance.stdin.close()
            new_instance.kill()
            new_instance.wait(timeout=10)


@pytest.mark.long  # a Ray start (~12 s on 2 cores)
def test_a_killed_daemons_private_instance_outside_the_job_folder_is_removed(
    job_root, jpeg_folder, tmp_path, monkeypatch
):
    """A job path too long for Ray's sockets puts the private instance in a fresh 0700 folder in
    the temp folder (/tmp/prefetchd-ray-*). Before: after a kill -9 of the daemon its processes
    were ended (the bridge's guard) but that folder, Ray's session and logs, stayed for good: no
    later start or stop knows its name. Now the guard removes it once the processes are gone."""
    short = Path(tempfile.mkdtemp(prefix="pfd", dir="/tmp"))  # room for Ray's socket paths
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(short))
    config = write_config(tmp_path, jpeg_folder, name="a-job-name-too-long-for-rays-sockets", workers=0)
    holders: list[psutil.Process] = []
    try:
        result = cli(
            "start", str(config), "--executor", "ray", "--ray-address", "local", "--ray-workers", "1", timeout=180
        )
        assert result.returncode == 0, result.stderr
        (elsewhere,) = short.glob("prefetchd-ray-*")
        assert not (job_root / "a-job-name-too-long-for-rays-sockets" / "ray").exists()
        holders = _holding_files_under(elsewhere, os.getuid())
        assert holders, "no Ray process holds a file in the private folder"
        pid = int(next(line.split(": ", 1)[1] for line in result.stdout.splitlines() if line.startswith("pid:")))
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(holders), timeout_s=30, what="the instance's processes to be ended")
        wait_until(lambda: not elsewhere.exists(), timeout_s=30, what=f"{elsewhere} to be removed")
    finally:
        _kill_all(_alive(holders) + _holding_files_under(short, os.getuid()))
        shutil.rmtree(short, ignore_errors=True)


def test_the_guard_removes_only_a_folder_of_the_users_own(users):
    """Self-attack of the guard's clean-up: once the pool removed the instance's folder in /tmp,
    another user may make a folder of that name before the guard runs. The guard must leave it
    (nothing is deleted through a path that is not ours); before the check, it removed hers."""
    mallory = users[MALLORY]
    base = Path(tempfile.mkdtemp(prefix="pfd-guard-", dir="/tmp"))
    base.chmod(0o1777)  # sticky and open to all, as /tmp
    theirs = base / "prefetchd-ray-abcdefgh"
    made = mallory.run("/bin/sh", "-c", f"mkdir -m 777 {theirs} && echo hers > {theirs}/file")
    assert made.returncode == 0, made.stderr
    code = (
        "import sys; from prefetchd.remote.rayinstance import start_guard; "
        "print(start_guard(sys.argv[1], True).pid, flush=True)"
    )
    try:
        started = subprocess.run([sys.executable, "-c", code, str(theirs)], capture_output=True, text=True, timeout=60)
        assert started.returncode == 0, started.stderr
        guard = int(started.stdout.split()[-1])  # it runs once its parent, the "bridge" here, is gone
        wait_until(lambda: not psutil.pid_exists(guard), timeout_s=30, what="the guard to finish")
        assert (theirs / "file").read_text() == "hers\n", "the guard removed another user's folder"
    finally:
        shutil.rmtree(base, ignore_errors=True)
