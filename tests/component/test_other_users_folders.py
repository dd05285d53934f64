"""Another user's folders as prefetchd's output and cache (issue 24, findings 2 and 3).

``prefetchd pack`` writes where it is told and the shard index cache reads what it finds: in a
folder another user (mallory) owns or can write, she can read and replace alice's shards, swap
``.partial`` or ``pack.json`` for a symlink between two of alice's steps, or plant a cache file
whose labels she chose (its name is a hash of what ``stat`` shows). Both now follow the job
root's rule: such a folder is refused (pack) or not used (the cache). Run as two real users.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.component.test_shards import good, write_shard
from tests.crossusers import ALICE, MALLORY, no_traceback, read_line

# One xdist worker for all of them: they share the two users and alice's default root.
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("cross_user")]

# mallory's side of a swap: once alice's pack has made OUT_DIR/.partial (and, with a file name,
# that file in it), .partial becomes mallory's: a symlink to TARGET, or her folder TARGET. She
# polls until then, or until the test closes her stdin; then says whether she swapped.
_SWAP_PARTIAL = r"""
import os, select, sys, time
out, wait_for, kind, target = sys.argv[1:5]
partial = os.path.join(out, ".partial")
print("ready", flush=True)
swapped = False
deadline = time.monotonic() + 60
while not swapped and time.monotonic() < deadline and not select.select([sys.stdin], [], [], 0.001)[0]:
    if not os.path.lexists(os.path.join(partial, wait_for)):
        continue
    try:
        os.rename(partial, os.path.join(out, ".alices-partial"))
        if kind == "symlink":
            os.symlink(target, partial)
        else:
            os.rename(target, partial)
        swapped = True
    except OSError:
        pass
sys.stdin.read()
print("swapped" if swapped else "never swapped", flush=True)
"""

# mallory's cache file: she indexes the shard herself (the cache file's name is the same for
# every user), sets every label to LABEL, and opens the file and its folder to alice.
_PLANT_CACHE = r"""
import os, sys
import numpy as np
from prefetchd.sources import shards
folder, shard, label, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4], 8)
os.environ["PREFETCHD_CACHE"] = folder
shards.scan_webdataset({"urls": shard}, "mallory")
(name,) = [n for n in os.listdir(folder) if n.endswith(".npy")]
path = os.path.join(folder, name)
table = np.load(path)
table[:, 2] = label
np.save(path, table)
os.chmod(path, 0o644)
os.chmod(folder, mode)
print(name, flush=True)
"""

# alice's side of the cache: the labels her index of the shard holds, and what was logged.
_SCAN = r"""
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from prefetchd.sources import shards
print(json.dumps(shards.scan_webdataset({"urls": sys.argv[1]}, "alice").labels.tolist()), flush=True)
"""


@pytest.fixture
def place(users):
    """A folder under /tmp both users can enter, with alice's private folder (``alice``) and
    mallory's (``mallory``, 0755) in it; removed after."""
    base = Path(tempfile.mkdtemp(prefix="pfd-files-", dir="/tmp"))
    base.chmod(0o755)
    for name, user, mode in (("alice", users[ALICE], 0o700), ("mallory", users[MALLORY], 0o755)):
        (base / name).mkdir()
        os.chown(base / name, user.uid, user.gid)
        (base / name).chmod(mode)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def mallorys(users, path: Path, mode: int) -> Path:
    """A folder ``path`` of mallory's, as if she had made it with ``mode``."""
    path.mkdir()
    os.chown(path, users[MALLORY].uid, users[MALLORY].gid)
    path.chmod(mode)
    return path


def readable_by_all(path: Path) -> Path:
    path.chmod(0o644)
    return path


def alices_pack(users, source: Path | str, out: Path, *flags: str):
    return users[ALICE].prefetchd("pack", str(source), str(out), "--workers", "1", *flags)


def slow_file_list(place: Path, shared_data) -> Path:
    """1,500 samples (the shared images, over and over) that --max-short-side must resize: a
    pack of a few seconds, so that mallory's swap lands while it runs."""
    images = sorted((shared_data.parent / "train").rglob("*.jpg"))
    (place / "list.txt").write_text("".join(f"{images[i % len(images)]},{i % 2}\n" for i in range(1500)))
    return readable_by_all(place / "list.txt")


def hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o755], ids=oct)
def test_pack_refuses_an_out_dir_of_another_users_and_writes_nothing_there(users, place, shared_data, mode):
    out = mallorys(users, place / "mallory" / "out", mode)
    result = alices_pack(users, shared_data.parent / "train", out)
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "output folder" in result.stderr and f"uid {users[MALLORY].uid}" in result.stderr, result.stderr
    assert no_traceback(result)
    assert os.listdir(out) == []


def test_pack_refuses_an_out_dir_under_a_folder_of_another_users(users, place, shared_data):
    """alice's own empty folder, but under mallory's: she could rename it away and put hers there."""
    out = place / "mallory" / "alices-out"
    out.mkdir(mode=0o700)
    os.chown(out, users[ALICE].uid, users[ALICE].gid)
    result = alices_pack(users, shared_data.parent / "train", out)
    assert result.returncode == 1 and "lies under" in result.stderr, result.stderr
    assert os.listdir(out) == []


def test_a_swap_of_partial_for_a_symlink_to_alices_earlier_pack_leaves_that_pack_alone(
    users, place, shared_data, processes
):
    earlier = place / "alice" / "earlier"
    assert alices_pack(users, shared_data.parent / "train", earlier).returncode == 0
    before = hashes(earlier)
    out = mallorys(users, place / "mallory" / "out", 0o777)
    mallory = users[MALLORY].popen(
        users[MALLORY].python, "-c", _SWAP_PARTIAL, str(out), "shard-000000.tar", "symlink", str(earlier)
    )
    processes.append(mallory)
    assert read_line(mallory) == "ready"
    slow = slow_file_list(place, shared_data)
    result = alices_pack(users, slow, out, "--max-short-side", "16", "--shard-size", "64K")
    mallory.stdin.close()
    swap = read_line(mallory)
    assert hashes(earlier) == before, (swap, result.returncode, result.stderr)
    assert result.returncode == 1 and "output folder" in result.stderr, (swap, result.stderr)
    assert no_traceback(result)


def test_a_swap_of_partial_for_a_folder_whose_pack_json_is_a_symlink_leaves_alices_file_alone(
    users, place, shared_data, processes
):
    notes = place / "alice" / "notes.txt"
    notes.write_text("alice's notes\n")
    os.chown(notes, users[ALICE].uid, users[ALICE].gid)
    notes.chmod(0o600)
    stage = mallorys(users, place / "mallory" / "stage", 0o777)
    (stage / "pack.json").symlink_to(notes)
    os.chown(stage / "pack.json", users[MALLORY].uid, users[MALLORY].gid, follow_symlinks=False)
    out = mallorys(users, place / "mallory" / "out", 0o777)
    mallory = users[MALLORY].popen(users[MALLORY].python, "-c", _SWAP_PARTIAL, str(out), "", "folder", str(stage))
    processes.append(mallory)
    assert read_line(mallory) == "ready"
    result = alices_pack(users, slow_file_list(place, shared_data), out, "--max-short-side", "16")
    mallory.stdin.close()
    swap = read_line(mallory)
    assert notes.read_text() == "alice's notes\n", (swap, result.returncode, result.stderr)
    assert result.returncode == 1 and "output folder" in result.stderr, (swap, result.stderr)


@pytest.mark.parametrize("mode", [None, "644"])
def test_mallory_can_read_alices_pack_only_when_mode_shares_it_and_never_write_it(users, place, shared_data, mode):
    out = place / "alice" / "pack"
    place.joinpath("alice").chmod(0o755)  # alice's folder open to all: the pack's own modes decide
    flags = ("--mode", mode) if mode else ()
    assert alices_pack(users, shared_data.parent / "train", out, *flags).returncode == 0
    shard = out / "shard-000000.tar"
    read = users[MALLORY].run("sh", "-c", f"cat {shard} > /dev/null")
    write = users[MALLORY].run("sh", "-c", f"echo mallory >> {shard}")
    plant = users[MALLORY].run("touch", str(out / "shard-000001.tar"))
    assert (read.returncode == 0) == (mode == "644"), read.stderr
    assert write.returncode != 0 and plant.returncode != 0
    expected = (0o644, 0o755) if mode else (0o600, 0o700)
    assert (shard.stat().st_mode & 0o777, out.stat().st_mode & 0o777) == expected


@pytest.mark.parametrize("where", ["mallory's folder others can write", "mallory's folder", "under mallory's folder"])
def test_a_shard_cache_that_mallory_could_write_is_not_used(users, place, where):
    shard = readable_by_all(write_shard(place / "s.tar", good(6)))  # labels 0 1 2 0 1 2
    if where == "under mallory's folder":  # alice's default cache path, under mallory's XDG_CACHE_HOME
        xdg = mallorys(users, place / "mallory" / "xdg", 0o755)
        folder = xdg / "prefetchd" / "shards"
        for path in (folder.parent, folder):
            mallorys(users, path, 0o755)  # the last one opened to all once mallory's file is in it
        env = {"XDG_CACHE_HOME": str(xdg)}
    else:
        folder = mallorys(users, place / "mallory" / "cache", 0o755)
        env = {"PREFETCHD_CACHE": str(folder)}
    mode = "755" if where == "mallory's folder" else "777"
    planted = users[MALLORY].run(users[MALLORY].python, "-c", _PLANT_CACHE, str(folder), str(shard), "2", mode)
    assert planted.returncode == 0, planted.stderr
    result = users[ALICE].run(users[ALICE].python, "-c", _SCAN, str(shard), env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [0, 1, 2, 0, 1, 2], result.stderr
    assert result.stderr.count("shard index cache not used") == 1, result.stderr
    reason = "lies under" if where == "under mallory's folder" else f"uid {users[MALLORY].uid}"
    assert reason in result.stderr, result.stderr


def test_a_user_with_no_home_indexes_shards_without_a_cache(users, place):
    """Attack of issue 24's cache: a uid with no passwd entry and no $HOME (a container run with
    an arbitrary uid) has no default cache folder: Path.home() raised RuntimeError ("Could not
    determine home directory") out of indexing, and every start of a WebDataset job failed. The
    cache is best effort: it is not used, the log says why once, and the shards are indexed."""
    shard = readable_by_all(write_shard(place / "s.tar", good(6)))
    env = {k: v for k, v in users[ALICE].env.items() if k != "HOME"}
    python = users[ALICE].python
    result = subprocess.run(
        [python, "-c", _SCAN, str(shard)], capture_output=True, text=True, timeout=60,
        user=54321, group=54321, extra_groups=[], cwd="/", env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [0, 1, 2, 0, 1, 2], result.stderr
    assert result.stderr.count("shard index cache not used") == 1, result.stderr
    assert "home" in result.stderr and "PREFETCHD_CACHE" in result.stderr, result.stderr
