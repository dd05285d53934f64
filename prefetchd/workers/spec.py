"""What a worker is given and what its batches look like: the producer spec (``producer.json``),
the batch layout of a job, and the check of a made batch against both.

Apart from the producer (which imports Pillow, OpenCV and the sample readers): the master plans
the layout, writes the spec and checks leftover batches with these, and never loads the worker's
image libraries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from prefetchd.workers.transformspec import validate_transforms
from prefetchd_client.batchfile import PREAMBLE, BatchLayout, FieldSpec

PRODUCER_SPEC = "producer.json"  # in the job directory: what workers (and verify) are given

# The header area of a batch file holds the field table and the meta object. It is sized so
# that every sample of a batch can be recorded as replaced in the short form below (at most
# 80 bytes of JSON); the full form (path, error) is kept while it fits, and always logged.
_META_FIXED_BYTES = 256  # config hash, plan digest, content digest, the keys, "replaced_details": ~150
_REPLACED_BYTES_PER_SAMPLE = 96

SPEC_VERSION = 4  # of producer.json: workers and `prefetchd verify` read it, perhaps another install's

@dataclass(frozen=True)
class ProducerSpec:
    """What a worker needs, as plain JSON-able data (workers start with spawn)."""

    job_dir: str
    plan: dict  # Plan.to_json()
    source_names: list
    transforms: list
    pipeline: str | None
    config_hash: str
    on_error: str = "replace"  # or "fail"
    decoder: str = "pillow"  # or "simplejpeg" (prefetchd.workers.fastdecode)
    plan_digest: str = ""  # prefetchd.config.plan_digest
    # per source: its kind and its own keys (sources.kinds.own_options: a Parquet source's
    # image_column, a WebDataset source's label_key), what its samples' reader needs (version 4)
    sources: list = field(default_factory=list)
    version: int = SPEC_VERSION

    def to_json(self) -> dict:
        return self.__dict__.copy()

    @classmethod
    def from_json(cls, data: dict) -> ProducerSpec:
        """The spec ``to_json`` wrote; SpecMismatch when another prefetchd version wrote it,
        TypeError or ValueError when it is not a spec at all."""
        if not isinstance(data, dict):
            raise ValueError(f"a spec is an object, not a {type(data).__name__}")
        if data.get("version") != SPEC_VERSION:
            raise SpecMismatch(
                f"written by another prefetchd version (spec version {str(data.get('version'))[:20]}, this "
                f"prefetchd reads {SPEC_VERSION}); restart the job with this prefetchd"
            )
        return cls(**data)


class SpecMismatch(ValueError):
    """A producer.json written by another prefetchd version."""

def builtin_fields(batch_size: int, transforms: list, evaluation: bool = False) -> list[FieldSpec]:
    """Batch fields of the built-in image pipeline: known without touching any image."""
    h, w = validate_transforms(transforms)
    return [FieldSpec("image", "uint8", (batch_size, h, w, 3)), *id_fields(batch_size, evaluation)]


def id_fields(batch_size: int, evaluation: bool) -> list[FieldSpec]:
    """What prefetchd adds to every batch; an evaluation's ``valid`` marks the last step's padding."""
    fields = [FieldSpec("label", "int64", (batch_size,)), FieldSpec("index", "int64", (batch_size,))]
    return fields + [FieldSpec("valid", "bool", (batch_size,))] if evaluation else fields


def plan_layout(fields: list[FieldSpec], source_names: list[str]) -> BatchLayout:
    """The batch layout of a job: the same in the master and in every worker."""
    batch = fields[0].shape[0] if fields[0].shape else 1
    table = len(BatchLayout.plan(fields).table_bytes) + 64  # offsets may gain a digit or two
    sources = sum(len(json.dumps(name)) + 24 for name in source_names)
    meta = _META_FIXED_BYTES + sources + batch * _REPLACED_BYTES_PER_SAMPLE
    return BatchLayout.plan(fields, header_area=PREAMBLE.size + table + meta)


def why_not_this_batch(header, size: int, position: tuple[int, int, int], layout: BatchLayout, spec) -> str | None:
    """Why a batch (its parsed header, its size in bytes) is not batch ``position`` (epoch, step,
    rank) of this plan and layout; None when it is. Both a previous daemon's leftover and a
    batch made on another machine pass here before they count. ``spec``: this job's
    ProducerSpec. Reading ``header["meta"]`` may raise BatchFormatError."""
    made = (header["epoch"], header["step"], header["rank"])
    if made != position:
        return f"it is batch {made}, not {position}"
    meta = header["meta"]
    # The plan digest, not merely the config hash (which leaves out world size, batch size and
    # weights so resume states stay elastic); and the field table, which a [pipeline] callable
    # decides beyond what the digest names.
    if meta.get("plan_digest") != spec.plan_digest or meta.get("config_hash") != spec.config_hash:
        return f"made by another plan (plan digest {str(meta.get('plan_digest'))[:20]}, this job's {spec.plan_digest})"
    if [{k: f[k] for k in ("name", "dtype", "shape", "offset")} for f in header["fields"]] != json.loads(
        layout.table_bytes
    ):
        return "its fields are laid out otherwise than this job's"
    if size != layout.size:
        return f"{size} bytes, where this job's batches have {layout.size}"
    return None
