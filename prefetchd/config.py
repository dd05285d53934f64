"""The job config: a TOML file, with every key overridable by a flag of ``prefetchd start``.

Each key (its section, type, default, rule, help and flag) is declared once, in
``prefetchd.settings``; this module reads a file and flags against that table and checks
what spans several keys, the ``[[source]]`` and ``[[transform]]`` arrays. An example:

```toml
[job]
name = "imagenet"
world_size = 8
batch_size = 256

[daemon]
buffer = "30G"
workers = 15
# endpoint = "tcp://127.0.0.1:5555"        # loopback unless CURVE is set:
# curve_secret_key = "server.key_secret"
# curve_authorized_keys = "clients/"

[[source]]
kind = "image_folder"    # or "file_list", "webdataset", "parquet": README, Configuration
root = "/data/imagenet/train"
# name = "imagenet"      # with several sources: a weight each mixes them
# weight = 0.7

[mix]
epoch = "cycle"

[[transform]]            # in order; see prefetchd.workers.transforms
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
import importlib.util
import json
import math
import os
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from prefetchd import settings
from prefetchd.curve import load_authorized_keys
from prefetchd.errors import ConfigError
from prefetchd.sources.kinds import COMMON_KEYS, KINDS
from prefetchd.workers import transformspec
from prefetchd.workers.decoders import resolve_decoder
from prefetchd_client.layout import parse_tcp_endpoint
from prefetchd_client.ranks import format_ranks
from prefetchd_client.transport import load_secret_certificate

# A config without [[transform]] or [pipeline] (or none at all): the usual ImageNet training crop, or
# with mode = "eval" its evaluation view.
DEFAULT_TRANSFORMS = ({"op": "random_resized_crop", "size": 224}, {"op": "hflip"})
DEFAULT_EVAL_TRANSFORMS = ({"op": "resize_short", "size": 256}, {"op": "center_crop", "size": 224})
_SECTIONS = {*settings.SECTIONS, "source", "transform"}
@dataclass(frozen=True)
class Config:
    """A checked job config. Build it with ``load_config`` or ``build_config``: the defaults
    and rules of its key fields are those of ``prefetchd.settings`` (where each field's meaning
    is too); ``sources`` and ``transforms`` are the checked arrays of tables."""

    name: str
    seed: int
    world_size: int
    ranks: tuple[int, ...] | None  # None: every rank (served_ranks)
    batch_size: int
    mode: str  # "train" or "eval"
    drop_last: bool
    decoder: str
    buffer_bytes: int
    workers: int | str  # a count, or "auto" (min_workers to max_workers, by demand: master/autoscale.py)
    min_workers: int
    max_workers: int
    node_cpus: int | None  # None: cores - 1 with --workers auto, else no node budget (master/demand.py)
    cpu_weight: float
    executor: str
    ray_address: str
    ray_workers: int | str  # batches in flight on the cluster, or "auto" (1 to max_ray_workers, by demand)
    max_ray_workers: int
    ray_resources: dict | None
    retain: int
    on_error: str
    max_bad_rate: float
    worker_timeout: float
    store_timeout: float
    max_worker_restarts: int
    worker_nice: int
    on_trainer_exit: str
    consumer_timeout: float
    endpoint: str
    curve_secret_key: str | None
    curve_authorized_keys: str | None
    metrics: str | None  # HOST:PORT of the /metrics server, None: off
    sources: tuple[dict, ...]
    mix: str
    transforms: tuple[dict, ...]
    pipeline: str | None

    @property
    def worker_range(self) -> tuple[int, int]:
        """(fewest, most) local workers: both the count given, or with auto its bounds."""
        return (self.min_workers, self.max_workers) if self.workers == "auto" else (self.workers, self.workers)

    @property
    def ray_range(self) -> tuple[int, int]:
        """(fewest, most) batches in flight on the Ray cluster: the count given, or with auto 1 to its most."""
        return (1, self.max_ray_workers) if self.ray_workers == "auto" else (self.ray_workers, self.ray_workers)

    @property
    def served_ranks(self) -> tuple[int, ...]:
        """The ranks whose batches this daemon makes: its node's, or all of them."""
        return tuple(range(self.world_size)) if self.ranks is None else self.ranks

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Config:
        ranks = None if d.get("ranks") is None else tuple(d["ranks"])
        return cls(**{**d, "ranks": ranks, "sources": tuple(d["sources"]), "transforms": tuple(d["transforms"])})

    def content(self, num_samples: int, data_fingerprint: str, order: int) -> dict:
        """What decides which samples an epoch holds and how each is augmented (``order``: how
        the plan shuffles an epoch, plan.ORDER).

        A resume state must match it field by field. World size and batch size are left
        out: a state taken with one resumes with another (elastic resume); so are the mixing
        weights and rule, which may change on resume (the new mixture applies from there).
        """
        augment = [list(self.transforms), self.pipeline]
        if self.decoder != "pillow":  # so configs from before the choice existed keep their hash
            augment.append(self.decoder)
        augment = json.dumps(augment, sort_keys=True).encode()
        content = {
            "seed": self.seed,
            "order": order,
            "samples": num_samples,
            "drop_last": self.drop_last,
            "data": data_fingerprint,
            "augment": hashlib.sha256(augment).hexdigest()[:16],
        }
        if self.mode == "eval":  # in order and padded; the client reads it here (training keeps its hash)
            content.update(mode="eval", drop_last=False)
        return content


def content_hash(content: dict) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


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
        tcp = parse_tcp_endpoint(endpoint)  # its form was checked by its Setting
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
            ("curve_authorized_keys", load_authorized_keys),
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
    if "://" in path:  # a URL (an object in a store): the kind's scan checks it
        return path
    try:
        p = Path(path).expanduser()  # RuntimeError for ~user of no such user
        return str(p if p.is_absolute() else (base / p).resolve())
    except (RuntimeError, OSError) as exc:  # a symlink loop on the way
        raise ConfigError(f"cannot resolve the path {path!r} against {base}: {exc}") from None


def _check_source(i: int, src, base: Path) -> dict:
    where = f"[[source]] #{i + 1}"
    if not isinstance(src, dict):
        raise ConfigError(f"{where} must be a table")
    kinds = ", ".join(sorted(KINDS))
    if "kind" not in src:
        raise ConfigError(f'{where} has no kind: add kind = "image_folder" (or one of {kinds})')
    kind = KINDS.get(src["kind"]) if isinstance(src["kind"], str) else None
    if kind is None:
        raise ConfigError(f"{where}: kind must be one of {kinds}, got {src['kind']!r}")
    _check_keys(src, {*COMMON_KEYS, kind.data_key, *kind.options}, f"{where} ({kind.name})")
    key = kind.data_key
    value = src.get(key)
    patterns = value if isinstance(value, list) and value else [value]
    if not all(isinstance(v, str) and v for v in patterns) or (not kind.patterns and isinstance(value, list)):
        several = " (or a list of them)" if kind.patterns else ""
        raise ConfigError(f'{where} ({kind.name}) needs {key} = "..."{several} (or pass --data PATH)')
    if kind.patterns:  # brace patterns: each path they name is resolved against `base` by the kind's scan
        src = {**src, "base": str(base)}
    else:
        src = {**src, key: _resolve(value, base)}
    for option, default in kind.options.items():
        if option in src and (not isinstance(src[option], str) or not src[option]):
            raise ConfigError(f"{where} ({kind.name}): {option} must be a non-empty string, got {src[option]!r}")
        if default is not None:
            src.setdefault(option, default)
    weight = src.get("weight")
    if weight is not None and (
        isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf
    ):
        raise ConfigError(f"{where}: weight must be a positive finite number, got {weight!r}")
    name = src.get("name", f"source{i}")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: name must be a non-empty string, got {name!r}")
    return {**src, "name": name}


def _check_ranks_in_world(ranks: tuple[int, ...] | None, world_size: int) -> None:
    if ranks is not None and ranks[-1] >= world_size:
        raise ConfigError(
            f"[job] ranks / --ranks {format_ranks(ranks)} goes past the world: world_size is {world_size}, so the "
            f"ranks are 0-{world_size - 1}; give this node's ranks of that world, or the whole --world-size"
        )


def _check_executor(values: dict) -> None:
    if values["workers"] == "auto" and values["min_workers"] > values["max_workers"]:
        raise ConfigError(
            f"[daemon] min_workers / --min-workers ({values['min_workers']}) is more than max_workers / "
            f"--max-workers ({values['max_workers']}); with --workers auto the count moves between the two"
        )
    if values["workers"] == 0 and values["executor"] != "ray":
        raise ConfigError(
            "[daemon] workers / --workers must be at least 1 with the local executor; 0 makes sense only with "
            "--executor ray, where the cluster makes every batch"
        )
    # The bridge process imports Ray; without it, the start fails here, before anything is made.
    if values["executor"] == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("[daemon] executor / --executor ray needs Ray on this node: pip install 'prefetchd[ray]'")


def _resolve_decoder(decoder: str) -> str:
    try:
        return resolve_decoder(decoder)
    except ImportError as exc:
        raise ConfigError(f"{settings.BY_OPTION['decoder'].where} / --decoder: {exc}") from None


def build_config(raw: dict, *, base: Path, default_name: str, overrides: dict | None = None) -> Config:
    """Validate a parsed TOML document plus flag overrides into a Config.

    ``overrides`` maps a Setting's ``option`` (its flag's name: ``world_size``, ``mix``) or
    ``data`` to a value; None means the flag was not given."""
    _check_keys(raw, _SECTIONS, "config")
    tables = {section: _key_table(raw, section) for section in settings.SECTIONS}
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    data = overrides.pop("data", None)
    for option, value in overrides.items():
        if option not in settings.BY_OPTION:
            raise ConfigError(f"unknown flag --{option.replace('_', '-')}")
        s = settings.BY_OPTION[option]
        tables[s.section][s.key] = value
    tables["job"].setdefault("name", default_name)
    values = {s.field: _checked_value(s, tables[s.section]) for s in settings.SETTINGS}
    values = _check_endpoint(values, base, overrides)
    _check_ranks_in_world(values["ranks"], values["world_size"])
    _check_executor(values)
    values["decoder"] = _resolve_decoder(values["decoder"])
    sources = _check_sources(raw.get("source", []), data, base)

    specs = raw.get("transform")
    if specs is None and values["pipeline"] is None:  # no [[transform]] and no callable: the default of the mode
        specs = [dict(t) for t in (DEFAULT_EVAL_TRANSFORMS if values["mode"] == "eval" else DEFAULT_TRANSFORMS)]
    specs = [] if specs is None else specs
    if not isinstance(specs, list):
        raise ConfigError("transform must be an array of tables: write [[transform]], not [transform]")
    if values["pipeline"] is None:
        transformspec.validate_transforms(specs)
    elif specs:
        raise ConfigError("use either [pipeline] callable (--pipeline) or [[transform]] entries, not both")
    if values["mode"] == "eval":
        _check_eval(specs if values["pipeline"] is None else [], sources)  # a callable's draws are its own
    return Config(**values, sources=sources, transforms=tuple(specs))


def _check_eval(specs: list, sources: tuple[dict, ...]) -> None:
    """An evaluation job reads every sample once, as it is: nothing random, nothing weighted."""
    random = transformspec.random_steps(specs) if specs else []
    if random:
        raise ConfigError(
            f'{random[0]} is random, but [job] mode = "eval" reads every sample as it is: use '
            "resize_short with size, then center_crop (the usual evaluation transform)"
        )
    if "weight" in sources[0]:
        raise ConfigError(
            '[job] mode = "eval" reads every sample of every source once: remove the [[source]] weights'
        )


def _key_table(raw: dict, section: str) -> dict:
    table = raw.get(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{section} must be a table: write [{section}] and its keys below it, got {table!r}")
    _check_keys(table, settings.section_keys(section), f"[{section}]")
    return dict(table)


def _checked_value(setting: settings.Setting, table: dict):
    value = table[setting.key] if setting.key in table else setting.default_value()
    return None if value is None else setting.validate(value)


def _check_sources(raw_sources, data: str | None, base: Path) -> tuple[dict, ...]:
    """The [[source]] tables, checked; ``data`` (--data) replaces the only one's folder."""
    if not isinstance(raw_sources, list):
        raise ConfigError("source must be an array of tables: write [[source]], not [source]")
    if data is not None:
        if len(raw_sources) > 1:
            raise ConfigError("--data replaces the only [[source]]'s folder, but the config has several")
        if raw_sources and not isinstance(raw_sources[0], dict):
            raise ConfigError("[[source]] #1 must be a table")
        kind = raw_sources[0].get("kind", "image_folder") if raw_sources else "image_folder"
        key = KINDS[kind].data_key if isinstance(kind, str) and kind in KINDS else "root"
        raw_sources = [{**(raw_sources[0] if raw_sources else {"kind": kind}), key: data}]
        base = Path.cwd()  # a flag's path is the current folder's, not the config file's
    if not raw_sources:
        raise ConfigError("no data: add a [[source]] table to the config, or pass --data FOLDER")
    sources = tuple(_check_source(i, s, base) for i, s in enumerate(raw_sources))
    names = [s["name"] for s in sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"[[source]] names must be unique, got {names}")
    weighted = [s.get("weight") is not None for s in sources]
    if any(weighted) and not all(weighted):
        raise ConfigError("give every [[source]] a weight, or none (then they are concatenated)")
    return sources


def load_config(path: str | os.PathLike | None, overrides: dict | None = None) -> Config:
    """Read a TOML config (or none: flags only) and apply flag overrides."""
    if path is None:
        return build_config({}, base=Path.cwd(), default_name="default", overrides=overrides)
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
