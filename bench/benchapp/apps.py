import os

from django.apps import AppConfig


class BenchAppConfig(AppConfig):
    name = "bench.benchapp"
    label = "benchapp"
    verbose_name = "Benchmark job types"

    def ready(self) -> None:
        # Measurement-only knobs for experiments; the benchmarks' defaults leave both unset.
        if interval := os.environ.get("BENCH_SWITCH_INTERVAL"):
            import sys

            sys.setswitchinterval(float(interval))
        if path := os.environ.get("BENCH_TRACE"):
            from bench.benchapp import trace

            trace.install(path)
