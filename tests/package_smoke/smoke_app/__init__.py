"""The smoke project's one app: a job type discovered from its ``jobs.py``."""
