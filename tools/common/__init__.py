"""Helpers the tools share: the disk's rate (disk), a child process's result protocol (child), rates
from a run's trace (traces), peak RSS of a process tree (rss), synthetic stores (stores), tiny
models and prompts built from a fixed seed (models)."""
