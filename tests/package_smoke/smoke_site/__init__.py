"""A minimal Django project that uses the installed django-pg-jobs as a user's project would."""
