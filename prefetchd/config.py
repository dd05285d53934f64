"""The job config: a TOML file, with every key overridable by a flag of ``prefetchd start``.

```toml
[job]
name = "imagenet"        # the job directory's name; default: the config file's stem
seed = 0
world_size = 8           # trainer ranks that read this job
batch_size = 256         # per rank
drop_last = true         # false: the last step is padded from the epoch's start
decoder = "pillow"       # or "simplejpeg": libjpeg-turbo + OpenCV, pip install 'prefetchd[fast]'

[daemon]
buffer = "30G"           # byte bound of the buffer (K, M, G, T = powers of 1024)
workers = 15             # default: cores - 1, at least 1
retain = 2               # consumed batches kept per rank: a restart a few steps back is warm
on_error = "replace"     # a bad sample: "replace" it (recorded in the batch header) or "fail"
max_bad_rate = 0.25      # stop when more of the samples than this are bad
worker_timeout = 60      # seconds a busy worker may finish no sample (an idle one: send no heartbeat)
max_worker_restarts = 20 # worker deaths tolerated per minute before the daemon stops
worker_nice = 10         # workers' CPU niceness (0-19): a trainer's threads run first when they wake
on_trainer_exit = "keep" # a rank's trainer process is gone: "keep" its window (warm restart) or "release" it
endpoint = "ipc"         # the control socket; or "tcp://127.0.0.1:5555" (loopback unless CURVE is set)
# curve_secret_key = "server.key_secret"  # CURVE: the server's secret certificate (mode 0600)
# curve_authorized_keys = "clients/"      # CURVE: folder of authorised client public certificates (*.key)

[[source]]
kind = "image_folder"    # or "file_list" with path = "train.txt" ("path,label" lines)
root = "/data/imagenet/train"
# name = "imagenet"      # with several sources: a weight each mixes them
# weight = 0.7

[mix]
epoch = "cycle"          # or "first_exhausted", "all_once" (see prefetchd.plan)

[[transform]]            # in order; see prefetchd.transforms
op = "random_resized_crop"
size = 224

[pipeline]               # optional: your own per-sample code instead of [[transform]]
callable = "mypkg.aug:make_sample"
```

Relative paths resolve against the config file's folder (those of flags against the current
one). Pure: no I/O beyond reading the file and checking the CURVE key files it names.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefetchd_client.batchfile import VERSION as BATCH_FORMAT_VERSION
from prefetchd_client.layout import MAX_RANK, check_job_name
from prefetchd_client.transport import load_secret_certificate, parse_tcp_endpoint

from . import control, fastdecode, transforms
from .errors import ConfigError
from .plan import MIX_RULES
from .sizes import parse_size

DEFAULT_BUFFER = "1G"
DEFAULT_RETAIN = 2  # consumed batches kept per rank, so a restart a few steps back is warm
# Without a config file: the usual ImageNet training crop.
DEFAULT_TRANSFORMS = ({"op": "random_resized_crop", "size": 224}, {"op": "hflip"})
_SECTIONS = {"job", "daemon", "source", "transform", "pipeline", "mix"}
_JOB_KEYS = {"name": str, "seed": int, "world_size": int, "batch_size": int, "drop_last": bool, "decoder": str}
_DAEMON_KEYS = {
    "buffer": (str, int),
    "workers": int,
    "retain": int,
    "on_error": str,
    "max_bad_rate": (float, int),
    "worker_timeout": (float, int),
    "max_worker_restarts": int,
    "worker_nice": int,
    "on_trainer_exit": str,
    "endpoint": str,
    "curve_secret_key": str,
    "curve_authorized_keys": str,
}
ON_TRAINER_EXIT = ("keep", "release")
ON_ERROR = ("replace", "fail")
_SOURCE_KEYS = {"image_folder": {"kind", "root", "name", "weight"}, "file_list": {"kind", "path", "name", "weight"}}


def default_workers() -> int:
    return max(1, (os.cpu_count() or 2) - 1)


@dataclass(frozen=True)
class Config:
    name: str
    seed: int = 0
    world_size: int = 1
    batch_size: int = 32
    drop_last: bool = True
    decoder: str = "pillow"
    buffer_bytes: int = field(default_factory=lambda: parse_size(DEFAULT_BUFFER))
    workers: int = field(default_factory=default_workers)
    retain: int = DEFAULT_RETAIN
    on_error: str = "replace"
    max_bad_rate: float = 0.25
    worker_timeout: float = 60.0
    max_worker_restarts: int = 20
    worker_nice: int = 10
    on_trainer_exit: str = "keep"
    endpoint: str = "ipc"
    curve_secret_key: str | None = None
    curve_authorized_keys: str | None = None
    sources: tuple[dict, ...] = ()
    mix: str = "cycle"
    transforms: tuple[dict, ...] = ()
    pipeline: str | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Config:
        return cls(**{**d, "sources": tuple(d["sources"]), "transforms": tuple(d["transforms"])})

    def content(self, num_samples: int, data_fingerprint: str) -> dict:
        """What decides which samples an epoch holds and how each is augmented.

        A resume state must match it field by field. World size and batch size are left
        out: a state taken with one resumes with another (elastic resume); so are the mixing
        weights and rule, which may change on resume (the new mixture applies from there).
        """
        augment = [list(self.transforms), self.pipeline]
        if self.decoder != "pillow":  # so configs from before the choice existed keep their hash
            augment.append(self.decoder)
        augment = json.dumps(augment, sort_keys=True).encode()
        return {
            "seed": self.seed,
            "samples": num_samples,
            "drop_last": self.drop_last,
            "data": data_fingerprint,
            "augment": hashlib.sha256(augment).hexdigest()[:16],
        }


def content_hash(content: dict) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def plan_digest(config: Config, plan: dict, data_fingerprint: str) -> str:
    """Identifies everything that decides a batch's bytes; a batch is of this job only if it
    carries this digest.

    Unlike the config hash (what a resume state must match), nothing is left out: world size,
    batch size, drop_last, weights and mix rule (all in ``plan``, ``Plan.to_json()``), the
    data, the source names (a batch's per-source counts), the transforms or the pipeline
    callable, the decoder, and the batch format version. A daemon restarted with any of them
    changed must not adopt the batches the previous one left.
    """
    decides = {
        "format_version": BATCH_FORMAT_VERSION,
        "plan": plan,
        "data": data_fingerprint,
        "sources": [s["name"] for s in config.sources],
        "transforms": list(config.transforms),
        "pipeline": config.pipeline,
        "decoder": config.decoder,
    }
    return content_hash(decides)


def _typed(value, types, where: str):
    types = types if isinstance(types, tuple) else (types,)
    # bool is an int in Python; a flag like world_size = true is still a mistake.
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"{where} must be {names}, got {value!r}")
    return value


# The [daemon] keys besides buffer: what a valid value is. Defaults live in Config alone.
_DAEMON_RULES = {
    "workers": (lambda v: v >= 1, "at least 1"),
    "retain": (lambda v: v >= 0, "0 or more"),
    "on_error": (lambda v: v in ON_ERROR, f"one of {', '.join(ON_ERROR)}"),
    "max_bad_rate": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "worker_timeout": (lambda v: v > 0, "positive"),
    "max_worker_restarts": (lambda v: v >= 0, "0 or more"),
    "worker_nice": (lambda v: 0 <= v <= 19, "a niceness from 0 (as the trainer) to 19 (lowest priority)"),
    "on_trainer_exit": (lambda v: v in ON_TRAINER_EXIT, f"one of {', '.join(ON_TRAINER_EXIT)}"),
    "endpoint": (
        lambda v: v == "ipc" or _is_tcp_endpoint(v),
        "ipc or tcp://HOST:PORT with HOST an IP address, localhost or * and PORT 1-65535 "
        "(e.g. tcp://127.0.0.1:5555; IPv6 in brackets: tcp://[::1]:5555)",
    ),
    "curve_secret_key": (lambda v: v != "", "the path of the server's secret certificate"),
    "curve_authorized_keys": (lambda v: v != "", "the path of a folder of client public certificates"),
}


def _is_tcp_endpoint(text: str) -> bool:
    try:
        parse_tcp_endpoint(text)
    except ValueError:
        return False
    return True


def _check_daemon_values(daemon: dict) -> dict:
    """The [daemon] values given (file or flag), checked; absent keys keep Config's defaults."""
    values = {}
    for key, (valid, requirement) in _DAEMON_RULES.items():
        if key not in daemon:
            continue
        value = float(daemon[key]) if _DAEMON_KEYS[key] == (float, int) else daemon[key]
        if not valid(value):
            raise ConfigError(f"[daemon] {key} / --{key.replace('_', '-')} must be {requirement}, got {value!r}")
        values[key] = value
    return values


def _check_endpoint(values: dict, base: Path, flags: dict) -> dict:
    """The control endpoint's rule: TCP on a loopback host, or anywhere with CURVE configured.

    Resolves the CURVE paths (a flag's against the current folder) and checks the files now,
    so a bad key fails ``start`` before anything is spawned.
    """
    secret, authorized = values.get("curve_secret_key"), values.get("curve_authorized_keys")
    if (secret is None) != (authorized is None):
        raise ConfigError(
            "[daemon] curve_secret_key / --curve-secret-key and curve_authorized_keys / --curve-authorized-keys "
            "go together: set both (the server's secret certificate and the folder of authorised client "
            "certificates) or neither"
        )
    endpoint, curve = values.get("endpoint", "ipc"), secret is not None
    if curve and endpoint == "ipc":
        raise ConfigError(
            "[daemon] curve_secret_key / --curve-secret-key secures a TCP endpoint: set [daemon] endpoint / "
            "--endpoint tcp://HOST:PORT as well, or drop the CURVE keys (the ipc socket is private to you already)"
        )
    if endpoint != "ipc":
        tcp = parse_tcp_endpoint(endpoint)  # its form was checked by _DAEMON_RULES
        if not tcp.loopback and not curve:
            where = "every interface" if tcp.wildcard else tcp.host
            raise ConfigError(
                f"[daemon] endpoint / --endpoint {endpoint} would listen on {where}, which is not a loopback "
                "address, without authentication: anyone who can reach this node could stop the job or move its "
                "position. Use the default ipc endpoint (private to you), or configure CURVE with [daemon] "
                "curve_secret_key and curve_authorized_keys (--curve-secret-key, --curve-authorized-keys); "
                f"tcp://127.0.0.1:{tcp.port} is reachable by every local user"
            )
    if curve:
        for key, check in (
            ("curve_secret_key", load_secret_certificate),
            ("curve_authorized_keys", control.load_authorized_keys),
        ):
            values[key] = _resolve(values[key], Path.cwd() if key in flags else base)
            try:
                check(values[key])
            except ValueError as exc:
                raise ConfigError(f"[daemon] {key} / --{key.replace('_', '-')}: {exc}") from None
    return values


def _check_keys(table: dict, known, where: str) -> None:
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(known))}")


def _resolve(path: str, base: Path) -> str:
    p = Path(path).expanduser()
    try:
        return str(p if p.is_absolute() else (base / p).resolve())
    except (RuntimeError, OSError) as exc:  # a symlink loop on the way
        raise ConfigError(f"cannot resolve the path {path!r} against {base}: {exc}") from None


def _check_source(i: int, src, base: Path) -> dict:
    where = f"[[source]] #{i + 1}"
    if not isinstance(src, dict):
        raise ConfigError(f"{where} must be a table")
    kind = src.get("kind")
    if kind not in _SOURCE_KEYS:
        raise ConfigError(f"{where}: kind must be one of {', '.join(sorted(_SOURCE_KEYS))}, got {kind!r}")
    _check_keys(src, _SOURCE_KEYS[kind], f"{where} ({kind})")
    key = "root" if kind == "image_folder" else "path"
    if not isinstance(src.get(key), str) or not src[key]:
        raise ConfigError(f'{where} ({kind}) needs {key} = "..." (or pass --data PATH)')
    weight = src.get("weight")
    if weight is not None and (
        isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf
    ):
        raise ConfigError(f"{where}: weight must be a positive finite number, got {weight!r}")
    name = src.get("name", f"source{i}")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: name must be a non-empty string, got {name!r}")
    return {**src, "name": name, key: _resolve(src[key], base)}


def build_config(raw: dict, *, base: Path, default_name: str, overrides: dict | None = None) -> Config:
    """Validate a parsed TOML document plus flag overrides into a Config."""
    _check_keys(raw, _SECTIONS, "config")
    job, daemon = dict(raw.get("job", {})), dict(raw.get("daemon", {}))
    _check_keys(job, _JOB_KEYS, "[job]")
    _check_keys(daemon, _DAEMON_KEYS, "[daemon]")
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    data = overrides.pop("data", None)
    for k, v in overrides.items():
        (job if k in _JOB_KEYS else daemon)[k] = v
    for k, types in _JOB_KEYS.items():
        if k in job:
            _typed(job[k], types, f"[job] {k}")
    for k, types in _DAEMON_KEYS.items():
        if k in daemon:
            _typed(daemon[k], types, f"[daemon] {k}")

    name = job.get("name", default_name)
    try:
        check_job_name(name)
    except ValueError as exc:
        raise ConfigError(f"[job] name / --name: {exc}") from None
    for k in ("world_size", "batch_size"):
        if job.get(k, 1) < 1:
            raise ConfigError(f"[job] {k} / --{k.replace('_', '-')} must be at least 1, got {job[k]}")
    if job.get("world_size", 1) > MAX_RANK + 1:  # batch names hold four digits of rank
        raise ConfigError(f"[job] world_size / --world-size must be at most {MAX_RANK + 1}, got {job['world_size']}")
    if job.get("seed", 0) < 0:
        raise ConfigError(f"[job] seed / --seed must be non-negative, got {job['seed']}")
    decoder = job.get("decoder", "pillow")
    if decoder not in fastdecode.DECODERS:
        raise ConfigError(f"[job] decoder / --decoder must be one of {', '.join(fastdecode.DECODERS)}, got {decoder!r}")
    if decoder == "simplejpeg":
        try:
            fastdecode.require()
        except ImportError as exc:
            raise ConfigError(f"[job] decoder / --decoder: {exc}") from None
    try:
        buffer_bytes = parse_size(daemon.get("buffer", DEFAULT_BUFFER))
    except ValueError as exc:
        raise ConfigError(f"[daemon] buffer / --buffer: {exc}") from None
    daemon_values = _check_endpoint(_check_daemon_values(daemon), base, overrides)

    raw_sources = raw.get("source", [])
    if not isinstance(raw_sources, list):
        raise ConfigError("source must be an array of tables: write [[source]], not [source]")
    if data is not None:
        if len(raw_sources) > 1:
            raise ConfigError("--data replaces the only [[source]]'s folder, but the config has several")
        kind = raw_sources[0].get("kind", "image_folder") if raw_sources else "image_folder"
        key = "root" if kind == "image_folder" else "path"
        raw_sources = [{**(raw_sources[0] if raw_sources else {"kind": kind}), key: data}]
        base_for_data = Path.cwd()
    if not raw_sources:
        raise ConfigError("no data: add a [[source]] table to the config, or pass --data FOLDER")
    source_base = base_for_data if data is not None else base
    sources = tuple(_check_source(i, s, source_base) for i, s in enumerate(raw_sources))
    names = [s["name"] for s in sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"[[source]] names must be unique, got {names}")
    weighted = [s.get("weight") is not None for s in sources]
    if any(weighted) and not all(weighted):
        raise ConfigError("give every [[source]] a weight, or none (then they are concatenated)")
    mix_table = raw.get("mix", {})
    _check_keys(mix_table, {"epoch"}, "[mix]")
    mix = mix_table.get("epoch", "cycle")
    if mix not in MIX_RULES:
        raise ConfigError(f"[mix] epoch must be one of {', '.join(MIX_RULES)}, got {mix!r}")

    pipeline = raw.get("pipeline", {})
    _check_keys(pipeline, {"callable"}, "[pipeline]")
    callable_ = pipeline.get("callable")
    if callable_ is not None and (not isinstance(callable_, str) or callable_.count(":") != 1):
        raise ConfigError(f"[pipeline] callable must look like 'package.module:function', got {callable_!r}")
    specs = raw.get("transform", [])
    if not isinstance(specs, list):
        raise ConfigError("transform must be an array of tables: write [[transform]], not [transform]")
    if callable_ is None:
        transforms.validate_transforms(specs)
    elif specs:
        raise ConfigError("use either [pipeline] callable or [[transform]] entries, not both")

    return Config(
        name=name,
        seed=job.get("seed", 0),
        world_size=job.get("world_size", 1),
        batch_size=job.get("batch_size", 32),
        drop_last=job.get("drop_last", True),
        decoder=decoder,
        buffer_bytes=buffer_bytes,
        **daemon_values,
        sources=sources,
        mix=mix,
        transforms=tuple(specs),
        pipeline=callable_,
    )


def load_config(path: str | os.PathLike | None, overrides: dict | None = None) -> Config:
    """Read a TOML config (or none: flags only) and apply flag overrides."""
    if path is None:
        raw = {"transform": [dict(t) for t in DEFAULT_TRANSFORMS]}
        return build_config(raw, base=Path.cwd(), default_name="default", overrides=overrides)
    path = Path(path)
    if path.exists() and not path.is_file():  # a FIFO would block the read forever
        raise ConfigError(f"config file {path} is not a regular file")
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    try:
        base = path.resolve().parent
    except (RuntimeError, OSError) as exc:
        raise ConfigError(f"cannot resolve config file {path}: {exc}") from None
    return build_config(raw, base=base, default_name=path.stem, overrides=overrides)
