"""Sample indexes from real folders and file lists, and their errors."""

import os

import pytest

from prefetchd.errors import DataError
from prefetchd.master.job import build_index
from prefetchd.sources.index import SampleIndex, read_file_list, scan_image_folder


def touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")


def test_image_folder_order_matches_torchvision(tmp_path):
    for rel in ["b/2.jpg", "b/10.JPG", "a/z.png", "a/y.jpeg", "a/notes.txt", "c/x.webp", ".hidden/q.jpg"]:
        touch(tmp_path / rel)
    index = scan_image_folder(str(tmp_path), "src")
    names = [os.path.relpath(index.path(i), tmp_path) for i in range(len(index))]
    # torchvision counts hidden folders as classes too (tests/component/test_imagefolder.py runs its code)
    assert names == [".hidden/q.jpg", "a/y.jpeg", "a/z.png", "b/10.JPG", "b/2.jpg", "c/x.webp"]
    assert index.labels.tolist() == [0, 1, 1, 2, 2, 3]


def test_file_list_resolves_relative_paths_and_commas(tmp_path):
    lst = tmp_path / "lists" / "train.txt"
    lst.parent.mkdir()
    lst.write_text("img/a.jpg,3\n/abs/b,c.jpg,1\n\n")
    index = read_file_list(str(lst), "src")
    assert [index.path(i) for i in range(2)] == [str(tmp_path / "lists/img/a.jpg"), "/abs/b,c.jpg"]
    assert index.labels.tolist() == [3, 1]


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "has no class sub-folders"),
        (lambda p: (p / "cls").mkdir(parents=True), "hold no images \\(cls\\)"),
        (lambda p: p.write_text("x"), "is not a folder"),
    ],
)
def test_image_folder_errors(tmp_path, setup, message):
    root = tmp_path / "data"
    setup(root)
    with pytest.raises(DataError, match=message):
        scan_image_folder(str(root), "[[source]] #1")


def test_file_list_errors(tmp_path):
    with pytest.raises(DataError, match="cannot read file list"):
        read_file_list(str(tmp_path / "nope.txt"), "src")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(DataError, match="is empty"):
        read_file_list(str(empty), "src")
    bad = tmp_path / "bad.txt"
    bad.write_text("a.jpg,1\nb.jpg\n")
    with pytest.raises(DataError, match=r"bad.txt:2: expected 'path,label'"):
        read_file_list(str(bad), "src")
    if os.getuid() != 0:  # root reads anything
        locked = tmp_path / "locked.txt"
        locked.write_text("a,1\n")
        locked.chmod(0)
        with pytest.raises(DataError, match="cannot read"):
            read_file_list(str(locked), "src")


def test_index_round_trips_through_npy_and_concatenates(tmp_path):
    a = SampleIndex.from_lists(["/x/1.jpg", "/x/ü.jpg"], [0, 1])
    b = SampleIndex.from_lists(["/y/3.jpg"], [7])
    both = SampleIndex.concat([a, b])
    both.save(tmp_path / "index")
    loaded = SampleIndex.load(tmp_path / "index").in_memory()
    assert [loaded.path(i) for i in range(3)] == ["/x/1.jpg", "/x/ü.jpg", "/y/3.jpg"]
    assert loaded.labels.tolist() == [0, 1, 7]
    assert loaded.fingerprint() == both.fingerprint() != a.fingerprint()


def test_build_index_concatenates_sources_in_order(tmp_path):
    touch(tmp_path / "f/c/1.jpg")
    lst = tmp_path / "l.txt"
    lst.write_text("q.jpg,5\n")
    index, sizes = build_index(
        ({"kind": "image_folder", "root": str(tmp_path / "f")}, {"kind": "file_list", "path": str(lst)})
    )
    assert len(index) == 2 and index.labels.tolist() == [0, 5] and sizes == (1, 1)
