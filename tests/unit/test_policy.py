"""The job's policies, without processes: an explicit clock, the messages and exit codes a user sees."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefetchd.errors import DaemonStop, ExitCode
from prefetchd.master.policy import BadSampleBudget, NoSpaceBackoff, Refusals, RestartBudget, TaskRetries

LOG = "/dev/shm/prefetchd-0/job/daemon.log"
TASK, NAME = (1, 3), "e0 s3 r1"
MAKING = " (last seen at sample 5, /data/x.jpg)"


# -- the worker restart window ------------------------------------------------------------------


def test_deaths_spread_over_more_than_the_window_do_not_stop():
    budget = RestartBudget(20, LOG)
    budget.note_death(0.0, -9)
    for i in range(20):  # 21 deaths in all, but the first slid out before the last came
        budget.note_death(60.5 + i * 0.025, -9)
    assert budget.recent == 20


def test_one_death_more_than_allowed_within_the_window_stops():
    budget = RestartBudget(20, LOG)
    budget.note_death(0.0, -9)
    for _ in range(19):
        budget.note_death(30.0, -9)
    with pytest.raises(DaemonStop) as stop:
        budget.note_death(60.0, 1)  # 60 s after the first: still within the window
    assert stop.value.exit_code == ExitCode.WORKER_CRASHES
    assert str(stop.value) == (
        f"21 workers died within 60 s (last exit code 1); stopping instead of restarting forever; see {LOG}"
    )


def test_no_restarts_allowed_stops_at_the_first_death():
    with pytest.raises(DaemonStop, match=r"1 workers died within 60 s \(last exit code None\)"):
        RestartBudget(0, LOG).note_death(5.0, None)


@given(
    max_restarts=st.integers(0, 6),
    gaps=st.lists(st.integers(0, 40).map(lambda quarters: quarters / 4), min_size=1, max_size=40),
)
def test_the_window_counts_what_a_brute_force_count_does(max_restarts, gaps):
    """Deaths at non-decreasing times (a monotonic clock), gaps in quarter seconds so that deaths
    fall exactly on the window's edge: ``recent`` is the number of deaths in [now - 60 s, now],
    and the budget stops at the first death that brings it past --max-worker-restarts."""
    budget = RestartBudget(max_restarts, LOG)
    times, now = [], 0.0
    for gap in gaps:
        now += gap
        times.append(now)
        in_window = sum(1 for t in times if t >= now - 60.0)
        if in_window > max_restarts:
            with pytest.raises(DaemonStop, match=f"^{in_window} workers died within 60 s"):
                budget.note_death(now, -9)
            return
        budget.note_death(now, -9)
        assert budget.recent == in_window


# -- task retries -------------------------------------------------------------------------------


def test_a_failed_task_backs_off_longer_each_attempt_and_stops_at_the_third():
    retries = TaskRetries(LOG, worker_timeout=2.0)
    assert retries.may_start(TASK, 0.0)
    assert retries.failed(TASK, NAME, "Traceback\n  ...\nOSError: first", 10.0) == 1
    assert not retries.may_start(TASK, 10.49)
    assert retries.may_start((0, 3), 10.1), "another task does not wait"
    assert retries.may_start(TASK, 10.5)
    assert retries.failed(TASK, NAME, "OSError: second", 20.0) == 2
    assert retries.attempts_made(TASK) == 2
    assert not retries.may_start(TASK, 20.99)
    assert retries.may_start(TASK, 21.0)
    with pytest.raises(DaemonStop) as stop:
        retries.failed(TASK, NAME, "Traceback (most recent call last):\n  File x\nValueError: boom\n\n", 30.0)
    assert stop.value.exit_code == ExitCode.TASK_ERROR
    assert str(stop.value) == "batch e0 s3 r1 failed 3 times: ValueError: boom"


def test_hangs_are_failed_attempts_and_stop_with_the_timeout_in_the_message():
    retries = TaskRetries(LOG, worker_timeout=2.0)
    retries.failed(TASK, NAME, "OSError: x", 0.0)  # failures and hangs spend the same attempts
    retries.hung(TASK, NAME, "")
    with pytest.raises(DaemonStop) as stop:
        retries.hung(TASK, NAME, MAKING)
    assert stop.value.exit_code == ExitCode.TASK_ERROR
    message = str(stop.value)
    assert message.startswith(f"batch e0 s3 r1 made no progress within --worker-timeout 2 s, 3 times{MAKING}: ")
    assert "raise --worker-timeout above the slowest sample" in message and message.endswith(f"see {LOG}")


def test_deaths_are_counted_apart_from_attempts():
    retries = TaskRetries(LOG, worker_timeout=2.5)
    for _ in range(4):
        retries.died(TASK, NAME, -9, "")
    retries.hung(TASK, NAME, "")
    retries.hung(TASK, NAME, "")  # two hangs and four deaths: neither is spent
    with pytest.raises(DaemonStop) as stop:
        retries.died(TASK, NAME, -11, MAKING)
    assert stop.value.exit_code == ExitCode.WORKER_CRASHES
    assert str(stop.value).startswith(f"the worker making batch e0 s3 r1 died 5 times (last exit code -11){MAKING}: ")
    assert str(stop.value).endswith(f"see {LOG}")


def test_counts_are_per_task():
    retries = TaskRetries(LOG, worker_timeout=1.0)
    for rank in range(4):
        retries.failed((rank, 7), f"e0 s7 r{rank}", "OSError: x", 0.0)
        retries.failed((rank, 7), f"e0 s7 r{rank}", "OSError: x", 1.0)
        for _ in range(4):
            retries.died((rank, 7), f"e0 s7 r{rank}", -9, "")
    assert [retries.attempts_made((rank, 7)) for rank in range(4)] == [2, 2, 2, 2]


def test_a_published_task_starts_its_counts_again():
    retries = TaskRetries(LOG, worker_timeout=2.0)
    for _ in range(2):
        retries.failed(TASK, NAME, "OSError: x", 0.0)
    for _ in range(4):
        retries.died(TASK, NAME, -9, "")
    retries.published(TASK)
    assert retries.attempts_made(TASK) == 0
    assert retries.may_start(TASK, 0.0), "its back-off is forgotten too"
    for _ in range(2):
        retries.failed(TASK, NAME, "OSError: x", 5.0)
    for _ in range(4):
        retries.died(TASK, NAME, -9, "")
    with pytest.raises(DaemonStop, match="failed 3 times"):
        retries.failed(TASK, NAME, "OSError: x", 9.0)


def test_the_limits_are_parameters():
    retries = TaskRetries(LOG, worker_timeout=1.0, attempts=1, deaths=2)
    retries.died(TASK, NAME, -9, "")
    with pytest.raises(DaemonStop, match="died 2 times"):
        retries.died(TASK, NAME, -9, "")
    with pytest.raises(DaemonStop, match="failed 1 times: x"):
        retries.failed(TASK, NAME, "x", 0.0)


# -- the bad-sample budget ----------------------------------------------------------------------


def replaced(n: int) -> list[dict]:
    return [{"index": i, "path": f"/data/{i}.jpg", "error": "not an image", "replacement": i + 1} for i in range(n)]


def test_a_long_run_of_unreadable_samples_stops_at_once():
    budget = BadSampleBudget(max_rate=1.0, log=LOG)
    budget.add_batch(128, replaced(63), longest_bad_run=63)  # one short of the run: the rate allows all
    with pytest.raises(DaemonStop) as stop:
        budget.add_batch(128, replaced(64), longest_bad_run=64)
    assert stop.value.exit_code == ExitCode.BAD_DATA
    assert str(stop.value) == (
        f"64 unreadable samples in a row (the last: /data/63.jpg: not an image); is the data intact? see {LOG}"
    )
    assert (budget.samples, budget.bad) == (256, 127)


def test_a_long_run_recorded_in_the_short_form_still_stops_with_what_it_has():
    budget = BadSampleBudget(max_rate=1.0, log=LOG)
    short_form = [{"slot": i, "index": i, "replacement": i + 1} for i in range(64)]  # no path, no error
    with pytest.raises(DaemonStop, match=r"64 unreadable samples in a row \(the last: \?\)"):
        budget.add_batch(128, short_form, longest_bad_run=64)


def test_the_rate_is_judged_only_over_enough_samples():
    budget = BadSampleBudget(max_rate=0.1, log=LOG)
    for _ in range(9):
        budget.add_batch(100, replaced(11), longest_bad_run=1)  # 11 % bad, over 900 samples: not judged yet
    assert (budget.samples, budget.bad) == (900, 99)
    with pytest.raises(DaemonStop) as stop:
        budget.add_batch(100, replaced(11), longest_bad_run=1)
    assert stop.value.exit_code == ExitCode.BAD_DATA
    assert str(stop.value) == (
        f"110 of 1000 samples were unreadable, more than --max-bad-rate 0.1; see {LOG} for their paths"
    )


def test_a_rate_exactly_at_the_limit_goes_on():
    budget = BadSampleBudget(max_rate=0.1, log=LOG)
    for _ in range(20):
        budget.add_batch(100, replaced(10), longest_bad_run=1)
    assert (budget.samples, budget.bad) == (2000, 200)


def test_an_unreported_batch_counts_its_samples_unjudged():
    budget = BadSampleBudget(max_rate=0.1, log=LOG, min_samples=100)
    budget.add_batch(50, replaced(20), longest_bad_run=1)  # 40 %, below min_samples
    budget.add_unreported_batch(50)  # reaches min_samples, but only a report is judged
    assert (budget.samples, budget.bad) == (100, 20)
    with pytest.raises(DaemonStop, match="20 of 150 samples"):
        budget.add_batch(50, [], longest_bad_run=0)


@given(
    max_rate=st.sampled_from([0.0, 0.01, 0.1, 0.5]),
    batches=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 300)), min_size=1, max_size=30),
)
def test_the_budget_stops_exactly_when_the_rule_says(max_rate, batches):
    budget = BadSampleBudget(max_rate=max_rate, log=LOG)
    samples = bad = 0
    for size, n_bad in batches:
        n_bad = min(n_bad, size)
        samples, bad = samples + size, bad + n_bad
        run = min(n_bad, 70)
        should_stop = run >= 64 or (samples >= 1000 and bad > max_rate * samples)
        if should_stop:
            with pytest.raises(DaemonStop):
                budget.add_batch(size, replaced(n_bad), run)
            return
        budget.add_batch(size, replaced(n_bad), run)
        assert (budget.samples, budget.bad) == (samples, bad)


# -- the full-tmpfs back-off --------------------------------------------------------------------


def test_the_back_off_doubles_up_to_its_cap():
    backoff = NoSpaceBackoff()
    assert not backoff.backing_off and not backoff.waiting(0.0)
    delays, now = [], 100.0
    for attempt in range(8):
        assert backoff.full(now) is (attempt == 0), "only the first full tmpfs starts a back-off"
        assert backoff.backing_off
        waited = 0.0
        while backoff.waiting(now + waited):
            waited = round(waited + 0.05, 2)
        delays.append(waited)
        now += waited
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]


def test_space_back_ends_the_back_off_and_the_next_starts_short():
    backoff = NoSpaceBackoff()
    assert not backoff.space_back(), "no back-off to end"
    for now in (0.0, 0.1, 0.3, 0.7):
        backoff.full(now)
    assert backoff.space_back() and not backoff.backing_off
    assert not backoff.space_back(), "ended once"
    assert backoff.waiting(1.49), "the wait already begun runs out (until 0.7 + 0.8 s)"
    assert not backoff.waiting(1.5)
    assert backoff.full(10.0), "a new back-off, logged again"
    assert backoff.waiting(10.09) and not backoff.waiting(10.1)


# -- refusals -----------------------------------------------------------------------------------


def test_refusals_log_the_first_ten_of_each_kind_then_a_summary_a_minute():
    refusals = Refusals()
    lines = [refusals.note("progress_file", f"bad {i}", 100.0) for i in range(10)]
    assert lines == [f"refused a progress file: bad {i}" for i in range(10)]
    assert refusals.note("progress_file", "bad 10", 100.0) == "refused so far: {'progress_file': 11} (last: bad 10)"
    assert [refusals.note("progress_file", "again", 100.0 + s) for s in (1, 30, 59.9)] == [None] * 3
    assert refusals.note("message", "1 frames, expected one", 120.0) == "refused a message: 1 frames, expected one"
    assert refusals.note("progress_file", "late", 160.0) == (
        "refused so far: {'progress_file': 15, 'message': 1} (last: late)"
    )
    assert refusals.note("progress_file", "late", 200.0) is None
    assert refusals.counts == {"progress_file": 16, "message": 1}


def test_every_refusal_is_counted_though_few_are_logged():
    refusals = Refusals()
    logged = [refusals.note(kind, "x", t / 10) for t in range(600) for kind in ("position", "trainer_lock")]
    assert refusals.counts == {"position": 600, "trainer_lock": 600}
    assert sum(line is not None for line in logged) == 2 * 10 + 1  # the first summary, and no minute has passed
    assert logged[1] == "refused a trainer lock: x"
