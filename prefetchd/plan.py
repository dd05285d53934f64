"""The plan: which samples make batch (epoch, step, rank), and the seed of each sample.

A pure function of (seed, number of samples, world size, batch size, drop_last). The
epoch's order is a permutation keyed by (seed, epoch); global step k takes the next
``world_size * batch_size`` samples of it, and rank r takes the r-th slice of that. Each
sample's augmentation draws from a generator keyed by (seed, epoch, sample id). Nothing
depends on workers, timing or how often a batch is made.

With ``drop_last = false`` the last step is filled up by wrapping around to the start of
the epoch's permutation (as DistributedSampler pads), so every rank gets full batches and
the same number of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# Domain tags keep the permutation and augmentation streams independent for equal keys.
_PERMUTATION = 0x5045524D
_AUGMENT = 0x4155474D


@dataclass(frozen=True)
class Plan:
    num_samples: int
    world_size: int
    batch_size: int
    seed: int = 0
    drop_last: bool = True

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size

    @property
    def batches_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_samples // self.global_batch
        return -(-self.num_samples // self.global_batch)

    def permutation(self, epoch: int) -> np.ndarray:
        return _permutation(self.seed, epoch, self.num_samples)

    def sample_ids(self, epoch: int, step: int, rank: int) -> np.ndarray:
        if not 0 <= step < self.batches_per_epoch or not 0 <= rank < self.world_size:
            raise IndexError(f"no batch (epoch {epoch}, step {step}, rank {rank}) in this plan")
        start = step * self.global_batch + rank * self.batch_size
        positions = np.arange(start, start + self.batch_size) % self.num_samples
        return self.permutation(epoch)[positions]

    def sample_rng(self, epoch: int, sample_id: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, _AUGMENT, epoch, int(sample_id)])

    # Batches of one rank in reading order, across epochs: index = epoch * per_epoch + step.
    def linear(self, epoch: int, step: int) -> int:
        return epoch * self.batches_per_epoch + step

    def unlinear(self, index: int) -> tuple[int, int]:
        return divmod(index, self.batches_per_epoch)


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    # A worker builds each epoch's permutation once (1.28 M samples: ~20 ms) and keeps it.
    perm = np.random.default_rng([seed, _PERMUTATION, epoch]).permutation(n)
    perm.flags.writeable = False
    return perm
