"""Register the several-databases tests' job types (tests/dbapp/types.py)."""

from jobs import register
from tests.dbapp.types import job_types

for job_type in job_types():
    register(job_type.payload_type, job_type.handler, policy=job_type.policy)
