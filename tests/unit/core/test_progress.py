"""Progress reports without a database: the checks, the context's memory, the stored shape."""

from __future__ import annotations

import logging
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobs import JobContext
from jobs.core.progress import COUNT_MAX, NOTE_MAX, Progress, read, report


def context(attempt: int = 1) -> JobContext:
    return JobContext(
        id=1,
        job_id="j-1",
        name="test.progress.v1",
        tenant="default",
        attempt=attempt,
        max_attempts=3,
        timeout=5.0,
        logger=logging.LoggerAdapter(logging.getLogger("test")),
    )


@pytest.mark.parametrize(
    "args,error,message",
    [
        (("3",), TypeError, "done must be an int, not str"),
        ((True,), TypeError, "done must be an int, not bool"),
        ((1.5,), TypeError, "done must be an int, not float"),
        ((1, 2.0), TypeError, "total must be an int, not float"),
        ((1, 2, None), TypeError, "note must be a str, not NoneType"),
        ((-1,), ValueError, r"done must not be negative \(got -1\)"),
        ((0, -2), ValueError, r"total must not be negative \(got -2\)"),
        ((11, 10), ValueError, r"done \(11\) is more than total \(10\)"),
        ((COUNT_MAX + 1,), ValueError, "done must be at most"),
    ],
)
def test_a_bad_report_is_refused_with_a_message_naming_the_value(args, error, message):
    ctx = context()
    with pytest.raises(error, match=message):
        ctx.progress(*args)
    assert ctx.last_progress is None and ctx.unsent_progress() is None


def test_a_long_note_is_cut_and_the_attempt_is_recorded():
    ctx = context(attempt=2)
    ctx.progress(3, 10, "x" * 500)
    assert ctx.last_progress == Progress(3, 10, "x" * NOTE_MAX, attempt=2)
    assert ctx.last_progress.percent == 30


def test_an_attempt_a_handler_overwrote_is_left_out():
    ctx = context()
    ctx.attempt = object()  # type: ignore[assignment]
    ctx.progress(1, 2)
    assert ctx.last_progress.attempt is None
    assert ctx.last_progress.as_json() == {"done": 1, "total": 2, "note": ""}


def test_only_the_latest_report_is_kept_and_each_is_handed_over_once():
    ctx = context()
    for done in range(1000):
        ctx.progress(done, 1000)
    number, latest = ctx.unsent_progress()
    assert latest.done == 999
    ctx.progress_sent(number)
    assert ctx.unsent_progress() is None
    ctx.progress(1000, 1000, "done")
    newer, latest = ctx.unsent_progress()
    assert newer > number and latest.note == "done"
    ctx.progress_sent(number)  # an older renewal's acknowledgement does not hide the newer one
    assert ctx.unsent_progress() == (newer, latest)


def test_reports_from_many_threads_leave_one_consistent_latest_report():
    ctx = context()

    def report_many(offset: int) -> None:
        for done in range(500):
            ctx.progress(done, 500, f"thread {offset}")

    threads = [threading.Thread(target=report_many, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    number, latest = ctx.unsent_progress()
    assert number == 2000
    assert latest.done == 499 and latest.note.startswith("thread ")


@given(
    done=st.one_of(st.integers(), st.booleans(), st.floats(), st.text(max_size=3), st.none()),
    total=st.one_of(st.none(), st.integers(), st.booleans(), st.floats()),
    note=st.one_of(st.text(max_size=400), st.integers(), st.none()),
)
def test_every_report_is_either_refused_or_stored_whole(done, total, note):
    def valid_count(value):
        return type(value) is int and 0 <= value <= COUNT_MAX

    expected_ok = (
        valid_count(done)
        and (total is None or (valid_count(total) and done <= total))
        and isinstance(note, str)
    )
    try:
        made = report(done, total, note, attempt=1)
    except (TypeError, ValueError) as exc:
        assert not expected_ok, exc
        assert str(exc).startswith("progress: ")
        return
    assert expected_ok
    assert (made.done, made.total, made.note) == (done, total, note[:NOTE_MAX])
    assert made.percent is None or 0 <= made.percent <= 100
    assert read(made.as_json()) == made  # what the column stores reads back the same


@given(
    value=st.one_of(
        st.none(),
        st.integers(),
        st.text(max_size=5),
        st.dictionaries(
            st.sampled_from(["done", "total", "note", "attempt", "other"]),
            st.one_of(st.none(), st.integers(), st.text(max_size=5), st.booleans(), st.floats()),
        ),
    )
)
def test_any_stored_value_reads_as_a_sound_report_or_none(value):
    found = read(value)
    if found is not None:
        assert found.done >= 0 and (found.total is None or found.done <= found.total)
        assert isinstance(found.note, str) and len(found.note) <= NOTE_MAX
