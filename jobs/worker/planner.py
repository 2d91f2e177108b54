"""Claim planning: which types the next claim asks for, and how many jobs of each.

Each pass the run loop asks the planner for its claim requests (:meth:`ClaimPlanner.requests`)
and tells it what the claim returned (:meth:`ClaimPlanner.claimed`). Between the two it keeps:

- a **rotation** over the types the worker serves, so none always comes first;
- **fair shares**: the free slots are shared among the types that want them, so one type with
  a large (or no) ``concurrency`` cannot take every slot while another waits; slots a type
  leaves unused go round again at once;
- the **exhausted** types: one whose claim came up short has nothing more due right now and is
  skipped until a NOTIFY for it (:meth:`ClaimPlanner.notice`) or the next poll;
- the **held-back** types: one with flow controls (:mod:`jobs.queue.flow`) that came up short
  may have jobs due that its limits hold, and no NOTIFY says when a place frees elsewhere in
  the fleet, so it is tried again soon: at its bucket's next token or 50 ms, doubling while
  its claims come back empty, up to the poll interval;
- each tenant-ordered type's **cursor**, which the claim moves on from.

The NOTIFY listener's thread tells the planner of new work; the rest runs on the loop's thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter

from jobs.catalogue import routing as databases
from jobs.catalogue.registry import Registry
from jobs.db.sqlstate import one_line
from jobs.queue import ClaimedJob, ClaimRequest, flow
from jobs.worker.config import WorkerConfig
from jobs.worker.slots import Slots

logger = logging.getLogger("jobs.worker")

#: A NOTIFY brings a held-back limited type's next try forward to this long after its last.
NOTICE_RETRY = 0.1


class ClaimPlanner:
    """What the worker's next claim asks for (see the module docstring)."""

    def __init__(self, registry: Registry, config: WorkerConfig) -> None:
        self.registry = registry
        self.config = config
        # The types bound to this worker's database and the unbound ones (routing).
        self.names = list(databases.served(registry, config.database))
        # Each type's flow controls, and its gate rows (made once, before the first claim).
        self.limits = {
            name: limits
            for name in self.names
            if (limits := flow.limits_of(registry[name].policy)) is not None
        }
        self._gates_made = not self.limits
        self.cursors: dict[str, str] = {}
        # When a type held back by its limits is worth another try: (next try, empty tries
        # in a row, last try). The listener's thread moves the next try, under _lock.
        self._held_back: dict[str, tuple[float, int, float]] = {}
        self._exhausted: set[str] = set()
        # Names a NOTIFY announced since the last claim was sent (None: any name): such a
        # claim may have read before that commit, so its coming up short proves nothing.
        self._noticed: set[str | None] = set()
        self._shared: set[str] = set()  # names the last claim held below their own room
        self._rotation = 0
        self.next_poll = 0.0
        self._lock = threading.Lock()

    def described(self) -> str:
        """The types served, for the start-up log line. A type's own limit below the slot
        count is said, so a slow drain is not a mystery."""
        types = []
        for name in self.names:
            limit = self.registry[name].policy.concurrency
            capped = limit is not None and limit < self.config.concurrency
            types.append(f"{name} (at most {limit} at once)" if capped else name)
        return ", ".join(types) or "(none)"

    def ensure_gates(self) -> None:
        """Make the gate rows of the types with flow controls, once (raises DatabaseError)."""
        if not self._gates_made:
            flow.ensure(self.limits, using=self.config.database)
            self._gates_made = True

    # -- before the claim ------------------------------------------------------------------

    def requests(self, now: float, slots: Slots) -> list[ClaimRequest]:
        """The claim requests for the slots free now, rotating over the types."""
        if not self.names:
            return []
        if now >= self.next_poll:
            self._exhausted.clear()
            self.next_poll = now + self.config.poll_interval
        free, idle, running = slots.room()
        if free <= 0:
            return []
        count = len(self.names)
        self._rotation = (self._rotation + 1) % count
        rooms = []
        for name in self.names[self._rotation :] + self.names[: self._rotation]:
            held = self._held_back.get(name)
            if held is not None and held[0] != math.inf:
                if held[0] > now:
                    continue
                # Its wait is over: tried now (the claim's result sets the next wait), and no
                # longer a reason for the loop to wake.
                self._held_back[name] = (math.inf, held[1], held[2])
            if name in self._exhausted:
                continue
            policy = self.registry[name].policy
            # Not prefetched: a job under a fleet-wide limit or rate, which counts against
            # it from its claim. (Fair order alone is decided at the claim too; holding a job
            # a few ms more does not change it.)
            limits = self.limits.get(name)
            prefetched = limits is None or not limits.gated
            room = free if prefetched else min(free, idle)
            if policy.concurrency is not None:
                room = min(room, policy.concurrency - running.get(name, 0))
            if room > 0:
                rooms.append((name, room, policy.max_attempts))
        share = -(-free // len(rooms)) if rooms else 0
        self._shared = {name for name, room, _ in rooms if room > share}
        with self._lock:
            self._noticed.clear()  # the claim these requests are for reads after this
        return [ClaimRequest(name, min(room, share), cap) for name, room, cap in rooms]

    def waits(self, now: float) -> list[float]:
        """How long until each held-back type is due another try (when slots are free)."""
        with self._lock:
            return [max(0.0, at - now) for at, _, _ in self._held_back.values()]

    # -- after the claim -------------------------------------------------------------------

    def claimed(self, requests: list[ClaimRequest], claimed: list[ClaimedJob], free: int) -> bool:
        """Note what the claim for ``free`` slots returned; True when the loop should claim
        again at once (a type held to its share may take the slots left over)."""
        got = Counter(job.name for job in claimed)
        if self.limits:
            self._note_flow(requests, claimed, got)
            requests = [r for r in requests if r.name not in self.limits]
        if len(claimed) >= free:
            return False
        # A name that gave fewer jobs than asked has nothing more due right now; skip it
        # until a NOTIFY for it or the next poll. Not if a NOTIFY for it came while the
        # claim ran: the claim may have read before that job's commit.
        with self._lock:
            noticed = set(self._noticed)
        if None not in noticed:
            self._exhausted.update(
                r.name for r in requests if got[r.name] < r.limit and r.name not in noticed
            )
        return any(got[r.name] >= r.limit for r in requests if r.name in self._shared)

    def _note_flow(
        self, requests: list[ClaimRequest], claimed: list[ClaimedJob], got: Counter[str]
    ) -> None:
        """Move tenant cursors on; hold back a limited type that gave fewer jobs than asked."""
        now = time.monotonic()
        for request in requests:
            limits = self.limits.get(request.name)
            if limits is None:
                continue
            if limits.tenant_ordered:
                tenants = [job.tenant for job in claimed if job.name == request.name]
                after = self.cursors.get(request.name, "")
                self.cursors[request.name] = flow.next_cursor(after, tenants)
            if got[request.name] >= request.limit:
                with self._lock:
                    self._held_back.pop(request.name, None)
                continue
            streak = (
                self._held_back.get(request.name, (0.0, 0, 0.0))[1] + 1
                if not got[request.name]
                else 0
            )
            delay = min(
                self.config.poll_interval,
                flow.rate_retry_seconds(limits) * 2 ** min(streak, 16),
            )
            with self._lock:
                self._held_back[request.name] = (now + delay, streak, now)
            if streak % 8 == 3:
                self._restore_gate(request.name, limits)

    def _restore_gate(self, name: str, limits: flow.FlowLimits) -> None:
        """Empty tries in a row: a gate row gone (deleted by hand) would hold the type back
        for good, and costs one insert to put back. After the pass's commit: a failure here
        must not undo the pass (its claimed jobs are to dispatch)."""
        try:
            flow.restore_gates({name: limits}, using=self.config.database)
        except Exception as exc:
            logger.warning(
                "could not check the gate row of %s (%s)",
                name,
                one_line(exc),
                extra={"job_type": name, "action": "gate_check_failed"},
            )

    # -- news from elsewhere ---------------------------------------------------------------

    def notice(self, name: str | None) -> None:
        """A NOTIFY announced new work of ``name`` (None: of any name); another thread."""
        with self._lock:
            self._noticed.add(name)
        if name is None:
            self._exhausted.clear()
        else:
            self._exhausted.discard(name)
        # New work for a type held back is tried soon, since the type may have been held back
        # for want of due jobs; but new work is no room under a limit, so however many
        # notices come, the type is tried at most every NOTICE_RETRY.
        with self._lock:
            for held in [name] if name is not None else list(self._held_back):
                if held in self._held_back:
                    at, streak, tried = self._held_back[held]
                    self._held_back[held] = (min(at, tried + NOTICE_RETRY), streak, tried)

    def recovered(self) -> None:
        """Jobs were requeued (expired leases): they are due now, so every type is tried."""
        self._exhausted.clear()

    def look_again_by(self, at: float) -> None:
        """Claim again by ``at`` (monotonic) at the latest: a retry is due then that no
        NOTIFY will announce."""
        self.next_poll = min(self.next_poll, at)
