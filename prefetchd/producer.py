"""Make one batch: read, decode and augment its samples straight into the batch file.

Used by the worker processes, and in-process by tools that regenerate a batch. The pixels
are written once, into the mapped batch file (no stacking, no pickling), and the batch
becomes visible by a hard link from ``tmp/`` into ``batches/``: atomic like rename, but it
fails if the name exists, so a batch is published once even when two workers made it.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefetchd_client.batchfile import BatchLayout, BatchWriter, FieldSpec, content_digest
from prefetchd_client.layout import JobPaths, batch_name

from .plan import Plan
from .sources import SampleIndex
from .transforms import ImagePipeline, validate_transforms

PRODUCER_SPEC = "producer.json"  # in the job directory: what workers (and verify) are given


class SampleError(Exception):
    """A sample could not be produced; the message names its file."""


@dataclass(frozen=True)
class ProducerSpec:
    """What a worker needs, as plain JSON-able data (workers start with spawn)."""

    job_dir: str
    plan: dict  # Plan.to_json()
    source_names: list
    transforms: list
    pipeline: str | None
    config_hash: str

    def to_json(self) -> dict:
        return self.__dict__.copy()


def builtin_fields(batch_size: int, transforms: list) -> list[FieldSpec]:
    """Batch fields of the built-in image pipeline: known without touching any image."""
    h, w = validate_transforms(transforms)
    return [FieldSpec("image", "uint8", (batch_size, h, w, 3)), *_id_fields(batch_size)]


def _id_fields(batch_size: int) -> list[FieldSpec]:
    return [FieldSpec("label", "int64", (batch_size,)), FieldSpec("index", "int64", (batch_size,))]


def load_callable(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


class BatchProducer:
    def __init__(self, spec: ProducerSpec):
        self.spec = spec
        self.paths = JobPaths(Path(spec.job_dir))
        self.plan = Plan.from_json(spec.plan)
        self.index = SampleIndex.load(self.paths.dir / "index")
        if spec.pipeline:
            self._user_fn = load_callable(spec.pipeline)
            self._image = None
        else:
            self._user_fn = None
            self._image = ImagePipeline(list(spec.transforms))
        self.layout = BatchLayout.plan(self.field_specs())

    def field_specs(self) -> list[FieldSpec]:
        b = self.plan.batch_size
        if self._image is not None:
            return builtin_fields(b, self.spec.transforms)
        # The user's code decides its fields: run it once on sample 0.
        sample = self._run_user_fn(0, self.plan.sample_rng(0, 0))
        return [FieldSpec(k, np.asarray(v).dtype.name, (b, *np.shape(v))) for k, v in sample.items()] + _id_fields(b)

    def _run_user_fn(self, sid: int, rng: np.random.Generator) -> dict:
        source = {"path": self.index.path(sid), "label": self.index.label(sid), "index": int(sid)}
        out = self._user_fn(source, rng)
        if not isinstance(out, dict) or not out or {"label", "index"} & set(out):
            raise TypeError(
                f"{self.spec.pipeline} must return a non-empty dict of arrays without 'label' or 'index' "
                f"keys (prefetchd adds those), got {type(out).__name__}"
            )
        return out

    def fill(self, arrays: dict[str, np.ndarray], epoch: int, step: int, rank: int) -> list[int]:
        """Write the batch's samples into ``arrays``; returns how many came from each source."""
        ids, passes = self.plan.batch_samples(epoch, step, rank)
        arrays["index"][:] = ids
        arrays["label"][:] = self.index.labels[ids]
        for slot, (sid, pass_) in enumerate(zip(ids, passes)):
            path = self.index.path(sid)
            rng = self.plan.sample_rng(epoch, sid, pass_)
            try:
                if self._image is not None:
                    self._image.apply(path, rng, arrays["image"][slot])
                else:
                    for key, value in self._run_user_fn(sid, rng).items():
                        arrays[key][slot] = value
            except Exception as exc:
                raise SampleError(f"sample {sid} ({path}): {type(exc).__name__}: {exc}") from exc
        return np.bincount(self.plan.source_of(ids), minlength=len(self.spec.source_names)).tolist()

    def meta(self, arrays: dict[str, np.ndarray], per_source: list[int]) -> dict:
        return {
            "config_hash": self.spec.config_hash,
            "sha256": content_digest(arrays, self.layout.fields),
            "sources": dict(zip(self.spec.source_names, per_source)),
        }

    def regenerate(self, epoch: int, step: int, rank: int) -> tuple[dict, dict[str, np.ndarray]]:
        """Make a batch in memory, as a worker would: (meta, arrays)."""
        arrays = {f.name: np.zeros(f.shape, f.dtype) for f in self.layout.fields}
        per_source = self.fill(arrays, epoch, step, rank)
        return self.meta(arrays, per_source), arrays

    def produce(self, epoch: int, step: int, rank: int) -> tuple[bool, list[int]]:
        """Write batch (epoch, step, rank) into the buffer.

        Returns (published, samples per source); published is False if the batch was already there.
        """
        name = batch_name(epoch, step, rank)
        tmp = self.paths.tmp_dir / f"{name}.{os.getpid()}"
        writer = BatchWriter(tmp, self.layout)
        try:
            per_source = self.fill(writer.arrays, epoch, step, rank)
            writer.finish(epoch, step, rank, self.meta(writer.arrays, per_source))
            try:
                os.link(tmp, self.paths.batch(epoch, step, rank))
                return True, per_source
            except FileExistsError:
                return False, per_source
        finally:
            writer.close()
            os.unlink(tmp)
