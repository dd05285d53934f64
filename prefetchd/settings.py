"""Every key of the job config, declared once: its section, type, default, rule, help and flag.

The table below is the single source for what a config file accepts (``prefetchd.config``),
the flags of ``prefetchd start`` (``prefetchd.cli.app``), the config that ``prefetchd status
--json`` echoes (``echo``) and the README's config table (``markdown_table``). A new key is
one more ``Setting`` here and one field of ``Config``; a test fails when they disagree.

``[[source]]`` and ``[[transform]]`` are arrays of tables, not keys: ``prefetchd.config``
checks them, ``--data`` replaces the only source's folder.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

from prefetchd.errors import ConfigError
from prefetchd.sizes import parse_size
from prefetchd_client.layout import MAX_RANK, check_job_name, parse_tcp_endpoint
from prefetchd_client.ranks import parse_ranks

SECTIONS = ("job", "daemon", "mix", "pipeline")
# How sources take turns across an epoch ([mix] epoch = ...); plan.Plan implements each. Declared
# here, beside the key, so that the command's flags need no numpy (plan imports it).
MIX_RULES = ("cycle", "first_exhausted", "all_once")
# The JPEG decoders, slowest first; prefetchd.workers.transforms.NATIVE_DECODERS implements all but Pillow.
DECODERS = ("pillow", "simplejpeg", "turbojpeg")
MAX_NODE_CPUS = 4096  # --node-cpus; a lease naming more CPUs, workers or demand is no daemon's
CPU_WEIGHTS = (0.01, 100)  # --cpu-weight's range: a ratio of 10^4 between jobs at most
Rule = tuple[Callable[[Any], bool], str]  # (is the value valid, what "must be" it is)


@dataclass(frozen=True)
class Setting:
    section: str
    key: str
    types: tuple[type, ...]  # the first is the flag's type
    _: KW_ONLY
    help: str  # one line: the README's and ``--help``'s meaning of the key
    default: Any = None  # None: unset (the key is optional)
    default_factory: Callable[[], Any] | None = None  # a default that depends on the machine
    default_text: str = ""  # the default as people read it, where the value alone does not say
    choices: tuple[str, ...] = ()
    rules: tuple[Rule, ...] = ()
    # A last check that may turn the value into what Config holds (a size into bytes);
    # its ValueError's text follows "[section] key / --flag: ".
    check: Callable[[Any], Any] | None = None
    field: str = ""  # Config's attribute; default: the key
    option: str = ""  # the flag without its dashes, and the key of build_config's overrides; default: the key
    metavar: str = ""
    type_text: str = ""  # the README's type column, where the types alone do not say

    def __post_init__(self) -> None:
        object.__setattr__(self, "field", self.field or self.key)
        object.__setattr__(self, "option", self.option or self.key)

    @property
    def flag(self) -> str:
        return "--" + self.option.replace("_", "-")

    @property
    def flag_decls(self) -> str:
        """The flag as click declares it: a boolean has its negative form beside it."""
        return f"{self.flag}/--no-{self.flag[2:]}" if self.types == (bool,) else self.flag

    @property
    def where(self) -> str:
        return f"[{self.section}] {self.key}"

    def default_value(self) -> Any:
        return self.default_factory() if self.default_factory is not None else self.default

    def shown_default(self) -> str:
        """The default as ``--help`` and the README show it; empty when the key is unset by default."""
        if self.default_text:
            return self.default_text
        if self.default is None:
            return ""
        return str(self.default).lower() if isinstance(self.default, bool) else str(self.default)

    def validate(self, value: Any) -> Any:
        """``value`` (from the file or a flag) checked against the key's type and rules, as Config holds it.

        ConfigError names the key and its flag, says what is accepted and shows the value.
        """
        _check_type(value, self.types, self.where)
        if float in self.types:
            value = float(value)  # an int where a float is meant: 60 seconds is 60.0
        # "[daemon] retain / --retain"; a flag named apart from its key comes first, so the
        # message still reads "[mix] epoch must be ...": "--mix / [mix] epoch must be ...".
        name = f"{self.where} / {self.flag}" if self.option == self.key else f"{self.flag} / {self.where}"
        if self.choices and value not in self.choices:
            raise ConfigError(f"{name} must be one of {', '.join(self.choices)}, got {value!r}")
        for valid, requirement in self.rules:
            if not valid(value):
                raise ConfigError(f"{name} must be {requirement}, got {value!r}")
        if self.check is not None:
            try:
                value = self.check(value)
            except ValueError as exc:
                raise ConfigError(f"{name}: {exc}") from None
        return value


def _check_type(value: Any, types: tuple[type, ...], where: str) -> None:
    # bool is an int in Python; a flag like world_size = true is still a mistake.
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"{where} must be {names}, got {value!r}")


def default_workers() -> int:
    return max(1, (os.cpu_count() or 2) - 1)


def parse_workers(value) -> int | str:
    """``--workers``: a count (0 or more; a flag's digits too) or ``"auto"``; ValueError otherwise."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value == "auto" or type(value) is int and value >= 0:
        return value
    raise ValueError(f"must be a number of workers (0 or more) or auto, got {value!r:.60}")


def parse_ray_workers(value) -> int | str:
    """``--ray-workers``: 1 to _MAX_RAY_WORKERS batches in flight, or ``"auto"``; ValueError otherwise."""
    count = int(value) if isinstance(value, str) and value.strip().isdigit() else value
    if count == "auto" or type(count) is int and 1 <= count <= _MAX_RAY_WORKERS:
        return count
    raise ValueError(f"must be 1 to {_MAX_RAY_WORKERS} batches in flight, or auto, got {value!r:.60}")


def _is_endpoint(text: str) -> bool:
    if text == "ipc":
        return True
    try:
        parse_tcp_endpoint(text)
    except ValueError:
        return False
    return True


_MAX_RAY_WORKERS = 1024  # two pipe ends, two threads each in the bridge, a descriptor in the master


def parse_resources(value) -> dict[str, float]:
    """``"prep=1,io=0.5"`` (or a TOML table) as {name: amount}; ValueError saying what is accepted."""
    if isinstance(value, str):
        pairs = [part.strip().partition("=") for part in value.split(",")]
        if not all(name and eq for name, eq, _ in pairs):
            raise ValueError(f"expected NAME=AMOUNT[,NAME=AMOUNT], got {value[:80]!r}")
        try:
            value = {name.strip(): float(amount) for name, _, amount in pairs}
        except ValueError:
            raise ValueError(f"an amount is not a number in {value[:80]!r}") from None
    resources = {}
    for name, amount in value.items():
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not 0 < amount < 2**32:
            raise ValueError(f"the amount of {str(name)[:40]!r} must be a positive number, got {amount!r:.40}")
        if amount > 1 and amount != int(amount) or amount < 1e-4:  # what Ray accepts
            raise ValueError(f"the amount of {str(name)[:40]!r} must be a whole number or a fraction of 1 "
                             f"(at least 0.0001), got {amount!r:.40}")
        if not name or not name.isprintable() or name in ("CPU", "GPU", "memory"):
            raise ValueError(f"{name[:40]!r} is not a custom resource name (each task takes 1 CPU already)")
        resources[name] = float(amount)
    return resources


_METRICS_FORMS = (
    "HOST:PORT, :PORT or PORT with PORT 1-65535 (e.g. 127.0.0.1:9464; 0.0.0.0:9464 for every interface; "
    "IPv6 in brackets: [::1]:9464)"
)
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")  # a DNS name or an IPv4 address


def parse_metrics_address(value) -> str:
    """``--metrics`` as ``"HOST:PORT"`` (``"[V6]:PORT"``); a bare ``:PORT`` or ``PORT`` (an int in TOML)
    is loopback, 127.0.0.1. Only the form is checked here: the host is resolved, and the port
    bound, by the daemon's start-up (prefetchd.ops.metrics_http). ValueError says what is accepted."""
    text = str(value) if type(value) is int else value
    if len(text) > 270 or not text.isprintable() or not text.isascii():  # a name is at most 253 bytes
        raise ValueError(f"expected {_METRICS_FORMS}, got {text[:60]!r}{' (cut)' if len(text) > 60 else ''}")
    host, colon, port = text.rpartition(":") if ":" in text else ("", "", text)
    if host.startswith("[") and host.endswith("]"):
        try:
            host = f"[{ipaddress.IPv6Address(host[1:-1])}]"
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address; expected {_METRICS_FORMS}") from None
    elif host and not _HOST_NAME.fullmatch(host):
        raise ValueError(f"{host[:60]!r} is not a host name or IP address; expected {_METRICS_FORMS}")
    if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        raise ValueError(f"the port must be a number from 1 to 65535, got {port[:60]!r}; expected {_METRICS_FORMS}")
    return f"{host or '127.0.0.1'}:{int(port)}"


def _at_least(n: int) -> Rule:
    return (lambda v: v >= n, f"at least {n}")


_NOT_NEGATIVE: Rule = (lambda v: v >= 0, "0 or more")
_ENDPOINT_FORMS = (
    "ipc or tcp://HOST:PORT with HOST an IP address, localhost or * and PORT 1-65535 "
    "(e.g. tcp://127.0.0.1:5555; IPv6 in brackets: tcp://[::1]:5555)"
)

SETTINGS: tuple[Setting, ...] = (
    # -- [job]: what the plan is made of
    Setting(
        "job", "name", (str,),
        help="the job directory's name: 1-64 letters, digits, '.', '_' or '-'",
        default_text="the config file's stem (without one: default)",
        check=check_job_name,
    ),
    Setting(
        "job", "seed", (int,),
        help="keys the epoch permutations and every sample's augmentation",
        default=0,
        rules=((lambda v: v >= 0, "non-negative"),),
    ),
    Setting(
        "job", "world_size", (int,),
        help="trainer ranks that read this job",
        default=1,
        # batch file names hold four digits of rank
        rules=(_at_least(1), (lambda v: v <= MAX_RANK + 1, f"at most {MAX_RANK + 1}")),
    ),
    Setting(
        "job", "ranks", (str, list),
        help="the ranks this node's daemon serves: a range A-B or a comma list (a list of integers in TOML); "
        "one daemon per node, each with its own ranks, of one global plan",
        default_text="all ranks",
        check=parse_ranks,
        metavar="RANKS",
        type_text="ranks",
    ),
    Setting(
        "job", "batch_size", (int,),
        help="samples per batch, per rank",
        default=32,
        rules=(_at_least(1),),
    ),
    Setting(
        "job", "mode", (str,),
        help="train: a new shuffle and augmentation every epoch; eval: every sample exactly once, in order, "
        "unaugmented, the last step padded and marked by each batch's boolean `valid` field",
        default="train",
        choices=("train", "eval"),
    ),
    Setting(
        "job", "drop_last", (bool,),
        help="false: the last step is padded by wrapping to the epoch's start, so ranks stay equal",
        default=True,
    ),
    Setting(
        "job", "decoder", (str,),
        help="the JPEG decoder: auto (the fastest installed), turbojpeg (libjpeg-turbo decodes only the crop's "
        "region), simplejpeg (libjpeg-turbo, whole image), or pillow; each gives slightly different pixels",
        default="auto",
        choices=("auto", *DECODERS),  # resolved, and checked installed, by prefetchd.workers.decoders.resolve_decoder
    ),
    # -- [daemon]: how this node serves it
    Setting(
        "daemon", "buffer", (str, int),
        help="the byte bound of the buffer: bytes, or a number with K, M, G or T (powers of 1024)",
        default="1G",
        check=parse_size,
        field="buffer_bytes",
        metavar="SIZE",
        type_text="size",
    ),
    Setting(
        "daemon", "workers", (str, int),
        help="local worker processes: a number (0 only with --executor ray: every batch made on the cluster), or "
        "auto: from --max-workers, fewer while the trainers need fewer, more again when they wait",
        default_factory=default_workers,
        default_text="cores - 1, at least 1",
        check=parse_workers,  # at least 1 with the local executor: prefetchd.config
        metavar="N|auto",
        type_text="int or auto",
    ),
    Setting(
        "daemon", "min_workers", (int,),
        help="with --workers auto: the fewest workers kept, however idle",
        default=1,
        rules=(_at_least(1),),
    ),
    Setting(
        "daemon", "max_workers", (int,),
        help="with --workers auto: the most workers, and the count it starts with",
        default_factory=default_workers,
        default_text="cores - 1, at least 1",
        rules=(_at_least(1),),
    ),
    Setting(
        "daemon", "node_cpus", (int,),
        help="the most workers busy at once over the jobs under this root on this node, divided by demand (those "
        "whose trainers wait first); taken part in with --workers auto, or by any job that sets it",
        default_text="with --workers auto: cores - 1; else none",
        rules=(_at_least(1), (lambda v: v <= MAX_NODE_CPUS, f"at most {MAX_NODE_CPUS}")),
        metavar="N",
    ),
    Setting(
        "daemon", "cpu_weight", (float, int),
        help="this job's weight when jobs that all wait divide --node-cpus",
        default=1.0,
        rules=((lambda v: CPU_WEIGHTS[0] <= v <= CPU_WEIGHTS[1], "a number from {} to {}".format(*CPU_WEIGHTS)),),
        type_text="number",
    ),
    Setting(
        "daemon", "executor", (str,),
        help="where batches are made: local worker processes, or also a Ray cluster (pip install 'prefetchd[ray]'; "
        "docs/scale-out.md)",
        default="local",
        choices=("local", "ray"),
    ),
    Setting(
        "daemon", "ray_address", (str,),
        help="with --executor ray: auto ($RAY_ADDRESS, else the cluster whose raylet runs here as you; never another "
        "user's), HOST:PORT, or local (a private Ray instance in the job folder, for trying it out). Joining a "
        "cluster runs code it sends as you: use only a cluster of your own",
        default="auto",
        rules=((lambda v: v != "" and v.isprintable(), "auto, local or HOST:PORT"),),
        metavar="ADDRESS",
    ),
    Setting(
        "daemon", "ray_workers", (str, int),
        help="with --executor ray: batches in flight on the cluster at once, one task and one CPU each; about twice "
        "the CPUs it may use, so none waits while a finished batch is written here; or auto: from "
        "--max-ray-workers, fewer while the trainers need fewer (the cluster's CPUs free for others)",
        default=8,
        check=parse_ray_workers,
        metavar="N|auto",
        type_text="int or auto",
    ),
    Setting(
        "daemon", "max_ray_workers", (int,),
        help="with --ray-workers auto: the most batches in flight on the cluster, and the count it starts with",
        default=16,
        rules=(_at_least(1), (lambda v: v <= _MAX_RAY_WORKERS, f"at most {_MAX_RAY_WORKERS}")),
    ),
    Setting(
        "daemon", "ray_resources", (str, dict),
        help="with --executor ray: custom resources each task asks for, NAME=AMOUNT[,NAME=AMOUNT] (a table in TOML), "
        "to place tasks on the nodes that have them",
        check=parse_resources,
        metavar="NAME=AMOUNT,...",
        type_text="resources",
    ),
    Setting(
        "daemon", "retain", (int,),
        help="consumed batches kept per rank, so a trainer restarted a few steps back is served warm",
        default=2,
        rules=(_NOT_NEGATIVE,),
    ),
    Setting(
        "daemon", "on_error", (str,),
        help="an unreadable sample: replace it (recorded in the batch header) or fail",
        default="replace",
        choices=("replace", "fail"),
    ),
    Setting(
        "daemon", "max_bad_rate", (float, int),
        help="stop when more of the samples than this are unreadable",
        default=0.25,
        rules=((lambda v: 0 < v <= 1, "in (0, 1]"),),
        type_text="number",
    ),
    Setting(
        "daemon", "worker_timeout", (float, int),
        help="seconds a busy worker may finish no sample (any worker: send no heartbeat) before it is replaced; "
        "above your slowest sample",
        default=60,
        rules=((lambda v: v > 0, "positive"),),
        type_text="number",
    ),
    Setting(
        "daemon", "store_timeout", (float, int),
        help="seconds an object store (s3://, gs://, https:// data) may stay unreachable, batches waiting for it, "
        "before the daemon stops",
        default=600,
        rules=((lambda v: v > 0, "positive"),),
        type_text="number",
    ),
    Setting(
        "daemon", "max_worker_restarts", (int,),
        help="worker deaths tolerated per minute before the daemon stops",
        default=20,
        rules=(_NOT_NEGATIVE,),
    ),
    Setting(
        "daemon", "worker_nice", (int,),
        help="the workers' CPU niceness, 0-19: below the trainer, whose threads then run first when they wake",
        default=10,
        rules=((lambda v: 0 <= v <= 19, "a niceness from 0 (as the trainer) to 19 (lowest priority)"),),
    ),
    Setting(
        "daemon", "on_trainer_exit", (str,),
        help="a rank's trainer process is gone: keep its window (a warm restart) or release it",
        default="keep",
        choices=("keep", "release"),
    ),
    Setting(
        "daemon", "consumer_timeout", (float, int),
        help="seconds a gone trainer of a named consumer (PrefetchLoader(consumer=...)) keeps its batches",
        default=120,
        rules=((lambda v: 0 <= v <= 86400, "0 to 86400 seconds (a day)"),),
        type_text="number",
    ),
    Setting(
        "daemon", "endpoint", (str,),
        help="the control socket: ipc (daemon.sock in the job folder) or tcp://HOST:PORT, loopback unless CURVE "
        "is set",
        default="ipc",
        rules=((_is_endpoint, _ENDPOINT_FORMS),),
    ),
    Setting(
        "daemon", "curve_secret_key", (str,),
        help="CURVE for a TCP endpoint: the server's secret certificate (.key_secret), a file of yours, mode 0600",
        rules=((lambda v: v != "", "the path of the server's secret certificate"),),
        metavar="FILE",
        type_text="path",
    ),
    Setting(
        "daemon", "curve_authorized_keys", (str,),
        help="with curve_secret_key: a folder of yours of the admitted clients' public certificates (*.key)",
        rules=((lambda v: v != "", "the path of a folder of client public certificates"),),
        metavar="DIR",
        type_text="path",
    ),
    Setting(
        "daemon", "metrics", (str, int),
        help="serve Prometheus metrics at http://HOST:PORT/metrics (pip install 'prefetchd[metrics]'; "
        "docs/operations.md): HOST:PORT, or :PORT / PORT for 127.0.0.1; another host only when given, and "
        "everyone who can reach it reads the job's metrics",
        check=parse_metrics_address,
        metavar="HOST:PORT",
        type_text="address",
    ),
    # -- one key each: the epoch rule of weighted sources, your own per-sample code
    Setting(
        "mix", "epoch", (str,),
        help="how an epoch of weighted sources ends. cycle: once the source with the most samples per unit of "
        "weight has given each once; first_exhausted: before any source would repeat; all_once: every sample "
        "once, weights ignored",
        default="cycle",
        choices=MIX_RULES,
        field="mix",
        option="mix",
    ),
    Setting(
        "pipeline", "callable", (str,),
        help="your own per-sample function, instead of [[transform]]",
        rules=((lambda v: v.count(":") == 1, "like 'package.module:function'"),),
        field="pipeline",
        option="pipeline",
        metavar="MODULE:FUNCTION",
    ),
)
BY_OPTION = {s.option: s for s in SETTINGS}


def section_keys(section: str) -> list[str]:
    return [s.key for s in SETTINGS if s.section == section]


def echo(config: Any) -> dict:  # a prefetchd.config.Config, which builds on this module
    """The config's keys as ``{section: {key: value}}`` (JSON-serialisable), and its
    ``source`` and ``transform`` tables as lists (as checked: paths made absolute): what
    ``prefetchd status --json`` shows. Values are those a config file may hold (the buffer in
    bytes); unset keys are None."""
    echoed: dict = {section: {} for section in SECTIONS}
    for s in SETTINGS:
        value = getattr(config, s.field)
        echoed[s.section][s.key] = list(value) if isinstance(value, tuple) else value  # as JSON has it
    echoed["source"] = [dict(source) for source in config.sources]
    echoed["transform"] = [dict(transform) for transform in config.transforms]
    return echoed


def _type_text(s: Setting) -> str:
    if s.type_text:
        return s.type_text
    if s.choices:
        quoted = [f"`{c}`" for c in s.choices]
        return ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return s.types[0].__name__


def markdown_table() -> str:
    """The README's table of config keys: key, flag, type, default and meaning."""
    rows = ["| key | flag | type | default | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        default = s.default_text or (f"`{s.shown_default()}`" if s.shown_default() else "unset")
        cells = (f"`{s.where}`", f"`{s.flag_decls}`", _type_text(s), default, s.help)
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"
