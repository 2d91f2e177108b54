"""One delivery row per outgoing message: its failure is a "not delivered" status."""

from __future__ import annotations

from collections.abc import Iterable

from django.db import models
from django.db.models import Q
from django.utils.translation import gettext_lazy as _

from jobs.runs import TERMINAL_STATES, RunContract, RunState

STATUS = {
    RunState.QUEUED: _("pending"),
    RunState.RUNNING: _("sending"),
    RunState.SUCCEEDED: _("delivered"),
    RunState.FAILED: _("not delivered"),
    RunState.CANCELLED: _("cancelled"),
}


class Delivery(RunContract):
    """A message to one recipient. ``job_id`` is the sender's key ("welcome-42").

    Retries happen in the jobs table (the mail job's policy); this row follows along and,
    when the last attempt fails, says "not delivered". Replay resends the message with the
    same job (``job_pk``), so the failed job and this row are resolved together.
    """

    to = models.EmailField(_("to"))
    subject = models.CharField(_("subject"), max_length=200)
    body = models.TextField(_("body"), blank=True, default="")
    sent_at = models.DateTimeField(_("sent at"), null=True, blank=True)
    resends = models.PositiveIntegerField(_("resends"), default=0)
    job_pk = models.BigIntegerField(
        _("job"), null=True, blank=True, help_text=_("The job delivering it; a resend replays it.")
    )

    monitor_job_type = "mail.deliver.v1"
    replay_description = _("resend the message")

    class Meta(RunContract.Meta):
        verbose_name = _("delivery")
        verbose_name_plural = _("deliveries")
        permissions = [("replay_delivery", _("Can resend undelivered mail"))]
        indexes = [
            models.Index(
                fields=["state", "finished_at"],
                condition=Q(state__in=TERMINAL_STATES),
                name="mail_delivery_finished",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.subject} → {self.to} ({self.status})"

    @property
    def status(self) -> str:
        """The mail team's word for the state: pending, sending, delivered, not delivered."""
        return str(STATUS.get(self.state, self.state))

    @classmethod
    def replay(cls, pks: Iterable[int], *, by: str) -> int:
        """Resend undelivered messages: the same row goes back to pending, its job replayed."""
        from project.mail import deliveries

        return len(deliveries.resend(pks, by=by))
