"""Benchmarks, run from the repository root as `python -m tools.bench.NAME`; results in docs/benchmarks.md."""
