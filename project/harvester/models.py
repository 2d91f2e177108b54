"""Harvested items, and the dead-letter table where the items that failed to harvest settle."""

from __future__ import annotations

from collections.abc import Iterable

from django.db import models
from django.db.models import Q
from django.utils.translation import gettext_lazy as _

from jobs.runs import TERMINAL_STATES, RunContract


class Item(models.Model):
    """Something to fetch from a source; ``harvested_at`` is set once it was fetched."""

    url = models.URLField(_("url"), max_length=500)
    title = models.CharField(_("title"), max_length=200, blank=True, default="")
    content = models.TextField(_("content"), blank=True, default="")
    harvested_at = models.DateTimeField(_("harvested at"), null=True, blank=True)

    class Meta:
        verbose_name = _("item")
        verbose_name_plural = _("items")

    def __str__(self) -> str:
        return self.title or self.url


class DeadLetter(RunContract):
    """An item that failed to harvest. Its home is here, not in a broker.

    ``failed`` is dead; a re-pick (replay) moves it to ``queued`` and replays the harvest job
    that failed (``job_pk``), ``running`` while a harvest of the item works, and ``succeeded``
    once the item was harvested, by whichever job: a replay of the failed job from the jobs
    table resolves it too. A failed re-pick lands it back in ``failed`` with one more attempt
    counted.
    """

    item = models.ForeignKey(
        Item, on_delete=models.CASCADE, related_name="dead_letters", verbose_name=_("item")
    )
    next_retry_at = None  # re-picks are an operator's (or a reconcile pass's) decision
    job_pk = models.BigIntegerField(
        _("job"), null=True, blank=True, help_text=_("The job that failed; a re-pick replays it.")
    )

    monitor_job_type = "harvester.harvest.v1"
    replay_description = _("re-pick the item: harvest it again from its source")

    class Meta(RunContract.Meta):
        verbose_name = _("dead letter")
        verbose_name_plural = _("dead letters")
        permissions = [("replay_deadletter", _("Can re-pick dead-lettered items"))]
        indexes = [
            models.Index(
                fields=["state", "finished_at"],
                condition=Q(state__in=TERMINAL_STATES),
                name="harvester_deadletter_finished",
            ),
        ]

    def __str__(self) -> str:
        return f"item {self.item_id} ({self.state})"

    @classmethod
    def replay(cls, pks: Iterable[int], *, by: str) -> int:
        """Re-pick dead-lettered items: harvest each one again, with the job that failed."""
        from project.harvester import dead_letters

        return len(dead_letters.repick(pks, by=by))
