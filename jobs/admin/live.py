"""The server's side of the console's live refresh (``jobs/static/jobs/live.js``).

A live page fetches itself again with the header ``X-Jobs-Live: 1`` and keeps only the
regions it marks; the server renders the same page, so a refresh shows exactly what a reload
would. Two things differ for such a request: its response says it varies on the header (the
admin's views are never cached already), and it leaves the session's messages unread, since
the refresh shows none and the operator's next page should.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.template.response import SimpleTemplateResponse
from django.utils.cache import patch_vary_headers

HEADER = "X-Jobs-Live"


def is_live(request: HttpRequest) -> bool:
    """Whether ``request`` is a live refresh rather than the operator opening the page."""
    return request.headers.get(HEADER) == "1"


def respond(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    """Mark ``response`` as varying on the live header; keep messages for a live request."""
    patch_vary_headers(response, [HEADER])
    if is_live(request) and isinstance(response, SimpleTemplateResponse):
        response.add_post_render_callback(lambda rendered: _keep_messages(request))
    return response


def _keep_messages(request: HttpRequest) -> None:
    """Leave the messages this render iterated for the next page the operator opens."""
    storage = getattr(request, "_messages", None)
    if storage is not None:
        storage.used = False
