"""Why a loader state cannot resume a job: the fields of the job's config that differ, in words."""

from __future__ import annotations

# What a field that is not a plain setting covers, said after it.
_COVERS = {
    "order": (
        "how an epoch's samples are shuffled; this prefetchd computes order 2, which never holds an epoch's "
        "order in memory, and a state without one was taken with order 1: its position names other samples "
        "here; resume it with the prefetchd that took it"
    ),
    "augment": (
        "the transforms, the [pipeline] callable or the decoder; decoder = auto picks the fastest installed, "
        "and before it was the default a job ran decoder = pillow"
    ),
}


def config_mismatch(job: str, theirs, ours: dict) -> str:
    """The message for a state taken with config ``theirs`` (as the state holds it: anything)
    offered to job ``job`` running with config ``ours``."""
    theirs = theirs if isinstance(theirs, dict) else {}
    differing = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    shown = "; ".join(f"{k}: state has {theirs.get(k)!r}, job has {ours.get(k)!r}" for k in differing)
    shown += "".join(f" ({k}: {_COVERS[k]})" for k in differing if k in _COVERS)
    return (
        f"cannot resume job {job!r} from this state: it was taken with another config "
        f"({shown or 'config_hash'}); start the job with the config the state came from"
    )
