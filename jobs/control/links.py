"""A job and the run row it drives, found from either side, so one failure reads as one.

A job type bound to a run table (``Policy(run_model=…, run_field=…)``) names its row in its
payload, and that is the whole link::

    job (jobs_job or jobs_jobhistory) ── payload ->> run_field = row pk ──▶ run row

* **job → row** reads the payload of the jobs at hand, by id, and then the rows by pk.
* **row → job** searches the jobs of the bound types for a payload naming the row. No index
  covers a payload key, so the search is narrowed by what the binding guarantees: the job is
  active while its row is, and finished no earlier than the row was created. A list asks for
  jobs in step with its rows (finished with finished rows, active with active ones); one row's
  page asks for any state.
* **fold**: in a list over both homes, a run row whose job is listed too is left out, in SQL,
  so counts and pages agree: the job's line stands for both and links to the row.

The bindings come from this process's registry, as the worker's do.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db.models import Case, Exists, OuterRef, Q, QuerySet, TextField, Value, When
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast

from jobs.catalogue.registry import get_registry
from jobs.control.tables import Row, RunTable
from jobs.runs import ACTIVE_STATES, RunContract


@dataclass(frozen=True)
class Bound:
    """A job type that drives rows of ``model``: ``payload[field]`` is the row's pk."""

    name: str
    model: type[RunContract]
    field: str


@dataclass(frozen=True)
class Link:
    """The other home of one piece of work: a job's run row, or a run row's job."""

    table: RunTable
    pk: Any
    state: str

    @property
    def token(self) -> str:
        return f"{self.table.label}:{self.pk}"

    @property
    def admin_url(self) -> str | None:
        return self.table.change_url(self.pk)


def bound_types() -> list[Bound]:
    """Every registered job type bound to a run table."""
    registry = get_registry()
    return [
        Bound(name, policy.run_model, policy.run_field)
        for name in registry.names()
        if (policy := registry[name].policy).run_model is not None
    ]


def fold(queries: Sequence[tuple[RunTable, QuerySet[Any]]]) -> list[tuple[RunTable, QuerySet[Any]]]:
    """The same queries, where a run row whose job one of the jobs queries matches is left out.

    One ``NOT EXISTS`` per jobs query on each bound table; tables nothing drives are as they
    were. Without a jobs query (filtered out, or not visible) nothing is folded.
    """
    jobs = [qs for table, qs in queries if table.is_jobs]
    bounds = bound_types()
    if not jobs or not bounds:
        return list(queries)
    folded = []
    for table, qs in queries:
        mine = [b for b in bounds if b.model is table.model]
        if mine and not table.is_jobs:
            row = Cast(OuterRef("pk"), TextField())
            for job_qs in jobs:
                qs = qs.filter(~Exists(_naming(job_qs, mine).filter(m_run=row)))
        folded.append((table, qs))
    return folded


def foldable(tables: Iterable[RunTable]) -> list[str]:
    """Labels of the tables among ``tables`` whose rows :func:`fold` may leave out."""
    tables = list(tables)
    if not any(t.is_jobs for t in tables):
        return []
    bound = {b.model for b in bound_types()}
    return [t.label for t in tables if t.model in bound and not t.is_jobs]


def links_for(rows: Sequence[Row], tables: Sequence[RunTable]) -> dict[str, Link]:
    """For each row of a list that has one, by its token: its job's run row, or its row's job.

    ``tables`` are those the operator may see: a link into any other is left out. A fixed
    number of queries: per jobs table and per bound table on the list, whatever the rows.
    """
    bounds = bound_types()
    if not bounds:
        return {}
    names = {b.name for b in bounds}
    jobs: dict[RunTable, list[Any]] = defaultdict(list)
    for r in rows:
        if r.table.is_jobs and r.job_type in names:
            jobs[r.table].append(r.pk)
    links = _runs_of_jobs(jobs, bounds, tables)
    for table in {r.table.label: r.table for r in rows if not r.table.is_jobs}.values():
        mine = [b for b in bounds if b.model is table.model]
        if mine:
            rows_here = [r for r in rows if r.table is table]
            found = jobs_of_rows(
                mine, [(r.pk, r.state, r.created_at) for r in rows_here], tables, in_step=True
            )
            links.update({r.token: found[r.pk] for r in rows_here if r.pk in found})
    return links


def link_of(table: RunTable, pk: Any, tables: Sequence[RunTable]) -> Link | None:
    """The other home of one row, for its own page: a job's run row, or a run row's newest job."""
    bounds = bound_types()
    if not bounds:
        return None
    if table.is_jobs:
        return _runs_of_jobs({table: [pk]}, bounds, tables).get(f"{table.label}:{pk}")
    mine = [b for b in bounds if b.model is table.model]
    row = table.model._default_manager.filter(pk=pk).values("state", "created_at").first()
    if not mine or row is None:
        return None
    found = jobs_of_rows(mine, [(pk, row["state"], row["created_at"])], tables, in_step=False)
    return found.get(pk)


def jobs_of_rows(
    bounds: Sequence[Bound],
    rows: Sequence[tuple[Any, str, datetime]],
    tables: Sequence[RunTable],
    *,
    in_step: bool,
) -> dict[Any, Link]:
    """The newest job naming each of ``rows`` (pk, state, created_at) of one bound table.

    ``in_step`` looks only where the binding keeps a job while its row is in that state:
    finished rows' jobs among finished jobs, active rows' jobs among active ones.
    """
    if not rows:
        return {}
    keys = {str(pk): pk for pk, _state, _created in rows}
    since = min(created for _pk, _state, created in rows)
    active = any(state in ACTIVE_STATES for _pk, state, _created in rows)
    finished = any(state not in ACTIVE_STATES for _pk, state, _created in rows)
    when = Q()
    if active or not in_step:
        when |= Q(state__in=ACTIVE_STATES)
    if finished or not in_step:
        when |= ~Q(state__in=ACTIVE_STATES) & Q(finished_at__gte=since)
    found: dict[Any, tuple[int, Link]] = {}
    for table in (t for t in tables if t.is_jobs):
        jobs = _naming(table.model._default_manager.filter(when), bounds)
        for job_pk, state, key in jobs.filter(m_run__in=list(keys)).values_list(
            "pk", "state", "m_run"
        ):
            pk = keys[key]
            if pk not in found or found[pk][0] < job_pk:
                found[pk] = (job_pk, Link(table, job_pk, state))
    return {pk: link for pk, (_job, link) in found.items()}


def _runs_of_jobs(
    jobs: dict[RunTable, list[Any]], bounds: Sequence[Bound], tables: Sequence[RunTable]
) -> dict[str, Link]:
    """The run row of each job, by the job's token: its payload, then the row by pk."""
    by_name = {b.name: b for b in bounds}
    wanted: dict[type[RunContract], dict[Any, list[str]]] = defaultdict(lambda: defaultdict(list))
    for table, pks in jobs.items():
        if not pks:
            continue
        named = _naming(table.model._default_manager.filter(pk__in=pks), bounds)
        for job_pk, name, key in named.values_list("pk", "name", "m_run"):
            bound = by_name[name]
            try:
                run_pk = None if key is None else bound.model._meta.pk.to_python(key)
            except ValidationError:  # not a key of that table: it names no row
                continue
            if run_pk is not None:
                wanted[bound.model][run_pk].append(f"{table.label}:{job_pk}")
    visible = {t.model: t for t in tables}
    links: dict[str, Link] = {}
    for model, named_by in wanted.items():
        run_table = visible.get(model)
        if run_table is None:
            continue
        for run_pk, state in model._default_manager.filter(pk__in=list(named_by)).values_list(
            "pk", "state"
        ):
            for token in named_by[run_pk]:
                links[token] = Link(run_table, run_pk, state)
    return links


def _naming(jobs: QuerySet[Any], bounds: Sequence[Bound]) -> QuerySet[Any]:
    """``jobs`` of the bound types, annotated ``m_run``: the run row's pk as text."""
    key = Case(
        *(When(name=b.name, then=KeyTextTransform(b.field, "payload")) for b in bounds),
        default=Value(None),
        output_field=TextField(),
    )
    named: QuerySet[Any] = jobs.filter(name__in=[b.name for b in bounds]).annotate(m_run=key)
    return named
