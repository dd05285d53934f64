"""What a job is, built once at start-up: its index, plan, hashes, producer spec, and the
batch layout with the byte bound it must fit; and the manifest that tells clients about it.

Nothing here runs a loop or owns a process: ``build_job`` reads the data's file list and
writes ``index`` and ``producer.json``; ``fit_layout`` checks the bound against a layout.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from prefetchd.config import Config, content_hash
from prefetchd.errors import ConfigError, DataError
from prefetchd.plan import Plan
from prefetchd.sizes import format_size
from prefetchd.sources.index import SampleIndex
from prefetchd.sources.indexfiles import IndexWriter
from prefetchd.sources.kinds import KINDS, own_options
from prefetchd.workers.spec import PRODUCER_SPEC, ProducerSpec, plan_layout
from prefetchd_client.batchfile import VERSION as BATCH_FORMAT_VERSION
from prefetchd_client.batchfile import BatchLayout, FieldSpec
from prefetchd_client.layout import JobPaths
from prefetchd_client.manifest import MANIFEST_VERSION

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Job:
    """A job's fixed facts: the same from its first batch to its last."""

    config: Config
    paths: JobPaths
    plan: Plan
    source_names: list[str]
    content: dict  # what a resume state must match (Config.content)
    config_hash: str
    plan_digest: str  # what a batch's bytes depend on (plan_digest)
    spec: ProducerSpec
    index_bytes: int  # the index's files in the job folder: on the tmpfs beside the buffer, once for all processes
    classes: int  # the largest label + 1
    class_names: list[str] | None  # label i's name, where the sources say (class_names)

    def batch_name(self, rank: int, index: int) -> str:
        """``e3 s12 r1``: how log lines and messages name a batch."""
        epoch, step = self.plan.unlinear(index)
        return f"e{epoch} s{step} r{rank}"


def write_index(sources: tuple[dict, ...], folder) -> tuple[SampleIndex, tuple[int, ...], int]:
    """One index over all sources, in config order (sample ids continue across sources),
    written to ``folder`` as the sources are scanned (a source of many shards a shard at a
    time), the number of samples of each source, and of classes (the largest label + 1).
    The index comes back as its files."""
    writer, sizes = IndexWriter(folder), []
    try:
        for i, src in enumerate(sources):
            before = writer.samples
            scanned = KINDS[src["kind"]].scanner()(src, f"[[source]] #{i + 1} ({src['kind']})")
            try:
                for part in _parts(scanned):
                    writer.add(part)
            finally:
                if not isinstance(scanned, SampleIndex):
                    scanned.close()  # a generator's indexing threads end now, not when it is collected
            sizes.append(writer.samples - before)
        writer.finish()
    finally:
        writer.close()
    return SampleIndex.load(folder), tuple(sizes), writer.max_label + 1


def build_index(sources: tuple[dict, ...]) -> tuple[SampleIndex, tuple[int, ...]]:
    """write_index's index in this process's memory (tests and benchmarks: a small dataset)."""
    with tempfile.TemporaryDirectory(prefix="prefetchd-index-") as folder:
        index, sizes, _ = write_index(sources, Path(folder) / "index")
        return index.in_memory(), sizes


def _parts(scanned) -> Iterable[SampleIndex]:
    """A scan gives its source's index whole, or (shards) part after part."""
    return [scanned] if isinstance(scanned, SampleIndex) else scanned


def build_job(config: Config, paths: JobPaths) -> Job:
    """Index the data, plan the epochs, and write what workers and `prefetchd verify` read."""
    index, sizes, classes = write_index(config.sources, paths.dir / "index")
    weights = tuple(s["weight"] for s in config.sources) if "weight" in config.sources[0] else ()
    evaluation = config.mode == "eval"
    drop_last = config.drop_last and not evaluation  # an evaluation reads every sample: it pads
    plan = Plan(
        len(index), config.world_size, config.batch_size, config.seed, drop_last, sizes, weights, config.mix, evaluation
    )
    if plan.batches_per_epoch < 1:
        raise DataError(
            f"an epoch has {plan.epoch_length} samples, fewer than one global batch "
            f"({config.world_size} ranks x batch_size {config.batch_size}); lower --batch-size or add data"
        )
    source_names = [s["name"] for s in config.sources]
    fingerprint = index.fingerprint()
    content = config.content(len(index), fingerprint, plan.order)
    digest = plan_digest(config, plan.to_json(), fingerprint)
    spec = ProducerSpec(
        job_dir=str(paths.dir),
        plan=plan.to_json(),
        source_names=source_names,
        transforms=list(config.transforms),
        pipeline=config.pipeline,
        config_hash=content_hash(content),
        on_error=config.on_error,
        decoder=config.decoder,
        plan_digest=digest,
        sources=[own_options(s) for s in config.sources],
    )
    write_json(paths.dir / PRODUCER_SPEC, spec.to_json())  # `prefetchd verify` remakes batches from it
    index_bytes = sum(entry.stat().st_size for entry in os.scandir(paths.dir / "index"))
    names = class_names(config.sources)
    return Job(config, paths, plan, source_names, content, spec.config_hash, digest, spec, index_bytes, classes, names)


_MAX_CLASS_NAMES_CHARS = 256 << 10  # of the manifest's 1 MiB


def class_names(sources: tuple[dict, ...]) -> list[str] | None:
    """The classes' names where every source names them alike (an image folder's class folders,
    the classes `pack` kept, a Hugging Face ClassLabel); None where one does not, or they differ
    (labels are one space across sources), or they would not fit the manifest."""
    named = [KINDS[src["kind"]].names_of_classes(src) for src in sources]
    names = named[0]
    if names is None or any(other != names for other in named[1:]):
        return None
    if sum(len(n) + 4 for n in names) > _MAX_CLASS_NAMES_CHARS:
        log.info("%d class names are too many for the manifest: the client's classes are None", len(names))
        return None
    return names


def fit_layout(job: Job, fields: list[FieldSpec]) -> tuple[BatchLayout, int]:
    """The batch layout of these fields and how many batches the bound holds; ConfigError when
    the bound is too small for one batch per rank or larger than the filesystem's free space."""
    cfg = job.config
    layout = plan_layout(fields, job.source_names)
    size = layout.size
    capacity = cfg.buffer_bytes // size
    served = len(cfg.served_ranks)  # the bound is split between the ranks this daemon serves
    needed = served * (cfg.retain + 1)
    if capacity < needed:
        raise ConfigError(
            f"--buffer {format_size(cfg.buffer_bytes)} is smaller than one batch per rank: a batch is "
            f"{format_size(size)}, and {served} rank(s) x (1 ahead + --retain {cfg.retain}) need "
            f"{format_size(size * needed)}; use --buffer {format_size(size * served * (cfg.retain + 8))} "
            "or more (a few hundred batches per rank is typical)"
        )
    stats = os.statvfs(job.paths.dir)
    free = stats.f_bavail * stats.f_frsize
    if cfg.buffer_bytes > free:
        where = (
            "mount a tmpfs of --buffer + a few percent shared with the trainers' containers at the same path, "
            "and point PREFETCHD_ROOT there in both (docker/compose.yaml: a container's own /dev/shm is 64 MB, "
            "and not shared)"
            if in_a_container()
            else "a tmpfs of its own (docs/operations.md, \"Deploying\")"
        )
        raise ConfigError(
            f"--buffer {format_size(cfg.buffer_bytes)} exceeds the {format_size(free)} free on the "
            f"filesystem of {job.paths.dir.parent}; use a smaller --buffer, or another --root: {where}"
        )
    return layout, capacity


def in_a_container() -> bool:
    """Whether this process runs in a container (Docker, Podman, a Kubernetes pod): what advice fits."""
    markers = ("/.dockerenv", "/run/.containerenv")
    return any(os.path.exists(m) for m in markers) or "KUBERNETES_SERVICE_HOST" in os.environ


def write_manifest(job: Job, layout: BatchLayout, *, window: int, endpoint: str, curve_public_key, started_at) -> None:
    """What clients read: the plan's shape, the layout, where the control socket is."""
    cfg = job.config
    manifest = {
        "manifest_version": MANIFEST_VERSION,  # clients refuse another version: the packages differ
        "format_version": BATCH_FORMAT_VERSION,
        "job": job.paths.name,
        "config_hash": job.config_hash,
        "plan_digest": job.plan_digest,  # every batch's meta carries it (verify mode checks)
        "config": job.content,
        "num_samples": job.plan.num_samples,
        "classes": job.classes,
        "class_names": job.class_names,  # the client's classes and class_to_idx
        "transforms": list(cfg.transforms),  # for people: `start` and `status` show them
        "decoder": cfg.decoder,
        "batches_per_epoch": job.plan.batches_per_epoch,
        "world_size": cfg.world_size,
        "ranks": list(cfg.served_ranks),  # this node's: a trainer of another rank is told where it is not
        "batch_size": cfg.batch_size,
        "global_batch": job.plan.global_batch,
        "drop_last": cfg.drop_last,
        "fields": [f.to_json() for f in layout.fields],
        "batch_bytes": layout.size,
        "buffer_bytes": cfg.buffer_bytes,
        "window_per_rank": window,
        "retain": cfg.retain,
        "workers": cfg.workers,
        "pid": os.getpid(),
        "endpoint": endpoint,
        "curve_public_key": curve_public_key,  # clients use CURVE when it is set
        "started_at": started_at,
    }
    write_json(job.paths.manifest, manifest)


def write_json(path, data: dict) -> None:
    """Atomically, 0600: a reader sees the whole file or none."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
