"""A Kubernetes emptyDir as the root's parent under the `restricted` Pod Security standard
(issue 27): the kubelet makes it 0777 and no container may run as root to make it sticky, so
$PREFETCHD_POD_VOLUME names it; that exact mount point, and nothing else, stands as a folder
nobody else can change (prefetchd_client.folders.is_pod_volume). A real tmpfs mounted 0777
here, as the kubelet mounts one."""

from __future__ import annotations

import pytest

from prefetchd_client.errors import UnsafeFolder
from prefetchd_client.folders import POD_VOLUME_ENV, check_folders_above, make_private_dir
from tests.conftest import mounted_tmpfs


@pytest.fixture
def empty_dir(tmp_path):
    with mounted_tmpfs(tmp_path / "buffer", "size=4m,mode=777") as mount:  # as the kubelet mounts an emptyDir
        yield mount


def test_a_0777_volume_is_refused_unless_named_and_then_only_itself(empty_dir, monkeypatch):
    root = empty_dir / "prefetchd"
    with pytest.raises(UnsafeFolder, match="mode 777, not sticky"):
        check_folders_above(root / "job", "job root")
    monkeypatch.setenv(POD_VOLUME_ENV, str(empty_dir))
    fd, made = make_private_dir(root, "job root")  # as a start makes its root
    made.close()
    check_folders_above(root / "job", "job root")
    assert (root.stat().st_mode & 0o777) == 0o700
    # a 0777 folder inside the volume is another folder, refused as ever
    inner = empty_dir / "shared"
    inner.mkdir()
    inner.chmod(0o777)
    with pytest.raises(UnsafeFolder, match="shared"):
        check_folders_above(inner / "prefetchd" / "job", "job root")


@pytest.mark.parametrize("named", ["relative/buffer", "", "{folder}/", "{other}"])
def test_only_the_exact_mount_point_named_by_an_absolute_path_counts(empty_dir, tmp_path, monkeypatch, named):
    other = tmp_path / "open"  # a 0777 folder that is not a mount point: a hostPath's look-alike
    other.mkdir()
    other.chmod(0o777)
    monkeypatch.setenv(POD_VOLUME_ENV, named.format(folder=empty_dir, other=other))
    expect_refused = named != "{folder}/"  # a trailing slash names the same mount point
    for parent in (empty_dir, other):
        refused = parent == other or expect_refused
        if refused:
            with pytest.raises(UnsafeFolder):
                check_folders_above(parent / "prefetchd" / "job", "job root")
        else:
            check_folders_above(parent / "prefetchd" / "job", "job root")
