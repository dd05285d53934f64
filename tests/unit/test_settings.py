"""Each config key is declared once (prefetchd.settings): its flag, Config's field, the status
echo and the README table all come from that table, and these tests fail when one drifts."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import zmq.auth

from prefetchd import settings
from prefetchd.config import Config, build_config, load_config
from prefetchd.errors import ConfigError
from prefetchd.workers.decoders import resolve_decoder
from tests.conftest import REPO, cli

pytestmark = pytest.mark.timeout(120)

README = REPO / "README.md"
ARRAYS = {"sources", "transforms"}  # Config's fields that are arrays of tables, not keys
# The flags of `start` that are not config keys.
OTHER_FLAGS = {"--data", "--root", "--foreground", "--keep", "--help"}


def curve_files(folder: Path) -> dict[str, str]:
    """A server secret certificate and a folder with one authorised client, as zmq.auth writes them."""
    (folder / "server").mkdir()
    (folder / "authorized").mkdir()
    _, secret = zmq.auth.create_certificates(folder / "server", "server")
    os.chmod(secret, 0o600)  # zmq.auth leaves it to the umask; a secret key must be private
    zmq.auth.create_certificates(folder / "authorized", "client")
    os.unlink(folder / "authorized" / "client.key_secret")
    return {"curve_secret_key": secret, "curve_authorized_keys": str(folder / "authorized")}


def non_default_flags(option: str, tmp_path: Path) -> tuple[dict, object]:
    """Flags that set ``option`` to a valid value other than its default (with the flags it
    needs beside it), and the value Config must then hold."""
    tcp = {"endpoint": "tcp://127.0.0.1:5555"}
    values = {
        "name": ("other", "other"),
        "seed": (7, 7),
        "world_size": (3, 3),
        "ranks": ("0", (0,)),
        "batch_size": (5, 5),
        "mode": ("eval", "eval"),
        "drop_last": (False, False),
        "decoder": ("simplejpeg", "simplejpeg"),
        "buffer": ("3M", 3 << 20),
        "workers": (settings.default_workers() + 1, settings.default_workers() + 1),
        "min_workers": (2, 2),
        "max_workers": (5, 5),
        "node_cpus": (3, 3),
        "cpu_weight": (2.5, 2.5),
        "executor": ("ray", "ray"),
        "ray_address": ("10.0.0.1:6379", "10.0.0.1:6379"),
        "ray_workers": (3, 3),
        "max_ray_workers": (4, 4),
        "ray_resources": ("prep=1,io=0.5", {"prep": 1.0, "io": 0.5}),
        "retain": (5, 5),
        "on_error": ("fail", "fail"),
        "max_bad_rate": (0.5, 0.5),
        "worker_timeout": (7.5, 7.5),
        "store_timeout": (30, 30),
        "max_worker_restarts": (3, 3),
        "worker_nice": (4, 4),
        "on_trainer_exit": ("release", "release"),
        "consumer_timeout": (5, 5),
        "endpoint": ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),
        "metrics": ("9464", "127.0.0.1:9464"),
        "mix": ("first_exhausted", "first_exhausted"),
        "pipeline": ("mypkg.aug:make_sample", "mypkg.aug:make_sample"),
    }
    if option in ("curve_secret_key", "curve_authorized_keys"):  # they go together, and need TCP
        keys = curve_files(tmp_path)
        return {**tcp, **keys}, keys[option]
    assert option in values, f"a new key {option!r}: give this test a valid value other than its default"
    value, expected = values[option]
    return {option: value}, expected


@pytest.mark.parametrize("setting", settings.SETTINGS, ids=lambda s: s.option)
def test_every_flag_reaches_its_config_field(setting, tmp_path):
    if setting.option == "decoder":
        try:
            resolve_decoder("simplejpeg")
        except ImportError:
            pytest.skip("the simplejpeg decoder is not installed")
    flags, expected = non_default_flags(setting.option, tmp_path)
    default = load_config(None, {"data": str(tmp_path)})
    cfg = load_config(None, {"data": str(tmp_path), **flags})
    assert getattr(default, setting.field) != expected, "the test's value is the default: it proves nothing"
    assert getattr(cfg, setting.field) == expected
    changed = {(s.section, s.key) for s in settings.SETTINGS if getattr(cfg, s.field) != getattr(default, s.field)}
    assert changed == {(settings.BY_OPTION[o].section, settings.BY_OPTION[o].key) for o in flags}


def test_every_key_has_a_flag_in_start_help(job_root):
    result = cli("start", "--help", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    shown = set(re.findall(r"--[a-z][a-z-]*", result.stdout))
    expected = {s.flag for s in settings.SETTINGS}
    expected |= {f"--no-{s.flag[2:]}" for s in settings.SETTINGS if s.types == (bool,)}
    assert expected - shown == set(), "keys without a flag"
    assert shown - expected - OTHER_FLAGS == set(), "flags of start that are neither a key nor --data/--root/..."
    assert "[default: 0.25]" in result.stdout and "[default: cores - 1, at least 1]" in result.stdout


def test_config_fields_are_the_table_keys_and_the_arrays():
    fields = {f.name for f in dataclasses.fields(Config)}
    assert fields == {s.field for s in settings.SETTINGS} | ARRAYS
    assert len({s.option for s in settings.SETTINGS}) == len(settings.SETTINGS), "two keys share a flag"
    assert {s.section for s in settings.SETTINGS} == set(settings.SECTIONS)


def test_every_default_passes_its_own_rules():
    for s in settings.SETTINGS:
        if s.default_value() is not None:
            s.validate(s.default_value())


def test_the_echo_is_every_key_with_a_value_a_config_file_accepts(tmp_path):
    cfg = load_config(None, {"data": str(tmp_path), "seed": 3, "buffer": "5M", "mix": "all_once"})
    echoed = settings.echo(cfg)
    tables = {section: keys for section, keys in echoed.items() if section not in ("source", "transform")}
    assert {section: set(keys) for section, keys in tables.items()} == {
        section: set(settings.section_keys(section)) for section in settings.SECTIONS
    }
    assert echoed["daemon"]["buffer"] == 5 << 20 and echoed["mix"]["epoch"] == "all_once"
    assert echoed["transform"] == [{"op": "random_resized_crop", "size": 224}, {"op": "hflip"}]
    assert json.loads(json.dumps(echoed)) == echoed
    # Fed back as a config file, the echo makes the same config.
    raw = {section: {k: v for k, v in keys.items() if v is not None} for section, keys in tables.items()}
    again = build_config(
        {**raw, "source": echoed["source"], "transform": echoed["transform"]}, base=tmp_path, default_name="unused"
    )
    assert again == cfg


def test_the_readme_config_table_is_the_settings_table():
    text = README.read_text()
    found = re.search(r"<!-- settings:begin -->\n(.*?)<!-- settings:end -->", text, re.S)
    assert found, "README.md lacks the <!-- settings:begin --> ... <!-- settings:end --> markers"
    assert found[1] == settings.markdown_table(), (
        "README.md's config table differs from prefetchd.settings: regenerate it with "
        "python -c 'from prefetchd.settings import markdown_table; print(markdown_table())'"
    )


def test_a_flag_named_apart_from_its_key_names_both_in_its_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^--mix / \[mix\] epoch must be one of cycle, .*, got 'forever'$"):
        load_config(None, {"data": str(tmp_path), "mix": "forever"})
    with pytest.raises(ConfigError, match=r"^\[daemon\] retain / --retain must be 0 or more, got -1$"):
        load_config(None, {"data": str(tmp_path), "retain": -1})
