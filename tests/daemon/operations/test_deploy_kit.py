"""The deployment kit in docker/, checked without a container engine or a running systemd.

What an image, a pod or a unit would run is read from the files themselves and run here, as
written, against generated data: only paths that exist only inside the image or on the target
node (the config mounted at /etc/prefetchd, the tmpfs at /buffer, %t, the venv) are replaced, by
the variables and arguments the files define for that. The YAML files must have the properties
their comments promise; the unit must be one systemd would run as Type=notify.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest
import yaml

from prefetchd.sizes import parse_size
from prefetchd_client.layout import JobPaths
from tests.conftest import (
    JOB_ROOT_PREFIX,
    REPO,
    SHM,
    daemon_family,
    mounted_tmpfs,
    wait_pids_gone,
    wait_until,
    write_config,
)
from tests.daemon.lifecycle.test_sdnotify import FakeManager, ForegroundDaemon

pytestmark = pytest.mark.timeout(120)

DOCKER = REPO / "docker"
IMAGE_CONFIG = "/etc/prefetchd/job.toml"  # where the kit mounts a job's config
JOB = "imagenet"  # the job the kit serves: configs/imagenet.toml's (its probes ask about the root's one job)


# -- reading the files --------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in (DOCKER / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, rest = pending.strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def docker_values(kind: str) -> dict[str, str]:
    """ARG defaults or ENV values, by name."""
    values = {}
    for keyword, rest in dockerfile():
        if keyword == kind:
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                values[name] = value
    return values


def docker_exec_form(keyword: str) -> list[str]:
    (rest,) = [rest for k, rest in dockerfile() if k == keyword]
    return json.loads(rest)  # exec form: a JSON array, no shell


def the_image_command(config: Path, *args: str) -> list[str]:
    """ENTRYPOINT + CMD (or ``args``, as `docker run IMAGE ARGS` replaces CMD), the image-only
    config path replaced by ``config``, the entry point found on this PATH."""
    entrypoint = docker_exec_form("ENTRYPOINT")
    cmd = list(args) or docker_exec_form("CMD")
    command = [str(config) if a == IMAGE_CONFIG else a for a in entrypoint + cmd]
    found = shutil.which(command[0], path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    assert found, f"{command[0]} is not installed here"
    return [found, *command[1:]]


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def pod_spec() -> dict:
    (doc,) = list(yaml.safe_load_all((DOCKER / "kubernetes.yaml").read_text()))
    assert doc["kind"] in ("Pod", "Deployment", "Job"), doc["kind"]
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def sidecar(spec: dict) -> dict:
    (daemon,) = [c for c in spec["initContainers"] if c.get("restartPolicy") == "Always"]
    return daemon


def unit() -> configparser.ConfigParser:
    # systemd allows a key more than once (ExecStartPre=...), so not strict; `%` is a specifier.
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",), comment_prefixes=("#", ";"))
    parser.optionxform = str  # keys are case-sensitive
    parser.read_string((DOCKER / "prefetchd.service").read_text())
    return parser


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def k8s_size(text: str) -> int:
    return parse_size(text.removesuffix("i"))  # "32Gi": prefetchd's sizes are powers of 1024 too


def buffer_flag(args: list[str]) -> int:
    return parse_size(args[args.index("--buffer") + 1])


def probe_command(spec: dict, probe: str) -> list[str]:
    return sidecar(spec)[probe]["exec"]["command"]


@pytest.fixture
def volume():
    """A folder on the real tmpfs standing for the kit's /buffer, removed after the test."""
    folder = Path(tempfile.mkdtemp(prefix=JOB_ROOT_PREFIX, dir=SHM))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def empty_dir(volume):
    """A tmpfs mounted 0777 in ``volume``, as the kubelet makes a pod's emptyDir."""
    with mounted_tmpfs(volume / "emptydir", "size=64m,mode=777") as mount:
        yield mount


# -- the Dockerfile -----------------------------------------------------------------------


def test_the_dockerfile_builds_a_slim_non_root_image_without_torch(tmp_path):
    instructions = dockerfile()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    args = docker_values("ARG")
    (user,) = [rest for k, rest in instructions if k == "USER"]
    uid, gid = (args.get(v.strip("${}"), v) for v in user.split(":"))
    assert int(uid) > 0 and int(gid) > 0, f"USER {user} is root"
    runs = " ".join(rest for k, rest in instructions if k == "RUN")
    assert '--uid "${UID}"' in runs and "pip install" in runs and './client ".[${EXTRAS}]"' in runs
    # the extras a build argument: each one the README names, Parquet and object storage among them
    assert args["EXTRAS"] == "metrics"
    comment = (DOCKER / "Dockerfile").read_text()
    extras = re.search(r"--build-arg EXTRAS=(\S+)", comment)[1].split(",")
    optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"parquet", "cloud"} <= set(extras) <= set(optional)
    assert "torch" not in runs.lower(), "the daemon never imports torch: the image must not install it"
    entrypoint = docker_exec_form("ENTRYPOINT")
    assert entrypoint[:2] == ["prefetchd", "start"] and "--foreground" in entrypoint
    assert docker_exec_form("CMD") == [IMAGE_CONFIG]

    # What the COPY lines bring in is enough to build both packages (offline, as pip would in the image).
    stage = tmp_path / "src"
    stage.mkdir()
    for keyword, rest in instructions:
        if keyword == "COPY" and not rest.split()[-1].startswith("/"):  # into the build's WORKDIR
            *sources, target = rest.split()
            for source in sources:
                copy = shutil.copytree if (REPO / source).is_dir() else shutil.copy
                copy(REPO / source, stage / (target if target.endswith("/") and target != "./" else source))
    wheels = tmp_path / "wheels"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            "./client",
            ".",
        ],
        cwd=stage,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name.split("-")[0] for p in wheels.iterdir()) == ["prefetchd", "prefetchd_client"]


def test_the_image_command_serves_in_a_kubernetes_empty_dir_and_the_probes_see_it(tmp_path, jpeg_folder, empty_dir):
    """The pod's steps on this machine: an emptyDir as the kubelet makes it (a tmpfs mounted
    0777), no init container, the image's ENTRYPOINT + CMD with the pod's environment; the
    startup probe and compose's healthcheck pass while it serves and fail once it stopped."""
    spec = pod_spec()
    mount, volume = "/buffer", empty_dir
    assert [c["name"] for c in spec["initContainers"]] == ["prefetchd"]  # nothing runs before it, as root or not

    image_env = docker_values("ENV")
    pod_env = env_of(sidecar(spec))
    assert pod_env["PREFETCHD_ROOT"] == image_env["PREFETCHD_ROOT"] and pod_env["PREFETCHD_POD_VOLUME"] == mount
    env = {**image_env, **pod_env}
    env = {k: str(volume) + v[len(mount) :] if v == mount or v.startswith(mount + "/") else v for k, v in env.items()}
    config = write_config(tmp_path, jpeg_folder, name=JOB)
    paths = JobPaths(Path(env["PREFETCHD_ROOT"]) / JOB)
    healthcheck = compose()["services"]["prefetchd"]["healthcheck"]["test"]
    assert healthcheck[0] == "CMD-SHELL"
    probes = [probe_command(spec, "startupProbe"), probe_command(spec, "livenessProbe"), ["sh", "-c", healthcheck[1]]]

    def probe_codes() -> list[int]:
        runs = [subprocess.run(p, env={**os.environ, **env}, capture_output=True, timeout=30) for p in probes]
        return [run.returncode for run in runs]

    daemon = ForegroundDaemon(the_image_command(config), env, tmp_path)
    try:
        wait_until(lambda: "serving" in daemon.stderr() or daemon.proc.poll() is not None, 60, what="serving")
        assert daemon.proc.poll() is None, daemon.stderr()
        daemon.family = daemon_family(paths)
        assert probe_codes() == [0, 0, 0]
        assert daemon.stop(signal.SIGTERM) == 0, daemon.stderr()  # docker stop, or the pod ending
        wait_pids_gone(daemon.family)
        assert not paths.dir.exists()
        assert 0 not in probe_codes()
    finally:
        daemon.close()


# -- compose.yaml and kubernetes.yaml -----------------------------------------------------


def test_compose_shares_one_sized_tmpfs_between_the_daemon_and_the_trainer():
    text = (DOCKER / "compose.yaml").read_text()
    assert "64 MB" in text  # the comment on why /dev/shm will not do
    doc = compose()
    daemon, trainer = doc["services"]["prefetchd"], doc["services"]["trainer"]
    assert daemon["build"]["dockerfile"] == "docker/Dockerfile" and daemon.get("init") is True
    volume = doc["volumes"]["buffer"]["driver_opts"]
    options = dict(o.split("=") for o in volume["o"].split(","))
    assert volume["type"] == "tmpfs"
    assert parse_size(options["size"]) >= buffer_flag(daemon["command"]) * 1.05, "the tmpfs must hold the buffer"

    args = docker_values("ARG")
    assert trainer["user"] == f"{args['UID']}:{args['GID']}" == f"{options['uid']}:{options['gid']}"
    assert int(options["mode"], 8) & 0o022 == 0, "a root others can write is refused"
    targets = []
    for service in (daemon, trainer):
        (mount,) = [v for v in service["volumes"] if v.get("source") == "buffer"]
        assert mount["type"] == "volume"
        targets.append(mount["target"])
        root = service["environment"]["PREFETCHD_ROOT"]
        assert root.startswith(mount["target"] + "/") and root == docker_values("ENV")["PREFETCHD_ROOT"]
    assert targets[0] == targets[1]
    assert trainer["depends_on"]["prefetchd"]["condition"] == "service_healthy"
    assert daemon["command"][0] == IMAGE_CONFIG and JOB not in daemon["healthcheck"]["test"][1]  # the config names it


def test_kubernetes_runs_the_daemon_as_a_native_sidecar_on_a_memory_empty_dir():
    text = (DOCKER / "kubernetes.yaml").read_text()
    assert "memory limit" in text and "tmpfs" in text  # the comment on where the pages are charged
    spec = pod_spec()
    daemon = sidecar(spec)
    (trainer,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert spec["securityContext"]["runAsUser"] > 0 and daemon["securityContext"]["runAsNonRoot"] is True
    assert trainer["securityContext"]["runAsNonRoot"] is True  # the pod's uid for both: one owner

    mounts = {}
    for container in (daemon, trainer):
        for mount in container["volumeMounts"]:
            empty = volumes[mount["name"]].get("emptyDir")
            if empty and env_of(container)["PREFETCHD_ROOT"].startswith(mount["mountPath"] + "/"):
                mounts[container["name"]] = (mount["name"], mount["mountPath"], env_of(container)["PREFETCHD_ROOT"])
    assert mounts["prefetchd"] == mounts["trainer"], mounts
    empty = volumes[mounts["prefetchd"][0]]["emptyDir"]
    assert empty["medium"] == "Memory"
    assert k8s_size(empty["sizeLimit"]) >= buffer_flag(daemon["args"]) * 1.05
    assert k8s_size(daemon["resources"]["limits"]["memory"]) > buffer_flag(daemon["args"]), "pages count here"
    assert daemon["args"][0] == IMAGE_CONFIG and daemon["image"] == "prefetchd:latest"
    assert env_of(daemon)["PREFETCHD_POD_VOLUME"] == env_of(trainer)["PREFETCHD_POD_VOLUME"] == mounts["prefetchd"][1]
    assert daemon["startupProbe"]["failureThreshold"] > 1
    for probe in ("startupProbe", "livenessProbe"):  # the job's name is the config's alone (issue 27)
        assert JOB not in probe_command(spec, probe)[-1]


_PSS_VOLUMES = {  # the volume types `restricted` allows
    *("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"),
}


def test_the_pod_passes_the_restricted_pod_security_standard():
    """issue 27: its init container ran as root (to chmod the emptyDir), which `restricted` rejects.
    The standard's rules (kubernetes.io/docs/concepts/security/pod-security-standards), each checked."""
    spec = pod_spec()
    pod = spec.get("securityContext", {})
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    for volume in spec["volumes"]:
        assert set(volume) - {"name"} <= _PSS_VOLUMES, volume
    for container in spec["initContainers"] + spec["containers"]:
        own = container.get("securityContext", {})
        merged = {**pod, **own}
        assert merged.get("runAsNonRoot") is True and merged.get("runAsUser", 1) != 0, container["name"]
        assert own.get("allowPrivilegeEscalation") is False and not own.get("privileged"), container["name"]
        assert own.get("capabilities", {}).get("drop") == ["ALL"], container["name"]
        assert set(own.get("capabilities", {}).get("add", [])) <= {"NET_BIND_SERVICE"}, container["name"]
        assert merged.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost"), container["name"]


# -- the systemd unit ---------------------------------------------------------------------


def test_the_unit_is_type_notify_with_a_watchdog_and_a_buffer_kept_across_restarts():
    service = unit()["Service"]
    assert service["Type"] == "notify" and service["Restart"] == "on-failure"
    assert service["RuntimeDirectoryPreserve"] == "restart" and service["KillMode"] == "mixed"
    assert 0 < parse_watchdog_s(service["WatchdogSec"]) <= 120
    argv = shlex.split(service["ExecStart"])
    assert argv[1] == "start" and "--foreground" in argv and "--keep" in argv
    assert argv[argv.index("--root") + 1] == f"%t/{service['RuntimeDirectory']}", "--root is the RuntimeDirectory"
    assert "0" not in service["RestartPreventExitStatus"].split()


def parse_watchdog_s(text: str) -> float:
    m = re.fullmatch(r"(\d+)\s*(s|min)?", text)
    assert m, text
    return int(m[1]) * (60 if m[2] == "min" else 1)


def test_the_units_exec_start_serves_notifies_and_a_restart_adopts_the_warm_buffer(tmp_path, jpeg_folder, volume):
    """ExecStart as systemd runs it (%t, the venv and the config replaced; the runtime directory
    made 0700 as RuntimeDirectory= does), twice, as Restart= or `systemctl restart` would, the
    folder kept between (RuntimeDirectoryPreserve=restart): READY=1, STOPPING=1, and the second
    daemon keeps the first one's batches."""
    service = unit()["Service"]
    runtime = volume / service["RuntimeDirectory"]
    runtime.mkdir(mode=0o700)
    config = write_config(tmp_path, jpeg_folder, name=JOB)
    argv = shlex.split(service["ExecStart"].replace("%t", str(volume)))
    argv = [str(config) if a == IMAGE_CONFIG else a for a in argv]
    assert argv[0].endswith("/bin/prefetchd")
    argv = [sys.executable, "-m", "prefetchd", *argv[1:]]  # the venv's prefetchd: this one
    paths = JobPaths(runtime / JOB)

    watchdog_usec = parse_watchdog_s(service["WatchdogSec"]) * 10**6
    manager = FakeManager()
    try:
        for life in ("first", "restarted"):
            daemon = ForegroundDaemon(argv, manager.env(watchdog_usec=watchdog_usec), tmp_path)
            try:
                manager.wait_for("READY=1", 60, on_arrival=lambda: paths.manifest.exists())
                daemon.family = daemon_family(paths)
                wait_until(lambda: any(paths.batch_dir.iterdir()), 30, what="batches in the buffer")
                assert daemon.stop(signal.SIGTERM) == 0, daemon.stderr()  # systemctl restart / stop
                manager.wait_for("STOPPING=1", 5)
                wait_pids_gone(daemon.family)
            finally:
                daemon.close()
            assert any(paths.batch_dir.iterdir()), f"--keep: the {life} daemon's batches stay"
        assert re.search(r"kept [1-9]\d* batches from a previous daemon", paths.log.read_text())
    finally:
        manager.close()
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
