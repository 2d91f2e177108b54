"""The admin only: the jobs app adds its monitor pages to the default admin site."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
