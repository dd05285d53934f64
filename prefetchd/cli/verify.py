"""``prefetchd verify``: remake one batch in this process and compare it with the published one.

Determinism made checkable: the batch's content digest (``meta.xxh3_64``) and its bytes must
equal what the plan yields here, whatever worker made it and however often. Its plan
digest (``meta.plan_digest``) must be this job's too: a batch made by another plan (another
world size, batch size, weights, transforms, decoder...) differs even where its pixels could
pass, and the result says so with both digests.
"""

from __future__ import annotations

import json

import numpy as np

from prefetchd.errors import JobError
from prefetchd.workers.producer import BatchProducer
from prefetchd.workers.spec import PRODUCER_SPEC, ProducerSpec, SpecMismatch
from prefetchd_client.batchfile import DIGEST_KEY, BatchFormatError, map_batch
from prefetchd_client.folders import read_regular_file
from prefetchd_client.layout import JobPaths
from prefetchd_client.manifest import read_manifest
from prefetchd_client.ranks import format_ranks

_MAX_SPEC_BYTES = 1 << 20


def _read_spec(paths: JobPaths) -> ProducerSpec:
    """The job's producer.json: a small regular file (never a FIFO: O_NONBLOCK) holding the
    fields of a ProducerSpec; JobError otherwise."""
    path = paths.dir / PRODUCER_SPEC
    try:
        data = read_regular_file(path, _MAX_SPEC_BYTES)
    except FileNotFoundError:
        raise
    except ValueError as exc:
        raise JobError(f"{exc}; a daemon never writes that: restart the job") from None
    except OSError as exc:
        raise JobError(f"cannot read {path}: {exc.strerror}") from None
    try:
        return ProducerSpec.from_json(json.loads(data))
    except SpecMismatch as exc:
        raise JobError(f"{path} was {exc}") from None
    except (ValueError, RecursionError, TypeError) as exc:
        raise JobError(f"{path} is not what a daemon writes ({type(exc).__name__}); restart the job") from None


def verify_batch(paths: JobPaths, epoch: int, step: int, rank: int) -> dict:
    try:
        manifest = read_manifest(paths)
        spec = _read_spec(paths)
    except FileNotFoundError:
        raise JobError(f"no serving job {paths.name!r} under {paths.dir.parent}; start it first") from None
    if not (0 <= rank < manifest["world_size"] and 0 <= step < manifest["batches_per_epoch"] and epoch >= 0):
        raise JobError(
            f"no batch epoch {epoch} step {step} rank {rank} in job {paths.name!r}: steps are "
            f"0..{manifest['batches_per_epoch'] - 1}, ranks 0..{manifest['world_size'] - 1}"
        )
    if rank not in manifest["ranks"]:
        raise JobError(
            f"rank {rank} is not served by the daemon of job {paths.name!r} under {paths.dir.parent}: it serves "
            f"ranks {format_ranks(manifest['ranks'])} of {manifest['world_size']} (--ranks); verify it on the node "
            "that serves it"
        )
    path = paths.batch(epoch, step, rank)
    try:
        header, published = map_batch(path)
        published_digest = header["meta"].get(DIGEST_KEY)
        published_plan = header["meta"].get("plan_digest")
    except FileNotFoundError:
        raise JobError(
            f"batch epoch {epoch} step {step} rank {rank} is not in the buffer (consumed, or not produced yet); "
            f"`prefetchd status {paths.name}` shows each rank's window"
        ) from None
    except BatchFormatError as exc:
        raise JobError(f"{path} is not a valid batch file ({exc}); the daemon never publishes one") from None
    try:
        producer = BatchProducer(spec)
    except ImportError as exc:  # this node's decoder (fastdecode.require's words), or the pipeline's module
        raise JobError(f"cannot remake batches of job {paths.name!r} here: {exc}") from None
    except Exception as exc:  # its index, its transforms, its pipeline's import: all read from the job folder
        raise JobError(
            f"cannot remake batches of job {paths.name!r} from its {PRODUCER_SPEC} and index: "
            f"{type(exc).__name__}: {str(exc)[:200]}; a daemon never writes such a job folder: restart the job"
        ) from None
    meta, regenerated = producer.regenerate(epoch, step, rank)
    differing = sorted(k for k in regenerated if not np.array_equal(regenerated[k], published.get(k)))
    other_plan = _other_plan(published_plan, spec.plan_digest)
    return {
        "batch": path.name,
        "digest_kind": DIGEST_KEY,
        "published_digest": published_digest,
        "regenerated_digest": meta[DIGEST_KEY],
        "differing_fields": differing,
        "published_plan_digest": published_plan,
        "plan_digest": spec.plan_digest,
        "reason": other_plan,
        "identical": not differing and published_digest == meta[DIGEST_KEY] and other_plan is None,
    }


def _other_plan(published: object, ours: str) -> str | None:
    """Why a batch is not of this job's plan, or None when it is (or the job predates digests)."""
    if not ours or published == ours:
        return None
    return f"made by another plan: its plan digest {published!r:.40}, this job's {ours!r}"
