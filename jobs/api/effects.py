"""Idempotency at the effect boundary: effect keys, the effect journal, transactional completion.

A job runs at least once, so a step that changes the outside world (charge a card, send a
message) must be safe to repeat. Three tools, from the cheapest (docs/effects.md):

* :func:`effect_key` — a stable key per (job row, step), for an API that deduplicates on an
  idempotency key: every attempt of the row sends the same key, so a repeat is a no-op there.
* :func:`effect` — a journal for two-phase effects::

      (nothing) ──intent (committed)──▶ call(key) ──result (committed)──▶ done
                       │ crash mid-call
                       ▼
      next attempt: done?  return the result, no call
                    intent? reconcile(key) when given (ask what happened), else call again
                            with the same key

* :func:`complete` — mark the job succeeded inside the handler's own transaction, so the
  business write and ``succeeded`` commit together or not at all; fenced by the claim token.

Every write is conditional on the attempt's claim token: an attempt whose lease was lost
records nothing and gets :class:`~jobs.errors.LeaseLost`. Importing this module touches no
model: the queue is imported when a function is called.
"""

from __future__ import annotations

import json
import threading
import uuid
import weakref
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.transaction import TransactionManagementError

from jobs.core.context import JobContext
from jobs.errors import LeaseLost

if TYPE_CHECKING:
    from jobs.queue import ClaimedJob

T = TypeVar("T")

#: The longest step name the journal stores.
STEP_MAX = 200

# uuid5's namespace for effect keys. Changing it changes every key: never do.
_NAMESPACE = uuid.UUID("6a6f6273-6566-6665-6374-6b6579730001")

# Per attempt (the worker's context object), held only as long as the context lives: the
# job row's created_at, and whether the handler's transaction completed the job.
_lock = threading.Lock()
_created: weakref.WeakKeyDictionary[JobContext, datetime] = weakref.WeakKeyDictionary()
_completed: weakref.WeakSet[JobContext] = weakref.WeakSet()


def key_for(row_id: int, created_at: datetime, step: str) -> str:
    """The effect key of ``step`` of the job row ``row_id`` created at ``created_at``."""
    stamp = created_at.astimezone(UTC).isoformat(timespec="microseconds")
    return str(uuid.uuid5(_NAMESPACE, f"{row_id}\x1f{stamp}\x1f{step}"))


def effect_key(ctx: JobContext, step: str) -> str:
    """A key for ``step`` of this job, the same on every attempt and replay of its row.

    Pass it to an external API as its idempotency key (Stripe's ``Idempotency-Key``, a
    message id): a retried attempt then repeats the request, not the effect. It is a UUID
    string (36 characters, within every payment provider's limit), derived from the row's
    id, the row's creation time and ``step``, so it differs between rows (also a row re-
    enqueued under the same ``job_id``), between steps, and between databases whose id
    sequences collide. Reads the row's creation time once per attempt.
    """
    _check_step(step)
    return key_for(ctx.id, _created_at(ctx), step)


class EffectStep:
    """One journaled step of a job (:func:`effect`); :meth:`run` makes its call at most once
    per success, and reconciles after a crash mid-call."""

    def __init__(self, ctx: JobContext, step: str) -> None:
        _check_step(step)
        self.ctx = ctx
        self.step = step

    @property
    def key(self) -> str:
        """The key the step's call gets (:func:`effect_key`)."""
        return effect_key(self.ctx, self.step)

    def run(
        self,
        call: Callable[[str], T],
        *,
        reconcile: Callable[[str], T | None] | None = None,
    ) -> T:
        """Make ``call(key)`` unless the journal has its result; return the result.

        * Done before (a replay, or a retry after a later step failed): the recorded result,
          ``call`` is not made.
        * Only the intent recorded (an earlier attempt died or failed mid-call, so the call
          may have happened): ``reconcile(key)`` when given, which asks the provider; a
          result means it happened and is recorded, None means it did not and ``call`` is
          made. Without ``reconcile``, ``call`` is made again with the same key: safe only
          with a provider that deduplicates on it.
        * Otherwise the intent is committed, then ``call(key)`` is made, then its result is
          committed.

        The result must be JSON (keep the provider's id and status, not its response object);
        the value returned is the result as stored, so a first run and a replay return the
        same. Must be called outside a transaction (its writes commit before and after the
        call). Raises :class:`~jobs.errors.LeaseLost` when this attempt no longer holds the
        job (nothing is recorded then), and whatever ``call`` or ``reconcile`` raise (the
        intent stays: the next attempt reconciles).
        """
        token, created_at, found = self._begin()
        if found is not None and found.state == "done":
            return found.result  # type: ignore[no-any-return]  # JSON as the call returned it
        key = found.key if found is not None else key_for(self.ctx.id, created_at, self.step)
        if found is not None and reconcile is not None:
            happened = reconcile(key)
            if happened is not None:
                return self._done(token, key, happened)
        self._intent(token, key)
        return self._done(token, key, call(key))

    async def arun(
        self,
        call: Callable[[str], Awaitable[T]],
        *,
        reconcile: Callable[[str], Awaitable[T | None]] | None = None,
    ) -> T:
        """:meth:`run` for an ``async def`` handler: ``call`` and ``reconcile`` are awaited,
        the journal's writes run in ``sync_to_async`` (the job's own connection)."""
        from asgiref.sync import sync_to_async

        token, created_at, found = await sync_to_async(self._begin)()
        if found is not None and found.state == "done":
            return found.result  # type: ignore[no-any-return]
        key = found.key if found is not None else key_for(self.ctx.id, created_at, self.step)
        if found is not None and reconcile is not None:
            happened = await reconcile(key)
            if happened is not None:
                return await sync_to_async(self._done)(token, key, happened)
        await sync_to_async(self._intent)(token, key)
        result = await call(key)
        return await sync_to_async(self._done)(token, key, result)

    # -- the journal's writes -------------------------------------------------------------

    def _begin(self) -> tuple[uuid.UUID, datetime, Any]:
        from jobs.queue import effects as journal

        ctx = self.ctx
        token = _token(ctx, "jobs.effect()")
        if connections[ctx.using].in_atomic_block:
            raise TransactionManagementError(
                "an effect's run() must be called outside transaction.atomic(): its intent "
                "must commit before the call is made, and its result right after"
            )
        created_at, found = journal.read(ctx.id, self.step, using=ctx.using)
        if created_at is None:
            raise LeaseLost(f"job {ctx.job_id} is no longer running: its row has left the table")
        _remember_created(ctx, created_at)
        return token, created_at, found

    def _intent(self, token: uuid.UUID, key: str) -> None:
        from jobs.queue import effects as journal

        ctx = self.ctx
        if journal.record_intent(ctx.id, token, self.step, key, ctx.attempt, using=ctx.using):
            return
        raise LeaseLost(
            f"job {ctx.job_id}: attempt {ctx.attempt} no longer holds the job; "
            f"the effect {self.step!r} was not started"
        )

    def _done(self, token: uuid.UUID, key: str, result: T) -> T:
        from jobs.queue import effects as journal
        from jobs.queue import text
        from jobs.queue.types import InvalidResult

        ctx = self.ctx
        try:
            encoded = text.dumps(result)
        except ValueError as exc:
            raise InvalidResult(
                f"the result of effect {self.step!r} cannot be stored as JSON ({exc}); the call "
                f"was made with key {key}, and the next attempt will reconcile"
            ) from None
        if not journal.record_done(ctx.id, token, self.step, encoded, ctx.attempt, using=ctx.using):
            raise LeaseLost(
                f"job {ctx.job_id}: attempt {ctx.attempt} no longer holds the job; the effect "
                f"{self.step!r} was made (key {key}) but its result was not recorded: the "
                "attempt that holds the job now will reconcile"
            )
        return json.loads(encoded)  # type: ignore[no-any-return]  # as a replay returns it


def effect(ctx: JobContext, step: str) -> EffectStep:
    """The journaled step ``step`` of this job: ``jobs.effect(ctx, "charge").run(call)``.

    ``step`` names the effect within the job (up to 200 characters); each step of a job is
    journaled once, whichever attempt makes it.
    """
    return EffectStep(ctx, step)


def complete(ctx: JobContext, result: Any = None) -> None:
    """Mark this job succeeded in the caller's open transaction, fenced by the claim token.

    Call it last inside the handler's ``transaction.atomic(using=ctx.using)`` block, after the
    business writes: they and ``succeeded`` (with ``result`` and the attempt log entry) commit
    together or not at all (the console's count follows within a second, from the worker, as
    for every outcome it writes). Raises :class:`~jobs.errors.LeaseLost`
    when this attempt no longer holds the job: let it propagate, so the block rolls back and
    the business write is not saved. Once the transaction commits, the worker writes no
    other outcome for this attempt (whatever the handler does afterwards); if it rolls back,
    the worker writes the handler's outcome as usual.

    The job row stays locked until the transaction ends: keep the block short after this
    call. Outside a transaction it raises ``TransactionManagementError`` (there would be
    nothing to commit it with; return from the handler instead). Raises
    :class:`~jobs.queue.InvalidResult` for a result that is not storable JSON.
    """
    from jobs import queue
    from jobs.queue import effects as journal

    token = _token(ctx, "jobs.complete()")
    if not connections[ctx.using].in_atomic_block:
        raise TransactionManagementError(
            "jobs.complete() must be called inside transaction.atomic(using=ctx.using), "
            "with the business writes it completes the job with"
        )
    outcome = queue.Outcome.succeeded(_as_claimed(ctx, token), result)
    # The row locked first, waiting out a lease renewal: the write below cannot find it busy.
    if not journal.hold(ctx.id, token, using=ctx.using):
        raise LeaseLost(
            f"job {ctx.job_id}: attempt {ctx.attempt} no longer holds the job (its lease was "
            "lost, or it was completed already); roll back"
        )
    # Counted by the worker once it learns of the commit, as it counts its own outcomes (the
    # rollup's upsert in this statement would cost the handler's transaction a third more).
    report = queue.record([outcome], count=False, using=ctx.using)
    if not report.applied:  # not expected while the row is held: never report success then
        raise LeaseLost(f"job {ctx.job_id}: the completion was not written; roll back")
    transaction.on_commit(lambda: _mark_completed(ctx), using=ctx.using, robust=True)


def completed_by_handler(ctx: JobContext) -> bool:
    """For the worker: True once a :func:`complete` of this attempt has committed."""
    with _lock:
        return ctx in _completed


def _mark_completed(ctx: JobContext) -> None:
    with _lock:
        _completed.add(ctx)


def _as_claimed(ctx: JobContext, token: uuid.UUID) -> ClaimedJob:
    """The claimed job as the context knows it (an outcome reads its id and token only)."""
    from jobs.queue import ClaimedJob

    return ClaimedJob(
        id=ctx.id,
        job_id=ctx.job_id,
        name=ctx.name,
        payload={},
        tenant=ctx.tenant,
        queue="",
        priority=0,
        attempts=ctx.attempt,
        max_attempts=ctx.max_attempts,
        claim_token=token,
        latency=0.0,
    )


def _token(ctx: JobContext, what: str) -> uuid.UUID:
    if ctx.claim_token is None:
        raise ValueError(
            f"{what} needs the context the worker passed to the handler (it carries the "
            "attempt's claim token)"
        )
    return ctx.claim_token


def _check_step(step: object) -> None:
    if not isinstance(step, str) or not step or len(step) > STEP_MAX:
        raise ValueError(f"an effect's step must be 1-{STEP_MAX} characters, got {step!r}")


def _created_at(ctx: JobContext) -> datetime:
    with _lock:
        created = _created.get(ctx)
    if created is not None:
        return created
    from jobs.queue import effects as journal

    found, _ = journal.read(ctx.id, "", using=ctx.using or DEFAULT_DB_ALIAS)
    if found is None:
        raise LeaseLost(f"job {ctx.job_id} is no longer running: its row has left the table")
    _remember_created(ctx, found)
    return found


def _remember_created(ctx: JobContext, created_at: datetime) -> None:
    with _lock:
        _created[ctx] = created_at
