"""The pauses page: what no worker claims now, and the operator's pause and resume.

Every change goes through :mod:`jobs.control.pauses`, which checks ``jobs.pause_work``,
makes the change through the queue (a conditional insert or delete, so a double click acts
once) and records one ``LogEntry``; nothing here writes the table. Each control asks first
and acts only on the confirming POST::

    Pause…   GET  add/?kind=…&value=…[&reason=…][&next=…]  the form, or its confirmation
             POST add/ with post=yes                        pause, then back to ``next``
    Resume…  GET  <id>/resume/[?next=…]                     confirmation (delete/ is the same)
             POST <id>/resume/ with post=yes                resume, then back to ``next``
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import F, Q, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import url_has_allowed_host_and_scheme, urlencode
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from jobs.admin.display import duration, moment, now_of, second, with_now
from jobs.admin.inputs import CheckedInputs
from jobs.catalogue.registry import get_registry
from jobs.control import pauses
from jobs.control.inputs import validate_text
from jobs.models import Pause, PauseKind
from jobs.queue.pauses import VALUE_MAX, validate

VIA = "the admin"

#: What a pause of each kind does, on its confirmation page.
EFFECTS = {
    PauseKind.JOB_TYPE: _(
        "No worker claims jobs of this type until it is resumed: every worker on every host "
        "stops within one poll interval. Its backlog stays queued and keeps growing; jobs "
        "already running finish normally."
    ),
    PauseKind.QUEUE: _(
        "No worker claims jobs in this queue until it is resumed: every worker on every host "
        "stops within one poll interval. Its backlog stays queued and keeps growing; jobs "
        "already running finish normally."
    ),
    PauseKind.TENANT: _(
        "No worker claims jobs of this tenant until it is resumed: every worker on every host "
        "stops within one poll interval. Its backlog stays queued and keeps growing; jobs "
        "already running finish normally."
    ),
    PauseKind.SCHEDULE: _(
        "The scheduler fires no slot of this schedule from its next tick until it is resumed; "
        "its jobs already enqueued run normally. On resume, the slots that came due meanwhile "
        "are recorded as skipped and the next slot fires on time. The schedules page pauses "
        "configured schedules by name; a name no schedule has holds nothing back."
    ),
}
RESUMED = _("Workers claim its jobs again at once: idle ones are woken.")


class PauseForm(forms.Form):
    """What to pause: a kind, a name and why (shown on the overview and logged)."""

    kind = forms.ChoiceField(label=_("Kind"), choices=PauseKind.choices)
    value = forms.CharField(
        label=_("Name"),
        max_length=VALUE_MAX,
        validators=[validate_text],
        widget=forms.TextInput(attrs={"class": "vTextField"}),
        help_text=_("The job type (email.send.v1), queue or tenant, exactly as jobs name it."),
    )
    reason = forms.CharField(
        label=_("Reason"),
        max_length=200,
        required=False,
        validators=[validate_text],
        widget=forms.TextInput(attrs={"class": "vTextField"}),
        help_text=_("Shown on the overview and kept in the admin log."),
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if "kind" in data and "value" in data:
            try:
                validate(data["kind"], data["value"])
            except ValueError as exc:
                self.add_error("value", str(exc))
            else:
                if (why := pauses.refusal(data["kind"], data["value"])) is not None:
                    self.add_error("value", why)  # the pauses page acts on default
        return data


# django-stubs declare ModelAdmin generic; Django's takes no type arguments at run time.
class PauseAdmin(CheckedInputs, admin.ModelAdmin):  # type: ignore[type-arg]
    """The pauses list; pause (the add page) and resume (per row, or selected) confirm first."""

    list_display = ("kind", "name", "since", "ends", "paused_by", "reason", "resume_button")
    list_display_links = None
    list_filter = ("kind",)
    ordering = ("paused_at", "pk")
    actions = ["resume_selected"]
    change_list_template = "admin/jobs/pause/change_list.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Pause]:
        # The age by PostgreSQL's clock, which stamped paused_at. A throttle's timed pause
        # that has ended holds nothing any more: it is not listed.
        rows: QuerySet[Pause] = (
            super()
            .get_queryset(request)
            .filter(Q(until__isnull=True) | Q(until__gt=Now()))
            .annotate(age=Now() - F("paused_at"))
        )
        return with_now(rows)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_view_permission(request, obj) or pauses.can_pause(request.user)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return pauses.can_pause(request.user)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Deleting a pause is resuming it: delete_view asks and resumes through jobs.control.
        return pauses.can_pause(request.user)

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return pauses.can_pause(request.user)

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # it would delete rows behind the queue's back
        return actions

    @admin.display(description=_("name"), ordering="value")
    def name(self, obj: Pause) -> str:
        return obj.value

    @admin.display(description=_("since"), ordering="paused_at")
    def since(self, obj: Pause) -> str:
        return moment(obj.paused_at, now_of(obj))

    @admin.display(description=_("ends"), ordering="until")
    def ends(self, obj: Pause) -> str:
        """A throttle's pause ends by itself; any other lasts until resumed."""
        if obj.until is None:
            return gettext("when resumed")
        return moment(obj.until, now_of(obj))

    def get_list_display(self, request: HttpRequest) -> Any:
        shown = super().get_list_display(request)
        if pauses.can_pause(request.user):
            return shown
        return [name for name in shown if name != "resume_button"]

    @admin.display(description="")
    def resume_button(self, obj: Pause) -> str:
        return format_html(
            '<a role="button" class="button jobs-resume" href="{}">{}</a>',
            self.resume_url(obj),
            _("Resume…"),
        )

    def resume_url(self, obj: Pause, back: str = "") -> str:
        url = reverse(f"{self.admin_site.name}:jobs_pause_resume", args=[obj.pk])
        return f"{url}?{urlencode({'next': back})}" if back else url

    def get_urls(self) -> list[URLPattern]:
        resume = self.admin_site.admin_view(self.resume_view)
        return [
            path("<path:object_id>/resume/", resume, name="jobs_pause_resume"),
            *super().get_urls(),
        ]

    def add_view(
        self, request: HttpRequest, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Pause…: the form (GET), its confirmation (a valid GET or POST), the confirming POST."""
        if not self.has_add_permission(request):
            raise PermissionDenied
        back = self._back(request)
        data = request.POST if request.method == "POST" else request.GET
        form = PauseForm(data if ("kind" in data or "value" in data) else None)
        if not form.is_valid():
            title = gettext("Pause a job type, queue or tenant")
            return self._render(
                request, "admin/jobs/pause/pause_form.html", title, form=form, back=back
            )
        kind, value = form.cleaned_data["kind"], form.cleaned_data["value"]
        if request.method == "POST" and data.get("post") == "yes":
            reason = form.cleaned_data["reason"]
            changed = pauses.pause(request.user, kind, value, reason=reason, via=VIA)
            label = what(kind, value)
            if changed:
                self.message_user(
                    request,
                    gettext(
                        "Paused %(what)s: workers stop claiming its jobs within one poll interval."
                    )
                    % {"what": label},
                    messages.SUCCESS,
                )
            else:
                self.message_user(
                    request,
                    gettext("%(what)s was paused already: nothing changed.") % {"what": label},
                    messages.WARNING,
                )
            return HttpResponseRedirect(back)
        return self._render(
            request,
            "admin/jobs/pause/pause_confirmation.html",
            gettext("Pause %(what)s?") % {"what": what(kind, value)},
            form=form,
            back=back,
            kind=kind,
            value=value,
            what=what(kind, value),
            effect=EFFECTS[PauseKind(kind)],
            existing=Pause.objects.filter(kind=kind, value=value).first(),
            unknown_type=kind == PauseKind.JOB_TYPE and value not in get_registry(),
        )

    def resume_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Resume…: the confirmation (GET), then the confirming POST resumes."""
        if not pauses.can_pause(request.user):
            raise PermissionDenied
        back = self._back(request)
        pause = self.get_object(request, unquote(object_id))
        if request.method == "POST" and request.POST.get("post") == "yes":
            self._resume(request, [pause] if pause is not None else [])
            return HttpResponseRedirect(back)
        if pause is None:
            self.message_user(
                request, gettext("That pause is over: nothing to resume."), messages.WARNING
            )
            return HttpResponseRedirect(back)
        return self._resume_confirmation(request, [pause], back, action="")

    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        return self.resume_view(request, object_id)

    @admin.action(permissions=["pause"], description=_("Resume selected pauses…"))
    def resume_selected(
        self, request: HttpRequest, queryset: QuerySet[Pause]
    ) -> HttpResponse | None:
        """Confirm, then resume the pauses the page named (a "yes" over select-all asks again)."""
        rows = list(queryset.order_by("paused_at", "pk"))
        if request.POST.get("post") == "yes" and request.POST.get("select_across") != "1":
            self._resume(request, rows)
            return None
        selected = len(request.POST.getlist(helpers.ACTION_CHECKBOX_NAME))
        return self._resume_confirmation(
            request,
            rows,
            request.get_full_path(),
            action="resume_selected",
            over=0 if request.POST.get("select_across") == "1" else max(0, selected - len(rows)),
        )

    def _resume(self, request: HttpRequest, rows: Sequence[Pause]) -> None:
        """One resume per pause through jobs.control (each logged there); a message with counts."""
        done = [p for p in rows if pauses.resume(request.user, p.kind, p.value, via=VIA)]
        if done:
            self.message_user(
                request,
                gettext("Resumed %(what)s. %(effect)s")
                % {"what": ", ".join(what(p.kind, p.value) for p in done), "effect": RESUMED},
                messages.SUCCESS,
            )
        if len(done) < len(rows) or not rows:
            self.message_user(
                request,
                gettext("Nothing else to resume: the other pauses were over already.")
                if done
                else gettext("Nothing to resume: that pause was over already."),
                messages.WARNING,
            )

    def _resume_confirmation(
        self, request: HttpRequest, rows: Sequence[Pause], back: str, *, action: str, over: int = 0
    ) -> HttpResponse:
        """What a resume would lift, and how many selected pauses are over already."""
        return self._render(
            request,
            "admin/jobs/pause/resume_confirmation.html",
            gettext("Resume paused work?"),
            back=back,
            pauses=[
                {"pause": p, "what": what(p.kind, p.value), "since": self.since(p)} for p in rows
            ],
            action=action,
            action_checkbox_name=helpers.ACTION_CHECKBOX_NAME,
            effect=RESUMED,
            over=over,
        )

    def _render(
        self, request: HttpRequest, template: str, title: str, **context: Any
    ) -> HttpResponse:
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.opts,
            **context,
        }
        return TemplateResponse(request, template, context)

    def _back(self, request: HttpRequest) -> str:
        """Where to go afterwards: a ``next`` on this site, else the pauses list."""
        candidate = request.POST.get("next") or request.GET.get("next") or ""
        if candidate and url_has_allowed_host_and_scheme(
            candidate, allowed_hosts={request.get_host()}, require_https=request.is_secure()
        ):
            return candidate
        return reverse(f"{self.admin_site.name}:jobs_pause_changelist")


#: The jobs list's filters that name something a pause can hold back.
FILTERS = (("name", PauseKind.JOB_TYPE), ("queue", PauseKind.QUEUE), ("tenant", PauseKind.TENANT))


def pause_links(request: HttpRequest, site_name: str) -> list[tuple[str, str]]:
    """*Pause…* links for the job type, queue and tenant the jobs list is filtered by."""
    base = reverse(f"{site_name}:jobs_pause_add")
    links = []
    for param, kind in FILTERS:
        value = (request.GET.get(param) or "").strip()
        if value:
            query = urlencode({"kind": kind, "value": value, "next": request.get_full_path()})
            label = gettext("Pause %(what)s…") % {"what": what(kind, value)}
            links.append((label, f"{base}?{query}"))
    return links


def what(kind: str, value: str) -> str:
    """How a pause is named to people: "job type email.send.v1", "queue bulk", "tenant acme"."""
    return f"{PauseKind(kind).label} {value}"


def since(at: Any, age_seconds: float | None) -> str:
    """When a pause began, to the second, with its age ("… (5m 02s ago)")."""
    if age_seconds is None:
        return second(at)
    return gettext("%(time)s (%(age)s ago)") % {
        "time": second(at),
        "age": duration(age_seconds),
    }
