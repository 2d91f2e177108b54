#!/usr/bin/env python
"""The smoke project's manage.py, run by tests/acceptance/test_package.py inside a fresh venv."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "smoke_site.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
