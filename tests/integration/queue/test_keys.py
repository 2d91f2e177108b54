"""A job's key: held while it is active and through its window, released past it, and taken
back by replay or a keyed enqueue only then, one row for one key under concurrency.

The key statements test the state as ``state || ''`` and a held key as ``key_held IS TRUE``
so that no partial index's predicate matches them (test_lookups_by_key.py). The statements
as they were written before those rewrites are kept here, and the current ones are held to
them on random tables of a few keys (ids sharing a key, holders within and past their
window, active holders, ids that do not exist): ``release``, ``release_for`` then replay's
statement, replay's statement alone and the restore's undo condition give the same rows,
results and conflicts; ``LIMIT 1`` loses nothing, as a key has one holder at most.

Through the API: a holder is released only past its window (each terminal state, never an
active holder); one replay of several keys, two ids sharing one; replay from the history
table, with the key free past the holder's window or taken within it (the row goes back).
Concurrent sessions, each on its own connection and held up on the holder's row lock until
both wait: two replays of two rows sharing a key (one replays); the same while a keyed
enqueue takes the key (neither replays); two keyed enqueues releasing the same expired
holder (one row, both told its id). Waits poll with a deadline.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.db.clock import database_now
from jobs.models import Job
from jobs.queue import (
    NewJob,
    history,
    keys,
    operations,
)
from jobs.queue.enqueue import COPY_AT_LEAST
from tests.support.history import where
from tests.support.keyed_rows import DAY, MINUTE, UP, backend, insert, outcome_of
from tests.support.polling import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


# Its other parts are built by the helpers the current statement is built by.


UNRESTORE_WHERE = re.search(r"WHERE (.*?)\n\s*RETURNING", history.UNRESTORE, re.S)[1]


class Session(threading.Thread):
    """``action()`` on a connection of its own; its backend's pid is known before it runs."""

    def __init__(self, action: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.action = action
        self.pid: int | None = None
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.pid = backend()
            self.result = self.action()
        except BaseException as exc:  # re-raised by outcome()
            self.error = exc
        finally:
            connection.close()

    def outcome(self) -> Any:
        self.join(30)
        assert not self.is_alive(), "a session did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def blocked_behind_me(*actions: Callable[[], Any]) -> list[Session]:
    """Start a session for each action; return once every one waits for a lock."""
    sessions = [Session(action) for action in actions]
    for session in sessions:
        session.start()
    wait_for(
        lambda: all(s.pid or not s.is_alive() for s in sessions),
        15.0,
        what="the sessions' pids",
        interval=0.01,
    )

    def waiting() -> bool:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT count(DISTINCT pid) FROM pg_locks WHERE NOT granted AND pid = ANY(%s)",
                [[s.pid for s in sessions]],
            )
            return cur.fetchone()[0] == len(sessions)

    wait_for(
        lambda: waiting() or any(not s.is_alive() for s in sessions),
        15.0,
        what="both sessions waiting",
        interval=0.01,
    )
    assert all(s.is_alive() for s in sessions), [s.error for s in sessions]
    return sessions


KEYS = [("t1", "k"), ("t1", "k2"), ("t2", "k")]


AGES = {"not finished": None, "5 s": 5.0, "10 min": 10 * MINUTE, "3 days": 3 * DAY}


STATES = ["queued", "running", "succeeded", "failed", "cancelled"]


rows_strategy = st.lists(
    st.tuples(
        st.sampled_from([0, 0, 0, 1, 2]),  # mostly one key: rows sharing it are the point
        st.sampled_from(STATES),
        st.booleans(),
        st.sampled_from(list(AGES)),
    ),
    min_size=1,
    max_size=8,
)


def insert_rows(cur, rows) -> list[int]:
    """The rows drawn, as the schema allows them: an active row holds its key (one turned
    ``failed`` when its key is held already), a finished one holds it if it wants and may."""
    held: set[int] = set()
    ids = []
    for key, state, wants, age in rows:
        active = state in ("queued", "running")
        holds = (active or wants) and key not in held
        if active and not holds:
            state = "failed"
        if holds:
            held.add(key)
        tenant, job_id = KEYS[key]
        ids.append(insert(cur, job_id, state, held=holds, age=AGES[age], tenant=tenant))
    return ids


def _rows_of(cur) -> set[int]:
    return {id_ for (id_,) in cur.fetchall()}


@pytest.mark.django_db
@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=rows_strategy, picks=st.lists(st.integers(0, 9), max_size=6))
# Two free rows of a key and its expired holder, one replayed: the holder is the one found.
@example(
    rows=[
        (0, "failed", False, "3 days"),
        (0, "failed", False, "3 days"),
        (0, "failed", True, "10 min"),
    ],
    picks=[0],
)
# A row holding its own key past its window and a free one, both replayed: they conflict.
@example(rows=[(0, "cancelled", True, "10 min"), (0, "failed", False, "3 days")], picks=[0, 1])
# A holder within its window, an active one, and an id that is no row.
@example(
    rows=[
        (0, "succeeded", True, "5 s"),
        (0, "failed", False, "3 days"),
        (1, "queued", False, "not finished"),
        (1, "failed", False, "3 days"),
        (2, "succeeded", True, "not finished"),
        (2, "failed", False, "3 days"),
    ],
    picks=[1, 3, 5, 9],
)
def test_the_key_statements_act_as_the_key_rules_say_on_any_table_of_a_few_keys(rows, picks):
    """``release``, ``release_for`` then replay's statement (as replay runs them), replay's
    statement alone and the restore's undo condition: the rows and results the rules say."""
    params = keys.window_params()
    model = _modelled(rows)
    with transaction.atomic(), connection.cursor() as cur:
        ids = insert_rows(cur, rows)
        chosen = sorted({ids[p] if p < len(ids) else ids[-1] + 1000 + p for p in picks})
        picked = sorted({p for p in picks if p < len(ids)})
        p = {"ids": chosen, "by": "ops", **params}

        def replay_after(release_for: Callable[[], None]) -> Callable[[], set]:
            def run():
                release_for()
                cur.execute(operations._REPLAY, p)
                return _rows_of(cur)

            return run

        def undo() -> set:
            cur.execute(f"SELECT j.id FROM jobs_job j WHERE {UNRESTORE_WHERE}", p)
            return _rows_of(cur)

        runs = {
            "release": lambda: keys.release(cur, chosen) if chosen else set(),
            "release_for, then replay": replay_after(lambda: keys.release_for(cur, chosen)),
            "replay alone": replay_after(lambda: None),
            "restore's undo": undo,
        }
        for what, run in runs.items():
            expected = _by_the_rules(what, model, picked, params)
            result, after = outcome_of(cur, run)
            if isinstance(result, set):
                result = sorted(ids.index(id_) for id_ in result)
            assert (result, after) == (expected[0], _as_table(ids, expected[1])), what
        transaction.set_rollback(True)


def _modelled(rows) -> list[dict[str, Any]]:
    """The rows :func:`insert_rows` makes of ``rows``, as the key rules read them."""
    held: set[int] = set()
    model = []
    for key, state, wants, age in rows:
        active = state in ("queued", "running")
        holds = (active or wants) and key not in held
        if holds:
            held.add(key)
        model.append(
            {
                "key": key,
                "state": "failed" if active and not holds else state,
                "held": holds,
                "age": AGES[age],
                "attempts": 1,
                "by": "",
            }
        )
    return model


def _window_passed(row: dict[str, Any], params: dict[str, float]) -> bool:
    """A finished row's key may go: past the success window, or the failure window."""
    if row["age"] is None or row["state"] in ("queued", "running"):
        return False
    window = params["success_window" if row["state"] == "succeeded" else "failure_window"]
    return row["age"] >= window


def _by_the_rules(
    what: str, model: list[dict[str, Any]], picked: list[int], params: dict[str, float]
) -> tuple[Any, list[dict[str, Any]]]:
    """What a statement returns (row positions) and the rows after it, by the key rules: a
    key held by a finished row past its window may be released (of the rows picked, or of
    the others sharing their keys before a replay); a failed or cancelled row is replayed
    when no other row holds its key, and two replayed rows of one key meet the key lock."""
    rows = [dict(row) for row in model]
    if what == "restore's undo":
        undone = [i for i in picked if rows[i]["state"] in ("failed", "cancelled")]
        return [i for i in undone if not rows[i]["held"]], rows
    if what == "release":
        released = [i for i in picked if rows[i]["held"] and _window_passed(rows[i], params)]
        for i in released:
            rows[i]["held"] = False
        return released, rows
    if what == "release_for, then replay":
        for j, row in enumerate(rows):
            sharing = any(rows[t]["key"] == row["key"] and t != j for t in picked)
            if sharing and row["held"] and _window_passed(row, params):
                row["held"] = False
    replayed = [
        i
        for i in picked
        if rows[i]["state"] in ("failed", "cancelled")
        and not any(o["held"] and o["key"] == rows[i]["key"] for o in rows if o is not rows[i])
    ]
    if len({rows[i]["key"] for i in replayed}) < len(replayed):
        return "key conflict", [dict(row) for row in model]
    for i in replayed:
        rows[i].update(state="queued", held=True, attempts=0, by="ops", age=None)
    return replayed, rows


def _as_table(ids: list[int], rows: list[dict[str, Any]]) -> list[tuple]:
    """Model rows as :func:`_table` reads the table."""
    return [
        (id_, row["state"], row["held"], row["attempts"], row["by"], row["age"] is None)
        for id_, row in zip(ids, rows, strict=True)
    ]


HOLDERS = [
    # (the holder's state, seconds since it finished, released for the replay)
    ("succeeded", 5.0, False),
    ("succeeded", 2 * DAY, True),
    ("failed", 5.0, False),
    ("failed", 10 * MINUTE, True),
    ("cancelled", 5.0, False),
    ("cancelled", 10 * MINUTE, True),
    ("queued", 2 * DAY, False),  # a replayed row may keep an old finished_at: still active
    ("running", None, False),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("state", "age", "released"), HOLDERS)
def test_replay_takes_a_key_from_its_holder_only_past_the_holders_window(state, age, released):
    with connection.cursor() as cur:
        old = insert(cur, "shared", "failed", held=False, age=3 * DAY)
        holder = insert(cur, "shared", state, held=True, age=age)

    report = queue.replay([old], by="operator")

    rows = {row.pk: row for row in Job.objects.filter(pk__in=[old, holder])}
    if released:
        assert report.replayed == (old,)
        assert (rows[old].state, rows[old].key_held) == ("queued", True)
        assert (rows[holder].state, rows[holder].key_held) == (state, False)
    else:
        assert report.key_taken == (old,) and report.replayed == ()
        assert (rows[old].state, rows[old].key_held) == ("failed", False)
        assert (rows[holder].state, rows[holder].key_held) == (state, True)


@pytest.mark.django_db
@pytest.mark.parametrize("conflict", [True, False], ids=["two free rows of one key", "no conflict"])
def test_one_replay_of_several_keys_releases_each_keys_expired_holder(conflict):
    """Each key's holder is found for each replayed row (``LIMIT 1`` a row): released past its
    window, kept within it; a replayed row holding its own key keeps it; of two free rows of
    one key the first replays (the statement then runs row by row)."""
    with connection.cursor() as cur:
        a1 = insert(cur, "k1", "failed", held=False, age=3 * DAY)
        b1 = insert(cur, "k1", "failed", held=False, age=3 * DAY)
        h1 = insert(cur, "k1", "failed", held=True, age=10 * MINUTE)
        a2 = insert(cur, "k2", "failed", held=False, age=3 * DAY)
        h2 = insert(cur, "k2", "failed", held=True, age=5.0)
        a3 = insert(cur, "k3", "failed", held=False, age=3 * DAY)
        h3 = insert(cur, "k3", "succeeded", held=True, age=2 * DAY)
        b4 = insert(cur, "k4", "failed", held=False, age=3 * DAY)
        a4 = insert(cur, "k4", "failed", held=True, age=5.0)  # holds its own key, within
        b5 = insert(cur, "k5", "failed", held=False, age=3 * DAY)
        a5 = insert(cur, "k5", "cancelled", held=True, age=10 * MINUTE)  # its own, past

    wanted = [a2, a3, a4, b4] + ([a1, b1, a5, b5] if conflict else [])
    report = queue.replay(wanted, by="operator")

    replayed = {a3, a4} | ({a1, b5} if conflict else set())
    assert set(report.replayed) == replayed
    assert set(report.key_taken) == set(wanted) - replayed
    holding = dict(Job.objects.filter(key_held=True).values_list("job_id", "pk"))
    expected = {"k2": h2, "k3": a3, "k4": a4}
    if conflict:
        expected |= {"k1": a1, "k5": b5}
    else:
        expected |= {"k1": h1, "k5": a5}
    assert holding == expected
    assert not Job.objects.get(pk=h3).key_held


@pytest.mark.django_db
@pytest.mark.parametrize("holder_age", [5.0, 10 * MINUTE], ids=["within", "past"])
def test_replay_from_history_takes_the_key_only_past_its_holders_window(holder_age):
    with connection.cursor() as cur:
        old = insert(cur, "from-history", "failed", held=False, age=2 * MINUTE)
    history.archive(now=database_now())
    assert where(old) == "history"
    with connection.cursor() as cur:
        holder = insert(cur, "from-history", "failed", held=True, age=holder_age)

    report = queue.replay([old], by="operator")

    if holder_age > MINUTE:
        assert report.replayed == (old,) and where(old) == "jobs"
        assert Job.objects.get(pk=old).key_held and not Job.objects.get(pk=holder).key_held
    else:
        assert report.key_taken == (old,) and where(old) == "history"  # put back
        assert Job.objects.get(pk=holder).key_held


def test_two_replays_of_rows_sharing_a_key_held_up_on_its_expired_holder_replay_one():
    with connection.cursor() as cur:
        first = insert(cur, "race", "failed", held=False, age=3 * DAY)
        second = insert(cur, "race", "failed", held=False, age=3 * DAY)
        holder = insert(cur, "race", "failed", held=True, age=10 * MINUTE)

    with transaction.atomic():
        Job.objects.select_for_update().get(pk=holder)
        sessions = blocked_behind_me(
            lambda: queue.replay([first], by="one"), lambda: queue.replay([second], by="two")
        )
    reports = [s.outcome() for s in sessions]

    assert sorted(len(r.replayed) for r in reports) == [0, 1]
    assert sorted(len(r.key_taken) for r in reports) == [0, 1]
    [winner] = [id_ for r in reports for id_ in r.replayed]
    assert list(Job.objects.filter(key_held=True).values_list("pk", flat=True)) == [winner]
    assert Job.objects.get(pk=holder).state == "failed"


def test_two_replays_held_up_while_an_enqueue_takes_the_key_replay_neither():
    with connection.cursor() as cur:
        first = insert(cur, "race", "failed", held=False, age=3 * DAY)
        second = insert(cur, "race", "failed", held=False, age=3 * DAY)
        holder = insert(cur, "race", "failed", held=True, age=10 * MINUTE)

    with transaction.atomic():
        taken = queue.enqueue(NewJob(UP, job_id="race"))
        assert taken.created and not Job.objects.get(pk=holder).key_held
        sessions = blocked_behind_me(
            lambda: queue.replay([first], by="one"), lambda: queue.replay([second], by="two")
        )
    reports = [s.outcome() for s in sessions]

    assert [(r.replayed, r.key_taken) for r in reports] == [((), (first,)), ((), (second,))]
    assert list(Job.objects.filter(key_held=True).values_list("pk", flat=True)) == [taken.id]


def test_two_keyed_enqueues_releasing_one_expired_holder_make_one_row():
    with connection.cursor() as cur:
        holder = insert(cur, "again", "succeeded", held=True, age=2 * DAY)

    with transaction.atomic():
        Job.objects.select_for_update().get(pk=holder)
        sessions = blocked_behind_me(
            lambda: queue.enqueue(NewJob(UP, job_id="again")),
            lambda: queue.enqueue(NewJob(UP, job_id="again")),
        )
    results = [s.outcome() for s in sessions]

    assert len({r.id for r in results}) == 1 and sorted(r.created for r in results) == [False, True]
    assert list(Job.objects.filter(key_held=True).values_list("pk", flat=True)) == [results[0].id]
    assert not Job.objects.get(pk=holder).key_held


def _enqueue_keyless(how: str, count: int) -> list[int]:
    jobs = [NewJob(name=UP, payload={"n": n}) for n in range(count)]
    if how == "one":
        return [queue.enqueue(job).id for job in jobs]
    if how == "in a transaction":
        with transaction.atomic():
            return [e.id for e in queue.enqueue_many(jobs)]
    return [e.id for e in queue.enqueue_many(jobs)]  # by COPY from COPY_AT_LEAST jobs on


@pytest.mark.parametrize(
    ("how", "count"),
    [("one", 3), ("in a transaction", 3), ("by copy", COPY_AT_LEAST)],
)
def test_a_keyless_job_stays_out_of_the_key_lock_its_whole_life(how, count):
    """Its generated key can never be presented again: the unique index would guard nothing
    and cost an entry on every insert and claim."""
    keyless = _enqueue_keyless(how, count)
    keyed = queue.enqueue(NewJob(name=UP, job_id="invoice-7")).id

    def holding() -> set[int]:
        return set(Job.objects.filter(key_held=True).values_list("pk", flat=True))

    assert holding() == {keyed}
    claimed = queue.claim([queue.ClaimRequest(UP, count + 1)], scope=queue.AllTenants())
    assert holding() == {keyed}
    for job in claimed:
        assert queue.retry(job, delay=0, code="handler_error")
    assert holding() == {keyed}
    claimed = queue.claim([queue.ClaimRequest(UP, count + 1)], scope=queue.AllTenants())
    for job in claimed:
        assert queue.complete(job)
    assert holding() == {keyed}
    assert set(Job.objects.filter(pk__in=keyless).values_list("state", flat=True)) == {"succeeded"}
