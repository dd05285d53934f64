"""Which ranks a daemon serves: ``--ranks 8-15`` on the node of ranks 8 to 15 of a world of 16.

Read from a flag or a config (the daemon) and from the manifest (the client), written into
messages as ``0-3,8``. The text form, exactly::

    RANKS  = ITEM ("," ITEM)*
    ITEM   = BLANK* NUMBER BLANK* ["-" BLANK* NUMBER BLANK*]    A-B with A <= B; A-A is rank A
    NUMBER = 1 to 8 ASCII digits                               a rank is at most MAX_RANK
    BLANK  = a space or a tab

Blanks are allowed around every item and dash alike (``0-3, 8`` as ``0-3,8``), and a range of
one rank alike (``--ranks $((N*G))-$((N*G+G-1))`` with one GPU per node writes ``3-3``);
anything else (another space, a newline, a sign, a Unicode digit, an empty item) is refused,
as is a rank given twice, in a message that shows the value. A loader given no rank takes
torch.distributed's, or $RANK (default_rank_and_world).
"""

from __future__ import annotations

import os
import sys

from .layout import MAX_RANK

_BLANKS = " \t"


def parse_ranks(value) -> tuple[int, ...]:
    """The ranks a daemon serves, sorted: ``"8-15"``, ``"0,2,5"``, ``"0-3,8-11"`` or a list of
    integers. ValueError (saying what is accepted) for anything else, a rank past what a batch
    name holds, or a rank given twice."""
    if isinstance(value, str):
        ranks = _parse_text(value)
    elif isinstance(value, list) and all(type(r) is int for r in value):
        ranks = value
    else:
        raise ValueError(f"expected a range A-B, a comma list or a list of integers, got {value!r:.60}")
    if not ranks:
        raise ValueError("no ranks given")
    if not all(0 <= r <= MAX_RANK for r in ranks):
        raise ValueError(f"ranks are 0..{MAX_RANK}, got {ranks!r:.60}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"a rank is given twice in {value!r:.60}")
    return tuple(sorted(ranks))


def _parse_text(value: str) -> list[int]:
    """The ranks of the text form (the module's docstring), in the order given."""
    shown = repr(value[:60]) + ("..." if len(value) > 60 else "")
    ranks, seen = [], set()
    for item in value.split(","):
        low, dash, high = (side.strip(_BLANKS) for side in item.partition("-"))
        if not _is_number(low) or dash and not _is_number(high):
            raise ValueError(f"expected a range A-B or a comma list of ranks (8-15, 0,2,5), got {shown}")
        low_rank, high_rank = int(low), int(high) if dash else int(low)
        if max(low_rank, high_rank) > MAX_RANK:  # before range(): 0-10**12 would not fit in memory
            raise ValueError(f"ranks are 0..{MAX_RANK}, got {item.strip(_BLANKS)[:30]!r} in {shown}")
        if high_rank < low_rank:
            raise ValueError(
                f"the range {item.strip(_BLANKS)[:30]!r} runs backwards in {shown}; write {high_rank}-{low_rank}"
            )
        # A rank given twice is refused at once: "0-9999," repeated would otherwise build a
        # list of billions of ranks before the duplicate check (what is kept stays <= MAX_RANK + 1).
        item_ranks = range(low_rank, high_rank + 1)
        if any(r in seen for r in item_ranks):
            raise ValueError(f"a rank is given twice in {shown}")
        seen.update(item_ranks)
        ranks.extend(item_ranks)
    return ranks


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 8  # ASCII digits, and no 5,000 of them


def format_ranks(ranks) -> str:
    """``0-3,8``: sorted ranks as ``parse_ranks`` reads them, runs as ranges."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def default_rank_and_world() -> tuple[int, int]:
    """torch.distributed's rank and world size where a process group is up, else $RANK and
    $WORLD_SIZE. torch is only looked up, never imported: a process group means it is imported
    already, and a trainer without torch (numpy arrays, as_tensors=False) would pay ~2 s of CPU."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
