"""Steps of the package smoke test that need Django set up, run inside the fresh venv.

``python smoke_checks.py STEP [ARG]`` prints one JSON object for the test to check, so the
assertions (and their messages) stay in tests/acceptance/test_package.py.
"""

from __future__ import annotations

import json
import os
import sys


def where() -> dict:
    """Where ``jobs``, its version and its admin templates were loaded from."""
    from django.template.loader import get_template

    import jobs

    return {
        "jobs_file": jobs.__file__,
        "jobs_version": jobs.__version__,
        "template": get_template("admin/jobs/app_index.html").origin.name,
    }


def enqueue(word: str) -> dict:
    """Enqueue one job of the smoke app's type, as a user's code would."""
    from smoke_app.jobs import EchoV1

    import jobs

    enqueued = jobs.enqueue(EchoV1(word=word), job_id=f"smoke-{word}")
    return {"id": enqueued.id, "job_id": enqueued.job_id, "state": enqueued.state}


def admin(job_pk: str) -> dict:
    """Log a superuser in and load the jobs admin pages with Django's test client."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    get_user_model().objects.create_superuser("smoke-admin", "admin@example.com", "smoke-pass")
    client = Client()
    if not client.login(username="smoke-admin", password="smoke-pass"):
        raise SystemExit("the superuser could not log in")
    pages = {}
    for path in (
        "/admin/",
        "/admin/jobs/",
        "/admin/jobs/job/",
        f"/admin/jobs/job/{job_pk}/change/",
        "/admin/jobs/job/monitor/",
        "/admin/jobs/job/monitor/groups/",
    ):
        response = client.get(path)
        pages[path] = {"status": response.status_code, "text": response.content.decode()}
    return pages


STEPS = {"where": where, "enqueue": enqueue, "admin": admin}

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "smoke_site.settings")
    import django

    django.setup()
    step, *args = sys.argv[1:]
    print(json.dumps(STEPS[step](*args)))
