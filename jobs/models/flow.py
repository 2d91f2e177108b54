"""Flow control's shared state: fleet-wide gates, tenant rate buckets, weights and fair shares."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _


class FlowGate(models.Model):
    """One row per job type with a limit the whole fleet shares (jobs.queue.flow).

    Every claim of such a type locks its row and, when it starts jobs, bumps ``version``: a
    claim that finds the row changed since its snapshot claims nothing this time, so the
    running jobs and buckets each claim reads are exact. ``tokens`` and ``refilled_at`` are
    the type's rate-limit bucket. ``tenant_ordered`` tells enqueue to put the type's jobs in
    the per-tenant claim index. Written by workers from their registry and by claims only.
    """

    name = models.CharField(_("job type"), max_length=200, primary_key=True)
    version = models.BigIntegerField(default=0)
    tokens = models.FloatField(null=True)
    refilled_at = models.DateTimeField(db_default=Now())
    tenant_ordered = models.BooleanField(default=False)
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "jobs_flow"
        verbose_name = _("flow gate")
        verbose_name_plural = _("flow gates")

    def __str__(self) -> str:
        return self.name


class TenantBucket(models.Model):
    """A (job type, tenant) rate-limit bucket, written by the claims of that type only."""

    pk = models.CompositePrimaryKey("name", "tenant")
    name = models.CharField(_("job type"), max_length=200)
    tenant = models.CharField(_("tenant"), max_length=64)
    tokens = models.FloatField()
    refilled_at = models.DateTimeField()

    class Meta:
        db_table = "jobs_flowtenant"
        verbose_name = _("tenant bucket")
        verbose_name_plural = _("tenant buckets")

    def __str__(self) -> str:
        return f"{self.name} / {self.tenant}"


class TenantWeight(models.Model):
    """A tenant's weight in the fair order of fair job types: twice the weight, twice the share.

    Tenants without a row weigh 1.
    """

    tenant = models.CharField(_("tenant"), max_length=64, primary_key=True)
    weight = models.PositiveIntegerField(_("weight"), default=1)

    class Meta:
        verbose_name = _("tenant weight")
        verbose_name_plural = _("tenant weights")
        constraints = [
            models.CheckConstraint(
                condition=Q(weight__gte=1, weight__lte=1000), name="jobs_tenantweight_range"
            )
        ]

    def __str__(self) -> str:
        return f"{self.tenant} (weight {self.weight})"


class FairAccount(models.Model):
    """A tenant's account in the fair order of a fair job type without tenant limits: its
    starts so far, each counted as 1/weight, so that the claims serve the least served first
    and each tenant's share of the starts follows its weight over time (jobs.queue.flow).

    ``served`` is NULL while the account is at rest (the tenant had nothing due when a claim
    read it): it comes back into play level with the least served. ``starts`` counts every
    start in fair order. Written by the claims of that type only.
    """

    pk = models.CompositePrimaryKey("name", "tenant")
    name = models.CharField(_("job type"), max_length=200)
    tenant = models.CharField(_("tenant"), max_length=64)
    served = models.FloatField(null=True)
    starts = models.BigIntegerField(db_default=0)

    class Meta:
        verbose_name = _("fair account")
        verbose_name_plural = _("fair accounts")
        indexes = [
            # The claim reads a type's accounts in play least served first.
            models.Index(
                fields=["name", "served", "tenant"],
                name="jobs_fairaccount_served",
                condition=Q(served__isnull=False),
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} / {self.tenant}"
