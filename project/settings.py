"""Settings for the demo and development project (12-factor, read with django-environ)."""

from importlib.util import find_spec
from pathlib import Path
from urllib.parse import unquote

import django
import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env(
    DEBUG=(bool, False),
    SECRET_KEY=(str, "insecure-development-key-change-me"),
    ALLOWED_HOSTS=(list, ["localhost", "127.0.0.1", "[::1]"]),
    TIME_ZONE=(str, "UTC"),
    LOG_LEVEL=(str, "INFO"),
)
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

DEBUG = env("DEBUG")
SECRET_KEY = env("SECRET_KEY")
ALLOWED_HOSTS = env("ALLOWED_HOSTS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "jobs",
    # Example consumers of the run contract (see docs/admin.md) and the demo's sample data.
    "project.mail",
    "project.harvester",
    "project.curation",
    "project.payments",
    "project.demo",
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

# The web process's request and database metrics come from django-prometheus, the optional
# web-metrics extra (it supports Django < 6.1): used where it is installed. The worker's and the
# scheduler's metrics need only prometheus-client.
WEB_METRICS = find_spec("django_prometheus") is not None
if WEB_METRICS:
    INSTALLED_APPS.insert(INSTALLED_APPS.index("jobs"), "django_prometheus")
    MIDDLEWARE = [
        "django_prometheus.middleware.PrometheusBeforeMiddleware",
        *MIDDLEWARE,
        "django_prometheus.middleware.PrometheusAfterMiddleware",
    ]

ROOT_URLCONF = "project.urls"
WSGI_APPLICATION = "project.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
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

# With no DATABASE_URL, use the embedded PostgreSQL under var/postgres (started on demand).
if "DATABASE_URL" not in env:
    from project import devdb

    env.ENVIRON["DATABASE_URL"] = devdb.database_url()
DATABASES = {"default": env.db("DATABASE_URL")}
# django-environ keeps a percent-encoded Unix socket directory as it is.
DATABASES["default"]["HOST"] = unquote(DATABASES["default"].get("HOST", ""))
DATABASES["default"].setdefault("CONN_HEALTH_CHECKS", True)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = env("TIME_ZONE")
USE_I18N = True
USE_TZ = True

# The mail example writes each message it sends to a file under var/mail. Django 6.1 replaces
# EMAIL_BACKEND and EMAIL_FILE_PATH with MAILERS; Django 6.0 knows only the former.
_EMAIL_BACKEND = env("EMAIL_BACKEND", default="django.core.mail.backends.filebased.EmailBackend")
_EMAIL_FILE_PATH = BASE_DIR / "var" / "mail"
if django.VERSION >= (6, 1):
    MAILERS = {
        "default": {"BACKEND": _EMAIL_BACKEND, "OPTIONS": {"file_path": str(_EMAIL_FILE_PATH)}}
    }
else:
    EMAIL_BACKEND = _EMAIL_BACKEND
    EMAIL_FILE_PATH = _EMAIL_FILE_PATH
DEFAULT_FROM_EMAIL = env("DEFAULT_FROM_EMAIL", default="jobs-demo@localhost")

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "var" / "static"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env("LOG_LEVEL")},
}

JOBS: dict = {}

# Django's own task API (@task, .enqueue()) runs on the jobs table too.
TASKS = {"default": {"BACKEND": "jobs.backends.PostgresBackend"}}
