"""What the tests share besides conftest's fixtures: tiny models and their HF references, the
verifier's captured states, the readers a hostile store is fed to, the kill loop, edits of
vLLM's source for the contract tests, the hypothesis budgets and the machine's capabilities.

Tests import it as `support` (tests/ is on sys.path as pytest's rootdir-relative conftest
directory); no test module imports another test module."""
