"""Attacks on a daemon per node (--ranks): hostile --ranks values, planted batch files before a
restart, a restart with other ranks under a waiting trainer, `prefetchd verify` of a rank not
served. Real masters (in this process where the `prefetchd` command is not the point), real
trainers, the real tmpfs."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefetchd_client import PrefetchLoader
from prefetchd_client.errors import PlanMismatch
from prefetchd_client.layout import MAX_RANK, parse_batch_name
from prefetchd_client.ranks import format_ranks, parse_ranks
from tests.conftest import cli, wait_until, write_config
from tests.helpers import job_status

pytestmark = pytest.mark.timeout(120)
WORLD = 4


def _limit_memory() -> None:  # in the child: 2 GiB of address space is plenty for a start that fails
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def test_a_long_ranks_string_of_overlapping_ranges_is_refused_fast_and_small(job_root, jpeg_folder, tmp_path):
    """'0-9999,' repeated fits one command-line argument (128 KiB): it used to be expanded into a
    list of 180 million ranks (GBs, a minute) before the duplicate was seen."""
    config = write_config(tmp_path, jpeg_folder, world_size=WORLD)
    ranks = "0-9999," * 18_000 + "0"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "prefetchd", "start", str(config), "--ranks", ranks],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_limit_memory,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--ranks" in result.stderr and "given twice" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr
    assert time.monotonic() - started < 20
    assert not any(job_root.iterdir())


def test_planted_batch_names_that_are_not_canonical_are_not_adopted(serve, jpeg_folder, tmp_path):
    """A batch file renamed or copied under a name the batch-name pattern still matches
    (a trailing newline: '$' matches before it; Unicode digits: '\\d' matches them) was adopted at
    a restart as the batch it names: the ledger counted it ready while the trainer's file name
    (paths.batch) did not exist, so the trainer waited out its timeout; a copy beside the real
    one was never deleted (beyond the bound)."""
    config = write_config(tmp_path, jpeg_folder, world_size=WORLD, batch_size=2, buffer="2M")
    job = serve(config, {"ranks": "0-1"})
    paths = job.paths
    wait_until(lambda: all(r["ready"] >= 3 for r in job_status(paths)["ranks"]), 30, what="batches of ranks 0-1")
    job.stop(keep=True)
    batches = paths.batch_dir
    os.rename(batches / "e000000-s00000000-r0000.batch", batches / "e000000-s00000000-r0000.batch\n")
    shutil.copy(
        batches / "e000000-s00000001-r0001.batch",
        batches / "e\u0660\u0660\u0660\u0660\u0660\u0660-s00000001-r0001.batch",
    )
    paths = serve(config, {"ranks": "0-1"}).paths
    left = sorted(n for n in os.listdir(batches) if parse_batch_name(n) is not None)
    aliases = [n for n in left if paths.batch(*parse_batch_name(n)).name != n]
    assert not aliases, f"adopted under names no trainer reads: {aliases!r}"
    loader = PrefetchLoader("job", rank=0, world_size=WORLD, timeout=15, as_tensors=False)
    try:
        assert next(iter(loader))["index"].shape == (2,)  # made again, not waited for
    finally:
        loader.close()


def test_a_trainer_whose_rank_a_restarted_daemon_no_longer_serves_is_told(serve, jpeg_folder, tmp_path):
    """The node's daemon is restarted with other ranks (0-3, then 2-3) while rank 0's trainer
    runs: the trainer must get the PlanMismatch a new loader gets (naming ranks 2-3), not wait
    out its whole timeout for batches nobody makes (its positions are refused and counted)."""
    config = write_config(tmp_path, jpeg_folder, world_size=WORLD, batch_size=2, buffer="2M")
    job = serve(config, {"ranks": "0-3"})
    loader = PrefetchLoader("job", rank=0, world_size=WORLD, timeout=20, restart_grace=30, as_tensors=False)
    try:
        batches = iter(loader)
        next(batches)
        job.stop(keep=True)
        serve(config, {"ranks": "2-3"})
        started = time.monotonic()
        with pytest.raises(PlanMismatch, match=r"rank 0 is not served .* ranks 2-3"):
            for _ in batches:  # the rest of the epoch, then the next: past what was read ahead
                pass
            for _ in loader:
                pass
        assert time.monotonic() - started < 15
    finally:
        loader.close()


def test_verify_of_a_rank_this_node_does_not_serve_says_so(serve, jpeg_folder, tmp_path):
    config = write_config(tmp_path, jpeg_folder, world_size=WORLD, batch_size=2)
    paths = serve(config, {"ranks": "2-3"}).paths
    wait_until(lambda: job_status(paths)["ranks"][0]["ready"] >= 1, 30, what="a batch of rank 2")
    result = cli("verify", "job", "--epoch", "0", "--step", "0", "--rank", "0")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "not served" in result.stderr and "2-3" in result.stderr, result.stderr
    served = cli("verify", "job", "--epoch", "0", "--step", "0", "--rank", "2")
    assert served.returncode == 0 and "identical" in served.stdout, served.stderr


def _read_ids(root, rank: int, world: int, *, state=None, stop_after=None) -> tuple[list[int], dict]:
    """The sample ids rank reads through the daemon under ``root`` (the rest of epoch 0 from
    ``state``, or its first ``stop_after`` batches) and the state after."""
    loader = PrefetchLoader("job", root=root, rank=rank, world_size=world, timeout=30, as_tensors=False)
    try:
        if state is not None:
            loader.load_state_dict(state)
        ids = []
        for n, batch in enumerate(loader, start=1):
            ids += batch["index"].tolist()
            if n == stop_after:
                break
        return ids, loader.state_dict()
    finally:
        loader.close()


@pytest.mark.long  # CI time: tests/daemon/scaleout/test_scale_out.py resumes two nodes on one always
def test_a_checkpoint_of_two_nodes_resumes_elastically_on_two_nodes_of_another_world(
    node_roots, serve, jpeg_folder, tmp_path
):
    """World 4 (batch 2) on two nodes, ranks 0-1 and 2-3; resumed as world 2 (batch 4, the same
    global batch) on two nodes of one rank each: nothing of epoch 0 is lost or repeated."""
    one, two = node_roots
    config = write_config(tmp_path, jpeg_folder, world_size=WORLD, batch_size=2, seed=3)
    nodes = [serve(config, {"ranks": "0-1"}), serve(config, {"ranks": "2-3"}, root=two)]
    root_of = lambda r: one if r < 2 else two  # noqa: E731
    before = [_read_ids(root_of(r), r, WORLD, stop_after=2) for r in range(WORLD)]
    states = {json.dumps(s, sort_keys=True) for _, s in before}
    assert len(states) == 1, "state_dict() must be the same on every rank"
    state = before[0][1]
    for node in nodes:
        node.stop()
    config = write_config(tmp_path, jpeg_folder, world_size=2, batch_size=4, seed=3)
    serve(config, {"ranks": "0"})
    serve(config, {"ranks": "1"}, root=two)
    after = [_read_ids(one if r == 0 else two, r, 2, state=state)[0] for r in range(2)]
    seen = sum((ids for ids, _ in before), []) + sum(after, [])
    assert sorted(seen) == list(range(48)), "a sample was lost or repeated across nodes and world sizes"
    assert len(after[0]) == len(after[1]) == (48 - 16) // 2  # ranks equal; resumed at global step 2


# -- the --ranks grammar (issue 24, finding 12) -----------------------------------------------
# ' 1' and '1-1' were accepted while '1 - 3', '1 ,2' (a blank before a dash or a comma) and
# others were refused, and '1\n' or '\xa01' (any Unicode space, as str.strip saw it) passed.
# The grammar now (prefetchd_client.ranks): blanks (space, tab) around every item and dash,
# nothing else; a range of one rank everywhere. A reference of it as a regular expression:

_BLANK, _NUMBER = "[ \t]*", "([0-9]{1,8})"
_ITEM = f"{_BLANK}{_NUMBER}{_BLANK}(?:-{_BLANK}{_NUMBER}{_BLANK})?"


def _reference_ranks(text: str) -> tuple[int, ...] | None:
    """What the grammar says ``text`` is: its ranks, sorted, or None for a refusal."""
    if re.fullmatch(f"{_ITEM}(?:,{_ITEM})*", text) is None:
        return None
    ranks: list[int] = []
    for item in text.split(","):
        low, high = re.fullmatch(_ITEM, item).groups()
        low, high = int(low), int(high or low)
        if high < low or high > MAX_RANK:
            return None
        ranks += range(low, high + 1)
    return tuple(sorted(ranks)) if len(set(ranks)) == len(ranks) else None


def _check_against_the_grammar(text: str) -> None:
    expected = _reference_ranks(text)
    if expected is None:
        with pytest.raises(ValueError) as refused:
            parse_ranks(text)
        assert repr(text[:60]) in str(refused.value), f"the refusal does not show the value: {refused.value}"
    else:
        assert parse_ranks(text) == expected
        assert parse_ranks(format_ranks(expected)) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (" 1", (1,)),
        ("1 ", (1,)),
        ("1-1", (1,)),
        (" 1 - 1 ", (1,)),
        ("1 - 3", (1, 2, 3)),
        ("1 ,2", (1, 2)),
        ("\t0-1,\t3 ", (0, 1, 3)),
        ("0003-0004", (3, 4)),
        (f"{MAX_RANK}-{MAX_RANK}", (MAX_RANK,)),
    ],
)
def test_ranks_blanks_anywhere_and_ranges_of_one_rank_are_accepted(text, expected):
    assert parse_ranks(text) == expected
    _check_against_the_grammar(text)


@pytest.mark.parametrize(
    "text",
    ["1\n", "\n1", "\xa01", "1\u20032", "1 2", "1-2-3", "+1", "1,", ",1", "1-", "-", "1_0", "0x1", "１", "1.0", " "],
)
def test_ranks_outside_the_grammar_are_refused_showing_the_value(text):
    _check_against_the_grammar(text)


_RANKS_ALPHABET = "0123456789-, \t\n+\xa0٣²x"
_numbers = st.integers(0, MAX_RANK + 3).map(str) | st.integers(0, 99).map(lambda n: f"{n:04d}")
_blanks = st.text(" \t", max_size=2)
_items = st.tuples(_blanks, _numbers, _blanks, st.none() | st.tuples(_blanks, _numbers, _blanks)).map(
    lambda t: f"{t[0]}{t[1]}{t[2]}" + ("" if t[3] is None else "-" + "".join(t[3]))
)


@settings(max_examples=250, deadline=None)
@given(st.lists(_items, min_size=1, max_size=4).map(",".join) | st.text(_RANKS_ALPHABET, max_size=16) | st.text())
def test_every_ranks_string_is_read_as_the_grammar_says_or_refused_naming_it(text):
    _check_against_the_grammar(text)


def test_a_daemon_serves_the_ranks_of_an_odd_but_valid_ranks_value_and_refuses_a_newline(
    job_root, serve, jpeg_folder, tmp_path
):
    config = write_config(tmp_path, jpeg_folder, world_size=WORLD, batch_size=2)
    refused = cli("start", str(config), "--ranks", "1\n")
    assert refused.returncode == 2, refused.stderr  # CONFIG: a flag's value is invalid
    assert "--ranks" in refused.stderr and r"'1\n'" in refused.stderr and "Traceback" not in refused.stderr
    assert not any(job_root.iterdir())
    paths = serve(config, {"ranks": " 3 - 3 , 1 "}).paths
    assert [r["rank"] for r in job_status(paths)["ranks"]] == [1, 3]
    shown = cli("status", "job")
    assert shown.returncode == 0 and "ranks 1,3 of 4" in shown.stdout, shown.stdout
