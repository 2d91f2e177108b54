"""The app's tables, one module a concern: the jobs table, its history and how far ahead the
history is ready (:mod:`.jobs`), the operator's tables (:mod:`.operators`), recorded schedule
slots (:mod:`.schedules`), the console's rollups (:mod:`.console`), flow control's state
(:mod:`.flow`), and workflows: batches, dependencies, effects (:mod:`.workflows`).

Every state change of the jobs table goes through :mod:`jobs.queue`. The models import
nothing above them; the run contract they share is :mod:`jobs.runs`.
"""

from jobs.models.console import BacklogSample, HistogramField, Rollup, RollupOutcome
from jobs.models.flow import FairAccount, FlowGate, TenantBucket, TenantWeight
from jobs.models.jobs import (
    HistoryReady,
    Job,
    JobHistory,
    default_max_attempts,
    default_queue,
    default_tenant,
    new_job_id,
    new_job_ids,
)
from jobs.models.operators import Pause, PauseKind, Process, ProcessComponent, TenantOverride
from jobs.models.schedules import ScheduleSlot, SlotKind
from jobs.models.workflows import (
    Batch,
    Dependency,
    DependencyFailure,
    Effect,
    EffectState,
    Settlement,
)

__all__ = [
    "BacklogSample",
    "Batch",
    "Dependency",
    "DependencyFailure",
    "Effect",
    "EffectState",
    "FairAccount",
    "FlowGate",
    "HistogramField",
    "HistoryReady",
    "Job",
    "JobHistory",
    "Pause",
    "PauseKind",
    "Process",
    "ProcessComponent",
    "Rollup",
    "RollupOutcome",
    "ScheduleSlot",
    "Settlement",
    "SlotKind",
    "TenantBucket",
    "TenantOverride",
    "TenantWeight",
    "default_max_attempts",
    "default_queue",
    "default_tenant",
    "new_job_id",
    "new_job_ids",
]
