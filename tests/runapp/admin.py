"""The bound run table in the admin, for the tests of its detail page and links."""

from django.contrib import admin

from jobs.admin import RunTableAdmin
from tests.runapp.models import Delivery

admin.site.register(Delivery, RunTableAdmin)
