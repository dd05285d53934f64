"""Make one batch: read, decode and augment its samples straight into the batch layout.

Used by the worker processes, and in-process by tools that regenerate a batch. The pixels
are written once into a buffer laid out as the batch file and reused by the worker (no
stacking, no pickling), then into the file with one pwrite. The batch becomes visible by a
hard link into ``batches/`` of the file written in ``tmp/`` (prefetchd_client.batchwriter
``link_written``): atomic like rename, but it fails if the name exists, so a batch is
published once even when two workers made it.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.random  # noqa: F401 - numpy loads it on first use (5-10 ms): here, once in the worker server
from PIL import Image

from prefetchd.errors import describe
from prefetchd.plan import Plan
from prefetchd.sources.index import SampleIndex
from prefetchd.sources.objects import ObjectChanged, StoreUnreachable
from prefetchd.sources.places import FILE
from prefetchd.sources.samplereader import SampleReader
from prefetchd.workers.spec import ProducerSpec, builtin_fields, id_fields, plan_layout
from prefetchd.workers.transforms import ImagePipeline
from prefetchd_client.batchfile import DIGEST_KEY, FieldSpec, content_digest
from prefetchd_client.batchwriter import BatchBuffer, BatchWriter
from prefetchd_client.layout import JobPaths
from prefetchd_client.text import printable


class SampleError(Exception):
    """A sample could not be produced; the message names its file."""


class CallableExited(Exception):
    """The [pipeline] callable raised SystemExit, KeyboardInterrupt or GeneratorExit on a sample."""


_REPLACEMENT_ATTEMPTS = 10
# Of one sample's cause, as its reader said it, wherever it goes: a batch's record, a log line,
# a stop message. Room for a path and the reader's sentence; a stop names at most 11 of them.
# Not a bad sample: the store did not answer (the batch waits for it), or the data changed under
# the job (which stops it). Replacing the sample would make the batch depend on when it was made.
_NOT_THE_SAMPLES = (StoreUnreachable, ObjectChanged)
_CAUSE_CHARS = 300
_DIGITS = re.compile(r"\d+")
# Of one batch's paths and causes, what its report carries in full: the master refuses a worker's
# message over messages.MAX_MESSAGE_BYTES (16 MiB) and kills the worker, and the bad samples are
# then neither logged nor counted (10,000 causes of 300 CJK characters made 19.1 MB: \uXXXX is 6
# bytes of JSON, an emoji 12). 512 Ki characters are at most 6 MiB, which leaves room for the ids
# of ~100,000 records; past them a record keeps its ids, so it is still counted.
_DETAIL_CHARS_PER_BATCH = 512 << 10
_DETAILS_NOT_KEPT = "(not kept: the batch's earlier bad samples filled its report)"
_ADDED = {"label", "index", "valid"}  # what prefetchd adds to the fields a pipeline callable returns
# The header area of a batch file is sized (spec.plan_layout) so that every sample of a batch
# can be recorded as replaced in the short form below (at most 80 bytes of JSON); the full form
# (path, error) is kept while it fits, and always logged.
_SHORT_REPLACED_KEYS = ("slot", "index", "replacement")


@dataclass
class FillReport:
    """What went into a batch besides pixels."""

    per_source: list[int]
    # {"slot", "index", "path" (SampleReader.where), "error" (its reader's words), "replacement"}
    replaced: list[dict] = field(default_factory=list)
    longest_bad_run: int = 0


@dataclass
class SampleProgress:
    """How far the producer's sample loop is, read by the worker's heartbeat thread.

    A heartbeat proves that the process lives, not that its task moves: a read on a hung
    network mount blocks in a call that releases the GIL, and the heartbeat thread beats on.
    So every beat carries ``finished`` (sample attempts that ended, made or found unreadable),
    and the master kills a busy worker whose count has not moved for --worker-timeout. A
    sample that legitimately takes longer than that is indistinguishable from a hung one.
    Written by the sample loop only; the reader needs no lock (single attribute stores).
    """

    finished: int = 0
    current: tuple[int, str] | None = None  # (sample id, path) being made: named when it hangs
    io: Callable[[], dict] = dict  # each object store's counters (SampleReader.io_totals), once a producer runs


def load_callable(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


class BatchProducer:
    def __init__(self, spec: ProducerSpec, progress: SampleProgress | None = None, index: SampleIndex | None = None):
        """``index``: the job's sample list, where its folder is not at hand (a Ray node)."""
        # Pillow only warns between MAX_IMAGE_PIXELS and twice that: make it a bad sample.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        self.spec = spec
        self.progress = SampleProgress() if progress is None else progress
        self.paths = JobPaths(Path(spec.job_dir))
        self.plan = Plan.from_json(spec.plan)
        self.index = SampleIndex.load(self.paths.dir / "index") if index is None else index
        self.reader = SampleReader(self.index, spec.sources, self.plan.source_sizes)
        self._caching = any(source.get("cache") for source in spec.sources)  # a cache evicts by the plan's next use
        self.progress.io = self.reader.io_totals
        if spec.pipeline:
            self._user_fn = load_callable(spec.pipeline)
            self._image = None
        else:
            self._user_fn = None
            self._image = ImagePipeline(list(spec.transforms), spec.decoder)
        self.layout = plan_layout(self.field_specs(), spec.source_names)
        self._buffer: BatchBuffer | None = None  # made on the first produce(): verify never needs it

    def field_specs(self) -> list[FieldSpec]:
        b = self.plan.batch_size
        if self._image is not None:
            return builtin_fields(b, self.spec.transforms, self.plan.evaluation)
        # The user's code decides its fields: run it once on sample 0, or, where sample 0 is bad,
        # on the sample that stands in for it in batch (0, 0): the plan's draw, so every worker,
        # local or remote, learns the same shapes from the same sample.
        samples: list[dict] = []

        def learn_from(sid: int) -> None:
            samples.append(self._run_user_fn(sid, self.plan.sample_rng(0, sid)))

        try:
            learn_from(0)
        except Exception as exc:
            self._stand_in(0, 0, 0, describe(exc, _CAUSE_CHARS), learn_from)
        return [FieldSpec(k, np.asarray(v).dtype.name, (b, *np.shape(v))) for k, v in samples[0].items()] + id_fields(
            b, self.plan.evaluation
        )

    def _run_user_fn(self, sid: int, rng: np.random.Generator) -> dict:
        source = {"path": self.index.path(sid), "label": self.index.label(sid), "index": int(sid)}
        if self.index.kinds is not None:  # a container's sample: its encoded image (None: a file of its own)
            source["data"] = None if self.index.kind(sid) == FILE else self.reader.image_bytes(sid)
        try:
            out = self._user_fn(source, rng)
        except (SystemExit, KeyboardInterrupt, GeneratorExit) as exc:
            # No Exception, so they would end the worker: it died again on each retry and the
            # stop said "a [pipeline] callable that exits", never what it raised. They are the
            # callable's own (a worker ignores SIGINT; Ray cancels a task by killing it): a bad
            # sample, with its words, as any other exception of the callable's.
            raise CallableExited(f"{self.spec.pipeline} raised {describe(exc, _CAUSE_CHARS)}") from None
        if not isinstance(out, dict) or not out or _ADDED & set(out):
            raise TypeError(
                f"{self.spec.pipeline} must return a non-empty dict of arrays without 'label', 'index' or 'valid' "
                f"keys (prefetchd adds those), got {type(out).__name__}"
            )
        return out

    def fill(self, arrays: dict[str, np.ndarray], epoch: int, step: int, rank: int) -> FillReport:
        """Write the batch's samples into ``arrays``.

        A sample that cannot be read (corrupt, truncated, not an allowed image format, too
        many pixels, gone) either stops the batch (``on_error = "fail"``) or is replaced by
        another sample drawn from the plan, so the batch keeps its size and the rank its
        number of batches; the replacement is deterministic and recorded.
        """
        ids, passes = self.plan.batch_samples(epoch, step, rank)
        self.reader.read_ahead(ids, self.plan.uses(epoch, step, rank) if self._caching else None)
        if self.plan.evaluation:
            arrays["valid"][:] = self.plan.batch_valid(step, rank)
        report, run = FillReport([]), 0
        details = 0  # characters of paths and causes in report.replaced
        for slot, (sid, pass_) in enumerate(zip(ids.tolist(), passes.tolist())):
            try:
                self._make_sample(arrays, slot, epoch, sid, pass_)
                run = 0
                continue
            except _NOT_THE_SAMPLES:
                raise
            except Exception as exc:
                error = describe(exc, _CAUSE_CHARS)
                if self.spec.on_error == "fail":
                    # one line (a file name may hold a newline): a worker's error travels as its last line
                    raise SampleError(printable(f"sample {sid} ({self.reader.place(sid)}): {error}")) from exc
            run += 1
            report.longest_bad_run = max(report.longest_bad_run, run)
            path = self.reader.where(sid)
            details += len(path) + len(error)
            replacement = self._replace(arrays, slot, epoch, sid, pass_, error)
            if details > _DETAIL_CHARS_PER_BATCH:
                path = error = _DETAILS_NOT_KEPT
            report.replaced.append(
                {"slot": slot, "index": sid, "path": path, "error": error, "replacement": replacement}
            )
            if self.plan.evaluation:  # the stand-in is counted where it is itself: not here too
                arrays["valid"][slot] = False
        report.per_source = np.bincount(
            self.plan.source_of(arrays["index"]), minlength=len(self.spec.source_names)
        ).tolist()
        return report

    def _make_sample(self, arrays: dict[str, np.ndarray], slot: int, epoch: int, sid: int, pass_: int) -> None:
        path = self.index.path(sid)
        self.progress.current = (sid, path)
        try:
            rng = self.plan.sample_rng(epoch, sid, pass_)
            if self._image is not None:
                self._image.apply(path, rng, arrays["image"][slot], self.reader.image_bytes(sid, path))
            else:
                out = self._run_user_fn(sid, rng)
                if out.keys() != arrays.keys() - _ADDED:
                    # A key left out would keep the last batch's value in the reused buffer: the
                    # batch's bytes would depend on which worker made it. A bad sample instead.
                    raise ValueError(
                        f"{self.spec.pipeline} returned keys {sorted(out)}, but its first sample had "
                        f"{sorted(arrays.keys() - _ADDED)}"
                    )
                for key, value in out.items():
                    arrays[key][slot] = value
            arrays["index"][slot] = sid
            arrays["label"][slot] = self.index.labels[sid]
        finally:
            self.progress.finished += 1  # an unreadable sample is progress too: the loop moves on

    def _replace(self, arrays: dict[str, np.ndarray], slot: int, epoch: int, sid: int, pass_: int, cause: str) -> int:
        """Make the sample that stands in for the unreadable ``sid`` (``cause``: why) in ``slot``."""
        return self._stand_in(
            epoch, sid, pass_, cause, lambda other: self._make_sample(arrays, slot, epoch, other, pass_)
        )

    def _stand_in(self, epoch: int, sid: int, pass_: int, cause: str, make: Callable[[int], None]) -> int:
        """``make`` each replacement the plan draws for the unreadable sample ``sid`` until one
        is made; its id. SampleError when none of _REPLACEMENT_ATTEMPTS is: it names each cause."""
        failures: list[tuple[int, str]] = []
        for attempt in range(_REPLACEMENT_ATTEMPTS):
            other = self.plan.replacement(epoch, sid, pass_, attempt)
            try:
                make(other)
                return other
            except _NOT_THE_SAMPLES:
                raise
            except Exception as exc:
                failures.append((other, describe(exc, _CAUSE_CHARS)))
        raise SampleError(printable(self._unreadable(sid, cause, failures)))  # one line, as above

    def _unreadable(self, sid: int, cause: str, failures: list[tuple[int, str]]) -> str:
        """Why a sample could not be stood in for: its place and its reader's words, then those
        of its replacements, once per kind of cause (causes that differ only in their numbers,
        a row or an offset, are one kind: told by the first of it, with the samples alike)."""
        kinds: dict[str, list[tuple[int, str]]] = {}
        for other, why in failures:
            kinds.setdefault(_DIGITS.sub("#", why), []).append((other, why))
        told = []
        for kind, alike in kinds.items():
            ids = ", ".join(str(other) for other, _ in alike)
            if kind == _DIGITS.sub("#", cause):
                told.append(f"{len(alike)} for the same reason (samples {ids})")
            else:
                other, why = alike[0]
                told.append(f"{len(alike)} as sample {other} ({self.reader.place(other)}): {why} (samples {ids})")
        return (
            f"sample {sid} ({self.reader.place(sid)}) is unreadable: {cause}; so were the "
            f"{len(failures)} replacements drawn for it: {'; '.join(told)}. Fix what this says: {len(failures) + 1} "
            "unreadable samples in a row point at the data, or at how it is read, not at one sample"
        )

    def meta(self, arrays: dict[str, np.ndarray], report: FillReport) -> dict:
        meta = {
            "config_hash": self.spec.config_hash,
            "plan_digest": self.spec.plan_digest,  # a restarted daemon adopts only batches of its own plan
            DIGEST_KEY: content_digest(arrays, self.layout.fields),
            "sources": dict(zip(self.spec.source_names, report.per_source)),
            "replaced": report.replaced,
        }
        if report.replaced and not self.layout.meta_fits(meta):
            # Many bad samples with long paths: the short form always fits (plan_layout);
            # the paths and errors are in the daemon's log, line by line.
            meta["replaced"] = [{k: r[k] for k in _SHORT_REPLACED_KEYS} for r in report.replaced]
            meta["replaced_details"] = "daemon.log"
        return meta

    def regenerate(self, epoch: int, step: int, rank: int) -> tuple[dict, dict[str, np.ndarray]]:
        """Make a batch in memory, as a worker would: (meta, arrays)."""
        arrays = {f.name: np.zeros(f.shape, f.dtype) for f in self.layout.fields}
        return self.meta(arrays, self.fill(arrays, epoch, step, rank)), arrays

    def make_in_memory(self, epoch: int, step: int, rank: int) -> tuple[memoryview, FillReport]:
        """Batch (epoch, step, rank) as its file's bytes, in a buffer the next call reuses."""
        if self._buffer is None:
            self._buffer = BatchBuffer(self.layout)
        try:
            report = self.fill(self._buffer.arrays, epoch, step, rank)
        finally:
            self.progress.current = None
        return self._buffer.seal(epoch, step, rank, self.meta(self._buffer.arrays, report)), report

    def fingerprint(self, samples: int = 2) -> str:
        """A digest of the first samples of batch (0, 0, 0) as this machine decodes and augments
        them: another Pillow, libjpeg-turbo or simplejpeg build, or a node that cannot read the
        data, gives another one. Cheap: ``samples`` samples, not a batch."""
        arrays = {f.name: np.zeros(f.shape, f.dtype) for f in self.layout.fields}
        ids, passes = self.plan.batch_samples(0, 0, 0)
        digest = hashlib.sha256()
        for slot in range(min(samples, len(ids))):
            try:
                self._make_sample(arrays, slot, 0, int(ids[slot]), int(passes[slot]))
            except Exception as exc:  # unreadable here: the digest says so, in its own way
                digest.update(f"{type(exc).__name__}: {exc}".encode())
                continue
            for f in self.layout.fields:
                digest.update(arrays[f.name][slot].tobytes())
        self.progress.current = None
        return digest.hexdigest()[:16]

    def produce(self, epoch: int, step: int, rank: int, spare: bool = False) -> tuple[bool, FillReport]:
        """Write batch (epoch, step, rank) into the buffer; ``spare``: over the consumed batch's
        file the master left at this process's temporary path for it.

        Returns (published, report); published is False if the batch was already there.
        """
        tmp = self.paths.tmp_file(epoch, step, rank, os.getpid())
        if self._buffer is None:
            self._buffer = BatchBuffer(self.layout)
        writer = BatchWriter(tmp, self.layout, self._buffer, spare=spare)
        try:
            report = self.fill(writer.arrays, epoch, step, rank)
            meta = self.meta(writer.arrays, report)
            return writer.finish(epoch, step, rank, meta, publish_as=self.paths.batch_file(epoch, step, rank)), report
        finally:
            self.progress.current = None
            try:
                writer.close()
            finally:
                os.unlink(tmp)
