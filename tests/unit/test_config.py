"""Config validation: every mistake gets a message naming the key and the fix."""

from pathlib import Path

import pytest

from prefetchd.config import build_config, content_hash, load_config
from prefetchd.errors import ConfigError
from prefetchd.sizes import parse_size
from tests.conftest import REPO

BASE = {"source": [{"kind": "image_folder", "root": "/data"}], "transform": [{"op": "center_crop", "size": 8}]}


def build(raw=None, **overrides):
    return build_config(BASE | (raw or {}), base=Path("/cfg"), default_name="x", overrides=overrides)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", 0),
        ("1024", 1024),
        ("30G", 30 << 30),
        ("1.5K", 1536),
        ("512m", 512 << 20),
        ("2T", 2 << 40),
        ("4GiB", 4 << 30),
        ("8 MB", 8 << 20),
    ],
)
def test_sizes_are_powers_of_1024(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "30X", "-1G", "1e9", "thirty"])
def test_bad_sizes_say_what_is_accepted(text):
    with pytest.raises(ValueError, match="K, M, G or T"):
        parse_size(text)


def test_every_daemon_key_is_accepted_in_the_file():
    daemon = {
        "buffer": "2G",
        "workers": 3,
        "retain": 4,
        "on_error": "fail",
        "max_bad_rate": 0.5,
        "worker_timeout": 30,
        "max_worker_restarts": 5,
    }
    cfg = build({"daemon": daemon})
    assert (cfg.workers, cfg.retain, cfg.on_error, cfg.max_bad_rate, cfg.worker_timeout, cfg.max_worker_restarts) == (
        3,
        4,
        "fail",
        0.5,
        30.0,
        5,
    )


def test_defaults_and_overrides():
    cfg = build({"job": {"batch_size": 8, "world_size": 2}}, batch_size=16, buffer="2G", seed=5)
    assert (cfg.name, cfg.batch_size, cfg.world_size, cfg.seed, cfg.drop_last) == ("x", 16, 2, 5, True)
    assert cfg.buffer_bytes == 2 << 30
    assert cfg.sources[0]["root"] == "/data"


def test_relative_paths_resolve_against_the_config_folder():
    cfg = build({"source": [{"kind": "file_list", "path": "lists/train.txt"}]})
    assert cfg.sources[0]["path"] == "/cfg/lists/train.txt"


@pytest.mark.parametrize("given", ["auto", "3"])
def test_workers_take_a_count_or_auto_as_a_flag_gives_them(given):
    cfg = build(workers=given, min_workers=2, max_workers=6)
    assert cfg.workers == (3 if given == "3" else "auto")
    assert cfg.worker_range == ((3, 3) if given == "3" else (2, 6))


def test_data_flag_replaces_the_source_root(tmp_path):
    cfg = build(data=str(tmp_path))
    assert cfg.sources[0]["root"] == str(tmp_path)


@pytest.mark.parametrize(
    "raw, overrides, message",
    [
        ({"jobs": {}}, {}, "unknown key 'jobs'"),
        ({"job": {"batchsize": 3}}, {}, r"\[job\]: unknown key 'batchsize'; known keys: batch_size"),
        ({"job": {"batch_size": "8"}}, {}, r"\[job\] batch_size must be int"),
        ({"job": {"world_size": True}}, {}, r"\[job\] world_size must be int"),
        ({}, {"batch_size": 0}, "must be at least 1"),
        ({}, {"buffer": "lots"}, r"--buffer: cannot read 'lots' as a size"),
        ({}, {"workers": 0}, "--workers must be at least 1"),
        ({}, {"workers": "many"}, "--workers: must be a number of workers .* or auto, got 'many'"),
        ({}, {"workers": -2}, "--workers: must be a number of workers"),
        ({"daemon": {"workers": 2.5}}, {}, r"\[daemon\] workers must be str or int"),
        ({}, {"workers": "auto", "min_workers": 4, "max_workers": 2}, r"min_workers .*\(4\) is more than max_workers"),
        ({}, {"min_workers": 0}, "--min-workers must be at least 1"),
        ({}, {"name": "../etc"}, "invalid job name"),
        ({"source": []}, {}, "no data: add a \\[\\[source\\]\\]"),
        ({"source": {"kind": "image_folder"}}, {}, r"write \[\[source\]\]"),
        ({"source": [{"kind": "s3"}]}, {}, "kind must be one of file_list, image_folder"),
        ({"source": [{"root": "/d"}]}, {}, r'\[\[source\]\] #1 has no kind: add kind = "image_folder"'),
        ({"source": [{"kind": "image_folder"}]}, {}, "needs root"),
        ({"source": [{"kind": "image_folder", "root": "/d", "weight": -1}]}, {}, "weight must be a positive finite"),
        ({"source": [{"kind": "image_folder", "root": "/d", "weight": float("inf")}]}, {}, "positive finite number"),
        ({"source": [{"kind": "image_folder", "root": "/d", "wieght": 1}]}, {}, "unknown key 'wieght'"),
        (
            {"source": [{"kind": "image_folder", "root": "/a", "weight": 1}, {"kind": "image_folder", "root": "/b"}]},
            {},
            "give every \\[\\[source\\]\\] a weight, or none",
        ),
        (
            {
                "source": [
                    {"kind": "image_folder", "root": "/a", "name": "x"},
                    {"kind": "image_folder", "root": "/b", "name": "x"},
                ]
            },
            {},
            "names must be unique",
        ),
        ({"mix": {"epoch": "forever"}}, {}, "epoch must be one of cycle, first_exhausted, all_once"),
        ({"transform": [{"op": "blur"}]}, {}, "unknown transform op 'blur'"),
        ({"transform": [{"op": "random_crop", "sise": 3}]}, {}, "unknown key 'sise'"),
        ({"transform": [{"op": "hflip"}]}, {}, "fixed"),
        ({"pipeline": {"callable": "nocolon"}}, {}, "package.module:function"),
        ({"pipeline": {"callable": "a:b", "extra": 1}}, {}, "unknown key 'extra'"),
        # found by attacking the source registry: a traceback each before
        ({"source": [1]}, {"data": "/d"}, r"\[\[source\]\] #1 must be a table"),
        ({"source": [{"kind": "image_folder", "root": "~pfd-no-such-user/x"}]}, {}, "cannot resolve the path"),
        ({}, {"data": "~pfd-no-such-user/x"}, "cannot resolve the path '~pfd-no-such-user/x'"),
    ],
)
def test_invalid_configs_name_the_problem(raw, overrides, message):
    with pytest.raises(ConfigError, match=message):
        build(raw, **overrides)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[job\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_shipped_configs_are_valid():
    root = REPO / "configs"
    imagenet = load_config(root / "imagenet.toml")
    assert [t["op"] for t in imagenet.transforms] == ["resize_short", "random_crop", "hflip", "color_jitter"]
    assert imagenet.transforms[0] == {"op": "resize_short", "min": 256, "max": 480}
    demo = load_config(root / "demo.toml")
    from prefetchd.cli.demo import DEMO_TRANSFORMS

    assert list(demo.transforms) == DEMO_TRANSFORMS


def test_content_identity_changes_with_what_decides_content():
    a = build()
    same = build(buffer="9G", workers=7, world_size=4, batch_size=3)  # layout, not content
    assert a.content(10, "d", 2) == same.content(10, "d", 2)
    assert a.content(10, "d", 2) != build(seed=1).content(10, "d", 2)
    assert a.content(10, "d", 2) != a.content(10, "other data", 2)
    assert (
        a.content(10, "d", 2)["augment"]
        != build({"transform": [{"op": "center_crop", "size": 9}]}).content(10, "d", 2)["augment"]
    )
    assert content_hash(a.content(10, "d", 2)) != content_hash(a.content(11, "d", 2))
    assert a.content(10, "d", 2) != a.content(10, "d", 1)  # another shuffle: a state's position names other samples


@pytest.mark.parametrize("section", ["job", "daemon", "mix", "pipeline"])
def test_a_section_that_is_not_a_table_names_the_fix(section):
    with pytest.raises(ConfigError, match=rf"{section} must be a table: write \[{section}\]"):
        build({section: 5})


def test_pipeline_flag_without_a_config_file_replaces_the_default_transforms(tmp_path):
    assert load_config(None, {"data": str(tmp_path)}).transforms  # the default crop
    cfg = load_config(None, {"data": str(tmp_path), "pipeline": "mypkg.aug:make_sample"})
    assert (cfg.pipeline, cfg.transforms) == ("mypkg.aug:make_sample", ())
    with pytest.raises(ConfigError, match=r"use either \[pipeline\] callable \(--pipeline\) or \[\[transform\]\]"):
        build(pipeline="mypkg.aug:make_sample")  # BASE has [[transform]] entries


def test_a_config_without_transforms_gets_the_default_of_its_mode_as_no_config_does():
    """issue 27: one default pipeline, whether a config names transforms or there is no config."""
    from prefetchd.config import DEFAULT_EVAL_TRANSFORMS, DEFAULT_TRANSFORMS

    no_transform = {k: v for k, v in BASE.items() if k != "transform"}
    config = build_config(no_transform, base=Path("/cfg"), default_name="x")
    assert config.transforms == DEFAULT_TRANSFORMS == load_config(None, {"data": "/d"}).transforms
    evaluation = build_config(no_transform | {"job": {"mode": "eval"}}, base=Path("/cfg"), default_name="x")
    no_config = load_config(None, {"data": "/d", "mode": "eval"})
    assert evaluation.transforms == DEFAULT_EVAL_TRANSFORMS == no_config.transforms
    callable_ = build_config(no_transform, base=Path("/cfg"), default_name="x", overrides={"pipeline": "m:f"})
    assert callable_.transforms == ()
    with pytest.raises(ConfigError, match="fixed output size"):  # an explicit empty list is not the default
        build_config(no_transform | {"transform": []}, base=Path("/cfg"), default_name="x")
