"""An object in a store read as a seekable binary file, for what takes a file (tarfile indexing a
shard, a member read as its own header defines it)."""

from __future__ import annotations

from prefetchd.sources.objects import ObjectInfo, Objects


class ObjectFile:
    """An object read as a seekable binary file (what tarfile and pyarrow take), in ranges of
    ``chunk`` bytes: reading it through once streams it once. ``pread`` reads at an offset
    without moving. The two chunks last read are kept (a member's header, then its data)."""

    def __init__(self, objects: Objects, url: str, info: ObjectInfo, chunk: int = 8 << 20):
        self.objects, self.url, self.info, self.chunk = objects, url, info, chunk
        self.name = url
        self._pos = 0
        self._chunks: dict[int, bytes] = {}

    def pread(self, size: int, offset: int) -> bytes:
        end = min(offset + max(size, 0), self.info.size)
        if offset >= end:
            return b""
        if end - offset >= self.chunk:  # a big read (a member, a column) is one request of its own
            return self.objects.read(self.url, offset, end, self.info)
        parts = []
        for i in range(offset // self.chunk, (end - 1) // self.chunk + 1):
            data = self._chunk_at(i)
            base = i * self.chunk
            parts.append(data[max(offset - base, 0) : end - base])
        return b"".join(parts)

    def _chunk_at(self, i: int) -> bytes:
        data = self._chunks.get(i)
        if data is None:
            start = i * self.chunk
            data = self.objects.read(self.url, start, min(start + self.chunk, self.info.size), self.info)
            if len(self._chunks) >= 2:
                self._chunks.pop(next(iter(self._chunks)))
            self._chunks[i] = data
        return data

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self.info.size - self._pos
        data = self.pread(size, self._pos)
        self._pos += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, self.info.size)[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        self._chunks.clear()

    def __enter__(self) -> ObjectFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
