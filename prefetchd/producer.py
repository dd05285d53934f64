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
    plan: dict  # Plan fields
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
        self.plan = Plan(**spec.plan)
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
        sample = self._run_user_fn(0, 0)
        return [FieldSpec(k, np.asarray(v).dtype.name, (b, *np.shape(v))) for k, v in sample.items()] + _id_fields(b)

    def _run_user_fn(self, epoch: int, sid: int) -> dict:
        source = {"path": self.index.path(sid), "label": self.index.label(sid), "index": sid}
        out = self._user_fn(source, self.plan.sample_rng(epoch, sid))
        if not isinstance(out, dict) or not out or {"label", "index"} & set(out):
            raise TypeError(
                f"{self.spec.pipeline} must return a non-empty dict of arrays without 'label' or 'index' "
                f"keys (prefetchd adds those), got {type(out).__name__}"
            )
        return out

    def fill(self, arrays: dict[str, np.ndarray], epoch: int, step: int, rank: int) -> None:
        ids = self.plan.sample_ids(epoch, step, rank)
        arrays["index"][:] = ids
        arrays["label"][:] = self.index.labels[ids]
        for slot, sid in enumerate(ids):
            path = self.index.path(sid)
            try:
                if self._image is not None:
                    self._image.apply(path, self.plan.sample_rng(epoch, sid), arrays["image"][slot])
                else:
                    for key, value in self._run_user_fn(epoch, sid).items():
                        arrays[key][slot] = value
            except Exception as exc:
                raise SampleError(f"sample {sid} ({path}): {type(exc).__name__}: {exc}") from exc

    def meta(self, arrays: dict[str, np.ndarray]) -> dict:
        return {"config_hash": self.spec.config_hash, "sha256": content_digest(arrays, self.layout.fields)}

    def regenerate(self, epoch: int, step: int, rank: int) -> tuple[dict, dict[str, np.ndarray]]:
        """Make a batch in memory, as a worker would: (meta, arrays)."""
        arrays = {f.name: np.zeros(f.shape, f.dtype) for f in self.layout.fields}
        self.fill(arrays, epoch, step, rank)
        return self.meta(arrays), arrays

    def produce(self, epoch: int, step: int, rank: int) -> bool:
        """Write batch (epoch, step, rank) into the buffer; False if it was already there."""
        name = batch_name(epoch, step, rank)
        tmp = self.paths.tmp_dir / f"{name}.{os.getpid()}"
        writer = BatchWriter(tmp, self.layout)
        try:
            self.fill(writer.arrays, epoch, step, rank)
            writer.finish(epoch, step, rank, self.meta(writer.arrays))
            try:
                os.link(tmp, self.paths.batch(epoch, step, rank))
                return True
            except FileExistsError:
                return False
        finally:
            writer.close()
            os.unlink(tmp)
