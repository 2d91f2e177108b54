from django.apps import AppConfig


class DemoConfig(AppConfig):
    """The demo's sample data (``manage.py demo_seed``); no models."""

    name = "project.demo"
    label = "demo"
