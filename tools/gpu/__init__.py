"""The benchmarks and exactness checks that need a GPU (`python -m tools.gpu.NAME` on a machine
with corecap and vLLM installed); results in docs/benchmarks.md."""
