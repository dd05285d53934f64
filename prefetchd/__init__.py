"""prefetchd: a per-node daemon that writes augmented batches ahead of the trainer into a tmpfs buffer."""

__version__ = "0.1.0"
