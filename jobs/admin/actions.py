"""The jobs list's confirmed actions: the confirmation page an action shows, and how its
confirming POST changes the rows it named and records who did it.
"""

from __future__ import annotations

from collections.abc import Callable

from django.contrib import messages
from django.contrib.admin import ModelAdmin, helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.db import DEFAULT_DB_ALIAS, transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.functional import Promise
from django.utils.translation import ngettext

from jobs.admin.databases import chosen, query
from jobs.control.failures import MAX_ROWS
from jobs.control.replays import REPLAY_ALL_LIMIT
from jobs.models import Job

# Rows one cancel or retry-now may change, over "select all" too: replay-all's bound.
ACTION_LIMIT = REPLAY_ALL_LIMIT


def not_eligible(count: int) -> str:
    """The sentence for selected rows an action left alone."""
    return ngettext(
        "%(count)d selected job was not eligible.",
        "%(count)d selected jobs were not eligible.",
        count,
    ) % {"count": count}


def confirm_then_act(
    model_admin: ModelAdmin[Job],
    request: HttpRequest,
    eligible: QuerySet[Job],
    *,
    action: str,
    title: str | Promise,
    act: Callable[[HttpRequest, list[int]], None],
    notes: Callable[[list[str]], list[str]] | None = None,
    confirm: Callable[[int], str] | None = None,
) -> HttpResponse | None:
    """Confirm, then one call for the rows the page showed, which records and reports them.

    The page takes the newest ``ACTION_LIMIT`` eligible rows (over "select all" too) and
    says so; its confirming POST names exactly those rows, so nothing changes that the
    operator was not shown. A "yes" over a whole filter (``select_across``) is asked again.
    """
    rows = list(eligible.order_by("-pk").values_list("pk", "state")[:ACTION_LIMIT])
    taken = [pk for pk, _state in rows]
    across = request.POST.get("select_across") == "1"
    if request.POST.get("post") == "yes" and not across:
        act(request, taken)
        return None
    matching = len(taken)
    if matching >= ACTION_LIMIT:  # there may be more: count them, up to the list's cap
        matching = eligible.order_by().values("pk")[:MAX_ROWS].count()
    selected = len(request.POST.getlist(helpers.ACTION_CHECKBOX_NAME))
    context = {
        **model_admin.admin_site.each_context(request),
        "title": title,
        "opts": model_admin.opts,
        "jobs": eligible.order_by("-pk")[: min(len(taken), 100)],  # the rows it changes
        "ids": taken,
        "count": matching,
        "capped": matching >= MAX_ROWS,
        "limit": ACTION_LIMIT,
        "skipped": 0 if across else max(0, selected - matching),
        "action": action,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        # What the confirming POST does to each state among the rows it names.
        "notes": notes([state for _pk, state in rows]) if notes is not None else [],
        "confirm": confirm(len(taken)) % {"count": len(taken)} if confirm else "",
        "database_query": query(chosen(request)),  # the rows' links keep their database
    }
    return TemplateResponse(request, "admin/jobs/job/action_confirmation.html", context)


def act_and_log(
    model_admin: ModelAdmin[Job],
    request: HttpRequest,
    ids: list[int],
    *,
    logged: str,
    call: Callable[[list[int], str], list[int]],
    done: Callable[[int], str],
) -> None:
    """The confirming POST: one queue call, one log entry per changed row, a message.

    The change and its record commit together: no change without who made it.
    """
    using = chosen(request)
    if using != DEFAULT_DB_ALIAS:
        logged = f"{logged} (database {using})"
    with transaction.atomic(), transaction.atomic(using=using):
        changed = call(ids, request.user.get_username()) if ids else []
        if changed:
            assert request.user.pk is not None  # the admin lets in only logged-in staff
            LogEntry.objects.log_actions(
                request.user.pk,
                Job.objects.using(using).filter(pk__in=changed).order_by("pk"),
                CHANGE,
                change_message=logged,
            )
    selected = len(request.POST.getlist(helpers.ACTION_CHECKBOX_NAME))
    message = done(len(changed)) % {"count": len(changed)}
    if selected > len(changed):
        message += " " + not_eligible(selected - len(changed))
    model_admin.message_user(request, message, messages.SUCCESS if changed else messages.WARNING)
