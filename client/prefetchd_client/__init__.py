"""prefetchd client: read batches that the prefetchd daemon wrote ahead into a tmpfs buffer.

The names below are imported on first use (PEP 562): the daemon's command line and its
workers import submodules of this package (the batch format, the job's folders) and must not
pay for the loader, ZeroMQ and asyncio at every start.
"""

from __future__ import annotations

import importlib

_HOME = {
    "AuthError": "errors",
    "BatchFormatError": "errors",
    "BatchLayout": "batchfile",
    "BatchTimeout": "errors",
    "BatchWriter": "batchwriter",
    "DaemonDied": "errors",
    "FieldSpec": "batchfile",
    "JobNotRunning": "errors",
    "JobPaths": "layout",
    "PlanMismatch": "errors",
    "PrefetchError": "errors",
    "PrefetchLoader": "loader",
    "UnsafeFolder": "errors",
    "map_batch": "batchfile",
    "parse_header": "batchfile",
    "resolve_root": "layout",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
