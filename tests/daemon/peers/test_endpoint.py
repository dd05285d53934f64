"""The control socket over TCP: only when asked, loopback unless CURVE is configured.

Real daemons where the command is the point (its refusals, `prefetchd stop` over TCP or CURVE),
masters in this process elsewhere; real sockets, real certificates (zmq.auth.create_certificates).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from prefetchd import control
from prefetchd.config import build_config
from prefetchd.errors import ConfigError
from prefetchd_client import AuthError, PrefetchLoader
from prefetchd_client.layout import parse_tcp_endpoint
from prefetchd_client.locks import daemon_alive
from prefetchd_client.manifest import read_manifest
from prefetchd_client.transport import CLIENT_KEY_ENV, load_public_certificate
from tests.conftest import cli, daemon_family, start_job, wait_pids_gone, wait_until, write_config
from tests.helpers import free_port, job_status, read_epoch

pytestmark = pytest.mark.timeout(120)

# 48 images, batches of 4: 12 steps an epoch. A batch is ~16 KiB, so a 64 KiB bound holds 4:
# a loader reads the epoch only if its position reports reach the daemon over the endpoint.
BUFFER = "64K"
STEPS = 12


def stop_and_check_gone(paths, *, env: dict | None = None) -> None:
    """`prefetchd stop` ends the daemon gracefully ("stopped", not killed: its threads, the
    authenticator's included, ended) and leaves nothing behind."""
    pids = daemon_family(paths)
    result = cli("stop", "job", env=env)
    assert result.returncode == 0 and "job job: stopped" in result.stdout, (result.stdout, result.stderr)
    wait_pids_gone(pids)
    assert not paths.dir.exists()


@pytest.fixture
def certs(tmp_path) -> dict[str, Path]:
    """A server certificate, an authorised client and an intruder, as zmq.auth writes them."""
    folders = {name: tmp_path / "keys" / name for name in ("server", "client", "intruder", "authorized")}
    for folder in folders.values():
        folder.mkdir(parents=True)
    out = {}
    for name in ("server", "client", "intruder"):
        public, secret = zmq.auth.create_certificates(folders[name], name)
        os.chmod(secret, 0o600)  # zmq.auth leaves it to the umask; a secret key must be private
        out[name], out[f"{name}_public"] = Path(secret), Path(public)
    shutil.copy(out["client_public"], folders["authorized"])  # only the client is authorised
    out["authorized"] = folders["authorized"]
    return out


# -- (a) TCP on loopback -----------------------------------------------------------------------


def test_tcp_job_serves_a_loader_and_answers_status_and_stop(tmp_path, jpeg_folder, job_root):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    paths = start_job(write_config(tmp_path, jpeg_folder, buffer=BUFFER), "--endpoint", endpoint)
    manifest = read_manifest(paths)
    assert manifest["endpoint"] == endpoint and manifest["curve_public_key"] is None
    assert not paths.socket.exists(), "the daemon must listen on TCP only, not on its ipc socket too"
    assert manifest["buffer_bytes"] // manifest["batch_bytes"] < STEPS, "the bound must need the reports"

    assert [len(b.arrays["index"]) for b in read_epoch("job", timeout=30)] == [4] * STEPS
    # The reports travelled over TCP: the daemon has the loader at the next epoch's start.
    report = wait_until(
        lambda: (s := job_status(paths, through_cli=True))["ranks"][0]["epoch"] == 1 and s, what="position over TCP"
    )
    assert report["state"] == "serving" and report["pid"] == manifest["pid"]
    assert control.request(endpoint, {"op": "ping"})["pid"] == manifest["pid"]
    stop_and_check_gone(paths)


# -- (b) refused: a host that is not loopback, without CURVE ---------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "192.0.2.7", "[::]"])
def test_non_loopback_host_without_curve_is_refused(tmp_path, jpeg_folder, job_root, serve, host):
    # The command's own message and exit code for this refusal: the config-file case below.
    port = free_port()
    with pytest.raises(ConfigError) as refused:
        serve(write_config(tmp_path, jpeg_folder), {"endpoint": f"tcp://{host}:{port}"})
    assert refused.value.exit_code == ConfigError.exit_code
    for phrase in ("[daemon] endpoint / --endpoint", "not a loopback", f"tcp://127.0.0.1:{port}", "curve_secret_key"):
        assert phrase in str(refused.value), refused.value
    assert list(job_root.iterdir()) == [], "a refused start left files behind"
    with socket.socket() as s:  # and nothing listens on the port
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_non_loopback_host_in_the_config_file_is_refused(tmp_path, jpeg_folder, job_root):
    config = write_config(tmp_path, jpeg_folder)
    config.write_text(config.read_text().replace("[daemon]\n", '[daemon]\nendpoint = "tcp://10.1.2.3:5555"\n'))
    result = cli("start", str(config))
    assert result.returncode == 2 and "[daemon] endpoint / --endpoint tcp://10.1.2.3:5555" in result.stderr
    assert list(job_root.iterdir()) == []


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1", "tcp://127.0.0.1:65536", "udp://127.0.0.1:5555"])
def test_malformed_endpoint_flag_is_refused(tmp_path, jpeg_folder, job_root, serve, endpoint):
    with pytest.raises(ConfigError) as refused:
        serve(write_config(tmp_path, jpeg_folder), {"endpoint": endpoint})
    assert refused.value.exit_code == 2
    assert "--endpoint must be ipc or tcp://HOST:PORT" in str(refused.value) and repr(endpoint) in str(refused.value)
    assert list(job_root.iterdir()) == []


def test_the_command_refuses_a_malformed_endpoint_flag_in_one_message(tmp_path, jpeg_folder, job_root):
    endpoint = "udp://127.0.0.1:5555"
    result = cli("start", str(write_config(tmp_path, jpeg_folder)), "--endpoint", endpoint)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--endpoint must be ipc or tcp://HOST:PORT" in result.stderr and repr(endpoint) in result.stderr
    assert list(job_root.iterdir()) == []


def test_a_port_in_use_is_a_clear_error(tmp_path, jpeg_folder, job_root, serve):
    # How the command shows a port in use: tests/daemon/operations/test_metrics.py (--metrics).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as refused:
            serve(write_config(tmp_path, jpeg_folder), {"endpoint": f"tcp://127.0.0.1:{port}"})
    assert refused.value.exit_code == 2
    assert "cannot listen on" in str(refused.value) and "choose another port" in str(refused.value)
    assert list(job_root.iterdir()) == []


# -- (c) CURVE -----------------------------------------------------------------------------------


def start_curve_job(tmp_path, jpeg_folder, certs) -> tuple:
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # loopback: only the refusal rule is about other hosts
    flags = ["--endpoint", endpoint, "--curve-secret-key", str(certs["server"])]
    paths = start_job(
        write_config(tmp_path, jpeg_folder, buffer=BUFFER), *flags, "--curve-authorized-keys", str(certs["authorized"])
    )
    return paths, endpoint


def test_curve_admits_the_authorised_client_only(tmp_path, jpeg_folder, job_root, certs, monkeypatch):
    monkeypatch.delenv(CLIENT_KEY_ENV, raising=False)
    paths, endpoint = start_curve_job(tmp_path, jpeg_folder, certs)
    manifest = read_manifest(paths)
    server_key = load_public_certificate(certs["server_public"]).decode()
    assert manifest["endpoint"] == endpoint and manifest["curve_public_key"] == server_key
    assert "secret" not in json.dumps(manifest)

    # The authorised client reads an epoch; its reports reach the daemon (the bound needs them).
    batches = read_epoch("job", timeout=30, curve_client_key=certs["client"])
    assert [len(b.arrays["index"]) for b in batches] == [4] * STEPS
    ok = {CLIENT_KEY_ENV: str(certs["client"])}
    wait_until(
        lambda: job_status(paths, through_cli=True, env=ok)["ranks"][0]["epoch"] == 1, what="position over CURVE"
    )

    # The intruder: the loader fails at once with a clear error, not a batch timeout later...
    began = time.monotonic()
    with pytest.raises(AuthError, match="refused this client's CURVE key"):
        PrefetchLoader("job", as_tensors=False, curve_client_key=certs["intruder"])
    assert time.monotonic() - began < 5
    # ... a raw socket with its key (or with none) gets no answer at all, within a deadline...
    for curve in (certs["intruder"], None):
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        if curve is not None:
            sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(curve)
            sock.curve_serverkey = server_key.encode()
        sock.connect(endpoint)
        sock.send(b'{"op": "stop", "keep": false}')
        assert sock.poll(1500) == 0, "an unauthorised client got an answer"
        sock.close(linger=0)
        context.term()
    # ... and `status` with its key says refused (with the fix) instead of hanging.
    refused = job_status(paths, through_cli=True, env={CLIENT_KEY_ENV: str(certs["intruder"])})
    assert refused["state"] == "refused" and "curve_authorized_keys" in refused["error"]
    without_key = job_status(paths, through_cli=True)
    assert without_key["state"] == "refused" and CLIENT_KEY_ENV in without_key["error"]

    # Their stop requests did nothing; the authorised client still sees the same daemon.
    assert daemon_alive(paths) and job_status(paths, through_cli=True, env=ok)["pid"] == manifest["pid"]
    stop_and_check_gone(paths, env=ok)


def test_stop_works_without_a_client_key(tmp_path, jpeg_folder, job_root, certs, monkeypatch):
    # The manifest (0600, in a 0700 folder) proves the job is ours: stop signals the daemon.
    monkeypatch.delenv(CLIENT_KEY_ENV, raising=False)
    paths, _ = start_curve_job(tmp_path, jpeg_folder, certs)
    stop_and_check_gone(paths)


def test_a_readable_secret_key_is_refused_at_start(tmp_path, jpeg_folder, job_root, certs):
    os.chmod(certs["server"], 0o644)
    flags = ["--curve-secret-key", str(certs["server"]), "--curve-authorized-keys", str(certs["authorized"])]
    result = cli("start", str(write_config(tmp_path, jpeg_folder)), "--endpoint", "tcp://127.0.0.1:5555", *flags)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--curve-secret-key" in result.stderr and f"chmod 600 {certs['server']}" in result.stderr
    assert list(job_root.iterdir()) == []


# -- (d) config-level validation ------------------------------------------------------------------

BASE = {"source": [{"kind": "image_folder", "root": "/data"}], "transform": [{"op": "center_crop", "size": 8}]}


def build(daemon: dict, base: Path = Path("/cfg"), **flags):
    return build_config(BASE | {"daemon": daemon}, base=base, default_name="x", overrides=flags)


def curve_keys(certs) -> dict:
    return {"curve_secret_key": str(certs["server"]), "curve_authorized_keys": str(certs["authorized"])}


def test_the_default_endpoint_is_ipc():
    assert build({}).endpoint == "ipc" and build({}).curve_secret_key is None


@pytest.mark.parametrize(
    "endpoint", ["ipc", "tcp://127.0.0.1:5555", "tcp://127.9.8.7:1", "tcp://localhost:65535", "tcp://[::1]:5555"]
)
def test_loopback_endpoints_are_accepted(endpoint):
    assert build({"endpoint": endpoint}).endpoint == endpoint
    assert build({}, endpoint=endpoint).endpoint == endpoint


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1",  # no port
        "tcp://127.0.0.1:",
        "tcp://127.0.0.1:0",  # out of range
        "tcp://127.0.0.1:65536",
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:http",
        "udp://127.0.0.1:5555",  # other schemes
        "ipc:///tmp/x.sock",
        "inproc://x",
        "tcp://::1:5555",  # IPv6 without brackets
        "tcp://[127.0.0.1]:5555",
        "tcp://node7:5555",  # a name other than localhost
        "tcp://:5555",
        "",
    ],
)
def test_malformed_endpoints_say_what_is_accepted(endpoint):
    with pytest.raises(ConfigError, match=r"\[daemon\] endpoint / --endpoint must be ipc or tcp://HOST:PORT"):
        build({"endpoint": endpoint})


@pytest.mark.parametrize(
    "endpoint, where",
    [
        ("tcp://0.0.0.0:5555", "every interface"),
        ("tcp://*:5555", "every interface"),
        ("tcp://[::]:5555", "every interface"),
        ("tcp://10.0.0.1:5555", "10.0.0.1"),
        ("tcp://[2001:db8::1]:5555", "2001:db8::1"),
        ("tcp://128.0.0.1:5555", "128.0.0.1"),
    ],
)
def test_non_loopback_without_curve_is_refused_with_the_fix(endpoint, where):
    with pytest.raises(ConfigError) as info:
        build({}, endpoint=endpoint)
    message = str(info.value)
    assert f"--endpoint {endpoint} would listen on {where}, which is not a loopback address" in message
    assert "tcp://127.0.0.1:5555" in message and "--curve-secret-key" in message


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.1:5555"])
def test_non_loopback_with_curve_is_accepted(certs, endpoint):
    cfg = build({"endpoint": endpoint, **curve_keys(certs)})
    assert (cfg.endpoint, cfg.curve_secret_key) == (endpoint, str(certs["server"]))


def test_a_wildcard_bind_is_reached_over_loopback():
    assert parse_tcp_endpoint("tcp://*:5555").connect_address() == "tcp://127.0.0.1:5555"
    assert parse_tcp_endpoint("tcp://[::]:5555").connect_address() == "tcp://[::1]:5555"
    assert parse_tcp_endpoint("tcp://127.0.0.1:5555").connect_address() == "tcp://127.0.0.1:5555"


def test_curve_paths_resolve_like_other_paths(certs, monkeypatch):
    keys = certs["server"].parent.parent
    relative = {k: os.path.relpath(v, keys) for k, v in curve_keys(certs).items()}
    cfg = build({"endpoint": "tcp://127.0.0.1:5555", **relative}, base=keys)  # file: its folder
    assert cfg.curve_secret_key == str(certs["server"])
    monkeypatch.chdir(keys)
    cfg = build({}, endpoint="tcp://127.0.0.1:5555", **relative)  # flags: the current folder
    assert cfg.curve_authorized_keys == str(certs["authorized"])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c, d: d.pop("curve_authorized_keys"), "go together: set both"),
        (lambda c, d: d.pop("curve_secret_key"), "go together: set both"),
        (lambda c, d: d.update(endpoint="ipc"), "secures a TCP endpoint: set \\[daemon\\] endpoint"),
        (lambda c, d: d.update(endpoint=5555), r"\[daemon\] endpoint must be str"),
        (lambda c, d: d.update(curve_secret_key=""), "--curve-secret-key must be the path"),
        (lambda c, d: os.chmod(c["server"], 0o640), "mode 0640: a secret key must be yours alone; run chmod 600"),
        (lambda c, d: d.update(curve_secret_key=str(c["server_public"])), "holds no secret key"),
        (lambda c, d: d.update(curve_secret_key=str(c["server"]) + ".missing"), "cannot open"),
        (
            lambda c, d: (
                os.symlink(c["server"], c["server"].with_name("link"))
                or d.update(curve_secret_key=str(c["server"].with_name("link")))
            ),
            "a symlink",
        ),
        (lambda c, d: c["server"].write_text('curve\n    secret-key = "short"\n'), "not 40"),
        (lambda c, d: d.update(curve_authorized_keys=str(c["server"])), "is not a folder"),
        (lambda c, d: os.unlink(c["authorized"] / "client.key"), "holds no client certificates"),
        (lambda c, d: os.chmod(c["authorized"], 0o777), "not writable by others"),
        (lambda c, d: os.chmod(c["authorized"] / "client.key", 0o666), "not writable by others"),
    ],
)
def test_curve_key_mistakes_are_refused_with_the_fix(certs, change, message):
    daemon = {"endpoint": "tcp://10.0.0.1:5555", **curve_keys(certs)}
    change(certs, daemon)
    with pytest.raises(ConfigError, match=message):
        build(daemon)
