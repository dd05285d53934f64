"""prefetchd client: read batches that the prefetchd daemon wrote ahead into a tmpfs buffer."""

from .batchfile import BatchLayout, BatchWriter, FieldSpec, map_batch, parse_header
from .errors import (
    AuthError,
    BatchFormatError,
    BatchTimeout,
    DaemonDied,
    JobNotRunning,
    PlanMismatch,
    PrefetchError,
    UnsafeFolder,
)
from .layout import JobPaths, resolve_root
from .loader import PrefetchLoader

__all__ = [
    "AuthError",
    "BatchFormatError",
    "BatchLayout",
    "BatchTimeout",
    "BatchWriter",
    "DaemonDied",
    "FieldSpec",
    "JobNotRunning",
    "JobPaths",
    "PlanMismatch",
    "PrefetchError",
    "PrefetchLoader",
    "UnsafeFolder",
    "map_batch",
    "parse_header",
    "resolve_root",
]
