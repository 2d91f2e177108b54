"""Run-contract tables as a consumer app defines them, for the scheduler's watchdog tests."""
