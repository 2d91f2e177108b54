"""``manage.py demo_seed``: sample work for the example apps, some of which fails on purpose.

Deterministic failures, so the failure monitor has something to show once a worker runs:
mail to a blocked domain (rejected) and to a flaky one (retried, then not delivered), an
item whose source answers 404 and one whose source times out (both dead-lettered), and a
curation pass over a collection with a document that has no body (a failed run), and an
import of four contact lines, one without an email address (a batch whose report lists the
failed line). A few
older undelivered messages give the grouped view some history. Runs once; ``--again`` adds
another batch.
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.utils import timezone

import jobs
from jobs.runs import ErrorCode
from project.curation import passes
from project.curation.models import Document
from project.demo.jobs import ImportFileV1
from project.harvester.jobs import HarvestItemV1
from project.harvester.models import Item
from project.mail import deliveries
from project.mail.models import Delivery
from project.payments.jobs import ChargeOrderV1

MAIL = [
    ("alice@example.com", "Welcome aboard"),
    ("bob@example.com", "Your invoice"),
    ("carol@example.org", "Password changed"),
    ("dave@blocked.example", "Welcome aboard"),  # the relay refuses the domain
    ("erin@flaky.example", "Your invoice"),  # the relay times out every time
]
ITEMS = [
    "https://news.example/articles/solar-grid-upgrade",
    "https://news.example/articles/rail-strike-ends",
    "https://archive.example/missing/2019-annual-report",  # 404
    "https://feeds.example/slow/market-ticker",  # times out
]
DOCUMENTS = {
    "articles": [("Solar grid", "Grid upgrade text."), ("Rail strike", "Strike ends.")],
    "archive": [("Annual report", "Figures."), ("Board minutes", "")],  # no body: fails
}
CONTACTS = [
    "Ada Lovelace,ada@example.com",
    "Grace Hopper,grace@example.com",
    "Alan Turing",  # no email address: this line fails, and the report lists it
    "Edsger Dijkstra,edsger@example.org",
]
HISTORY = [  # (hours ago, recipient, code, detail)
    (3, "frank@blocked.example", ErrorCode.REJECTED, "550 5.7.1 blocked.example refuses"),
    (30, "gina@flaky.example", ErrorCode.HANDLER_ERROR, "RelayTimeout: relay timed out"),
    (100, "hal@blocked.example", ErrorCode.REJECTED, "550 5.7.1 blocked.example refuses"),
]


class Command(BaseCommand):
    help = "Enqueue sample work for the example apps (mail, harvester, curation, payments)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--again", action="store_true", help="add another batch")

    def handle(self, *args: Any, **options: Any) -> None:
        if Delivery.objects.filter(job_id__startswith="demo-").exists() and not options["again"]:
            self.stdout.write("demo data already seeded (use --again for another batch)")
            return
        batch = secrets.token_hex(3)
        for index, (to, subject) in enumerate(MAIL):
            deliveries.send(to, subject, f"Hello {to}", key=f"demo-{batch}-mail-{index}")
        now = timezone.now()
        for hours, to, code, detail in HISTORY:
            deliveries.record_failure(
                to,
                "Weekly digest",
                key=f"demo-{batch}-old-{hours}",
                code=code,
                detail=detail,
                finished_at=now - timedelta(hours=hours),
            )
        for url in ITEMS:
            item = Item.objects.create(url=url)
            jobs.enqueue(HarvestItemV1(item_id=item.pk), job_id=f"demo-{batch}-harvest-{item.pk}")
        for collection, documents in DOCUMENTS.items():
            Document.objects.bulk_create(
                Document(collection=collection, title=title, body=body) for title, body in documents
            )
            passes.start_pass(collection, by="demo_seed")
        # An import that fans out into a job per line and reports once (docs/workflows.md).
        jobs.enqueue(
            ImportFileV1(source=f"contacts-{batch}.csv", lines=CONTACTS),
            job_id=f"demo-{batch}-import",
        )
        # A payment whose first answer is lost: the retry asks the provider instead of
        # charging again (docs/effects.md; the provider's ledger is in the admin).
        jobs.enqueue(
            ChargeOrderV1(order=f"order-{batch}", amount_cents=4200, lose_first_response=True),
            job_id=f"demo-{batch}-charge",
        )
        self.stdout.write(
            f"seeded batch {batch}: {len(MAIL)} messages, {len(ITEMS)} items, "
            f"{len(DOCUMENTS)} curation passes, an import of {len(CONTACTS)} lines, "
            "a payment; "
            "a worker turns some of them into failures"
        )
