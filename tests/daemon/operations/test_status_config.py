"""A serving job states its settings: `prefetchd status` echoes the config the job runs with, and a
flag given to the start wins over the file (here the epoch rule of a mix, read back from the manifest)."""

from __future__ import annotations

import json

from prefetchd import settings
from prefetchd.config import load_config
from prefetchd.plan import Plan
from prefetchd_client.manifest import read_manifest
from tests.conftest import cli, write_config


def test_status_echoes_the_config(tmp_path, jpeg_folder, serve):
    config = write_config(tmp_path, jpeg_folder, name="echo", seed=4, world_size=2)
    serve(config, {"retain": 3})
    result = cli("status", "echo", "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert "config" in status, "prefetchd.ops.status.job_status must echo the config: settings.echo(m.config)"
    assert status["config"] == settings.echo(load_config(config, {"retain": 3}))


def test_mix_flag_overrides_the_config_files_epoch_rule(tmp_path, jpeg_folder, serve):
    """Two weighted sources of 48 images: a `cycle` epoch runs until the weight-1 source has
    given all 48 (48 + 144 samples), a `first_exhausted` one ends when the weight-3 source has
    (48 + 16)."""
    extra = '\n[mix]\nepoch = "cycle"\n'
    config = write_config(tmp_path, jpeg_folder, name="mixed", batch_size=4, extra=extra)
    one_source = f'[[source]]\nkind = "image_folder"\nroot = "{jpeg_folder}"\n'
    two_sources = (
        f'[[source]]\nname = "a"\nweight = 1\nkind = "image_folder"\nroot = "{jpeg_folder}"\n\n'
        f'[[source]]\nname = "b"\nweight = 3\nkind = "image_folder"\nroot = "{jpeg_folder}"\n'
    )
    assert one_source in config.read_text()
    config.write_text(config.read_text().replace(one_source, two_sources))

    def plan(mix: str) -> Plan:
        return Plan(96, 1, 4, source_sizes=(48, 48), weights=(1.0, 3.0), mix=mix)

    assert plan("first_exhausted").batches_per_epoch != plan("cycle").batches_per_epoch
    paths = serve(config, {"mix": "first_exhausted"}).paths
    assert read_manifest(paths)["batches_per_epoch"] == plan("first_exhausted").batches_per_epoch
