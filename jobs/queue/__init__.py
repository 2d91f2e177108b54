"""The queue: every SQL statement on the jobs table lives in this package.

Job states and who moves them::

                 enqueue
                    │
                    ▼        claim (new token, attempts + 1, lease)
    ┌──────────▶ queued ─────────────────────────────▶ running ──complete──▶ succeeded
    │  replay       │  ▲                                 │  │
    │               │  └─ retry(delay) / release ────────┘  ├──fail──────────▶ failed
    │            cancel  └─ requeue_expired (lease lost) ───┘  ├─fail_exhausted─▶ failed
    │               ▼                                       │
    └────────── cancelled / failed ◀── cancel_running ──────┘  (at the worker's next renewal)

A claim skips job types, queues and tenants that are paused (``pause`` / ``resume``, the
pauses table). Every statement that ends an attempt appends it to the row's attempt log
(:mod:`jobs.queue.attempts`) in the same statement.

A finished row that holds no key leaves for the history table (``history.archive``); retention
drops history partitions whole (``history.drop_expired``). Every outcome write is fenced by the
claim token. Every function takes ``using`` (a database
alias) and runs on that connection, so it joins the caller's transaction when there is one.
The worker, the scheduler, the admin and management commands call these functions; none of
them writes the jobs table itself.
"""

from jobs.queue import (
    attempts,
    batches,
    bound,
    counts,
    dependencies,
    flow,
    history,
    pauses,
    processes,
    rollup,
    rollup_compaction,
    rollup_reads,
)
from jobs.queue._db import PreparedStatementsRefused
from jobs.queue.claim import claim, claim_sql
from jobs.queue.cycle import record_and_claim
from jobs.queue.enqueue import enqueue, enqueue_many
from jobs.queue.maintenance import (
    backlog,
    fail_exhausted,
    pending,
    prune,
    requeue_expired,
    table_health,
)
from jobs.queue.operations import cancel, cancel_active, cancel_running, replay, run_now
from jobs.queue.outcomes import complete, fail, record, release, retry
from jobs.queue.pauses import pause, paused, resume, throttle
from jobs.queue.renewal import next_attempt, renew, renew_leases, renew_tokens
from jobs.queue.types import (
    BACKLOG_CAP,
    RESULT_MAX,
    RETRY_DELAY_MAX,
    AllTenants,
    AllTenantsExcept,
    BacklogRow,
    BatchFailure,
    BatchState,
    ClaimedJob,
    ClaimRequest,
    Enqueued,
    InvalidJob,
    InvalidResult,
    NewJob,
    OnlyTenant,
    Outcome,
    OutcomeReport,
    ProcessBeat,
    Renewal,
    ReplayReport,
    Scope,
    SweepRow,
    TableHealth,
)

__all__ = [
    "BACKLOG_CAP",
    "RESULT_MAX",
    "RETRY_DELAY_MAX",
    "AllTenants",
    "AllTenantsExcept",
    "BacklogRow",
    "BatchFailure",
    "BatchState",
    "ClaimRequest",
    "ClaimedJob",
    "Enqueued",
    "InvalidJob",
    "InvalidResult",
    "NewJob",
    "OnlyTenant",
    "Outcome",
    "OutcomeReport",
    "PreparedStatementsRefused",
    "ProcessBeat",
    "Renewal",
    "ReplayReport",
    "Scope",
    "SweepRow",
    "TableHealth",
    "attempts",
    "backlog",
    "batches",
    "bound",
    "cancel",
    "cancel_active",
    "cancel_running",
    "claim",
    "claim_sql",
    "complete",
    "counts",
    "dependencies",
    "enqueue",
    "enqueue_many",
    "fail",
    "fail_exhausted",
    "flow",
    "history",
    "next_attempt",
    "pause",
    "paused",
    "pauses",
    "pending",
    "processes",
    "prune",
    "record",
    "record_and_claim",
    "release",
    "renew",
    "renew_leases",
    "renew_tokens",
    "replay",
    "requeue_expired",
    "resume",
    "retry",
    "rollup",
    "rollup_compaction",
    "rollup_reads",
    "run_now",
    "table_health",
    "throttle",
]
