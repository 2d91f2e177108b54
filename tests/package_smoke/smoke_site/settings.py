"""Settings of the package smoke project: the least a user's project needs to run jobs.

Only Django, the installed ``jobs`` app and the smoke app; the database comes from ``SMOKE_DB_*``
variables, set by the package test. Nothing here may import from the repository checkout.
"""

import os

SECRET_KEY = "package-smoke-test-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "localhost"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "jobs",
    "smoke_app",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "smoke_site.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ["SMOKE_DB_NAME"],
        "USER": os.environ.get("SMOKE_DB_USER", ""),
        "PASSWORD": os.environ.get("SMOKE_DB_PASSWORD", ""),
        "HOST": os.environ.get("SMOKE_DB_HOST", ""),
        "PORT": os.environ.get("SMOKE_DB_PORT", ""),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

# INFO from the worker and scheduler, so the test can read what they did.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"jobs": {"handlers": ["console"], "level": "INFO"}},
}

JOBS: dict = {}

TASKS = {"default": {"BACKEND": "jobs.backends.PostgresBackend"}}
