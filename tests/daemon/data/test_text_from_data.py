"""Text from data is data: a file name or a daemon's words never act on the terminal that shows
them (issue 24, finding 11), and ``prefetchd status`` shows its rows whatever COLUMNS and LINES
say (finding 12).

A corrupt JPEG named ``ESC ] 0 ; PWNED BEL ESC [ 2 J`` ... retitled the window and cleared the
screen through ``prefetchd status`` and the client's DaemonDied; ``status --watch`` under
COLUMNS=0 printed nothing. Jobs served by a master in the test's process, the real CLI in a
subprocess (a pty for ``--watch``), the real client."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from prefetchd.cli import statusview
from prefetchd.cli.datagen import make_image_folder
from prefetchd_client import DaemonDied, PrefetchLoader
from prefetchd_client.text import printable
from tests.conftest import wait_until, write_config
from tests.daemon.data.test_bad_samples import clear_stopped
from tests.helpers import as_a_terminal_starts_it, job_status, signal_state

pytestmark = pytest.mark.timeout(120)

# An OSC that retitles the window, a CSI that clears the screen, U+009B (the one-byte CSI, as
# UTF-8), a bidi override, rich markup, a byte that is not UTF-8, and a letter that is not ASCII.
EVIL_NAME = b"\x1b]0;PWNED\x07\x1b[2J\xc2\x9b2J\xe2\x80\xae[bold red][link=https:x]\xffgpj.evil\xe5\x90\x8d.jpg"
RAW_TERMINAL_BYTES = (b"\x1b", b"\x07", b"\x9b", "\u202e".encode())
SHOWN_NAME = r"\x1b]0;PWNED\x07\x1b[2J\x9b2J\u202e[bold red][link=https:x]\xffgpj.evil" + "\u540d.jpg"


def _assert_inert(output: bytes, where: str) -> str:
    """``output`` holds no byte that acts on a terminal, is UTF-8, and shows the name escaped."""
    acting = [b for b in RAW_TERMINAL_BYTES if b in output]
    assert not acting, f"{where} wrote {acting} to the terminal: {output[:600]!r}"
    text = output.decode("utf-8")  # strict: a raw 0xff is no text a terminal should get
    assert SHOWN_NAME in text, f"{where} does not show the name escaped: {text[:600]!r}"
    return text


@pytest.fixture
def evil_job(tmp_path, serve):
    """A job whose data folder holds a corrupt JPEG named EVIL_NAME; under --on-error fail the
    master stops naming it (stopped.json keeps its words)."""
    data = make_image_folder(tmp_path / "data", classes=2, per_class=8, size=(40, 60), seed=3)
    victim = sorted(data.rglob("*.jpg"))[0]
    evil = os.path.join(os.fsencode(victim.parent), EVIL_NAME)
    os.rename(victim, evil)
    with open(evil, "wb") as f:
        f.write(b"not a JPEG")
    job = serve(write_config(tmp_path, data, batch_size=16, size=16), {"on_error": "fail"})
    job.wait_stopped(30)  # on the corrupt file
    assert job.paths.stopped.exists()
    yield job.paths, os.fsdecode(evil)
    clear_stopped(job.paths)


def _prefetchd(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real CLI, its output as bytes: what a terminal would get."""
    return subprocess.run(
        [sys.executable, "-m", "prefetchd", *args], capture_output=True, timeout=60, env={**os.environ, **(env or {})}
    )


def test_a_file_name_with_terminal_escapes_shows_escaped_in_status_and_the_clients_error(evil_job):
    paths, evil = evil_job
    for args in (["status"], ["status", "job"]):
        shown = _prefetchd(*args)
        assert shown.returncode == 0, shown.stderr
        text = _assert_inert(shown.stdout, f"prefetchd {' '.join(args)}")
        assert "[bold red][link=https:x]" in text, "rich markup from a file name printed literally"
    with pytest.raises(DaemonDied) as raised:
        PrefetchLoader("job", as_tensors=False, timeout=10)
    _assert_inert(str(raised.value).encode(), "DaemonDied")
    _assert_inert(paths.log.read_bytes(), "daemon.log")  # which the error says to read: `tail` it
    # A terminal that is not UTF-8 gets the letter as an escape, not a UnicodeEncodeError.
    ascii_only = _prefetchd("status", "job", env={"PYTHONIOENCODING": "ascii"})
    assert ascii_only.returncode == 0 and b"evil\\u540d.jpg" in ascii_only.stdout, ascii_only.stderr[-2000:]
    # --json is printable ASCII for a terminal. The stop reason in it is the daemon's one-line
    # text, which shows the file name as escapes already (a cause travels as one line).
    as_json = _prefetchd("status", "job", "--json")
    assert as_json.returncode == 0 and all(0x20 <= b < 0x7F or b == 0x0A for b in as_json.stdout)
    assert printable(evil) in json.loads(as_json.stdout)["error"]


def test_the_clis_errors_show_a_data_path_escaped(tmp_path, job_root, jpeg_folder):
    missing = os.fsdecode(os.path.join(os.fsencode(tmp_path), EVIL_NAME))
    result = _prefetchd("start", str(write_config(tmp_path, jpeg_folder)), "--data", missing)
    assert result.returncode == 3, result.stderr  # DATA: the folder does not exist
    _assert_inert(result.stderr, "prefetchd start's error")
    assert not any(job_root.iterdir())


def test_a_status_reply_whose_every_string_is_hostile_renders_inert(tmp_path, serve, jpeg_folder):
    """Every string of a real serving job's reply (and every key) replaced by one with escapes
    and rich markup, as a peer answering on the job's socket could send: the plain and the live
    view show them escaped and literal. A reply nested deeper than any of ours is one line."""
    paths = serve(write_config(tmp_path, jpeg_folder, batch_size=4)).paths
    hostile = os.fsdecode(EVIL_NAME)

    def poison(value):
        if isinstance(value, str):
            return value + hostile
        if isinstance(value, dict):
            return {k: poison(v) for k, v in value.items()}
        return [poison(v) for v in value] if isinstance(value, list) else value

    reply = {"state": "serving", "job_dir": str(paths.dir), **job_status(paths)}
    reply = poison(reply) | {"state": "serving"}
    reply["workers"]["each"][0]["task"] = hostile
    reply["executor"] = {"kind": "ray", "address": hostile, "state": "lost", "why": hostile, "in_flight": 0, "slots": 1}
    reply["totals"]["refused"] = {hostile: 3}
    for live in (False, True):
        console = Console(file=io.StringIO(), width=200, color_system=None, soft_wrap=True)
        console.print(statusview.render(reply, live=live), highlight=False)
        text = _assert_inert(console.file.getvalue().encode("utf-8", "surrogateescape"), f"render(live={live})")
        assert text.count(SHOWN_NAME) >= 5, text  # the job, its trainer, the executor, the refusals, ...
        assert "[bold red][link=https:x]" in text
    deep: list = []
    for _ in range(900):
        deep = [deep]
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(statusview.render({"job": "job", "state": "serving", "job_dir": "x", "ranks": deep}))
    assert "not what prefetchd sends" in console.file.getvalue()


def _watch_in_a_pty(env: dict, marker: bytes, timeout_s: float = 15.0) -> tuple[bytes, int]:
    """``prefetchd status job --watch`` on a pty (a terminal: rich's live view), read until
    ``marker`` shows or the deadline passes, then Ctrl-C; its output and exit code."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefetchd", "status", "job", "--watch"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm-256color", **env},
        preexec_fn=as_a_terminal_starts_it,
    )
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + timeout_s
        while marker not in seen and time.monotonic() < deadline:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    seen += os.read(master, 1 << 16)
                except OSError:  # EIO: the command ended and closed the pty
                    break
        masks = signal_state(proc.pid)
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)  # a loaded machine: it has seen over 15 s
        except subprocess.TimeoutExpired:
            raise AssertionError(f"--watch did not end on Ctrl-C; its signals then: {masks}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return seen, code


ODD_SIZES = ("0", "-3", "²", "99999999999", "abc")  # zero, negative, a digit int() refuses, huge, no number


def _status_rows_under(sizes: tuple[str, ...], watch: tuple[str, ...], tmp_path, jpeg_folder, serve) -> None:
    """`prefetchd status` under each of ``sizes`` as COLUMNS and LINES (at once), and `--watch`
    under each of ``watch``, show rank 0's row: "never" is its trainer and its last report (no
    trainer reads this job)."""
    paths = serve(write_config(tmp_path, jpeg_folder, batch_size=4)).paths
    wait_until(lambda: job_status(paths)["ranks"][0]["ready"] >= 1, 30, what="a batch ready")
    shown = {
        size: subprocess.Popen(
            [sys.executable, "-m", "prefetchd", "status", "job"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "COLUMNS": size, "LINES": size},
        )
        for size in sizes
    }
    for size, proc in shown.items():
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0 and b"Traceback" not in stderr, stderr[-2000:]
        assert b"in flight" in stdout and b"never" in stdout, f"COLUMNS={size}: {stdout!r}"
    for size in watch:
        started = time.monotonic()
        seen, code = _watch_in_a_pty({"COLUMNS": size, "LINES": size}, marker=b"never")
        assert b"never" in seen and b"ready" in seen, f"--watch under COLUMNS={size} showed {seen[-800:]!r}"
        assert code == 0 and b"Traceback" not in seen
        print(f"[figure] --watch under COLUMNS=LINES={size}: rank rows after {time.monotonic() - started:.1f} s")


def test_status_shows_its_rows_whatever_columns_and_lines_say(tmp_path, serve, jpeg_folder):
    _status_rows_under(ODD_SIZES, ("0",), tmp_path, jpeg_folder, serve)


@pytest.mark.long
def test_status_watch_shows_its_rows_under_every_odd_columns_and_lines(tmp_path, serve, jpeg_folder):
    _status_rows_under((), ODD_SIZES, tmp_path, jpeg_folder, serve)


_ACTING = {*map(chr, range(0x20)), *map(chr, range(0x7F, 0xA0)), "\u061c", "\u200e", "\u200f", "\u2028", "\u2029"}
_ACTING |= {*map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A))}


_SPECIALS = st.sampled_from(["\x1b", "\x07", "\x9b", "\x7f", "\n", "\u202e", "\u2066", "\udcff", "\ud800", "\\", "["])


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters() | _SPECIALS, max_size=40) | st.binary(max_size=40), st.none() | st.integers(0, 50))
def test_printable_leaves_nothing_that_acts_on_a_terminal(text, limit):
    shown = printable(text, limit)
    assert not _ACTING & set(shown) and not any(0xD800 <= ord(c) <= 0xDFFF for c in shown), repr(shown)
    shown.encode("utf-8")  # strict: prints on any UTF-8 terminal
    assert printable(shown) == shown, "escaping twice (the client, then the CLI) reads the same"
    if limit is not None:
        assert len(shown) <= limit + len("...")
    if isinstance(text, str) and text.isascii() and text.isprintable() and (limit is None or len(text) <= limit):
        assert shown == text


def test_printable_shows_each_kind_of_character_as_its_escape():
    assert printable("a\x1b]0;T\x07b\x9b\x7f\n\t") == r"a\x1b]0;T\x07b\x9b\x7f\n\t"
    assert printable("\u202eevil\u2066\u2028") == r"\u202eevil\u2066\u2028"
    assert printable(os.fsdecode(b"x\xff\x80y")) == r"x\xff\x80y"  # bytes that were not UTF-8
    assert printable(b"x\xff\x1by") == r"x\xff\x1by"
    assert printable("\ud800") == r"\ud800"
    assert printable("日本 ünïcode 🙂") == "日本 ünïcode 🙂"
    assert printable("\x1b" * 10, limit=9) == r"\x1b\x1b..."  # an escape is never cut in half


# -- attacked again: text that hides, markup that is not brackets, the CLI process's own output ----


def test_printable_shows_invisible_characters_that_hide_text_as_escapes():
    """Zero-width characters and the tag block (U+E0000, "ASCII smuggling": invisible letters a
    terminal shows as nothing) make two names that read alike differ, or hide words in a message.
    Before: kept as they are. The joiners that scripts and emoji need stay."""
    hidden = "a\u200bb\u2060c\ufeffd\u00ade\U000e0001\U000e0041\U000e007f\U000e0100\u180e\u206a\U0001d173"
    shown = r"a\u200bb\u2060c\ufeffd\xade\U000e0001\U000e0041\U000e007f\U000e0100\u180e\u206a\U0001d173"
    assert printable(hidden) == shown
    assert printable(shown) == shown  # idempotent still
    assert printable("👨\u200d👩\u200d👧 ब\u200dह") == "👨\u200d👩\u200d👧 ब\u200dह"  # ZWJ, ZWNJ kept
    assert printable("\U000e0041" * 10, limit=12) == r"\U000e0041..."  # an escape is never cut in half


def test_rich_emoji_codes_in_data_print_literally(tmp_path):
    """Rich replaces ``:fire:`` by an emoji in every print unless told not to: a job name or a
    file name holding it showed another text than the data's. Before: 🔥 in place of :fire:."""
    refused = _prefetchd("stop", ":fire:")
    assert refused.returncode == 4 and b":fire:" in refused.stderr, refused.stderr  # CONFIG: not a job name
    missing = _prefetchd("start", str(tmp_path / ":fire:.toml"), "--buffer", "1M")
    assert missing.returncode == 2 and b":fire:.toml" in missing.stderr, missing.stderr
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(statusview.render({"job": "job", "state": "stopping", "job_dir": "/x/:fire:", "error": ":fire:"}))
    assert console.file.getvalue().count(":fire:") == 2, console.file.getvalue()
    assert "\U0001f525" not in refused.stderr.decode() + missing.stderr.decode() + console.file.getvalue()


def test_the_cli_processs_own_log_records_and_warnings_reach_the_terminal_escaped():
    """`prefetchd verify` and `pack` read data in the CLI's own process: a record logged there
    (a shard member's name, prefetchd.sources.shards) went through logging's last resort, and a
    library's warnings.warn through warnings' own printing, to stderr as raw bytes."""
    code = (
        "import logging, warnings, prefetchd.cli.app; "
        "logging.getLogger('prefetchd.sources.shards').warning('skipped member %s', '\\x1b]0;PWNED\\x07.jpg'); "
        "warnings.warn('bad EXIF in \\x1b[2J\\u202e.jpg')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    acting = [b for b in RAW_TERMINAL_BYTES if b in result.stderr]
    assert not acting, f"the CLI process wrote {acting}: {result.stderr!r}"
    assert rb"skipped member \x1b]0;PWNED\x07.jpg" in result.stderr, result.stderr
    assert rb"bad EXIF in \x1b[2J\u202e.jpg" in result.stderr, result.stderr


def test_a_clis_error_quoting_a_huge_name_is_bounded(tmp_path):
    """A config key of 2 MB (a file from elsewhere) was quoted whole in `start`'s error: 2 MB on
    the terminal, ~3 s of rich's rendering (5 MB: 8 s). A message is cut at the daemon's bound
    for a stop reason (prefetchd.errors.MAX_MESSAGE_CHARS), escapes never cut in half."""
    from prefetchd.errors import MAX_MESSAGE_CHARS

    config = tmp_path / "huge.toml"
    config.write_text('"' + "\\u001b" * 1000 + "a" * 2_000_000 + '" = 1\n')  # TOML's escape of ESC
    result = _prefetchd("start", str(config), "--buffer", "1M")
    assert result.returncode == 2, result.stderr[-500:]  # USAGE: a config error
    assert result.stderr.startswith(b"error: ") and b"\\x1b" in result.stderr
    assert len(result.stderr) < MAX_MESSAGE_CHARS + 100, len(result.stderr)


def test_the_daemons_own_warnings_reach_its_log_escaped(tmp_path):
    """A detached daemon's stderr is daemon.log (daemon.serve dup2s it there once it serves):
    a warnings.warn in the master (a library's, quoting data) and a record of a logger that is
    not prefetchd's were written there raw, past the log's printable lines. The daemon's log set
    up as daemon.serve does it, in a real process."""
    log = tmp_path / "daemon.log"
    code = (
        "import logging, os, sys, warnings; from prefetchd.logsetup import log_to; "
        f"log_to({str(log)!r}); fd = os.open({str(log)!r}, os.O_WRONLY | os.O_APPEND); os.dup2(fd, 2); "
        "warnings.warn('bad EXIF in \\x1b]0;PWNED\\x07.jpg'); "
        "logging.getLogger('pyarrow').warning('column \\x1b[2J\\u202e'); sys.stderr.flush()"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    written = log.read_bytes()
    acting = [b for b in RAW_TERMINAL_BYTES if b in written]
    assert not acting, f"daemon.log got {acting}: {written!r}"
    assert rb"bad EXIF in \x1b]0;PWNED\x07.jpg" in written and rb"column \x1b[2J\u202e" in written, written
