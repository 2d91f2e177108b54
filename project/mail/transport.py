"""Sending one message. A stand-in for an SMTP relay, with deterministic failures for the demo.

* ``…@blocked.example`` — the relay refuses the domain (permanent: never retried).
* ``…@flaky.example`` — the relay times out (transient: retried, then not delivered).
* anything else goes through Django's email backend.
"""

from __future__ import annotations

from django.conf import settings
from django.core.mail import send_mail

BLOCKED_DOMAINS = frozenset({"blocked.example"})
FLAKY_DOMAINS = frozenset({"flaky.example"})


class Undeliverable(Exception):
    """The relay refused the message for good (a 5xx answer)."""


class RelayTimeout(Exception):
    """The relay did not answer in time; a later attempt may succeed."""


def send(to: str, subject: str, body: str) -> None:
    """Hand one message to the relay, or raise why not."""
    domain = to.rpartition("@")[2].lower()
    if domain in BLOCKED_DOMAINS:
        raise Undeliverable(f"550 5.7.1 {domain} does not accept mail from this relay")
    if domain in FLAKY_DOMAINS:
        raise RelayTimeout(f"relay timed out talking to {domain}")
    send_mail(subject, body, settings.DEFAULT_FROM_EMAIL, [to])
