"""`prefetchd pack` through the real command, its shards read by the real webdataset library."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prefetchd.cli.datagen import make_image, make_image_folder
from prefetchd.errors import ExitCode
from prefetchd.sources import shards, tarformat
from prefetchd.sources.index import scan_image_folder
from tests.conftest import JOB_ROOT_PREFIX, SHM, cli, wait_until
from tests.helpers import as_a_terminal_starts_it, signal_state

wds = pytest.importorskip("webdataset")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """3 classes x 10 JPEGs of 64-160 px."""
    return make_image_folder(tmp_path_factory.mktemp("data") / "train", classes=3, per_class=10, size=(64, 160))


def pack(source: Path | str, out: Path, *flags: str):
    return cli("pack", str(source), str(out), *flags)


def packed(source: Path | str, out: Path, *flags: str) -> dict:
    result = pack(source, out, *flags)
    assert result.returncode == 0, result.stderr
    return json.loads((out / "pack.json").read_text())


def read_shards(out: Path, manifest: dict) -> list[dict]:
    urls = [str(out / s["name"]) for s in manifest["shards"]]
    return list(wds.WebDataset(urls, shardshuffle=False))


def shard_hashes(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}


def assert_clean_failure(result, code: ExitCode, *phrases: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr


def test_pack_into_a_pipe_says_how_far_it_is(folder, tmp_path):
    """issue 27: rich's bar shows nothing until the end where stderr is not a terminal."""
    result = pack(folder, tmp_path / "out")
    assert result.returncode == 0 and "packing: 30 of 30" in result.stderr, result.stderr


def test_webdataset_reads_every_sample_in_id_order_with_its_label(folder, tmp_path):
    manifest = packed(folder, tmp_path / "out")
    index = scan_image_folder(str(folder), "test")
    samples = read_shards(tmp_path / "out", manifest)
    assert [s["__key__"] for s in samples] == [f"{i:09d}" for i in range(len(index))]
    assert [int(s["cls"]) for s in samples] == [index.label(i) for i in range(len(index))]
    # not resized: the very bytes of each file
    assert all(s["jpg"] == Path(index.path(i)).read_bytes() for i, s in enumerate(samples))
    assert manifest["classes"] == ["class_00", "class_01", "class_02"]
    assert manifest["samples"] == manifest["indexed"] == len(index) and manifest["skipped"] == []
    assert sorted(os.listdir(tmp_path / "out")) == ["pack.json", "shard-000000.tar", "shard-000000.tar.idx"]


def test_each_shard_gets_an_index_object_that_start_reads_instead_of_the_shard(folder, tmp_path, monkeypatch):
    """pack writes <shard>.idx beside each shard: the table indexing the shard gives; a scan
    uses it (nothing is cached), and one of another shard's size is not used."""
    monkeypatch.setenv("PREFETCHD_CACHE", str(tmp_path / "cache"))
    manifest = packed(folder, tmp_path / "out", "--shard-size", "64K")
    for shard in manifest["shards"]:
        path = tmp_path / "out" / shard["name"]
        assert shard["index"] == shard["name"] + ".idx"
        with open(path, "rb") as f:
            table = tarformat.index_tar(f, lambda n, at, f=f: os.pread(f.fileno(), n, at), str(path), None)
        read = shards.parse_index_object((tmp_path / "out" / shard["index"]).read_bytes(), path.stat().st_size)
        assert read is not None and (read.table == table).all()
        assert read.md5 == hashlib.md5(path.read_bytes()).hexdigest()  # what a bucket's ETag is for it
    last = len(manifest["shards"]) - 1
    source = {"urls": str(tmp_path / "out" / f"shard-{{000000..{last:06d}}}.tar")}
    index = shards.scan_webdataset(source, "test")
    assert len(index) == manifest["samples"] and not (tmp_path / "cache").exists()  # from the .idx alone
    first = tmp_path / "out" / manifest["shards"][0]["index"]
    first.write_bytes(shards.index_object_bytes(np.zeros((1, 3), np.int64), 12345, "0" * 32))  # another shard's
    assert shards.scan_webdataset(source, "test").fingerprint() == index.fingerprint()
    assert (tmp_path / "cache").exists()  # the first shard was read and its table cached


def test_shard_size_splits_into_shards_none_over_the_bound(folder, tmp_path):
    manifest = packed(folder, tmp_path / "out", "--shard-size", "64K")
    assert len(manifest["shards"]) > 2
    assert [s["name"] for s in manifest["shards"]] == [f"shard-{i:06d}.tar" for i in range(len(manifest["shards"]))]
    for shard in manifest["shards"]:
        assert shard["bytes"] == (tmp_path / "out" / shard["name"]).stat().st_size <= 64 * 1024
    samples = read_shards(tmp_path / "out", manifest)
    assert [s["__key__"] for s in samples] == [f"{i:09d}" for i in range(30)]
    assert sum(s["samples"] for s in manifest["shards"]) == 30


def test_same_bytes_on_a_rerun_and_with_any_worker_count(folder, tmp_path):
    runs = [
        shard_hashes(tmp_path / name)
        for name, workers in (("a", "1"), ("b", "1"), ("c", "2"))
        if packed(folder, tmp_path / name, "--workers", workers, "--shard-size", "100K", "--max-short-side", "100")
    ]
    assert len(runs[0]) > 2 and runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("length", ["short", "too long for a socket path"])
def test_pack_leaves_no_temporary_folder(folder, tmp_path, length):
    # Its workers come from a fork server, whose socket folder (pymp-*) lives in $TMPDIR, unless
    # that is too long for a socket's path (a batch scheduler's per-job folder): then in /tmp.
    short = Path(tempfile.mkdtemp(prefix=JOB_ROOT_PREFIX + "tmp-", dir=SHM))  # a test root: test_leaks.py skips it
    temp = short if length == "short" else tmp_path / ("t" * 80)
    temp.mkdir(exist_ok=True)
    try:
        result = cli("pack", str(folder), str(tmp_path / "out"), "--workers", "2", env={"TMPDIR": str(temp)})
        assert result.returncode == 0, result.stderr
        assert list(temp.iterdir()) == []
    finally:
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(short, ignore_errors=True)


def test_max_short_side_shrinks_big_images_and_keeps_jpeg(tmp_path):
    data = make_image_folder(tmp_path / "big", classes=2, per_class=3, size=(120, 300))
    manifest = packed(data, tmp_path / "out", "--max-short-side", "100", "--quality", "80")
    index = scan_image_folder(str(data), "test")
    originals = [Image.open(index.path(i)).size for i in range(len(index))]
    assert manifest["resized"] == sum(min(size) > 100 for size in originals) > 0
    for sample, size in zip(read_shards(tmp_path / "out", manifest), originals):
        image = Image.open(io.BytesIO(sample["jpg"]))
        assert image.format == "JPEG"
        assert min(image.size) == min(min(size), 100)
        if min(size) > 100:  # the aspect ratio kept, to the pixel
            assert abs(max(image.size) - round(max(size) * 100 / min(size))) <= 1


def test_png_passes_through_or_is_resized_as_png(tmp_path):
    data = tmp_path / "png" / "only"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    make_image(rng, 200, 150).save(data / "big.png")
    make_image(rng, 60, 40).save(data / "small.png")
    manifest = packed(data.parent, tmp_path / "out", "--max-short-side", "100")
    big, small = read_shards(tmp_path / "out", manifest)
    assert Image.open(io.BytesIO(big["png"])).size == (133, 100) and "jpg" not in big
    assert small["png"] == (data / "small.png").read_bytes()


def test_missing_folder_is_a_data_error(tmp_path):
    assert_clean_failure(pack(tmp_path / "nowhere", tmp_path / "out"), ExitCode.DATA, "does not exist")
    assert not (tmp_path / "out").exists()


def test_an_out_dir_that_holds_files_is_refused_and_left_alone(folder, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    assert_clean_failure(pack(folder, out), ExitCode.USER, "not empty")
    assert os.listdir(out) == ["mine.txt"] and (out / "mine.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    "flags, phrase",
    [
        (("--shard-size", "lots"), "--shard-size"),
        (("--shard-size", "1K"), "below one tar record"),
        (("--quality", "0"), "--quality"),
        (("--workers", "0"), "--workers"),
        (("--max-short-side", "0"), "--max-short-side"),
    ],
)
def test_bad_flags_are_config_errors(folder, tmp_path, flags, phrase):
    assert_clean_failure(pack(folder, tmp_path / "out", *flags), ExitCode.CONFIG, phrase)
    assert not (tmp_path / "out").exists()


def test_unreadable_samples_are_skipped_and_recorded_and_a_fifo_never_blocks(folder, tmp_path):
    files = sorted(str(p) for p in folder.rglob("*.jpg"))[:3]
    (tmp_path / "junk.jpg").write_bytes(b"not a jpeg at all")
    os.mkfifo(tmp_path / "pipe.jpg")  # nobody writes it: a blocking open would hang
    lines = [f"{files[0]},0", "junk.jpg,1", "pipe.jpg,1", f"{files[1]},2", "gone.jpg,0", f"{files[2]},1"]
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    manifest = packed(tmp_path / "list.txt", tmp_path / "out", "--workers", "2")
    reasons = {s["id"]: s["reason"] for s in manifest["skipped"]}
    assert sorted(reasons) == [1, 2, 4]
    assert "not an image" in reasons[1] and "not a regular file" in reasons[2] and "cannot open" in reasons[4]
    samples = read_shards(tmp_path / "out", manifest)
    assert [(s["__key__"], int(s["cls"])) for s in samples] == [("000000000", 0), ("000000003", 2), ("000000005", 1)]
    assert manifest["classes"] is None and manifest["samples"] == 3 and manifest["indexed"] == 6


def test_no_readable_sample_fails_and_leaves_nothing(tmp_path):
    (tmp_path / "junk.jpg").write_bytes(b"junk")
    (tmp_path / "list.txt").write_text("junk.jpg,0\n")
    (tmp_path / "empty").mkdir()
    for out, kept in ((tmp_path / "new", False), (tmp_path / "empty", True)):
        assert_clean_failure(pack(tmp_path / "list.txt", out), ExitCode.DATA, "none of its 1 samples")
        assert out.exists() == kept and (not kept or os.listdir(out) == [])


def modes(*paths: Path) -> list[int]:
    return [p.stat().st_mode & 0o7777 for p in paths]


@pytest.mark.parametrize(
    "flags, file_mode, dir_mode", [((), 0o600, 0o700), (("--mode", "644"), 0o644, 0o755)], ids=["default", "644"]
)
def test_files_are_private_and_new_folders_too_unless_mode_shares_them(folder, tmp_path, flags, file_mode, dir_mode):
    out = tmp_path / "new" / "parent" / "out"
    manifest = packed(folder, out, *flags)
    files = [out / "pack.json", *(out / s["name"] for s in manifest["shards"])]
    assert modes(*files) == [file_mode] * len(files)
    assert modes(out, out.parent, out.parent.parent) == [dir_mode] * 3  # each folder pack made
    assert modes(tmp_path) == [0o700]  # ... and none it did not


@pytest.mark.parametrize(
    "mode, phrase",
    [
        ("666", "lets other users write"),
        ("620", "lets other users write"),
        ("4644", "no setuid"),
        ("-600", "is not an octal mode"),
        ("755", "no x bit"),
        ("044", "you must be able to read and write"),
        ("rw-r--r--", "is not an octal mode"),
        ("6\x1b[2J44", "'6\\x1b[2J44' is not an octal mode"),  # shown escaped, never sent to the terminal
        # Python's int() reads these as 644 too; a mode is ASCII octal digits (0o allowed), nothing else
        ("\u096c\u096a\u096a", "is not an octal mode"),  # Devanagari 644
        ("6_44", "is not an octal mode"),
        ("+644", "is not an octal mode"),
        ("0x1a4", "is not an octal mode"),
    ],
)
def test_a_mode_that_opens_the_pack_to_writes_or_is_no_mode_is_a_config_error(folder, tmp_path, mode, phrase):
    assert_clean_failure(pack(folder, tmp_path / "out", "--mode", mode), ExitCode.CONFIG, "--mode", phrase)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["writable by others", "a symlink", "under a folder others can write"])
def test_an_out_dir_others_could_swap_is_refused_and_left_alone(folder, tmp_path, case):
    target = tmp_path / "target"
    target.mkdir()
    if case == "writable by others":
        out, phrase = target, "is writable by others"
        target.chmod(0o777)
    elif case == "a symlink":
        out, phrase = tmp_path / "link", "is a symlink"
        out.symlink_to(target)
    else:
        out, phrase = target / "out", "lies under"
        target.chmod(0o777)
    assert_clean_failure(pack(folder, out), ExitCode.USER, "output folder", phrase)
    assert os.listdir(target) == []


def test_a_failed_pack_removes_the_folders_it_made_and_no_other(tmp_path):
    (tmp_path / "junk.jpg").write_bytes(b"junk")
    (tmp_path / "list.txt").write_text("junk.jpg,0\n")
    (tmp_path / "mine").mkdir()
    out = tmp_path / "mine" / "new" / "deeper" / "out"
    assert_clean_failure(pack(tmp_path / "list.txt", out), ExitCode.DATA, "none of its 1 samples")
    assert os.listdir(tmp_path / "mine") == []


def test_ctrl_c_while_packing_leaves_nothing_behind(tmp_path):
    images = make_image_folder(tmp_path / "data", classes=1, per_class=4, size=(64, 96))
    # 40,000 lines: pack runs for many seconds after its second shard, even on a loaded machine
    # (with 4,000, a test process descheduled for a few seconds sent Ctrl-C after pack ended)
    (tmp_path / "list.txt").write_text("".join(f"{p},0\n" for p in sorted(images.rglob("*.jpg")) * 10000))
    out = tmp_path / "out"
    flags = ("--workers", "1", "--max-short-side", "16", "--shard-size", "64K")
    command = [sys.executable, "-m", "prefetchd", "pack", str(tmp_path / "list.txt"), str(out), *flags]
    proc = subprocess.Popen(command, preexec_fn=as_a_terminal_starts_it)
    try:
        wait_until(lambda: (out / ".partial" / "shard-000001.tar").exists(), timeout_s=60, what="a second shard")
        masks = signal_state(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) != 0, f"pack ended as if no Ctrl-C came; its signals then: {masks}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not out.exists()


def _marked(token: str) -> set[int]:
    """The live processes whose environment holds ``token``: pack and all it started (its fork
    server, the workers, the resource tracker), orphans and workers forked late among them."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if token.encode() in f.read() and _alive(int(entry)):
                        found.add(int(entry))
            except OSError:
                continue
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"  # a zombie has exited
    except OSError:
        return False


def test_a_pack_killed_with_sigkill_leaves_no_process_and_the_next_pack_says_what_is_left(tmp_path):
    """Attack of issue 24's pack: kill -9 of a pack with --workers 2 left its fork server and both
    workers alive for good (they hold their own pipes open: no EOF ever ends them), and a second
    pack into the folder said only "not empty"."""
    images = make_image_folder(tmp_path / "data", classes=1, per_class=4, size=(64, 96))
    (tmp_path / "list.txt").write_text("".join(f"{p},0\n" for p in sorted(images.rglob("*.jpg")) * 2000))
    out = tmp_path / "out"
    flags = ("--workers", "2", "--shard-size", "64K")
    token = f"PFD_PACK_TEST={os.getpid()}.{time.monotonic_ns()}"
    # A temp folder of its own: the killed pack cannot remove its fork server's pymp-* folder.
    temp = tempfile.mkdtemp(prefix="pfd-pack-", dir="/tmp")  # short: a socket path goes in it
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefetchd", "pack", str(tmp_path / "list.txt"), str(out), *flags],
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PFD_PACK_TEST": token.partition("=")[2], "TMPDIR": temp},
    )
    try:
        wait_until(lambda: (out / ".partial" / "shard-000001.tar").exists(), timeout_s=60, what="a second shard")
        assert len(_marked(token)) >= 4, _marked(token)  # pack, its fork server and two workers at least
        proc.kill()
        proc.wait()
        try:
            wait_until(lambda: not _marked(token), timeout_s=10, what="the pack's processes to end")
        except AssertionError:
            left = {p: open(f"/proc/{p}/cmdline", "rb").read()[:120] for p in _marked(token)}
            raise AssertionError(f"alive 10 s after the kill: {left}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _marked(token):  # what a failure left: this test's own processes, by their mark
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
    again = pack(tmp_path / "list.txt", out)
    assert_clean_failure(again, ExitCode.USER, "not empty", ".partial", "did not finish", f"rm -r {out}")
    assert os.listdir(out) == [".partial"]  # looked at, not touched


@pytest.mark.parametrize("full", ["blocks", "inodes"])
def test_a_full_file_system_is_the_users_error_and_leaves_nothing(small_tmpfs, tmp_path, full):
    """Attack of issue 24's pack: ENOSPC was "internal error while packing: OSError: [Errno 28]",
    exit 70, whether the shards filled the blocks or .partial found no inode. It is the place,
    not a bug: the message names the folder and what to do."""
    images = make_image_folder(tmp_path / "data", classes=1, per_class=4, size=(64, 96))
    (tmp_path / "list.txt").write_text("".join(f"{p},0\n" for p in sorted(images.rglob("*.jpg")) * 400))
    out = small_tmpfs / "out"
    if full == "inodes":  # OUT_DIR is there, empty; not one more file or folder fits
        out.mkdir(mode=0o700)
        subprocess.run(["mount", "-o", "remount,nr_inodes=2", str(small_tmpfs)], check=True)
    result = pack(tmp_path / "list.txt", out, "--workers", "1", "--shard-size", "64K")
    assert_clean_failure(result, ExitCode.USER, f"output folder {out}", "no space left", "free space")
    assert os.listdir(small_tmpfs) == ([] if full == "blocks" else ["out"])
    assert full == "blocks" or os.listdir(out) == []


def test_a_shared_sticky_folder_as_out_dir_is_refused_without_advice_to_chmod_it(folder):
    """Root owns /dev/shm, so for root it passed the owner check and was refused as "writable by
    others ... run chmod go-w /dev/shm": advice that breaks every other user of the node."""
    result = pack(folder, Path("/dev/shm"))
    if os.getuid() == 0:
        assert_clean_failure(result, ExitCode.USER, "/dev/shm", "a folder of your own inside it")
    assert "chmod" not in result.stderr, result.stderr


def test_the_file_system_root_as_out_dir_is_refused_for_what_it_is(folder):
    """It was "cannot create output folder /: No such file or directory" (mkdir of "")."""
    result = pack(folder, Path("/"))
    assert_clean_failure(result, ExitCode.USER, "output folder /", "not empty" if os.getuid() == 0 else "uid 0")
    assert "No such file" not in result.stderr
