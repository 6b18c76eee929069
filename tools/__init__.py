"""corecap's benchmarks and one-off scripts, outside the package: run from the repository root as
modules, `python -m tools.bench.NAME` (benchmarks), `python -m tools.gpu.NAME` (the H200 scripts),
`python -m tools.NAME` (the rest). What they share is in `tools.common`; their results and exact
commands are in docs/benchmarks.md."""
