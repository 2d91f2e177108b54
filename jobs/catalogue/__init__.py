"""What this deployment can run: payload types, policies, the registry of job types, which
database each type lives in, and the declared schedules.

Read at start-up and then frozen. Above the queue: the queue never asks the catalogue, its
callers pass what it needs (an alias, a run table).
"""
