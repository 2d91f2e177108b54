"""The types a user's type checker sees: declarations kept in step with the runtime."""

from __future__ import annotations

import dataclasses

from jobs.conf import DEFAULTS, JobsSettings
from jobs.policy import Policy, PolicyOptions


def test_policy_options_name_every_policy_field():
    """job(), register() and Policy() are typed by PolicyOptions: a new field goes in both."""
    assert set(PolicyOptions.__annotations__) == {f.name for f in dataclasses.fields(Policy)}


def test_jobs_settings_annotate_every_setting():
    """Each JOBS setting has a declared type, and nothing else is declared."""
    assert set(JobsSettings.__annotations__) == set(DEFAULTS)
