"""Durable background jobs for Django on PostgreSQL.

The public API for defining and enqueueing job types. Importing this package must stay cheap
and must not touch models: it is imported before Django's app registry is ready.
"""

# A plain literal: setuptools reads it at build time without importing the package, and it is
# right in a checkout that was never installed. The one place the version is written.
__version__ = "0.1.0"

from jobs.api.batches import Batch, batch
from jobs.api.effects import complete, effect, effect_key
from jobs.api.producer import JobSpec, enqueue, enqueue_many
from jobs.catalogue.payloads import InvalidPayload, Payload
from jobs.catalogue.registry import Backoff, Policy, Rate, job, register
from jobs.core.context import JobContext
from jobs.errors import Cancelled, LeaseLost, Reject, RetryAfter

__all__ = [
    "Backoff",
    "Batch",
    "Cancelled",
    "InvalidPayload",
    "JobContext",
    "JobSpec",
    "LeaseLost",
    "Payload",
    "Policy",
    "Rate",
    "Reject",
    "RetryAfter",
    "batch",
    "complete",
    "effect",
    "effect_key",
    "enqueue",
    "enqueue_many",
    "job",
    "register",
]
