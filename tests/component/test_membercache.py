"""A full member cache makes room by the plan's next use: the entries needed last go first, only
for an entry needed sooner, and the bound always holds (sources.membercache)."""

from pathlib import Path

from prefetchd.sources.membercache import MemberCache

URL, IDENTITY, SIZE = "s3://bucket/train-000.tar", [10_000, '"etag"', ""], 200


def put(cache: MemberCache, n: int, next_use: int) -> None:
    cache.put(URL, IDENTITY, n * SIZE, (n + 1) * SIZE, bytes([n]) * SIZE, next_use)


def held(folder: Path) -> dict[int, int]:
    """Each entry's first byte (which put made it) -> its next use."""
    return {p.read_bytes()[0]: p.stat().st_mtime_ns for p in folder.iterdir() if not p.name.startswith(".")}


def held_entries(folder: Path) -> dict[int, int]:
    """held(), of the cache's own entries only (names of 40 hex digits)."""
    return {
        p.read_bytes()[0]: p.stat().st_mtime_ns
        for p in folder.iterdir()
        if len(p.name) == 40 and all(c in "0123456789abcdef" for c in p.name)
    }


def ledger(folder: Path) -> int:
    return int((folder / ".bytes").read_text())


def test_a_full_cache_evicts_the_entries_needed_last_and_only_for_one_needed_sooner(tmp_path):
    folder = tmp_path / "mc"
    cache = MemberCache(str(folder), bound=5 * SIZE)
    for n, use in enumerate([500, 100, 900, 300, 950]):
        put(cache, n, use)
    assert held(folder) == {0: 500, 1: 100, 2: 900, 3: 300, 4: 950} and ledger(folder) == 5 * SIZE
    put(cache, 5, 400)  # full: the entries needed last (950, then 900 for some room ahead) make room
    assert held(folder) == {0: 500, 1: 100, 3: 300, 5: 400}
    put(cache, 6, 990)
    put(cache, 7, 995)  # full, and needed after every entry held: not written
    assert held(folder) == {0: 500, 1: 100, 3: 300, 5: 400, 6: 990} and ledger(folder) == 5 * SIZE
    put(cache, 8, 200)  # needed sooner: 990 and 500 go
    assert held(folder) == {1: 100, 3: 300, 5: 400, 8: 200}
    assert ledger(folder) == sum(p.stat().st_size for p in folder.iterdir() if not p.name.startswith("."))


def test_a_hit_moves_an_entry_to_its_next_use(tmp_path):
    folder = tmp_path / "mc"
    cache = MemberCache(str(folder), bound=3 * SIZE)
    for n, use in enumerate([10, 20, 30]):
        put(cache, n, use)
    assert cache.get(URL, IDENTITY, 0, SIZE, next_use=1000) == bytes([0]) * SIZE  # read, needed next at 1000
    put(cache, 3, 40)
    assert held(folder) == {1: 20, 2: 30, 3: 40}  # the entry just read, needed last now, made the room


def test_entries_without_a_plan_position_go_before_any_the_plan_places(tmp_path):
    folder = tmp_path / "mc"
    cache = MemberCache(str(folder), bound=2 * SIZE)
    put(cache, 0, 10)
    cache.put(URL, IDENTITY, SIZE, 2 * SIZE, bytes([1]) * SIZE)  # no next use given: a stand-in's read
    put(cache, 2, 10**15)  # far off, but placed: the unplaced one goes
    assert held(folder) == {0: 10, 2: 10**15}


def test_an_entry_whose_next_use_has_passed_goes_first(tmp_path):
    folder = tmp_path / "mc"
    cache = MemberCache(str(folder), bound=3 * SIZE)
    put(cache, 0, 10)  # needed at 10, but not read there (a sample drop_last left out)
    put(cache, 1, 500)
    put(cache, 3, 450)
    cache.put(URL, IDENTITY, 2 * SIZE, 3 * SIZE, bytes([2]) * SIZE, next_use=400, now=100)
    assert held(folder) == {2: 400, 3: 450}  # the passed one first, then the one needed last


def test_a_folder_or_a_file_not_of_the_cache_is_neither_counted_nor_removed(tmp_path):
    """A cache on a disk of its own has lost+found: eviction stopped for good on it (unlink of a
    folder), and a file of someone else's was removed and subtracted from a ledger that never
    counted it."""
    folder = tmp_path / "mc"
    cache = MemberCache(str(folder), bound=3 * SIZE)
    (folder / "lost+found").mkdir()
    (folder / "notes.txt").write_bytes(b"x" * 50_000)
    for n, use in enumerate([10, 20, 30]):
        put(cache, n, use)
    put(cache, 3, 5)  # needed first: room is made (30, then 20 for some room ahead)
    assert held_entries(folder) == {0: 10, 3: 5} and ledger(folder) == 2 * SIZE
    assert (folder / "lost+found").is_dir() and (folder / "notes.txt").stat().st_size == 50_000


def test_two_workers_writing_one_range_count_it_once(tmp_path):
    folder = tmp_path / "mc"
    first, second = MemberCache(str(folder), bound=10 * SIZE), MemberCache(str(folder), bound=10 * SIZE)
    put(first, 0, 5)
    put(second, 0, 5)  # missed by both, read by both: one entry, counted once
    assert held_entries(folder) == {0: 5} and ledger(folder) == SIZE


def test_a_ledger_that_is_not_a_count_is_counted_afresh_from_the_entries(tmp_path):
    folder = tmp_path / "mc"
    cache = MemberCache(str(folder), bound=3 * SIZE)
    for n in range(3):
        put(cache, n, 10 + n)
    (folder / ".bytes").write_text("-99999999")  # or gone: the entries would grow past the bound
    put(cache, 3, 1)
    assert held_entries(folder) == {0: 10, 3: 1} and ledger(folder) == 2 * SIZE
