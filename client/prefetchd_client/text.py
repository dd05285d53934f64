"""Text from data, made safe to show: ``printable``.

File names, a reader's error text, a daemon's stop reason, the strings of a manifest or a
status reply come from data or from a peer. Shown raw, ``ESC ] 0 ; ... BEL`` retitles the
window, ``ESC [ 2 J`` clears the screen, ``U+202E`` shows a file name backwards and a lone
surrogate (a name that is not UTF-8) makes ``print`` raise. Every such character is shown
as a visible escape instead, in the form Python's ``repr`` uses:

    C0 controls, DEL, C1 controls (U+0080-U+009F, U+009B CSI among them)  ->  \\x1b  \\x9b  \\n  \\t
    bidi controls U+061C, U+200E-U+200F, U+202A-U+202E, U+2066-U+2069    ->  \\u202e
    invisible ones: U+00AD, U+180E, U+200B, U+2060-U+2064, U+206A-U+206F,
      U+FEFF, U+FFF9-U+FFFB, U+1BCA0-U+1BCA3, U+1D173-U+1D17A, the tag
      block U+E0000-U+E007F, variation selectors U+E0100-U+E01EF        ->  \\u200b  \\U000e0041
    line and paragraph separators U+2028, U+2029                          ->  \\u2028
    a byte that was not UTF-8 (os.fsdecode's surrogate U+DC80-U+DCFF)     ->  \\xff
    any other lone surrogate                                              ->  \\ud800

Bytes are read as UTF-8, each invalid byte shown as ``\\xNN``. Backslashes are left as they are,
so ``printable`` is idempotent (a message escaped by the client and again by the CLI reads
the same) at the price that a name holding the four characters ``\\x1b`` reads like one holding
ESC. Everything else, other scripts and emoji included, is kept.

Where it is applied: at the edge where text leaves for a terminal or an exception message
(prefetchd_client.errors for every error the client raises, prefetchd.cli.app and
prefetchd.cli.statusview for what the CLI prints, prefetchd.logsetup for each line of
``daemon.log``), and where a cause is made: a bad sample's reader's words
(``prefetchd.errors.describe``) travel as one printable line, since a worker's error travels by
its last line, so the batch header's ``replaced`` records and ``stopped.json`` hold them escaped.
Other data kept as data (``status --json``, whose JSON escapes are printable ASCII) keeps the
exact text.
"""

from __future__ import annotations

import re

_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
_CUT_MARK = "..."


def _escape(code: int) -> str:
    if code <= 0xFF:
        return _SHORT.get(chr(code)) or f"\\x{code:02x}"
    if 0xDC80 <= code <= 0xDCFF:  # a byte os.fsdecode could not decode (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


# Every character shown as an escape: C0, DEL, C1; the bidi controls; the line and paragraph
# separators; lone surrogates. Found in runs by a regular expression, each run escaped by
# str.translate: both in C. (16 MiB of ESC, a status reply's bound, take ~1 s; alternating with
# another character ~5 s: the status view cuts each string at a limit first.)
_ACTING_RANGES = ((0x00, 0x1F), (0x7F, 0x9F), (0x061C, 0x061C), (0x200E, 0x200F), (0x2028, 0x202E))
_ACTING_RANGES += ((0x2066, 0x2069), (0xD800, 0xDFFF))
# Characters a terminal shows as nothing, which hide text or make two names that read alike
# differ: zero-width space and word joiners, soft hyphen, BOM, the deprecated format controls,
# interlinear annotation, shorthand and musical format controls, the tag block (U+E0000-E007F:
# invisible ASCII) and the variation selectors supplement. ZWNJ and ZWJ (U+200C, U+200D) stay:
# scripts and emoji sequences need them.
_ACTING_RANGES += ((0x00AD, 0x00AD), (0x180E, 0x180E), (0x200B, 0x200B), (0x2060, 0x2064), (0x206A, 0x206F))
_ACTING_RANGES += ((0xFEFF, 0xFEFF), (0xFFF9, 0xFFFB), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A))
_ACTING_RANGES += ((0xE0000, 0xE007F), (0xE0100, 0xE01EF))
_ESCAPES = {code: _escape(code) for low, high in _ACTING_RANGES for code in range(low, high + 1)}
_ACTING = re.compile("[" + "".join(f"{chr(low)}-{chr(high)}" for low, high in _ACTING_RANGES) + "]+")


def printable(text: object, limit: int | None = None) -> str:
    """``text`` (a str, bytes read as UTF-8, or anything's ``str()``) with every character that
    could act on a terminal shown as an escape (see the module's docstring). ``limit``: at most
    that many characters of the result, then ``...``; an escape is never cut in half."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", "backslashreplace")
    elif not isinstance(text, str):
        text = str(text)
    if limit is None or len(text) <= limit:
        shown = _ACTING.sub(lambda run: run.group().translate(_ESCAPES), text)
        if limit is None or len(shown) <= limit:
            return shown
    pieces, size = [], 0
    for ch in text[: limit + 1]:  # each character shows as one or more: no more are needed
        piece = _ESCAPES.get(ord(ch), ch)
        if size + len(piece) > limit:
            pieces.append(_CUT_MARK)
            break
        pieces.append(piece)
        size += len(piece)
    return "".join(pieces)
