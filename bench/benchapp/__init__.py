"""The job type the benchmarks run (installed only by ``bench.settings``)."""
