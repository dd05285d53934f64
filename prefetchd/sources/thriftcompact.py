"""The Thrift compact protocol, as far as a Parquet page header needs: structs of integers and
booleans; binaries, lists, maps and doubles skipped. Every length is checked against the bytes
at hand, nesting is bounded: a header cannot make its reader allocate, loop or recurse without
end."""

from __future__ import annotations

_MAX_DEPTH = 8  # a page header nests 3 deep (its statistics); pyarrow allows 64


class Unsupported(Exception):
    """Not something this reader reads (the caller has another way)."""


class Short(Exception):
    """The struct goes on past the bytes at hand: read more of them."""


class CompactReader:
    """Reads one struct from ``buf``; ``pos`` is where it ended."""

    def __init__(self, buf: bytes):
        self.buf, self.pos = buf, 0

    def _byte(self) -> int:
        if self.pos >= len(self.buf):
            raise Short
        self.pos += 1
        return self.buf[self.pos - 1]

    def _skip(self, n: int) -> None:
        if n < 0:
            raise Unsupported("a negative length in a page header")
        if self.pos + n > len(self.buf):
            raise Short
        self.pos += n

    def _varint(self) -> int:
        result = shift = 0
        while True:
            b = self._byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise Unsupported("a varint longer than 64 bits in a page header")

    def _zigzag(self) -> int:
        n = self._varint()
        return (n >> 1) ^ -(n & 1)

    def struct(self, depth: int = 0) -> dict[int, object]:
        if depth > _MAX_DEPTH:
            raise Unsupported("a page header nested too deep")
        fields: dict[int, object] = {}
        last = 0
        while True:
            head = self._byte()
            if head == 0:
                return fields
            delta, kind = head >> 4, head & 0x0F
            last = last + delta if delta else self._zigzag()
            fields[last] = self._value(kind, depth)

    def _value(self, kind: int, depth: int) -> object:
        if depth > _MAX_DEPTH:  # lists and maps nest too, not structs alone
            raise Unsupported("a page header nested too deep")
        if kind in (1, 2):  # a boolean field carries its value in its type
            return kind == 1
        if kind == 3:
            return self._byte()
        if kind in (4, 5, 6):
            return self._zigzag()
        if kind == 7:
            return self._skip(8)
        if kind == 8:
            return self._skip(self._varint())
        if kind in (9, 10):  # list, set
            head = self._byte()
            size, element = head >> 4, head & 0x0F
            if size == 15:
                size = self._varint()
            if size > len(self.buf) - self.pos:  # every element takes a byte at least
                raise Short
            for _ in range(size):
                self._byte() if element in (1, 2) else self._value(element, depth + 1)
            return None
        if kind == 11:  # map
            size = self._varint()
            if size:
                types = self._byte()
                if 2 * size > len(self.buf) - self.pos:
                    raise Short
                for _ in range(size):
                    for element in (types >> 4, types & 0x0F):
                        self._byte() if element in (1, 2) else self._value(element, depth + 1)
            return None
        if kind == 12:
            return self.struct(depth + 1)
        raise Unsupported(f"Thrift type {kind} in a page header")
