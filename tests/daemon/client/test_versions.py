"""A version on every boundary, seen on a serving job: a client or `prefetchd verify` meeting a
manifest or producer spec of another prefetchd version refuses it and says how to fix it."""

from __future__ import annotations

import json
import os

import pytest

from prefetchd.workers.spec import PRODUCER_SPEC, SPEC_VERSION
from prefetchd_client import PlanMismatch, PrefetchLoader
from prefetchd_client.manifest import MANIFEST_VERSION
from tests.conftest import cli, write_config


@pytest.mark.timeout(120)
def test_a_client_refuses_a_manifest_of_another_version_and_says_how_to_fix_it(tmp_path, jpeg_folder, serve):
    paths = serve(write_config(tmp_path, jpeg_folder, name="versions")).paths
    manifest = json.loads(paths.manifest.read_text())
    assert manifest["manifest_version"] == MANIFEST_VERSION
    loader = PrefetchLoader("versions", rank=0, world_size=1)  # this version reads it
    try:
        assert next(iter(loader)) is not None
    finally:
        loader.close()
    _rewrite(paths.manifest, manifest | {"manifest_version": 999})
    with pytest.raises(PlanMismatch, match=r"manifest version 999.*install the same version of both"):
        PrefetchLoader("versions", rank=0, world_size=1)


@pytest.mark.timeout(120)
def test_verify_refuses_a_producer_spec_of_another_version(tmp_path, jpeg_folder, serve):
    paths = serve(write_config(tmp_path, jpeg_folder, name="spec")).paths
    spec = json.loads((paths.dir / PRODUCER_SPEC).read_text())
    assert spec["version"] == SPEC_VERSION
    _rewrite(paths.dir / PRODUCER_SPEC, spec | {"version": 999})
    result = cli("verify", "spec", "--epoch", "0", "--step", "0")
    assert result.returncode == 4, result.stderr
    assert "another prefetchd version" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.timeout(120)
def test_verify_names_a_manifest_of_another_version_without_calling_it_foreign(tmp_path, jpeg_folder, serve):
    paths = serve(write_config(tmp_path, jpeg_folder, name="manifestv")).paths
    _rewrite(paths.manifest, json.loads(paths.manifest.read_text()) | {"manifest_version": 999})
    result = cli("verify", "manifestv", "--epoch", "0", "--step", "0")
    assert result.returncode == 4, result.stderr
    assert "manifest version 999" in result.stderr and "a daemon never writes that" not in result.stderr


def _rewrite(path, data: dict) -> None:
    tmp = path.with_name(path.name + ".edit")
    tmp.write_text(json.dumps(data))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
