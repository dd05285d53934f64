"""A sample's encoded image, wherever the index says it lies: a file of its own, a member of a
tar shard, a row of a Parquet file, or any place a source kind registers (sources.kinds).

Each place has its reader (a SampleBytes), made for the first sample there, with its own open
files and caches: containers are read only by the worker that makes the batch, and pyarrow is
imported only when a Parquet sample is read.
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from types import MappingProxyType

import numpy as np

from prefetchd.sources import kinds
from prefetchd.sources.index import NEVER, NO_LABEL, SampleBytes, SampleIndex
from prefetchd.sources.places import FILE


class SampleReader:
    def __init__(self, index: SampleIndex, sources: list[dict], source_sizes: tuple[int, ...]):
        """``sources``: per source, its kind and its own keys (kinds.own_options), as the producer
        spec carries them."""
        self.index = index
        # a list, not an array: bisect on it takes 0.03 us a sample, np.searchsorted 1 us
        self._sources, self._source_ends = list(sources), list(accumulate(source_sizes))
        self._readers: dict[int, SampleBytes] = {}
        self._uses: dict[int, tuple[int, int]] = {}  # the coming samples' use now and next in the plan (read_ahead)

    def image_bytes(self, sid: int, path: str | None = None) -> bytes:
        """The encoded image of sample ``sid`` (``path``: its index path, where the caller has
        looked it up already). ValueError (a bad sample) for one without a label or an image, or
        a damaged container."""
        place = self.index.kind(sid)
        reader, path = self._reader(place), self.index.path(sid) if path is None else path
        a, b = self.index.member(sid) if place != FILE else (-1, -1)
        options = self._options(sid)
        if place != FILE and self.index.labels[sid] == NO_LABEL:
            raise ValueError(reader.why_no_label(path, a, b, options))
        reader.now, reader.next_use = self._uses.get(sid, (0, NEVER))
        return reader.read_sample(path, a, b, options)

    def read_ahead(self, ids: np.ndarray, uses: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Ask for the coming samples' bytes now, all at once and in container-offset order, so a
        cold page cache or a network file system reads them while the batch's first ones decode.
        ``uses``: where the plan uses each of them now and next (plan.Plan.uses), for a cache."""
        self._uses = {} if uses is None else dict(zip(ids.tolist(), zip(*(u.tolist() for u in uses))))
        if self.index.kinds is None:
            return
        wanted: dict[int, list] = {}
        for i in ids:
            place = int(self.index.kinds[i])
            if place != FILE:
                wanted.setdefault(place, []).append((self.index.path(i), *self.index.member(i), self._options(i)))
        for place, places in wanted.items():
            self._reader(place).will_need(places)

    def where(self, sid: int) -> str:
        """The sample's place, as a batch records it: the path of a file of its own; in a
        container, the container and where in it ("shard S member KEY", "Parquet file F row
        group G row R")."""
        place = self.index.kind(sid)
        if place == FILE:
            return self.index.path(sid)
        return self._reader(place).where(self.index.path(sid), *self.index.member(sid))

    def place(self, sid: int) -> str:
        """The sample's place, for messages: ``where``, with a file of its own called one."""
        return f"file {self.index.path(sid)}" if self.index.kind(sid) == FILE else self.where(sid)

    def io_totals(self) -> dict[str, list]:
        """Each object store's counters over this process's readers (sources.objects.IO_FIELDS).
        Read by the heartbeat thread: a reader made meanwhile is counted at the next beat."""
        totals: dict[str, list] = {}
        for reader in list(self._readers.values()):
            for store, values in reader.io_totals().items():
                totals[store] = [a + b for a, b in zip(totals.get(store, [0] * len(values)), values)]
        return totals

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def _reader(self, place: int) -> SampleBytes:
        reader = self._readers.get(place)
        if reader is None:
            make = kinds.reader_for(place)
            if make is None:
                raise ValueError(f"unknown sample kind {place} in the index")
            reader = self._readers[place] = make()
            if self.index.objects:
                reader.objects_indexed = MappingProxyType(self.index.objects)
        return reader

    def _options(self, sid: int) -> dict:
        source = bisect.bisect_right(self._source_ends, sid)
        return self._sources[source] if source < len(self._sources) else {}
