"""The plan: which samples make batch (epoch, step, rank), and the seed of each sample.

A pure function of (seed, sources, world size, batch size, drop_last). Each epoch has an
*order*: a sequence of sample ids. Global step k takes the next ``world_size * batch_size``
entries of it, and rank r takes the r-th slice of that. Each sample's augmentation draws
from a generator keyed by (seed, epoch, sample id, pass). Nothing depends on workers,
timing or how often a batch is made.

The order of an epoch:

- no weights (one source, or several concatenated): a permutation of all samples keyed by
  (seed, epoch): every sample once;
- weighted mixing: each source contributes a count proportional to its weight, by the
  epoch rule ``mix``:
    ``cycle``            the epoch lasts until the source with the most samples per unit
                         of weight has given each of its samples once; the others cycle
                         (a new shuffle for every pass over them);
    ``first_exhausted``  the epoch ends when the first source would run out: nothing repeats;
    ``all_once``         every sample of every source once; the weights are ignored.
  Within a source the samples come in a permutation keyed by (seed, epoch, source, pass);
  the sources are interleaved evenly (stratified), so every batch is close to the weights.
  A sample seen twice in one epoch (a second pass) is augmented afresh: its pass number is
  part of its key.

No order is ever held whole: a batch is computed from its positions alone, in memory that grows
with the batch, not the epoch (a batch of an epoch of 10^9 samples takes kilobytes). A
permutation of [0, n) is a keyed pseudo-random permutation evaluated at positions, as Grain's
``index_shuffle``: a balanced Feistel network over the smallest even number of bits 2h with
4^h >= n, whose rounds (6; 8 for n <= 64) each xor into one half the top h bits of
``((other half ^ round key) * M)^2 mod 2^64``, the round keys drawn from
``SeedSequence([seed, PERMUTATION, epoch, *extra])``; and *cycle walking*: a value that lands
outside [0, n) goes through the network again until it lands inside, which keeps it a bijection
of [0, n) (fewer than 4 passes on average, as 4^h < 4n). Mixing draws the k-th of source s's
``counts[s]`` draws at key ``(k + u_s) / counts[s]`` (``u_s`` uniform, keyed by (seed, epoch, s))
and reads all draws in (key, source) order; how many draws of each source lie before a position
is counted from the keys, exactly, without listing them.

``ORDER`` numbers the way an epoch's order is computed; a plan records it (``Plan.order``), and
a plan of another order is refused rather than served with other batches. Order 1 drew each
epoch's permutation whole with numpy's ``Generator.permutation``; order 2 is the Feistel
permutation above (the interleave rule of mixing is unchanged), so the same seed gives another
shuffle than order 1 did.

With ``drop_last = false`` the last step is filled up by wrapping around to the start of
the epoch's order (as DistributedSampler pads), so every rank gets full batches and the
same number of them.

An evaluation plan (``evaluation``) reads the samples in index order, every epoch alike, and
pads the last step the same way; ``batch_valid`` tells the padding from the samples, so that
each sample counts exactly once across all ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

ORDER = 2  # how an epoch's order is computed (the module docstring); 1 was the numpy permutation

# Domain tags keep the random streams independent for equal keys.
_PERMUTATION = 0x5045524D
_AUGMENT = 0x4155474D
_INTERLEAVE = 0x494C5645
_REPLACE = 0x5245504C

_ROUNDS = 8  # keys drawn per permutation: the most rounds a network has (_rounds)
_M64 = (1 << 64) - 1
_MUL = 0xBF58476D1CE4E5B9  # splitmix64's first multiplier: odd, its bits spread evenly
# A run's draws are taken between two cuts of the keys this many positions, plus one a source,
# outside it: the number of draws below a cut is only foreseen to within one a source.
_MARGIN = 2


@dataclass(frozen=True)
class Plan:
    num_samples: int
    world_size: int
    batch_size: int
    seed: int = 0
    drop_last: bool = True
    source_sizes: tuple[int, ...] = ()  # with weights: the samples of each source, in index order
    weights: tuple[float, ...] = ()  # empty: no mixing
    mix: str = "cycle"
    evaluation: bool = False  # in index order, the last step padded (drop_last is then False)
    # How the epochs' orders are computed (ORDER). In to_json(), so in the plan digest: batches of
    # another order are never adopted.
    order: int = ORDER

    def __post_init__(self):
        if self.order != ORDER:
            raise ValueError(
                f"this plan has plan order {self.order}, but this prefetchd computes order {ORDER}: "
                "since order 2 an epoch's shuffle is computed another way (a keyed Feistel permutation "
                "instead of numpy's), so the same seed would give other batches; start a new job, or use "
                "the prefetchd that made this one"
            )

    def to_json(self) -> dict:
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}
        if not self.evaluation:  # a training plan's digest stays what it was before evaluation plans
            del d["evaluation"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        """A plan from to_json's dict; one without ``order`` was written before order 2 (order 1),
        and is refused as such (__post_init__), not read as this order."""
        return cls(**{"order": 1} | {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size

    @property
    def mixing(self) -> bool:
        return bool(self.weights) and self.mix != "all_once"

    @property
    def epoch_length(self) -> int:
        return int(self.source_counts().sum()) if self.mixing else self.num_samples

    @property
    def batches_per_epoch(self) -> int:
        if self.drop_last:
            return self.epoch_length // self.global_batch
        return -(-self.epoch_length // self.global_batch)

    def source_counts(self) -> np.ndarray:
        """Samples each source gives per epoch (mixing only): proportional to the weights."""
        return _source_counts(self.source_sizes, self.weights, self.mix)

    def epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, pass numbers) of the whole epoch, in reading order; the pass numbers are
        empty when not mixing. (``order(epoch)`` before the field ``order`` took the name.)

        This one materialises the epoch (arrays of its length): for tests and tools. Batches
        never call it; they compute the same entries from their positions."""
        length = self.epoch_length
        if self.evaluation or not self.mixing:
            return self._ids(epoch, np.arange(length, dtype=np.int64)), np.zeros(0, np.int64)
        return self._mixer().run(self.seed, epoch, 0, length)

    def batch_samples(self, epoch: int, step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, pass numbers) of batch (epoch, step, rank)."""
        if not 0 <= step < self.batches_per_epoch or not 0 <= rank < self.world_size:
            raise IndexError(f"no batch (epoch {epoch}, step {step}, rank {rank}) in this plan")
        length = self.epoch_length
        positions = self._positions(step, rank)
        if self.evaluation or not self.mixing:
            return self._ids(epoch, positions % length), np.zeros(len(positions), np.int64)
        # The slots are one run of the order, cut where the padding wraps to its start (more than
        # once when a batch is longer than the epoch).
        mixer, ids, passes = self._mixer(), [], []
        at, left = int(positions[0]) % length, len(positions)
        while left:
            take = min(left, length - at)
            i, p = mixer.run(self.seed, epoch, at, at + take)
            ids.append(i)
            passes.append(p)
            left, at = left - take, 0
        if len(ids) == 1:
            return ids[0], passes[0]
        return np.concatenate(ids), np.concatenate(passes)

    def uses(self, epoch: int, step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Where batch (epoch, step, rank)'s samples are used now and where they are needed next,
        as positions counted in samples across epochs (``epoch * epoch_length + position``): a
        local cache evicts the entries needed last first (sources.membercache). Without mixing
        the next use is the sample's position in the next epoch (the permutation inverted);
        with mixing, where a sample may come twice, it is taken as the same position in the
        next epoch (least recently used)."""
        length = self.epoch_length
        positions = self._positions(step, rank) % length
        now = epoch * length + positions
        if self.evaluation or self.mixing:  # evaluation: a sample's position is the same every epoch
            return now, now + length
        ids = self._ids(epoch, positions)
        return now, (epoch + 1) * length + _unpermute(ids, _Network.of(self.num_samples, self.seed, epoch + 1))

    def batch_valid(self, step: int, rank: int) -> np.ndarray:
        """Which slots of batch (step, rank) hold a sample rather than the last step's padding."""
        return self._positions(step, rank) < self.epoch_length

    def _positions(self, step: int, rank: int) -> np.ndarray:
        """Where batch (step, rank)'s slots lie in the epoch's order; past its end: the padding."""
        start = step * self.global_batch + rank * self.batch_size
        return np.arange(start, start + self.batch_size)

    def _ids(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The sample ids at these positions (in [0, num_samples)) of a plan that does not mix."""
        if self.evaluation:
            return positions
        return _permute(positions, _Network.of(self.num_samples, self.seed, epoch))

    def _mixer(self) -> _Mixer:
        return _Mixer.of(self.source_sizes, tuple(self.source_counts().tolist()))

    def sample_ids(self, epoch: int, step: int, rank: int) -> np.ndarray:
        return self.batch_samples(epoch, step, rank)[0]

    def sample_rng(self, epoch: int, sample_id: int, pass_: int = 0) -> np.random.Generator:
        key = [self.seed, _AUGMENT, epoch, int(sample_id)] + ([int(pass_)] if pass_ else [])
        return np.random.default_rng(key)

    def replacement(self, epoch: int, sample_id: int, pass_: int, attempt: int) -> int:
        """The sample that stands in for an unreadable one: drawn from the plan, so repeatable."""
        key = [self.seed, _REPLACE, epoch, int(sample_id), int(pass_), attempt]
        return int(np.random.default_rng(key).integers(self.num_samples))

    def source_of(self, sample_ids: np.ndarray) -> np.ndarray:
        """The source number of each sample id (ids are positions in the concatenated index)."""
        return np.searchsorted(np.cumsum(self.source_sizes), sample_ids, side="right")

    # Batches of one rank in reading order, across epochs: index = epoch * per_epoch + step.
    def linear(self, epoch: int, step: int) -> int:
        return epoch * self.batches_per_epoch + step

    def unlinear(self, index: int) -> tuple[int, int]:
        return divmod(index, self.batches_per_epoch)


def permutation(positions, n: int, seed: int, epoch: int, *extra: int) -> np.ndarray:
    """The keyed permutation of [0, n) that plans use, at these positions (int64); a position
    outside [0, n) is a ValueError. Memory and time grow with the positions, not with n."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= n):
        raise ValueError(f"positions must lie in [0, {n}): got {int(positions.min())}..{int(positions.max())}")
    if not positions.size:
        return positions.copy()
    return _permute(positions, _Network.of(n, seed, epoch, *extra))


def _half_bits(n: int) -> int:
    return max(1, ((n - 1).bit_length() + 1) // 2)


def _rounds(half: int) -> int:
    # With ideal round functions, 6 rounds leave the permutations of the tiniest domains (a
    # source of 5 samples) measurably non-uniform across keys; 8 do not. Above 4^3 samples 6
    # test as uniform as 8, and a batch there costs a quarter less.
    return 8 if half <= 3 else 6


# What a walk needs of a network, by row: half bits, the shift that keeps a hash's top h bits,
# the half mask, n, the gate of rounds 7 and 8 (per-element rows only: all ones where the element's
# network has 8 rounds, 0 where 6, which makes those two rounds two swaps), then the round keys.
_N, _GATE, _KEYS = 3, 4, 5


class _Network:
    """The Feistel network of one permutation of [0, n), its rows as 0-d uint64 arrays (numpy
    takes a 0-d array operand twice as fast as a numpy scalar or a 1-element array)."""

    def __init__(self, n: int, keys: np.ndarray):
        h = _half_bits(n)
        values = (h, 64 - h, (1 << h) - 1, n, 0, *keys[: _rounds(h)].tolist())
        self.rows = [np.array(v, np.uint64) for v in values]
        self.rows[_GATE] = None

    @staticmethod
    @lru_cache(maxsize=64)
    def of(n: int, seed: int, epoch: int, *extra: int) -> _Network:
        return _Network(n, _round_keys(seed, epoch, *extra))


@lru_cache(maxsize=256)
def _round_keys(seed: int, epoch: int, *extra: int) -> np.ndarray:
    keys = np.random.SeedSequence([seed, _PERMUTATION, epoch, *extra]).generate_state(_ROUNDS, np.uint64)
    keys.flags.writeable = False
    return keys


_MUL_0D = np.array(_MUL, np.uint64)


def _feistel(x: np.ndarray, rows, gated: bool) -> np.ndarray:
    """One pass of the network over [0, 4^h) at each x (uint64; a new array). The rows are 0-d,
    or per element (a 2-d array). uint64 arrays wrap silently, as the hash wants."""
    half, shift, mask, gate = rows[0], rows[1], rows[2], rows[_GATE]
    left = np.right_shift(x, half)
    right = np.bitwise_and(x, mask)
    t = np.empty_like(x)
    for i, k in enumerate(rows[_KEYS:]):
        # ((right ^ k) * MUL)^2, its top h bits: the square makes it non-linear; a multiply alone
        # leaves the permutations of small n far from uniform across keys.
        np.bitwise_xor(right, k, out=t)
        np.multiply(t, _MUL_0D, out=t)
        np.multiply(t, t, out=t)
        np.right_shift(t, shift, out=t)
        if gated and i >= 6:
            np.bitwise_and(t, gate, out=t)
        np.bitwise_xor(left, t, out=left)
        left, right = right, left
    np.left_shift(left, half, out=left)
    return np.bitwise_or(left, right, out=left)


def _feistel_one(x: int, half: int, shift: int, mask: int, keys: list[int]) -> int:
    """_feistel of one value, in Python ints: the same arithmetic, masked to 64 bits."""
    left, right = x >> half, x & mask
    for k in keys:
        t = ((right ^ k) * _MUL) & _M64
        left, right = right, left ^ (((t * t) & _M64) >> shift)
    return (left << half) | right


def _unpermute(ids: np.ndarray, net: _Network) -> np.ndarray:
    """The positions at which the permutation gives these ids: each round undone, last first,
    and the walk taken backwards (values >= n are passed through again, as on the way there)."""
    half, shift, mask, n = (int(r) for r in net.rows[:_GATE])
    keys = [int(k) for k in net.rows[_KEYS:]][::-1]
    out = []
    for v in ids.tolist():
        while True:
            left, right = v >> half, v & mask
            for k in keys:
                t = ((left ^ k) * _MUL) & _M64
                left, right = right ^ (((t * t) & _M64) >> shift), left
            v = (left << half) | right
            if v < n:
                break
        out.append(v)
    return np.asarray(out, dtype=np.int64)


# Below this many values still walking, a walk goes on in Python ints: a numpy pass costs the
# same ~40 calls whatever its length, and the last few values, the unlucky ones, can need many.
_TAIL = 12


def _permute(positions: np.ndarray, net: _Network) -> np.ndarray:
    """The permutation at positions (int64, all in [0, n))."""
    return _walk(positions.astype(np.uint64), net.rows, False).view(np.int64)


def _walk(x: np.ndarray, rows, gated: bool) -> np.ndarray:
    """Cycle walking: the network again on the values still >= n, until none is. ``rows`` as
    for _feistel; per-element rows are taken along with the values."""
    out = _feistel(x, rows, gated)
    todo = np.flatnonzero(out >= rows[_N])
    per_element = isinstance(rows, np.ndarray)
    while len(todo) > _TAIL:
        part = rows[:, todo] if per_element else rows
        y = _feistel(out[todo], part, gated)
        out[todo] = y
        todo = todo[y >= part[_N]]
    if len(todo):
        if per_element:
            tail = rows[:, todo].T.tolist()
        else:
            shared = [0 if r is None else int(r) for r in rows]
            tail = [shared] * len(todo)
        values = out[todo].tolist()
        for j, (half, shift, mask, n, gate, *keys) in enumerate(tail):
            if gated and not gate:
                keys = keys[:6]  # rounds 7 and 8 gated off: two swaps, nothing
            v = values[j]
            while v >= n:
                v = _feistel_one(v, half, shift, mask, keys)
            values[j] = v
        out[todo] = values
    return out


@lru_cache(maxsize=16)
def _source_counts(sizes: tuple[int, ...], weights: tuple[float, ...], mix: str) -> np.ndarray:
    sizes_a, p = np.asarray(sizes), np.asarray(weights, dtype=np.float64) / math.fsum(weights)
    if mix == "all_once":
        return sizes_a.copy()
    per_weight = sizes_a / p  # epoch length at which each source gives each sample once
    length = int(math.ceil(per_weight.max())) if mix == "cycle" else int(per_weight.min())
    exact = p * length
    counts = np.floor(exact).astype(np.int64)
    cap = sizes_a if mix == "first_exhausted" else np.full(len(sizes), np.iinfo(np.int64).max)
    # Largest remainder, in a fixed order, so the counts add up to the epoch length.
    for i in np.argsort(-(exact - counts), kind="stable")[: length - int(counts.sum())]:
        if counts[i] < cap[i]:
            counts[i] += 1
    return counts


class _Mixer:
    """The mixed order of one set of sources: source s gives ``counts[s]`` draws, its k-th at key
    ``(k + u_s) / counts[s]`` (float64, as numpy computes it), and the epoch reads all draws in
    (key, source) order. The k-th draw of s is sample ``offset_s + perm_(s, k // size_s)(k % size_s)``."""

    def __init__(self, sizes: tuple[int, ...], counts: tuple[int, ...]):
        self.sizes = np.asarray(sizes, np.int64)
        self.counts = np.asarray(counts, np.int64)
        self.fcounts = self.counts.astype(np.float64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.length = int(self.counts.sum())
        self.live = self.counts > 0  # a source that gives no draws has no keys (and no division)
        half = np.array([_half_bits(max(int(s), 1)) for s in sizes], np.uint64)
        self.eight = half <= 3  # their networks have 8 rounds (_rounds)
        gate = np.where(self.eight, np.uint64(_M64), np.uint64(0))
        one = np.uint64(1)
        self.net_rows = np.stack([half, 64 - half, (one << half) - one, self.sizes.astype(np.uint64), gate])

    @staticmethod
    @lru_cache(maxsize=8)
    def of(sizes: tuple[int, ...], counts: tuple[int, ...]) -> _Mixer:
        return _Mixer(sizes, counts)

    def run(self, seed: int, epoch: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, pass numbers) at positions [a, b) of the epoch's order (0 <= a <= b <= length)."""
        if a >= b:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        u = _offsets(seed, epoch, len(self.sizes))
        # The draws with key < x are the first sum_s below(x) of the order, whatever x is: take
        # the draws between two such cuts around [a, b) and sort just those.
        margin = len(self.sizes) + _MARGIN
        while True:
            cuts = np.array([(a - margin) / self.length, (b + margin) / self.length])
            below = self._below(cuts, u)
            first, last = int(below[0].sum()), int(below[1].sum())
            if first <= a and last >= b:
                break
            margin *= 4  # not seen: the counts are within a draw per source of the estimate
        lens = below[1] - below[0]
        src = np.repeat(np.arange(len(self.sizes)), lens)
        k = np.arange(len(src), dtype=np.int64) + np.repeat(below[0] - (np.cumsum(lens) - lens), lens)
        keys = (k + u[src]) / self.fcounts[src]
        pick = np.lexsort((src, keys))[a - first : b - first]
        src, k = src[pick], k[pick]
        size = self.sizes[src]
        passes = k // size
        local = k - passes * size
        eight = self.eight[src]
        rounds = 8 if eight.any() else 6
        rows = np.concatenate([self.net_rows[:, src], self._keys(seed, epoch, src, passes, below)[:rounds]])
        ids = _walk(local.astype(np.uint64), rows, rounds == 8 and not eight.all()).view(np.int64) + self.offsets[src]
        return ids, passes

    def _below(self, cuts: np.ndarray, u: np.ndarray) -> np.ndarray:
        """(cuts, sources): how many draws of each source have a key < each cut, exactly."""
        counts, fcounts = self.counts, np.where(self.live, self.fcounts, 1.0)
        # Draw k's key is below x when k < x * count - u, up to rounding: look at the draws around
        # that estimate, one on each side besides, with the keys' own float arithmetic.
        lo = np.minimum(np.maximum(_estimate(cuts, fcounts, u) - 2, 0), counts).astype(np.int64)
        k = lo[..., None] + np.arange(-1, 6)
        keys = (k + u[:, None]) / fcounts[:, None]
        inside = (k >= 0) & (k < counts[:, None])
        is_below = (keys < cuts[:, None, None]) & inside
        n = lo + is_below[..., 1:6].sum(axis=-1)
        # The estimate is within a draw or two; were it not, the first and last looked-at draws say.
        bad = (inside[..., 0] & ~is_below[..., 0]) | is_below[..., 6]
        for c, s in zip(*np.nonzero(bad & self.live)):
            n[c, s] = _below_slow(float(cuts[c]), float(u[s]), int(counts[s]))
        return np.where(self.live, n, 0)

    def _keys(self, seed: int, epoch: int, src: np.ndarray, passes: np.ndarray, below: np.ndarray) -> np.ndarray:
        """(rounds, draws): the round keys of each draw's permutation, keyed by (source, pass). The
        draws lie between the counts ``below``: a pass or two of each large source."""
        columns, base = [], np.zeros(len(self.sizes), np.int64)
        for s in np.flatnonzero(below[1] > below[0]).tolist():
            size = int(self.sizes[s])
            first, last = int(below[0, s]) // size, (int(below[1, s]) - 1) // size
            base[s] = len(columns) - first
            columns += [_round_keys(seed, epoch, s, p) for p in range(first, last + 1)]
        return np.stack(columns, axis=1)[:, base[src] + passes]


def _estimate(cuts: np.ndarray, fcounts: np.ndarray, u: np.ndarray) -> np.ndarray:
    """(cuts, sources): about how many draws of each source have a key < each cut."""
    return np.floor(cuts[:, None] * fcounts - u)


def _below_slow(x: float, u: float, count: int) -> int:
    """Draws of a source with key < x, by bisection (keys rise with k); Python floats are float64."""
    lo, hi = 0, count
    while lo < hi:
        mid = (lo + hi) // 2
        if (mid + u) / count < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@lru_cache(maxsize=8)
def _offsets(seed: int, epoch: int, sources: int) -> np.ndarray:
    """u_s: where within its first 1/count of the epoch source s's first draw sits."""
    u = np.array([np.random.default_rng([seed, _INTERLEAVE, epoch, s]).random() for s in range(sources)])
    u.flags.writeable = False
    return u
