"""Backoff, policies, classification, the registry and its start-up freeze."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.exceptions import AppRegistryNotReady, ImproperlyConfigured
from django.test import override_settings

import jobs
from jobs import JobContext, Payload, Rate, Reject, RetryAfter
from jobs.catalogue.registry import (
    Backoff,
    Catalogue,
    JobType,
    Policy,
    Registry,
    classify,
    default_backoff,
    get_registry,
)
from tests.jobapp import jobs as jobapp


class PingV1(Payload, name="test.ping.v1"):
    n: int


class PongV1(Payload, name="test.pong.v1"):
    n: int


class OtherPingV1(Payload, name="test.ping.v1"):  # claims a name already taken
    n: int


def handle(payload: Payload, ctx: JobContext) -> None:
    return None


def other_handle(payload: Payload, ctx: JobContext) -> None:
    return None


async def handle_async(payload: Payload, ctx: JobContext) -> None:
    return None


class TestBackoff:
    @pytest.mark.parametrize("attempt", range(1, 11))
    @pytest.mark.parametrize("rand", [0.0, 0.5, 1.0])
    def test_delay_stays_within_the_capped_exponential_window(self, attempt, rand):
        backoff = Backoff(base=timedelta(seconds=1), cap=timedelta(seconds=100))
        ceiling = min(100.0, 1.0 * 2 ** (attempt - 1))
        delay = backoff.delay(attempt, rand=lambda: rand)
        assert 0.0 <= delay <= ceiling
        assert delay == pytest.approx(rand * ceiling)

    def test_full_jitter_spreads_down_to_near_zero(self):
        backoff = Backoff(base=timedelta(seconds=2), cap=timedelta(seconds=60))
        rng = random.Random(7)
        delays = [backoff.delay(6, rand=rng.random) for _ in range(300)]
        assert min(delays) < 0.05 * 60 and max(delays) > 0.9 * 60

    def test_huge_attempt_numbers_are_capped_without_overflow(self):
        backoff = Backoff(base=timedelta(milliseconds=10), cap=timedelta(minutes=5))
        assert backoff.delay(2_147_483_647, rand=lambda: 1.0) == 300.0

    def test_numbers_are_seconds(self):
        assert Backoff(base=0.5, cap=10) == Backoff(timedelta(seconds=0.5), timedelta(seconds=10))

    @pytest.mark.parametrize(
        ("base", "cap", "message"),
        [
            (0, 10, r"Backoff base must be a positive duration, got datetime.timedelta\(0\)"),
            (1, -1, "Backoff cap must be a positive duration"),
            ("1", 10, "Backoff base must be a positive duration, got '1'"),
            (20, 10, r"Backoff base \(0:00:20\) must not exceed its cap \(0:00:10\)"),
        ],
    )
    def test_invalid_backoff_is_refused(self, base, cap, message):
        with pytest.raises(ValueError, match=message):
            Backoff(base=base, cap=cap)

    def test_attempts_start_at_one(self):
        with pytest.raises(ValueError, match="attempt numbers start at 1"):
            Backoff(base=1, cap=2).delay(0)

    def test_default_comes_from_settings(self):
        assert default_backoff() == Backoff(base=timedelta(seconds=1), cap=timedelta(seconds=300))
        with override_settings(JOBS={"BACKOFF_BASE": 0.1, "BACKOFF_CAP": 5}):
            assert default_backoff() == Backoff(base=0.1, cap=5)
            assert Policy().resolved_backoff() == Backoff(base=0.1, cap=5)
        own = Backoff(base=2, cap=4)
        assert Policy(backoff=own).resolved_backoff() is own


class TestPolicy:
    def test_defaults_are_valid(self):
        policy = Policy()
        assert policy.validate() == []
        assert (policy.concurrency, policy.timeout, policy.max_attempts) == (
            None,  # as many as the worker's --concurrency
            timedelta(seconds=60),
            5,
        )

    def test_seconds_are_normalized(self):
        policy = Policy(timeout=20, retry_in_process_up_to=0.5, permanent_errors=KeyError)
        assert policy.timeout == timedelta(seconds=20)
        assert policy.retry_in_process_up_to == timedelta(milliseconds=500)
        assert policy.permanent_errors == (KeyError,)

    def test_every_problem_is_reported(self):
        policy = Policy(
            concurrency=0,
            timeout=-1,
            max_attempts=True,
            backoff="fast",  # type: ignore[arg-type]
            queue="no spaces",
            priority=101,
            retry_in_process_up_to=-5,
            permanent_errors=(KeyError, "oops"),  # type: ignore[arg-type]
            classify="nope",  # type: ignore[arg-type]
        )
        assert policy.validate() == [
            "concurrency must be a whole number from 1 to 100, got 0",
            "timeout must be a positive duration, got datetime.timedelta(days=-1, seconds=86399)",
            "max_attempts must be a whole number from 1 to 2147483647, got True",
            "backoff must be a Backoff or None, got 'fast'",
            "queue must be 1-64 characters of letters, digits, '_', '.', ':' or '-' starting "
            "with a letter or digit, got 'no spaces'",
            "priority must be a whole number from -100 to 100, got 101",
            "retry_in_process_up_to must be zero or a positive duration, "
            "got datetime.timedelta(days=-1, seconds=86395)",
            "permanent_errors must hold exception classes, got 'oops'",
            "classify must be callable or None, got 'nope'",
        ]

    def test_upper_bounds(self):
        assert Policy(concurrency=100, max_attempts=2_147_483_647, priority=-100).validate() == []
        assert Policy(concurrency=101, max_attempts=2_147_483_648).validate() == [
            "concurrency must be a whole number from 1 to 100, got 101",
            "max_attempts must be a whole number from 1 to 2147483647, got 2147483648",
        ]

    def test_in_process_limit_defaults_to_the_setting(self):
        assert Policy().in_process_limit() == timedelta(seconds=60)
        assert Policy(retry_in_process_up_to=0).in_process_limit() == timedelta(0)
        with override_settings(JOBS={"RETRY_IN_PROCESS_UP_TO": 5}):
            assert Policy().in_process_limit() == timedelta(seconds=5)


class TestClassify:
    def test_order_of_precedence(self):
        policy = Policy(permanent_errors=(KeyError,))
        assert classify(policy, Reject("gone")) == "reject"
        assert classify(policy, RetryAfter(3)) == "retry_after"
        assert classify(policy, KeyError("x")) == "permanent"
        assert classify(policy, ConnectionError()) == "transient"
        assert classify(Policy(), KeyError("x")) == "transient"

    def test_the_hook_decides_before_permanent_errors(self):
        def hook(exc):
            if isinstance(exc, ConnectionError):
                return "permanent"
            if isinstance(exc, KeyError):
                return "transient"
            return None  # no opinion

        policy = Policy(classify=hook, permanent_errors=(KeyError, ValueError))
        assert classify(policy, ConnectionError()) == "permanent"
        assert classify(policy, KeyError()) == "transient"
        assert classify(policy, ValueError()) == "permanent"
        assert classify(policy, Reject()) == "reject"

    def test_a_broken_hook_is_logged_and_ignored(self, caplog):
        def broken(exc):
            raise RuntimeError("bug in hook")

        assert classify(Policy(classify=broken), KeyError()) == "transient"
        assert classify(Policy(classify=lambda exc: "maybe"), KeyError()) == "transient"
        assert "policy.classify raised" in caplog.text
        assert "policy.classify returned 'maybe'" in caplog.text


class TestJobType:
    def test_name_decode_and_async(self):
        job_type = JobType(PingV1, handle)
        assert job_type.name == "test.ping.v1"
        assert job_type.decode('{"n": 3}') == PingV1(n=3)
        assert job_type.policy == Policy()
        assert not job_type.is_async
        assert JobType(PingV1, handle_async).is_async


class TestRegistry:
    def test_lookup_api(self):
        registry = Registry(
            [
                JobType(PongV1, handle, Policy(max_attempts=2)),
                JobType(PingV1, other_handle, Policy(max_attempts=7)),
            ]
        )
        assert registry.names() == ("test.ping.v1", "test.pong.v1")
        assert registry["test.pong.v1"].payload_type is PongV1
        assert registry.get("test.pong.v1") is registry["test.pong.v1"]
        assert registry.get("missing.v1") is None
        assert "test.ping.v1" in registry and "missing.v1" not in registry
        assert [job_type.name for job_type in registry] == ["test.ping.v1", "test.pong.v1"]
        assert len(registry) == 2
        assert registry.max_attempts() == {"test.ping.v1": 7, "test.pong.v1": 2}
        with pytest.raises(KeyError, match=r"no job type named 'missing\.v1' is registered"):
            registry["missing.v1"]

    def test_empty_registry_is_valid(self):
        assert len(Registry([])) == 0

    def test_is_immutable(self):
        registry = Registry([JobType(PingV1, handle)])
        with pytest.raises(AttributeError):
            registry.extra = 1  # type: ignore[attr-defined]
        with pytest.raises(TypeError):
            registry._types["x"] = None  # type: ignore[index]

    def test_refuses_with_every_problem_at_once(self):
        with pytest.raises(ImproperlyConfigured) as info:
            Registry(
                [
                    JobType(PingV1, handle),
                    JobType(PingV1, other_handle),
                    JobType(OtherPingV1, handle),
                    JobType(dict, handle),  # type: ignore[arg-type]
                    JobType(PongV1, "not callable"),  # type: ignore[arg-type]
                    JobType(PongV1, lambda payload: None, Policy(concurrency=0)),
                    "junk",  # type: ignore[list-item]
                ]
            )
        here = __name__
        lam = f"{here}.TestRegistry.test_refuses_with_every_problem_at_once.<locals>.<lambda>"
        assert str(info.value) == "\n".join(
            [
                "Invalid job types:",
                f"  - test.ping.v1 is registered twice: {here}.handle and {here}.other_handle",
                f"  - test.ping.v1 is claimed by two payload classes: {here}.PingV1 and "
                f"{here}.OtherPingV1",
                f"  - builtins.dict ({here}.handle): <class 'dict'> is not a subclass of "
                f"jobs.Payload",
                "  - test.pong.v1 ('not callable'): handler 'not callable' is not callable",
                f"  - test.pong.v1 ({lam}): handler must accept two positional arguments "
                f"(payload, ctx)",
                f"  - test.pong.v1 ({lam}): concurrency must be a whole number from 1 to 100, "
                f"got 0",
                f"  - test.pong.v1 is registered twice: 'not callable' and {lam}",
                "  - entry #6 is not a JobType: 'junk'",
            ]
        )


class TestCatalogue:
    def test_collects_then_freezes_once(self):
        catalogue = Catalogue()
        first = JobType(PingV1, handle)
        catalogue.add(first)
        with pytest.raises(AppRegistryNotReady, match="job registry is built when Django starts"):
            catalogue.get()

        registry = catalogue.freeze()

        assert catalogue.frozen and catalogue.get() is registry and catalogue.freeze() is registry
        assert registry["test.ping.v1"] is first
        with pytest.raises(ImproperlyConfigured) as info:
            catalogue.add(JobType(PongV1, handle))
        assert str(info.value) == (
            "job type test.pong.v1 was registered after start-up; register job types in "
            "<app>/jobs.py, which is imported at start-up"
        )

    def test_an_invalid_catalogue_refuses_to_freeze(self):
        catalogue = Catalogue()
        catalogue.add(JobType(PingV1, handle, Policy(max_attempts=0)))
        with pytest.raises(ImproperlyConfigured, match="max_attempts must be a whole number"):
            catalogue.freeze()
        assert not catalogue.frozen


class TestDiscovery:
    def test_jobs_modules_of_installed_apps_are_registered_at_start_up(self):
        registry = get_registry()
        ping, audit = registry["jobapp.ping.v1"], registry["jobapp.audit.v1"]
        assert (ping.payload_type, ping.handler) == (jobapp.PingV1, jobapp.ping)
        assert ping.policy == Policy(
            concurrency=3, timeout=20, max_attempts=4, queue="pings", priority=5
        )
        assert audit.policy is jobapp.AUDIT_POLICY and audit.is_async

    def test_decorator_returns_the_handler_unchanged(self):
        assert jobapp.ping(jobapp.PingV1(message="hi"), None) == "hi"  # type: ignore[arg-type]

    def test_registering_after_start_up_is_an_error(self):
        with pytest.raises(ImproperlyConfigured, match=r"register job types in <app>/jobs.py"):
            jobs.register(PongV1, handle)
        with pytest.raises(ImproperlyConfigured, match="registered after start-up"):
            jobs.job(PongV1, concurrency=2)(handle)
        assert "test.pong.v1" not in get_registry()

    def test_policy_and_options_are_exclusive(self):
        with pytest.raises(TypeError, match="either policy= or policy options"):
            jobs.register(PongV1, handle, policy=Policy(), concurrency=2)


def test_importing_jobs_needs_neither_settings_nor_models():
    """``import jobs`` happens before Django's app registry is ready (settings, apps.py)."""
    code = textwrap.dedent(
        """
        import sys
        import jobs

        class PingV1(jobs.Payload, name="ping.v1"):
            n: int

        @jobs.job(PingV1, concurrency=2)
        def ping(payload, ctx):
            pass

        assert PingV1.from_json('{"n": 1}') == PingV1(n=1)
        assert "jobs.models" not in sys.modules and "jobs.queue" not in sys.modules
        """
    )
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    root = Path(__file__).resolve().parents[3]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "arguments",
    [(True,), (1.5,), (0,), (1, 0), (1, True), (1, -1), (1, float("nan")), (1, 1, 0), (1, 1, 1.0)],
)
def test_rate_refuses_what_is_not_a_rate(arguments):
    with pytest.raises(ValueError):
        Rate(*arguments)


@pytest.mark.parametrize(
    "options",
    [
        {"global_concurrency": True},
        {"global_concurrency": 0},
        {"tenant_concurrency": 1.0},
        {"rate_limit": 5},
        {"tenant_rate_limit": "10/s"},
        {"fair": 1},
    ],
)
def test_policy_names_each_bad_flow_option(options):
    (problem,) = Policy(**options).validate()
    assert next(iter(options)) in problem
