"""Values the queue API takes and returns. No SQL here, no business payloads.

Over 400 lines: every value in and out of the queue is found in this one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from jobs.core.frozen import direct_init
from jobs.core.limits import validate_key
from jobs.queue import text
from jobs.runs import ErrorCode, RunState

#: The longest delay an outcome may ask for: a retry further out is scheduled at this delay.
#: A ``RetryAfter(timedelta.max)`` would otherwise overflow PostgreSQL's timestamps.
RETRY_DELAY_MAX = timedelta(days=30)

#: The largest result a job may store (characters of JSON). Results live in the jobs table,
#: which every claim reads: large outputs belong in your own tables or object storage.
RESULT_MAX = 1_000_000


class InvalidResult(ValueError):
    """A handler's return value cannot be stored as the job's JSON result."""


class InvalidJob(ValueError):
    """A job (or one job of a batch) cannot be enqueued; nothing was inserted."""

    def __init__(self, message: str, *, index: int | None = None) -> None:
        self.index = index
        prefix = f"job #{index}: " if index is not None else ""
        super().__init__(prefix + message)


@direct_init
@dataclass(frozen=True, slots=True)
class NewJob:
    """A job to enqueue. Omitted fields take the ``JOBS`` defaults.

    ``job_id`` is the idempotency key within a tenant; leave it out for work that should never
    be deduplicated. Give either ``run_after`` (an aware datetime) or ``delay``, not both.
    ``after`` names jobs this one waits for (row ids, or job_ids of the same tenant): it is
    claimed only once all of them have succeeded, and ends as ``on_dependency_failure`` says
    (``"cancel"`` or ``"fail"``) when one of them fails or is cancelled
    (:mod:`jobs.queue.dependencies`). ``batch_id`` is set by :func:`jobs.queue.batches.add`.
    """

    name: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    job_id: str | None = None
    tenant: str | None = None
    queue: str | None = None
    priority: int = 0
    run_after: datetime | None = None
    delay: timedelta | None = None
    max_attempts: int | None = None
    after: tuple[int | str, ...] = ()
    on_dependency_failure: str = "cancel"
    batch_id: int | None = None


@dataclass(frozen=True, slots=True)
class BatchState:
    """A batch's counts as committed when read (:mod:`jobs.queue.batches`)."""

    id: int
    tenant: str
    description: str
    created_at: datetime
    created_by: str
    sealed_at: datetime | None
    total: int
    succeeded: int
    failed: int
    cancelled: int
    fired_at: datetime | None
    successor_pk: int | None

    @property
    def finished(self) -> int:
        """Members in a terminal state, whatever the outcome."""
        return self.succeeded + self.failed + self.cancelled

    @property
    def done(self) -> bool:
        """Every member finished and the successor (if any) was enqueued."""
        return self.fired_at is not None


@dataclass(frozen=True, slots=True)
class BatchFailure:
    """A member of a batch that failed or was cancelled."""

    id: int
    job_id: str
    name: str
    state: str
    last_error: str
    error_detail: str
    finished_at: datetime | None


@direct_init
@dataclass(frozen=True, slots=True)
class Enqueued:
    """What enqueue did for one job: ``created`` is False when an existing job was returned."""

    id: int
    job_id: str
    tenant: str
    name: str
    state: str
    created: bool
    using: str = "default"  # the database alias it is in: row ids are counted per database


@direct_init
@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """A job this worker holds a lease on; ``claim_token`` fences every outcome write."""

    id: int
    job_id: str
    name: str
    payload: dict[str, Any]
    tenant: str
    queue: str
    priority: int
    attempts: int
    max_attempts: int
    claim_token: UUID
    # Seconds from when the job was due to this claim (PostgreSQL's clock).
    latency: float

    @property
    def final_attempt(self) -> bool:
        return self.attempts >= self.max_attempts


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """Claim up to ``limit`` due jobs named ``name``.

    ``max_attempts``, when given, is the type's current policy: rows enqueued under a higher
    limit are not claimed past it (the exhaustion pass fails them instead).
    """

    name: str
    limit: int
    max_attempts: int | None = None


class Scope:
    """Which tenants a worker serves. Use one of the two subclasses."""

    def sql(self, alias: str) -> tuple[str, dict[str, Any]]:
        """A condition on the jobs table aliased ``alias``, with its named parameters."""
        raise NotImplementedError

    def pick_params(self) -> dict[str, str | None]:
        """The scope as the fair pick function's two arguments (see :func:`pick_scope_sql`)."""
        return {"pick_tenant": None, "pick_component": None}


def pick_scope_sql(alias: str) -> str:
    """Every scope as one condition on two arguments, for SQL whose plan is kept whatever the
    scope (a PL/pgSQL function): ``p_tenant`` alone, or every tenant without a
    ``p_component`` override, or (both NULL) every tenant."""
    return (
        f"(p_tenant IS NULL OR {alias}.tenant = p_tenant) AND (p_component IS NULL OR "
        f"NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o "
        f"WHERE o.tenant = {alias}.tenant AND o.component = p_component))"
    )


@dataclass(frozen=True, slots=True)
class AllTenantsExcept(Scope):
    """Base workers of ``component``: every tenant without a (tenant, component) override."""

    component: str

    def __post_init__(self) -> None:
        validate_key(self.component, "component")

    def sql(self, alias: str) -> tuple[str, dict[str, Any]]:
        return (
            f"NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o "
            f"WHERE o.tenant = {alias}.tenant AND o.component = %(scope_component)s)",
            {"scope_component": self.component},
        )

    def pick_params(self) -> dict[str, str | None]:
        return {"pick_tenant": None, "pick_component": self.component}


@dataclass(frozen=True, slots=True)
class OnlyTenant(Scope):
    """A branch worker: this one tenant only, whatever the overrides say."""

    tenant: str

    def __post_init__(self) -> None:
        validate_key(self.tenant, "tenant")

    def sql(self, alias: str) -> tuple[str, dict[str, Any]]:
        return f"{alias}.tenant = %(scope_tenant)s", {"scope_tenant": self.tenant}

    def pick_params(self) -> dict[str, str | None]:
        return {"pick_tenant": self.tenant, "pick_component": None}


@dataclass(frozen=True, slots=True)
class AllTenants(Scope):
    """Every tenant: for the scheduler's maintenance passes and for operators."""

    def sql(self, alias: str) -> tuple[str, dict[str, Any]]:
        return "TRUE", {}


@direct_init
@dataclass(frozen=True, slots=True)
class Outcome:
    """The result of one claimed attempt, written only while ``token`` still holds the job.

    Build one with :meth:`succeeded`, :meth:`retry`, :meth:`failed` or :meth:`released`: they
    make every value storable (error text cleaned of what PostgreSQL refuses, delays clamped
    to :data:`RETRY_DELAY_MAX`, results encoded strictly), so one outcome cannot make a batch
    of outcomes fail to write.
    """

    id: int
    token: UUID
    state: str
    code: str | None = ""  # None keeps the job's last_error as it is
    detail: str | None = ""
    delay: float = 0.0
    at: datetime | None = None
    attempts_delta: int = 0  # -1 gives the claimed attempt back
    result_json: str | None = None  # the result, already encoded (see jobs.queue.text.dumps)
    # The handler's last progress report, when no lease renewal wrote it (jobs.core.progress).
    progress_json: str | None = None

    @classmethod
    def succeeded(cls, job: ClaimedJob, result: Any = None) -> Outcome:
        """Raises :class:`InvalidResult` when ``result`` is not storable JSON."""
        if result is None:
            return cls(job.id, job.claim_token, RunState.SUCCEEDED)
        try:
            encoded = text.dumps(result)
        except ValueError as exc:
            raise InvalidResult(f"the result cannot be stored as JSON: {exc}") from None
        if len(encoded) > RESULT_MAX:
            raise InvalidResult(
                f"the result is {len(encoded):,} characters of JSON, over the {RESULT_MAX:,} "
                "a job may store"
            )
        return cls(job.id, job.claim_token, RunState.SUCCEEDED, result_json=encoded)

    @classmethod
    def retry(
        cls,
        job: ClaimedJob,
        *,
        code: str,
        detail: str = "",
        delay: timedelta | float = 0.0,
        at: datetime | None = None,
    ) -> Outcome:
        return cls(
            job.id,
            job.claim_token,
            RunState.QUEUED,
            text.clean(code),
            text.clean(detail),
            clamp_delay(delay),
            at,
        )

    @classmethod
    def failed(cls, job: ClaimedJob, *, code: str, detail: str = "") -> Outcome:
        return cls(job.id, job.claim_token, RunState.FAILED, text.clean(code), text.clean(detail))

    @classmethod
    def cancelled(cls, job: ClaimedJob) -> Outcome:
        """End the attempt cancelled: an operator asked it to stop (:func:`jobs.queue.cancel`).

        The write records who asked; the job is not retried.
        """
        return cls(job.id, job.claim_token, RunState.CANCELLED, ErrorCode.CANCELLED, "")

    @classmethod
    def released(cls, job: ClaimedJob) -> Outcome:
        """Hand the job back untried (shutdown): due at once, and the attempt is returned."""
        return cls(job.id, job.claim_token, RunState.QUEUED, None, None, attempts_delta=-1)


def clamp_delay(delay: timedelta | float) -> float:
    """Seconds from 0 to :data:`RETRY_DELAY_MAX`; NaN counts as 0."""
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
    if not seconds > 0:  # negative, zero or NaN
        return 0.0
    return min(seconds, RETRY_DELAY_MAX.total_seconds())


@dataclass(frozen=True, slots=True)
class ProcessBeat:
    """What a live process reports of itself with each lease renewal (see ``jobs_process``).

    ``expires_in`` is how long the row counts as live without another beat.
    """

    identity: str
    held: int
    draining: bool
    expires_in: float
    leader: bool = False


@dataclass(frozen=True, slots=True)
class Renewal:
    """What one lease renewal learned, by claim token.

    ``lost``: the lease is gone (token no longer matches, or the job left ``running``): the
    handler must stop and write no outcome. ``cancel_requested``: still held, but an operator
    asked the attempt to stop; it ends ``cancelled``. ``beat_missed``: a beat was sent and
    found no row (pruned during a long stall): the process should register again.
    """

    lost: frozenset[UUID] = frozenset()
    cancel_requested: frozenset[UUID] = frozenset()
    beat_missed: bool = False
    # Progress reports sent with the renewal and not written: their row was locked.
    unsent: frozenset[UUID] = frozenset()
    # Held rows another session had locked: not renewed this time, nor lost.
    skipped: frozenset[UUID] = frozenset()
    # Bound run tables whose heartbeat update failed after the renewal: (label, error).
    runs_failed: tuple[tuple[str, Exception], ...] = ()


@dataclass(frozen=True, slots=True)
class OutcomeReport:
    """Which outcomes were written, which were fenced out (the lease was lost), and which
    found their row locked by another session (``busy``: not written, try again).

    The id tuples follow the outcomes' order. One worker can hold two attempts of a job (a
    stale one whose lease expired and a fresh claim) and report both in one batch: ask about
    an outcome with :meth:`was_applied` / :meth:`was_busy` / :meth:`was_fenced`, which go by
    its claim token.
    """

    applied: tuple[int, ...]
    fenced: tuple[int, ...]
    busy: tuple[int, ...] = ()
    applied_tokens: frozenset[UUID] = frozenset()
    busy_tokens: frozenset[UUID] = frozenset()
    # Outcomes written as ``cancelled`` because an operator had asked (jobs.queue.cancel):
    # claim token -> the error detail written.
    stopped: Mapping[UUID, str] = field(default_factory=dict)
    # An outcome written ended a job others wait for: releasing them is pending
    # (jobs.queue.dependencies.release).
    settle: bool = False

    def was_applied(self, outcome: Outcome) -> bool:
        return outcome.token in self.applied_tokens

    def was_busy(self, outcome: Outcome) -> bool:
        return outcome.token in self.busy_tokens

    def was_fenced(self, outcome: Outcome) -> bool:
        return not self.was_applied(outcome) and not self.was_busy(outcome)

    def as_written(self, outcome: Outcome) -> Outcome:
        """The outcome the row got: a retry or hand-back an operator had stopped ends cancelled.

        Bound run rows follow this, not the outcome the worker sent.
        """
        detail = self.stopped.get(outcome.token)
        if detail is None:
            return outcome
        return Outcome(outcome.id, outcome.token, RunState.CANCELLED, ErrorCode.CANCELLED, detail)


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """``replayed`` went back to the queue; ``not_failed`` were not failed or cancelled;
    ``key_taken`` lost their job_id to a newer active job with the same key."""

    replayed: tuple[int, ...]
    not_failed: tuple[int, ...]
    key_taken: tuple[int, ...]


#: :func:`jobs.queue.backlog` counts exactly up to this many queued (and due) jobs per name.
#: 10,000 made the scheduler's gauges pass at 1,000,000 queued jobs cost 2-6x its cost at
#: 10,000 (bench/scale.py): it read 20,000 index entries per type; above the cap the
#: estimate (with the state/name statistics) is within a few per cent anyway.
BACKLOG_CAP = 1_000


@dataclass(frozen=True, slots=True)
class BacklogRow:
    """Queued jobs of one name, every tenant: counted exactly up to a cap, estimated above it.

    ``queued``: every queued job of the name, due or not. Exact while ``queued_exact``; past
    the cap it is PostgreSQL's planner estimate (as fresh as the table's last ANALYZE), and
    never below ``cap + 1``. ``due``: those due now. Exact while ``due_exact``; past the cap it
    is ``cap + 1``, standing for "more than the cap" (a floor, not an estimate).
    ``oldest_due``: when the longest-waiting due job became due (None: nothing is due).
    """

    name: str
    supported: bool
    queued: int
    queued_exact: bool
    due: int
    due_exact: bool
    oldest_due: datetime | None


@dataclass(frozen=True, slots=True)
class TableHealth:
    """What PostgreSQL's catalogs and cumulative statistics say about one table.

    ``live_tuples`` and ``dead_tuples`` are the statistics system's running estimates
    (``pg_stat_user_tables``), which lag writes by about a second and are reset by VACUUM and
    ANALYZE; dead tuples are row versions that updates and deletes left behind and that only
    VACUUM reclaims. ``table_bytes`` covers the heap with its TOAST, free-space and visibility
    maps (``pg_table_size``); ``index_bytes`` has each index's size by name
    (``pg_relation_size``). The times are the last autovacuum and autoanalyze (None: never
    since the statistics were last reset); a manual VACUUM or ANALYZE is not counted.
    """

    table: str
    live_tuples: int
    dead_tuples: int
    table_bytes: int
    index_bytes: Mapping[str, int]
    last_autovacuum: datetime | None
    last_autoanalyze: datetime | None


@dataclass(frozen=True, slots=True)
class SweepRow:
    """A job a maintenance pass moved, with the state and error code it moved to."""

    id: int
    job_id: str
    name: str
    tenant: str
    state: str
    code: str
