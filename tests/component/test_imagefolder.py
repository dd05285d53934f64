"""The image_folder index is torchvision's ImageFolder, sample for sample: compared against the
real torchvision code (its pure-Python folder.py), not against a reading of it, and served that
way by a real daemon; where prefetchd chooses to differ, the scan stops with a DataError.

torchvision's wheel is CUDA-linked and its compiled ops do not load beside the CPU torch used
here, so .ci/run installs it with --no-deps into a folder of its own (TORCHVISION_DIR) and
load_torchvision_folder imports only ``torchvision.datasets.folder`` from it, under a private
package name, without running ``torchvision/__init__.py``.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from prefetchd.cli.datagen import make_image
from prefetchd.errors import DataError
from prefetchd.sources.index import SampleIndex, read_file_list, scan_image_folder
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

TORCHVISION_VERSION = "0.28.0"  # the release that pairs with the pinned torch 2.13.0
TORCHVISION_DIR = REPO / "build" / f"torchvision-{TORCHVISION_VERSION}"
_PRIVATE_NAME = "_real_torchvision"
NON_UTF8 = os.fsdecode(b"\xff\xfe.jpg")  # any bytes but "/" and NUL make a valid Linux file name
NON_UTF8_CLASS = os.fsdecode(b"n0\xe9")


@pytest.fixture(scope="module")
def torchvision_folder() -> types.ModuleType:
    """torchvision's own folder.py (ImageFolder, find_classes, make_dataset)."""
    if not (TORCHVISION_DIR / "torchvision" / "datasets" / "folder.py").exists():
        pytest.skip(
            f"torchvision {TORCHVISION_VERSION} is not installed in {TORCHVISION_DIR}; install it as .ci/run does: "
            f"python -m pip install --no-deps --target {TORCHVISION_DIR} torchvision=={TORCHVISION_VERSION}"
        )
    return load_torchvision_folder(TORCHVISION_DIR / "torchvision")


def load_torchvision_folder(package: Path) -> types.ModuleType:
    # Empty parent packages stand in for torchvision/__init__.py and datasets/__init__.py, which
    # load the compiled ops; folder.py's relative imports (.vision, ..utils) then resolve to
    # the real files. The private name keeps a later `import torchvision` untouched.
    for name, folder in ((_PRIVATE_NAME, package), (f"{_PRIVATE_NAME}.datasets", package / "datasets")):
        if name not in sys.modules:
            stand_in = types.ModuleType(name)
            stand_in.__path__ = [str(folder)]
            sys.modules[name] = stand_in
    return importlib.import_module(f"{_PRIVATE_NAME}.datasets.folder")


def write_jpeg(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    make_image(np.random.default_rng(seed), 24 + seed % 17, 24 + seed % 13).save(path, "JPEG", quality=80)


def imagenet_shaped_folder(base: Path) -> Path:
    """Every rule at once: nested folders (whose sorted order is not the walk's), upper-case
    extensions, a symlinked class folder and file, a hidden class and hidden files, non-image
    files, and file names that are not UTF-8 or that sort differently as text and as bytes."""
    root = base / "train"
    names = [f"n01/img_{i:02d}.jpg" for i in range(6)]
    names += ["n01/sub/a.jpg", "n01/sub-2/b.jpg", "n01/sub/deeper/c.jpg", "n01/sub/deeper/d.JPEG"]
    names += ["n02/A.JPEG", "n02/b.Png", "n02/c.jpg", "n02/.x.jpg", "n02/€.jpg", "n02/\ue000.jpg", f"n02/{NON_UTF8}"]
    names += [".hidden/h.jpg", f"{NON_UTF8_CLASS}/e.jpg"]
    for seed, name in enumerate(names):
        write_jpeg(root / name, seed)
    (root / "n02" / "notes.txt").write_text("not an image")
    (root / "README.jpgx").write_text("a file at the top level is no class")
    write_jpeg(base / "elsewhere" / "s1.jpg", 40)
    write_jpeg(base / "elsewhere" / "s2.jpg", 41)
    write_jpeg(base / "loose.jpg", 42)
    (root / "n03").symlink_to(base / "elsewhere", target_is_directory=True)
    (root / "n02" / "linked.jpg").symlink_to(base / "loose.jpg")
    return root


def scanned_samples(root: Path) -> list[tuple[str, int]]:
    index = scan_image_folder(str(root), "[[source]] #1")
    return [(index.path(i), index.label(i)) for i in range(len(index))]


def test_scan_equals_torchvision_samples_for_an_imagenet_shaped_folder(tmp_path, torchvision_folder):
    root = imagenet_shaped_folder(tmp_path)
    expected = torchvision_folder.ImageFolder(str(root)).samples
    assert len(expected) == 22
    assert scanned_samples(root) == expected


def test_nested_sub_folders_are_walked_and_ordered_like_torchvision(tmp_path, torchvision_folder):
    root = tmp_path / "train"
    for i in range(30):
        write_jpeg(root / "a" / f"{i:02d}.jpg", i)
    for i, sub in enumerate(["x", "x-y", "x/z", "x/z/deep", "w"] * 2):
        write_jpeg(root / "a" / sub / f"n{i}.jpg", 30 + i)
    for i in range(40):
        write_jpeg(root / "b" / f"{i:02d}.jpg", 40 + i)
    expected = torchvision_folder.ImageFolder(str(root)).samples
    assert len(expected) == 80  # where a scan of the top level alone finds 70
    assert scanned_samples(root) == expected


def test_hidden_class_folders_and_hidden_files_count_as_in_torchvision(tmp_path, torchvision_folder):
    root = tmp_path / "train"
    for i, name in enumerate([".cache/a.jpg", "cat/.b.jpg", "cat/c.jpg", "dog/d.jpg"]):
        write_jpeg(root / name, i)
    expected = torchvision_folder.ImageFolder(str(root)).samples
    assert [label for _, label in expected] == [0, 1, 1, 2]
    assert scanned_samples(root) == expected


def test_non_utf8_file_names_keep_torchvision_ids_and_round_trip_through_the_saved_index(tmp_path, torchvision_folder):
    root = tmp_path / "train"
    # As text "\udcff" sorts before "\ue000"; as bytes 0xff sorts after 0xee: torchvision sorts text.
    for i, name in enumerate(["a.jpg", "€.jpg", NON_UTF8, "\ue000.jpg", "z.jpg"]):
        write_jpeg(root / os.fsdecode(b"cl\xe4ss") / name, i)
    expected = torchvision_folder.ImageFolder(str(root)).samples
    index = scan_image_folder(str(root), "[[source]] #1")
    index.save(tmp_path / "index")
    loaded = SampleIndex.load(tmp_path / "index").in_memory()
    assert [(loaded.path(i), loaded.label(i)) for i in range(len(loaded))] == expected
    assert all(Path(loaded.path(i)).read_bytes()[:2] == b"\xff\xd8" for i in range(len(loaded)))


def test_fingerprint_of_utf8_names_is_unchanged_so_saved_resume_states_stay_valid():
    paths, labels = ["/data/a/ü.jpg", "/data/b/x.JPEG"], [0, 1]
    encoded = [p.encode() for p in paths]  # the index's bytes before non-UTF-8 names were allowed
    offsets = np.cumsum([0] + [len(b) for b in encoded]).astype(np.int64)
    before = SampleIndex(np.frombuffer(b"".join(encoded), np.uint8), offsets, np.asarray(labels, np.int64))
    assert SampleIndex.from_lists(paths, labels).fingerprint() == before.fingerprint()


@pytest.mark.parametrize("link, target", [("cat/again", "."), ("cat/sub/up", "cat")])
def test_symlink_loop_inside_a_class_folder_is_a_data_error_naming_the_link(tmp_path, link, target):
    root = tmp_path / "train"
    write_jpeg(root / "cat" / "a.jpg", 0)
    (root / link).parent.mkdir(exist_ok=True)
    (root / link).symlink_to(root / target, target_is_directory=True)  # torchvision: every image 41 times
    with pytest.raises(DataError, match=rf"train/{link} leads back into a folder that contains it \(a symlink loop\)"):
        scan_image_folder(str(root), "[[source]] #1")


@pytest.mark.parametrize(
    "plant, what",
    [
        (lambda p: os.mkfifo(p), "a FIFO"),  # reading it would block a worker forever
        (lambda p: p.symlink_to(p.parent / "gone.jpg"), "a symbolic link to nothing"),
    ],
)
def test_image_name_that_is_not_a_regular_file_is_a_data_error_naming_it(tmp_path, plant, what):
    root = tmp_path / "train"
    write_jpeg(root / "cat" / "a.jpg", 0)
    (root / "cat" / "sub").mkdir()
    plant(root / "cat" / "sub" / NON_UTF8)
    with pytest.raises(DataError) as raised:
        scan_image_folder(str(root), "[[source]] #1")
    assert f"cat/sub/\\xff\\xfe.jpg is named like an image but is {what}, not a regular file" in str(raised.value)


def test_empty_hidden_class_folder_is_a_data_error_as_in_torchvision(tmp_path, torchvision_folder):
    root = tmp_path / "train"
    write_jpeg(root / "cat" / "a.jpg", 0)
    (root / ".ipynb_checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes .ipynb_checkpoints"):
        torchvision_folder.ImageFolder(str(root))
    with pytest.raises(DataError, match=r"hold no images \(.ipynb_checkpoints\).*hidden folders count as classes"):
        scan_image_folder(str(root), "[[source]] #1")


def test_file_list_that_is_not_utf8_is_a_data_error_naming_the_line(tmp_path):
    listing = tmp_path / "train.txt"
    listing.write_bytes(b"a.jpg,0\n" + os.fsencode(f"{NON_UTF8},1\n"))
    with pytest.raises(DataError, match=r"train.txt:2: file lists must be UTF-8 text.*0xff.*image_folder"):
        read_file_list(str(listing), "[[source]] #1")


def test_a_large_folder_says_how_far_its_indexing_is(tmp_path, monkeypatch, caplog):
    """issue 27: a start's indexing of a large folder shows progress (lines `start` echoes)."""
    import logging

    from prefetchd.sources import progress

    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)  # a line per class folder, as a long scan gets one per 5 s
    for c in range(3):
        (tmp_path / f"c{c}").mkdir()
        (tmp_path / f"c{c}" / "a.jpg").write_bytes(b"x")
    with caplog.at_level(logging.INFO, logger="prefetchd"):
        scan_image_folder(str(tmp_path), "[[source]] #1 (image_folder)")
    lines = [r.getMessage() for r in caplog.records if ": indexed " in r.getMessage()]
    assert lines == [f"[[source]] #1 (image_folder): indexed {n} of 3 class folders (0 s)" for n in (1, 2)]
