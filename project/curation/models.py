"""Documents of a collection, and a run row per curation pass over a collection."""

from __future__ import annotations

from collections.abc import Iterable

from django.db import models
from django.db.models import Q
from django.utils.translation import gettext_lazy as _

from jobs.runs import TERMINAL_STATES, RunContract, RunState


class Document(models.Model):
    """One document of a collection; a pass curates it (a body is required)."""

    collection = models.CharField(_("collection"), max_length=100, db_index=True)
    title = models.CharField(_("title"), max_length=200)
    body = models.TextField(_("body"), blank=True, default="")
    curated_at = models.DateTimeField(_("curated at"), null=True, blank=True)

    class Meta:
        verbose_name = _("document")
        verbose_name_plural = _("documents")

    def __str__(self) -> str:
        return f"{self.collection}: {self.title}"


class CurationRun(RunContract):
    """One pass over a collection. A pass is never retried: the next pass starts anew.

    ``job_id`` is ``curation-<collection>``, so the active-state lock allows one running
    pass per collection. Replaying a failed run starts a new run (``replay_of`` points back
    at it) that its failed pass job, replayed, works on (``job_pk``); the failed run stays as
    it was, as the record of that pass. Replaying that job from the jobs table does the same.
    """

    collection = models.CharField(_("collection"), max_length=100)
    replay_of = models.OneToOneField(
        "self",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="replayed_as",
        verbose_name=_("replay of"),
    )
    requested_by = models.CharField(_("requested by"), max_length=150, blank=True, default="")
    stats = models.JSONField(_("step stats"), default=dict, blank=True)
    job_pk = models.BigIntegerField(
        _("job"), null=True, blank=True, help_text=_("The pass job working on this run.")
    )
    attempts = None  # a run is one pass: no attempt counter
    next_retry_at = None  # and no retry schedule

    monitor_job_type = "curation.pass.v1"
    replay_description = _("start a new curation run over the collection (not a retry)")

    class Meta(RunContract.Meta):
        verbose_name = _("curation run")
        verbose_name_plural = _("curation runs")
        permissions = [("replay_curationrun", _("Can start a new run for a failed curation run"))]
        indexes = [
            models.Index(
                fields=["state", "finished_at"],
                condition=Q(state__in=TERMINAL_STATES),
                name="curation_run_finished",
            ),
        ]

    def __str__(self) -> str:
        return f"curation of {self.collection} #{self.pk} ({self.state})"

    @classmethod
    def replay_eligible(cls) -> Q:
        """Failed runs that no newer run has replaced yet."""
        return Q(state=RunState.FAILED, replayed_as__isnull=True)

    @classmethod
    def replay(cls, pks: Iterable[int], *, by: str) -> int:
        """Start a new run for each failed run (the failed run is kept as it was)."""
        from project.curation import passes

        return len(passes.rerun(pks, by=by))
