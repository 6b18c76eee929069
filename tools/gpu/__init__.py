"""The scripts run on the lent H200 (`python -m tools.gpu.NAME`, with the kit of ../shared/gpukit on
PYTHONPATH); results in docs/benchmarks.md."""
