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
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import psutil
import pytest

from prefetchd.remote import rayaddress, raycluster, rayresults
from tests.conftest import wait_until
from tests.crossusers import ALICE, MALLORY, no_traceback
from tests.helpers import free_port

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray"), pytest.mark.heavy]


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
