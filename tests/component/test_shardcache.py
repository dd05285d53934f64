"""The shard index cache (prefetchd.sources.shardcache): used only where no other user can have written
it, through the real indexing of real tar shards. A planted label (every label set to 2) is read
back only if the cache file is used; the shard's own labels are 0 1 2 0 ...; the two-user forms
of these attacks are in test_cross_user_files.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from prefetchd.sources import shards
from tests.component.test_shards import good, write_shard

pytestmark = pytest.mark.timeout(60)

NOBODY = 65534  # a uid that is not this user's, for a folder or file another user owns


@pytest.fixture
def shard(tmp_path) -> Path:
    return write_shard(tmp_path / "s.tar", good(4))


def scan(shard: Path) -> list[int]:
    return shards.scan_webdataset({"urls": str(shard)}, "test").labels.tolist()


def plant(cache: Path, shard: Path, monkeypatch) -> Path:
    """Index ``shard`` into the private folder ``cache``, then set every label of its cache file to 2."""
    monkeypatch.setenv("PREFETCHD_CACHE", str(cache))
    scan(shard)
    (path,) = cache.iterdir()
    table = np.load(path)
    table[:, 2] = 2
    np.save(path, table)
    assert scan(shard) == [2, 2, 2, 2]  # the planted file is what a trusted cache serves
    return path


def as_root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")


@pytest.mark.parametrize(
    "case", ["writable by others", "a symlink", "another user's", "under a folder others can write"]
)
def test_a_cache_folder_another_user_could_write_is_not_used_and_the_log_says_why_once(
    tmp_path, shard, monkeypatch, caplog, case
):
    private = tmp_path / "cache"
    plant(private, shard, monkeypatch)
    folder, why = private, ""
    if case == "writable by others":
        private.chmod(0o777)
        why = "writable by others"
    elif case == "a symlink":
        folder, why = tmp_path / "link", "is a symlink"
        folder.symlink_to(private)
    elif case == "another user's":
        as_root_only()
        os.chown(private, NOBODY, NOBODY)
        why = f"belongs to uid {NOBODY}"
    else:
        tmp_path.joinpath("open").mkdir(mode=0o700)
        folder = tmp_path / "open" / "cache"
        private.rename(folder)
        (tmp_path / "open").chmod(0o777)
        why = "lies under"
    monkeypatch.setenv("PREFETCHD_CACHE", str(folder))
    second = write_shard(tmp_path / "t.tar", good(3))
    with caplog.at_level(logging.INFO, logger="prefetchd"):
        labels = shards.scan_webdataset({"urls": [str(shard), str(second)]}, "test").labels.tolist()
    assert labels == [0, 1, 2, 0, 0, 1, 2]
    refusals = [r.getMessage() for r in caplog.records if "shard index cache not used" in r.getMessage()]
    assert len(refusals) == 1 and why in refusals[0], caplog.text  # two shards, one line
    assert len(os.listdir(folder)) == 1  # nothing written there either


@pytest.mark.parametrize("case", ["writable by others", "another user's", "a symlink", "a FIFO"])
def test_a_cache_file_that_is_not_the_users_own_regular_file_is_not_used(tmp_path, shard, monkeypatch, case):
    path = plant(tmp_path / "cache", shard, monkeypatch)
    if case == "writable by others":
        path.chmod(0o666)
    elif case == "another user's":
        as_root_only()
        os.chown(path, NOBODY, NOBODY)
    elif case == "a symlink":  # to a planted table of the user's own, elsewhere
        path.rename(tmp_path / "elsewhere.npy")
        path.symlink_to(tmp_path / "elsewhere.npy")
    else:
        path.unlink()
        os.mkfifo(path)  # nobody writes it: a blocking open would hang the start
    assert scan(shard) == [0, 1, 2, 0]
    # indexed afresh and written over it: the user's own file again, private
    assert path.is_file() and not path.is_symlink() and path.stat().st_uid == os.getuid()
    assert path.stat().st_mode & 0o777 == 0o600 and scan(shard) == [0, 1, 2, 0]


def test_cache_files_are_0600_in_folders_made_0700_whatever_the_umask(tmp_path, shard, monkeypatch):
    cache = tmp_path / "a" / "b" / "cache"
    monkeypatch.setenv("PREFETCHD_CACHE", str(cache))
    old_umask = os.umask(0o000)  # the widest: what the cache makes must still be private
    try:
        scan(shard)
    finally:
        os.umask(old_umask)
    (path,) = cache.iterdir()
    assert [p.stat().st_mode & 0o777 for p in (cache.parent.parent, cache.parent, cache, path)] == [0o700] * 3 + [0o600]
