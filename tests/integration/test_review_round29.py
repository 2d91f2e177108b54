"""Review round 29: a6826fa and c4425ce, look-ups of jobs by id planned by key whatever the
statistics (``state || ''``, ``key_held IS TRUE``, ``LATERAL … LIMIT 1`` in
``keys.release_for``, ``OFFSET 0`` in replay's key check, migration 0024's settle function).

Semantics, pinned (passing):

* ``state`` and ``key_held`` are NOT NULL and ``state`` compares under a deterministic
  collation, so ``state || ''`` and ``key_held IS TRUE`` test what ``state`` and
  ``key_held`` did for every value the schema allows;
* the old and new ``keys.release``, ``keys.release_for`` (then replay's statement),
  replay's statement alone and the restore's undo condition give the same rows, results and
  conflicts on random tables of a few keys (ids sharing a key, holders within and past their
  window, active holders, ids that do not exist): ``LIMIT 1`` loses nothing, as a key has
  one holder at most;
* the old (0013) and new (0024) settle functions leave the same rows after random
  dependency graphs and outcomes, the old one installed in a savepoint on the same
  connection;
* through the API: a holder is released only past its window (each terminal state, never an
  active holder); one replay of several keys, two ids sharing one; replay from the history
  table, with the key free past the holder's window or taken within it (the row goes back);
  success releasing waiting jobs, failure ending a chain (``fail`` and ``cancel`` edges), a
  diamond ending once by its lowest upstream's edge; ``migrate jobs 0023`` and forward on one
  connection with settles between, each definition in effect at once;
* concurrency, each session on its own connection, held up on the holder's row lock until
  both wait: two replays of two rows sharing a key (one replays); the same while a keyed
  enqueue takes the key (neither replays); two keyed enqueues releasing the same expired
  holder (one row, both told its id).

Plans (auto_explain, actual rows and buffers of every read of the jobs table): the claim
checks, the settle trigger, reckon, replay (its release, key check and restore's undo) and
the keyed enqueue's release read a few rows and pages, under statistics taken when the state
they test was empty AND under fresh statistics (no rewritten statement now reads another
index whole, nor any partial index at all). With the primary key dropped and sequential
scans disabled, no rewritten statement can use a partial index: ``state || ''`` and
``key_held IS TRUE`` imply no index's predicate (the terminal index's ``state IN (…)``,
the key lock's ``key_held``), so no statistics can steer them there.

Defects of the class the commits fix, in statements they left alone, all fixed since (the
state tested as ``state || ''``; the report statement skipped when every job replayed):

* ``run_now`` (``state = 'queued'``) reads the claim index whole under statistics taken when
  nothing was queued, when the backlog is delayed: the id is an Index Cond on the claim
  index's last column, so the heap rows stay few (the metric of
  ``test_lookups_by_key.py``, whose run_now test passes only because its backlog is due
  now) while every index entry past now is read;
* ``cancel_running`` (``state = ANY(ARRAY['running'])``) reads the running index whole under
  statistics taken when nothing was running: every job the fleet holds;
* ``replay``'s report statement (``SELECT … WHERE id = ANY(rest)``) runs with ``rest``
  empty when every job replayed (the usual case): ``id = ANY('{}')`` is then only a filter,
  on whichever partial index the statistics say is smallest, and under statistics taken
  when nothing was running it reads the running index whole, every job the fleet holds.

Waits poll with a deadline.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.db.clock import database_now
from jobs.models import WAITING_UNTIL, Job, JobHistory
from jobs.queue import (
    AllTenants,
    ClaimRequest,
    NewJob,
    Outcome,
    attempts,
    effects,
    flow,
    history,
    keys,
    operations,
)
from jobs.queue.renewal import next_attempt
from tests.integration.test_pgbouncer import wait_for
from tests.integration.test_review_round22 import explained_nested_statements
from tests.support.workflows import settle

pytestmark = pytest.mark.django_db(transaction=True)

M13 = importlib.import_module("jobs.migrations.0013_settle_chains")
M24 = importlib.import_module("jobs.migrations.0024_settle_by_key")
M25 = importlib.import_module("jobs.migrations.0025_dependents_release")
# The trigger function that settled waiting jobs in the statement (0010 to 0024).
SETTLED_IN_STATEMENT = M25.SETTLED_IN_STATEMENT


BACKLOG = 20_000
BACKLOG_NAME = "test.review29.backlog.v1"
UP, DOWN, MINE = "test.noop.v1", "test.after.v1", "test.review29.mine.v1"
MOST = 10  # rows a read of a few jobs may look at
BLOCKS = 40  # pages it may touch (a whole index of the backlog is well over a hundred)
SECOND = 1.0
MINUTE, DAY = 60 * SECOND, 86_400 * SECOND


# --- The statements as they were before the two commits (f7d7598), written out -------------

OLD_WINDOW_PASSED = """(
    (j.state = 'succeeded'
     AND j.finished_at <= statement_timestamp() - make_interval(secs => %(success_window)s))
    OR (j.state IN ('failed', 'cancelled')
        AND j.finished_at <= statement_timestamp() - make_interval(secs => %(failure_window)s))
)"""

OLD_RELEASE = f"""
UPDATE jobs_job AS j SET key_held = FALSE
WHERE j.id = ANY(%(ids)s) AND j.key_held AND {OLD_WINDOW_PASSED}
RETURNING j.id
"""

OLD_RELEASE_FOR = f"""
UPDATE jobs_job AS j SET key_held = FALSE
FROM jobs_job t
WHERE t.id = ANY(%(ids)s) AND j.tenant = t.tenant AND j.job_id = t.job_id
  AND j.id <> t.id AND j.key_held AND {OLD_WINDOW_PASSED}
"""

# Its other parts are built by helpers neither commit touched, as they were then.
OLD_REPLAY = (
    """
WITH target AS (
    SELECT j.id FROM jobs_job j
    WHERE j.id = ANY(%(ids)s) AND j.state IN ('failed', 'cancelled')
      AND NOT EXISTS (
          SELECT 1 FROM jobs_job o
          WHERE o.tenant = j.tenant AND o.job_id = j.job_id AND o.key_held AND o.id <> j.id
      )
    FOR UPDATE OF j
)
UPDATE jobs_job j
SET state = 'queued', attempts = 0, run_after = statement_timestamp(), key_held = TRUE,
    fair = """
    + flow.FAIR_AT_ENQUEUE.format(name="j.name")
    + """,
    started_at = NULL, finished_at = NULL, heartbeat_at = NULL, result = NULL,
    replayed_at = statement_timestamp(), replayed_by = %(by)s,
    cancel_requested_at = NULL, cancel_requested_by = '',
    attempt_log = CASE WHEN """
    + attempts.unlogged_last_sql("j")
    + """
        THEN j.attempt_log || """
    + attempts.entry_sql(
        row="j",
        outcome="j.state",
        code="j.last_error",
        error="j.error_detail",
        ended="j.finished_at",
    )
    + """
        ELSE j.attempt_log END
FROM target WHERE j.id = target.id
RETURNING j.id
"""
)
OLD_UNRESTORE_WHERE = (
    "j.id = ANY(%(ids)s) AND j.state IN ('failed', 'cancelled') AND NOT j.key_held"
)
UNRESTORE_WHERE = re.search(r"WHERE (.*?)\n\s*RETURNING", history.UNRESTORE, re.S)[1]


def _settle_body(sql: str) -> str:
    """The text of ``jobs_dependents_settle`` between its dollar quotes in a migration's SQL."""
    at = sql.index("CREATE OR REPLACE FUNCTION jobs_dependents_settle")
    start = sql.index("$$", at) + 2
    return sql[start : sql.index("$$", start)]


# 0013's definition of the settle function, as that migration wrote it.
SETTLE_0013 = M13.SQL[M13.SQL.index("CREATE OR REPLACE FUNCTION jobs_dependents_settle") :]
assert SETTLE_0013.rstrip().endswith("$$;")


def settle_source(function: str = "jobs_dependents_settle") -> str | None:
    with connection.cursor() as cur:
        cur.execute("SELECT prosrc FROM pg_proc WHERE proname = %s", [function])
        row = cur.fetchone()
    return None if row is None else row[0]


def _release_body(sql: str) -> str:
    """The text of ``jobs_dependents_release`` between its dollar quotes in a migration's SQL."""
    at = sql.index("CREATE FUNCTION jobs_dependents_release")
    start = sql.index("$$", at) + 2
    return sql[start : sql.index("$$", start)]


def backend() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return cur.fetchone()[0]


# --- Rows made directly ---------------------------------------------------------------------

_INSERT = """
INSERT INTO jobs_job (
    state, attempts, last_error, error_detail, job_id, name, payload, tenant, queue, priority,
    max_attempts, run_after, claimed_by, key_held, replayed_by, keyed, finished_at,
    claim_token, lease_expires_at, waiting_on, depended_on
)
VALUES (
    %(state)s, 1, CASE WHEN %(state)s IN ('failed', 'cancelled') THEN 'handler_error' ELSE '' END,
    '', %(job_id)s, %(name)s, '{}', %(tenant)s, 'default', 0, 5,
    CASE WHEN %(waiting)s > 0 THEN %(until)s ELSE statement_timestamp() END, '', %(held)s, '',
    TRUE, statement_timestamp() - make_interval(secs => %(age)s),
    CASE WHEN %(state)s = 'running' THEN gen_random_uuid() END,
    CASE WHEN %(state)s = 'running' THEN statement_timestamp() + interval '1 hour' END,
    %(waiting)s, %(depended_on)s
)
RETURNING id
"""


def insert(
    cur,
    job_id: str,
    state: str,
    *,
    held: bool,
    age: float | None = None,
    tenant: str = "default",
    name: str = UP,
    waiting: int = 0,
    depended_on: bool = False,
) -> int:
    """A row as the queue would leave it (``age``: seconds since it finished, if it did)."""
    cur.execute(
        _INSERT,
        {
            "state": state,
            "job_id": job_id,
            "name": name,
            "tenant": tenant,
            "held": held,
            "age": age,
            "waiting": waiting,
            "until": WAITING_UNTIL,
            "depended_on": depended_on,
        },
    )
    return cur.fetchone()[0]


def make_backlog() -> None:
    """BACKLOG queued rows of their own type, each with a key of its own."""
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO jobs_job (state, attempts, last_error, error_detail, job_id, name, "
            "payload, tenant, queue, priority, max_attempts, run_after, claimed_by, key_held, "
            "replayed_by, keyed) "
            "SELECT 'queued', 0, '', '', 'r29-backlog-' || g, %s, '{}', 'default', 'default', "
            "0, 5, statement_timestamp(), '', TRUE, '', TRUE FROM generate_series(1, %s) g",
            [BACKLOG_NAME, BACKLOG],
        )


_BACKLOG_AS = {
    "queued": "state = 'queued', key_held = TRUE, finished_at = NULL, claim_token = NULL, "
    "lease_expires_at = NULL",
    "running": "state = 'running', key_held = TRUE, finished_at = NULL, "
    "claim_token = gen_random_uuid(), lease_expires_at = statement_timestamp() + interval '1 h'",
    "succeeded, held": "state = 'succeeded', key_held = TRUE, finished_at = statement_timestamp(), "
    "claim_token = NULL, lease_expires_at = NULL",
    "succeeded, let go": "state = 'succeeded', key_held = FALSE, "
    "finished_at = statement_timestamp() - interval '2 days', claim_token = NULL, "
    "lease_expires_at = NULL",
    "failed, held": "state = 'failed', key_held = TRUE, finished_at = statement_timestamp(), "
    "claim_token = NULL, lease_expires_at = NULL",
    "failed, held past its window": "state = 'failed', key_held = TRUE, "
    "finished_at = statement_timestamp() - interval '2 days', claim_token = NULL, "
    "lease_expires_at = NULL",
    "failed, let go": "state = 'failed', key_held = FALSE, "
    "finished_at = statement_timestamp() - interval '2 days', claim_token = NULL, "
    "lease_expires_at = NULL",
}


def backlog_as(kind: str, extra: str = "") -> None:
    """Every backlog row in one state at once (none is waited for or in a batch: no trigger)."""
    with connection.cursor() as cur:
        cur.execute(
            f"UPDATE jobs_job SET {_BACKLOG_AS[kind]}{extra} WHERE name = %s", [BACKLOG_NAME]
        )


def analyze_then_reconnect() -> None:
    """Statistics of the table as it is now; plans (and plpgsql's kept plans) made afresh."""
    with connection.cursor() as cur:
        cur.execute("VACUUM ANALYZE jobs_job")
    connection.close()


@pytest.fixture
def no_autoanalyze():
    """Autovacuum would analyze the table after the backlog's updates (1 % churn) and make
    statistics meant to be stale fresh; kept off for the test, put back after."""
    with connection.cursor() as cur:
        cur.execute("ALTER TABLE jobs_job SET (autovacuum_enabled = off)")
    yield
    with connection.cursor() as cur:
        cur.execute("ALTER TABLE jobs_job RESET (autovacuum_enabled)")


# --- Plans ----------------------------------------------------------------------------------


@contextmanager
def explained() -> Iterator[list[dict]]:
    """The plans, with actual rows and buffers, of every statement (nested ones too) run
    meanwhile, in a transaction rolled back after."""
    with transaction.atomic(), explained_nested_statements() as plans:
        yield plans
        transaction.set_rollback(True)


def _scans(node: dict) -> list[dict]:
    # A read of the table, not a write (whose pages are those of its new rows and entries).
    own = (
        [node]
        if node.get("Relation Name") == "jobs_job" and node["Node Type"] != "ModifyTable"
        else []
    )
    return own + [scan for child in node.get("Plans", []) for scan in _scans(child)]


def reads(plan: dict) -> list[tuple[str, float, int]]:
    """Each read of the jobs table: its index, the rows it looked at (returned and thrown away
    by its filter, over all its loops) and the pages it touched."""
    return [
        (
            scan.get("Index Name", scan["Node Type"]),
            (scan.get("Actual Rows", 0) + scan.get("Rows Removed by Filter", 0))
            * scan.get("Actual Loops", 1),
            scan.get("Shared Hit Blocks", 0) + scan.get("Shared Read Blocks", 0),
        )
        for scan in _scans(plan["Plan"])
    ]


def assert_by_key(plans: list[dict]) -> None:
    every = [read for plan in plans for read in reads(plan)]
    wide = [
        (" ".join(plan["Query Text"].split()[:12]), reads(plan))
        for plan in plans
        if any(rows > MOST or blocks > BLOCKS for _, rows, blocks in reads(plan))
    ]
    assert every and not wide, wide
    # And none of them on a partial index, however few rows it read there.
    partial = [
        (" ".join(plan["Query Text"].split()[:12]), name)
        for plan in plans
        for name in _indexes(plan["Plan"])
        if name in PARTIAL
    ]
    assert partial == []


def where(pk: int) -> str:
    if Job.objects.filter(pk=pk).exists():
        return "jobs"
    return "history" if JobHistory.objects.filter(pk=pk).exists() else "gone"


# --- Threads held up on a row lock ----------------------------------------------------------


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
        lambda: all(s.pid or not s.is_alive() for s in sessions), 15.0, what="the sessions' pids"
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
    )
    assert all(s.is_alive() for s in sessions), [s.error for s in sessions]
    return sessions


# === Semantics ==============================================================================


@pytest.mark.django_db
def test_state_and_key_held_allow_no_value_for_which_the_rewrites_test_otherwise():
    with connection.cursor() as cur:
        cur.execute(
            "SELECT a.attname, a.attnotnull, format_type(a.atttypid, a.atttypmod), "
            "COALESCE(c.collisdeterministic, TRUE) FROM pg_attribute a "
            "LEFT JOIN pg_collation c ON c.oid = a.attcollation "
            "WHERE a.attrelid = 'jobs_job'::regclass "
            "AND a.attname IN ('state', 'key_held', 'tenant', 'job_id') ORDER BY a.attname"
        )
        assert cur.fetchall() == [
            ("job_id", True, "character varying(255)", True),
            ("key_held", True, "boolean", True),
            ("state", True, "character varying(16)", True),
            ("tenant", True, "character varying(64)", True),
        ]
        # Every state a row may have, and a few it may not: the rewrite and the original agree.
        cur.execute(
            "SELECT s, t FROM unnest(ARRAY['queued', 'running', 'succeeded', 'failed', "
            "'cancelled', 'queued ', 'Queued', '']::varchar(16)[]) AS s, "
            "unnest(ARRAY['queued', 'running', 'succeeded', 'failed', 'cancelled']) AS t "
            "WHERE (s || '' = t) IS DISTINCT FROM (s = t) "
            "   OR ((s || '') IN ('failed', 'cancelled'))"
            "      IS DISTINCT FROM (s IN ('failed', 'cancelled'))"
        )
        assert cur.fetchall() == []
        cur.execute(
            "SELECT b FROM (VALUES (TRUE), (FALSE)) v(b) WHERE (b IS TRUE) IS DISTINCT FROM b"
        )
        assert cur.fetchall() == []


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


def _table(cur) -> list[tuple]:
    cur.execute(
        "SELECT id, state, key_held, attempts, replayed_by, finished_at IS NULL "
        "FROM jobs_job ORDER BY id"
    )
    return cur.fetchall()


def _outcome(cur, run: Callable[[], Any]) -> tuple:
    """What ``run`` returns (or that it met the key lock) and the table after, undone."""
    with transaction.atomic():
        try:
            with transaction.atomic():
                result = run()
        except IntegrityError:
            result = "key conflict"
        after = _table(cur)
        transaction.set_rollback(True)
    return result, after


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
def test_the_key_statements_act_as_before_on_any_table_of_a_few_keys(rows, picks):
    """Old and new ``release``, ``release_for`` then replay's statement (as replay runs them),
    replay's statement alone and the restore's undo condition: same rows, same results."""
    params = keys.window_params()
    with transaction.atomic(), connection.cursor() as cur:
        ids = insert_rows(cur, rows)
        chosen = sorted({ids[p] if p < len(ids) else ids[-1] + 1000 + p for p in picks})
        p = {"ids": chosen, "by": "review", **params}

        def old_release():
            cur.execute(OLD_RELEASE, p)
            return _rows_of(cur)

        def new_release():
            return keys.release(cur, chosen) if chosen else set()

        def replay_after(release_for: Callable[[], None], statement: str) -> Callable[[], set]:
            def run():
                release_for()
                cur.execute(statement, p)
                return _rows_of(cur)

            return run

        def selected(condition: str) -> Callable[[], set]:
            def run():
                cur.execute(f"SELECT j.id FROM jobs_job j WHERE {condition}", p)
                return _rows_of(cur)

            return run

        pairs = [
            ("release", old_release, new_release),
            (
                "release_for, then replay",
                replay_after(lambda: cur.execute(OLD_RELEASE_FOR, p), OLD_REPLAY),
                replay_after(lambda: keys.release_for(cur, chosen), operations._REPLAY),
            ),
            (
                "replay alone",
                replay_after(lambda: None, OLD_REPLAY),
                replay_after(lambda: None, operations._REPLAY),
            ),
            ("restore's undo", selected(OLD_UNRESTORE_WHERE), selected(UNRESTORE_WHERE)),
        ]
        for what, old, new in pairs:
            assert _outcome(cur, old) == _outcome(cur, new), what
        transaction.set_rollback(True)


dag_strategy = st.lists(
    st.tuples(st.lists(st.integers(0, 10), max_size=3), st.sampled_from(["cancel", "fail"])),
    min_size=2,
    max_size=7,
)
steps_strategy = st.lists(
    st.tuples(st.integers(0, 6), st.sampled_from(["succeeded", "failed", "cancelled"])),
    min_size=1,
    max_size=6,
)


@pytest.mark.django_db
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(dag=dag_strategy, steps=steps_strategy)
def test_the_settle_function_acts_as_0013s_on_any_graph_and_outcomes(dag, steps):
    """Each job waits for some earlier ones; jobs due to run end one after another, the
    trigger settling what waits for them: 0013's function and 0024's leave the same rows."""
    with transaction.atomic(), connection.cursor() as cur:
        ups = [sorted({u % j for u in wanted}) if j else [] for j, (wanted, _) in enumerate(dag)]
        waited = {u for each in ups for u in each}
        ids: list[int] = []
        for j, upstreams in enumerate(ups):
            ids.append(
                insert(
                    cur,
                    f"dag-{j}",
                    "queued",
                    held=True,
                    waiting=len(upstreams),
                    depended_on=j in waited,
                )
            )
        for j, upstreams in enumerate(ups):
            for u in upstreams:
                cur.execute(
                    "INSERT INTO jobs_dependency (job, upstream, on_failure) VALUES (%s, %s, %s)",
                    [ids[j], ids[u], dag[j][1]],
                )

        def run() -> list[tuple]:
            return run_steps(steps)

        def run_steps(steps: list[tuple[int, str]]) -> list[tuple]:
            for index, state in steps:
                cur.execute(
                    "UPDATE jobs_job SET state = %(state)s, finished_at = statement_timestamp(), "
                    "key_held = %(state)s <> 'cancelled' "
                    "WHERE id = %(id)s AND state = 'queued' AND waiting_on = 0",
                    {"state": state, "id": ids[index % len(ids)]},
                )
            cur.execute(
                "SELECT id, state, waiting_on, key_held, last_error, error_detail, "
                "run_after = %s, finished_at IS NULL FROM jobs_job ORDER BY id",
                [WAITING_UNTIL],
            )
            return cur.fetchall()

        def with_0013() -> list[tuple]:
            # 0013's function, called by the trigger in the statement that ends a job.
            cur.execute(SETTLE_0013)
            cur.execute(SETTLED_IN_STATEMENT)
            assert "|| ''" not in settle_source()
            return run()

        def released_after() -> list[tuple]:
            # Today's: each job's waiting jobs released after it ends, before the next step.
            for index, state in steps:
                cur.execute(
                    "UPDATE jobs_job SET state = %(state)s, finished_at = statement_timestamp(), "
                    "key_held = %(state)s <> 'cancelled' "
                    "WHERE id = %(id)s AND state = 'queued' AND waiting_on = 0",
                    {"state": state, "id": ids[index % len(ids)]},
                )
                settle()
            return run_steps([])

        old, new = _outcome(cur, with_0013), _outcome(cur, released_after)
        assert settle_source() is None  # 0025's trigger, back
        assert old == new
        transaction.set_rollback(True)


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

    report = queue.replay([old], by="review")

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
    report = queue.replay(wanted, by="review")

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

    report = queue.replay([old], by="review")

    if holder_age > MINUTE:
        assert report.replayed == (old,) and where(old) == "jobs"
        assert Job.objects.get(pk=old).key_held and not Job.objects.get(pk=holder).key_held
    else:
        assert report.key_taken == (old,) and where(old) == "history"  # put back
        assert Job.objects.get(pk=holder).key_held


def _enqueue(name: str = UP, **fields) -> int:
    return queue.enqueue(NewJob(name=name, **fields)).id


def _run(name: str, outcome: str) -> None:
    """Claim one job and end it as ``outcome``, then release what waits for it."""
    [job] = queue.claim([ClaimRequest(name, 1)], scope=AllTenants(), worker="review")
    if outcome == "succeeded":
        assert queue.complete(job)
    else:
        assert queue.fail(job, code="rejected", detail="no")
    settle()


def _state(pk: int) -> tuple:
    row = Job.objects.get(pk=pk)
    return row.state, row.waiting_on, row.key_held, row.last_error


def _settles_each_way() -> None:
    """Success lets waiting jobs go (a diamond one at a time), failure ends the chain below."""
    first, second = _enqueue(job_id="first"), _enqueue(job_id="second")
    both = _enqueue(DOWN, after=(first, second))
    below = _enqueue(DOWN, after=(both,), on_dependency_failure="fail")
    _run(UP, "succeeded")
    assert _state(both)[:2] == ("queued", 1)
    _run(UP, "succeeded")
    assert _state(both)[:2] == ("queued", 0)
    assert Job.objects.get(pk=both).run_after <= database_now()
    assert _state(below)[:2] == ("queued", 1)

    top = _enqueue(job_id="top")
    left = _enqueue(DOWN, after=(top,))  # cancel edge
    right = _enqueue(DOWN, after=(top,), on_dependency_failure="fail")
    bottom = _enqueue(DOWN, after=(left, right), on_dependency_failure="fail")
    _run(UP, "failed")
    assert _state(left) == ("cancelled", 0, False, "dependency_failed")
    assert _state(right) == ("failed", 0, True, "dependency_failed")
    # Reached by two paths, ended once, by the lowest upstream's edge (left ended cancelled).
    assert _state(bottom) == ("failed", 0, True, "dependency_failed")
    assert Job.objects.get(pk=bottom).error_detail == (
        f"job {left}, which this job waited for, ended cancelled"
    )
    assert _state(both)[:2] == ("queued", 0)  # untouched by the other chain
    Job.objects.filter(name__in=[UP, DOWN]).delete()


def test_settles_are_right_before_across_and_after_migrating_back_to_0023_and_forward():
    """On one connection: settles by the release (0025's function, its plan kept), ``migrate
    jobs 0023`` (0013's function back; this release's code does not run on that schema),
    ``migrate`` forward, settles by the release again; each text exactly its migration's,
    each in effect at once on the connection that ran the other."""
    pid = backend()
    _settles_each_way()
    assert settle_source() is None
    assert settle_source("jobs_dependents_release") == _release_body(M25.SQL)
    try:
        call_command("migrate", "jobs", "0023", verbosity=0)
        assert backend() == pid
        assert settle_source() == _settle_body(M13.SQL)
    finally:
        call_command("migrate", "jobs", verbosity=0)
    assert backend() == pid
    assert settle_source() is None
    assert settle_source("jobs_dependents_release") == _release_body(M25.SQL)
    _settles_each_way()


# === Concurrency ============================================================================


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


# === Plans ==================================================================================

STALE_AND_FRESH = {
    # (statistics taken with the backlog, then the backlog becomes)
    "running": [("queued", "running"), ("running", "running")],
    "queued": [("succeeded, let go", "queued"), ("queued", "queued")],
    "keys": [
        ("queued", "succeeded, held"),  # no finished row when analyzed
        ("succeeded, let go", "failed, held"),  # no key held when analyzed
        ("failed, let go", "failed, held past its window"),
        ("succeeded, held", "succeeded, held"),  # fresh
        ("failed, held past its window", "failed, held past its window"),  # fresh
    ],
}


def _ids(pairs):
    return [f"analyzed {a}, now {b}" if a != b else f"fresh, {b}" for a, b in pairs]


@pytest.mark.parametrize(
    ("analyzed", "now"), STALE_AND_FRESH["running"], ids=_ids(STALE_AND_FRESH["running"])
)
def test_a_handlers_claim_checks_read_its_rows_by_key(no_autoanalyze, analyzed, now):
    make_backlog()
    backlog_as(analyzed)
    analyze_then_reconnect()
    backlog_as(now)
    queue.enqueue_many([NewJob(MINE, {})] * 3)
    held = queue.claim([ClaimRequest(MINE, 3)], scope=AllTenants(), worker="review")
    assert len(held) == 3

    with explained() as plans:
        assert all(effects.hold(job.id, job.claim_token) for job in held)
        job = held[0]
        assert effects.record_intent(job.id, job.claim_token, "step", "k", job.attempts) == "k"
        assert effects.record_done(job.id, job.claim_token, "step", "1", job.attempts)
        assert next_attempt(held[1]) == held[1].attempts + 1

    assert_by_key(plans)


@pytest.mark.parametrize(
    ("analyzed", "now"), STALE_AND_FRESH["queued"], ids=_ids(STALE_AND_FRESH["queued"])
)
def test_settles_and_reckon_read_the_waiting_jobs_by_key(no_autoanalyze, analyzed, now):
    make_backlog()
    backlog_as(analyzed)
    analyze_then_reconnect()
    backlog_as(now)
    up, other = _enqueue(), _enqueue(job_id="other")
    one = _enqueue(DOWN, after=(up,))
    two = _enqueue(DOWN, after=(up, other), on_dependency_failure="fail")
    [held] = queue.claim([ClaimRequest(UP, 1)], scope=AllTenants(), worker="review")
    assert held.id == up

    with explained() as succeeded:
        queue.record([Outcome.succeeded(held)])
        settle()
        assert (_state(one)[:2], _state(two)[:2]) == (("queued", 0), ("queued", 1))
    with explained() as failed:
        queue.record([Outcome.failed(held, code="broken")])
        settle()
        assert (_state(one)[0], _state(two)[0]) == ("cancelled", "failed")
    queue.record([Outcome.failed(held, code="broken")])
    settle()
    with explained() as replayed:
        assert queue.replay([two], by="review").replayed == (two,)
        settle()
        assert _state(two) == ("failed", 0, True, "dependency_failed")  # ended again by reckon

    for plans in (succeeded, failed, replayed):
        assert_by_key(plans)


@pytest.mark.parametrize(
    ("analyzed", "now"), STALE_AND_FRESH["keys"], ids=_ids(STALE_AND_FRESH["keys"])
)
def test_replay_and_the_keyed_release_read_rows_and_keys_by_key(no_autoanalyze, analyzed, now):
    """Replay of five failures, three of whose keys are held past their window (released),
    two within it (left alone; one was restored from history and goes back); the keyed
    enqueue's release of the expired holders."""
    make_backlog()
    with connection.cursor() as cur:
        back = insert(cur, "r29-5", "failed", held=False, age=2 * MINUTE)
    history.archive(now=database_now())
    assert where(back) == "history"
    with connection.cursor() as cur:
        targets = [insert(cur, f"r29-{i}", "failed", held=False, age=3 * DAY) for i in range(4)]
        targets.append(back)
        holders = [
            insert(cur, "r29-0", "failed", held=True, age=10 * MINUTE),
            insert(cur, "r29-1", "succeeded", held=True, age=2 * DAY),
            insert(cur, "r29-2", "cancelled", held=True, age=10 * MINUTE),
            insert(cur, "r29-3", "failed", held=True, age=5.0),
            insert(cur, "r29-5", "succeeded", held=True, age=5.0),
        ]
    backlog_as(analyzed)
    analyze_then_reconnect()
    backlog_as(now)

    with explained() as replay_plans:
        report = queue.replay(targets, by="review")
        assert report.replayed == tuple(targets[:3])
        assert report.key_taken == tuple(sorted((targets[3], back)))
        assert where(back) == "history"
        kept = Job.objects.filter(pk__in=holders, key_held=True).values_list("pk", flat=True)
        assert sorted(kept) == holders[3:]
    with explained() as release_plans, connection.cursor() as cur:
        assert keys.release(cur, holders) == set(holders[:3])

    assert_by_key(replay_plans)
    assert_by_key(release_plans)
    # A read of the restore's undo was among them (the row went back to history).
    assert any("DELETE FROM jobs_job j" in plan["Query Text"] for plan in replay_plans)


PARTIAL = frozenset(
    {
        "jobs_job_claim",
        "jobs_job_tenant_claim",
        "jobs_job_running",
        "jobs_job_retrying",
        "jobs_job_out_of_attempts",
        "jobs_job_terminal",
        "jobs_job_batch",
    }
)
REWRITTEN = {
    # a piece of each rewritten statement's text: the statement it names ran
    "effects.hold": "SELECT 1 FROM jobs_job WHERE id =",
    "effects._HELD": "held AS (",
    "next_attempt": "WITH bumped AS (",
    "keys.release": "UPDATE jobs_job AS j SET key_held = FALSE WHERE",
    "keys.release_for": "CROSS JOIN LATERAL",
    "replay": "WITH target AS (",
    "reckon": "FROM unnest(",
    "history.UNRESTORE": "WITH back AS (",
    "release, success": "released AS (",
    "release, failure": "ended AS (",
}


def _indexes(node: dict) -> list[str]:
    own = [node["Index Name"]] if "Index Name" in node else []
    return own + [name for child in node.get("Plans", []) for name in _indexes(child)]


def test_no_rewritten_lookup_can_use_a_partial_index_whatever_the_statistics():
    """With the primary key dropped and sequential scans disabled, the planner takes any index
    it may use (PostgreSQL 18 counts disabled nodes first): every rewritten statement then
    reads the table sequentially or by the key lock, so no partial index's predicate is
    implied by ``state || ''`` or ``key_held IS TRUE``, under any statistics."""
    with connection.cursor() as cur:
        # A replay from history whose key is taken; one releasing an expired holder.
        back = insert(cur, "taken", "failed", held=False, age=2 * MINUTE)
    history.archive(now=database_now())
    with connection.cursor() as cur:
        insert(cur, "taken", "succeeded", held=True, age=5.0)
        freed = insert(cur, "free", "failed", held=False, age=3 * DAY)
        holder = insert(cur, "free", "failed", held=True, age=10 * MINUTE)
    # A failed job waited for, and a replayed waiting job reckoned against it and ended again.
    failing = _enqueue(job_id="failing")
    ended = _enqueue(DOWN, after=(failing,))
    _run(UP, "failed")
    assert _state(ended)[0] == "cancelled"
    # A running job waited for by another, and a handler's running job.
    up = _enqueue(job_id="up")
    waiting = _enqueue(DOWN, after=(up,))
    [upstream] = queue.claim([ClaimRequest(UP, 1)], scope=AllTenants(), worker="review")
    queue.enqueue(NewJob(MINE, {}))
    [mine] = queue.claim([ClaimRequest(MINE, 1)], scope=AllTenants(), worker="review")

    with explained() as plans, connection.cursor() as cur:
        cur.execute("ALTER TABLE jobs_job DROP CONSTRAINT jobs_job_pkey")
        cur.execute("SET LOCAL enable_seqscan = off")
        assert effects.hold(mine.id, mine.claim_token)
        assert effects.record_intent(mine.id, mine.claim_token, "s", "k", mine.attempts) == "k"
        assert next_attempt(mine) == mine.attempts + 1
        with transaction.atomic():
            assert keys.release(cur, [holder]) == {holder}
            transaction.set_rollback(True)
        with transaction.atomic():
            queue.record([Outcome.succeeded(upstream)])
            settle()
            assert _state(waiting)[:2] == ("queued", 0)
            transaction.set_rollback(True)
        queue.record([Outcome.failed(upstream, code="broken")])
        settle()
        assert _state(waiting)[0] == "cancelled"
        report = queue.replay([freed, back, ended], by="review")
        settle()
        assert (report.replayed, report.key_taken) == ((freed, ended), (back,))
        assert _state(ended)[0] == "cancelled" and where(back) == "history"

    texts = [" ".join(plan["Query Text"].split()) for plan in plans]
    assert [what for what, piece in REWRITTEN.items() if not any(piece in t for t in texts)] == []
    partial = [
        (" ".join(plan["Query Text"].split()[:12]), name)
        for plan in plans
        for name in _indexes(plan["Plan"])
        if name in PARTIAL
    ]
    assert partial == []


# === Defects in statements the commits left alone (fixed since) ===========================


def test_run_now_reads_its_jobs_by_key_among_a_delayed_backlog(no_autoanalyze):
    make_backlog()
    backlog_as("succeeded, let go")
    analyze_then_reconnect()
    backlog_as(
        "queued", ", run_after = statement_timestamp() + interval '1 hour' + id * interval '1 s'"
    )
    ids = sorted(Job.objects.filter(name=BACKLOG_NAME).values_list("pk", flat=True)[:3])

    with explained() as plans:
        assert queue.run_now(ids) == ids

    assert_by_key(plans)


def test_cancel_running_reads_its_jobs_by_key_among_the_fleets(no_autoanalyze):
    make_backlog()
    backlog_as("queued")
    analyze_then_reconnect()
    backlog_as("running")
    ids = sorted(Job.objects.filter(name=BACKLOG_NAME).values_list("pk", flat=True)[:3])

    with explained() as plans:
        assert queue.cancel_running(ids, by="review") == ids

    assert_by_key(plans)


def test_a_replay_that_replays_every_job_reads_no_running_rows(no_autoanalyze):
    make_backlog()
    backlog_as("queued")
    analyze_then_reconnect()
    backlog_as("running")
    with connection.cursor() as cur:
        ids = [insert(cur, f"again-{i}", "failed", held=False, age=3 * DAY) for i in range(3)]

    with explained() as plans:
        assert queue.replay(ids, by="review").replayed == tuple(ids)

    assert_by_key(plans)
