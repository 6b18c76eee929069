"""corecap from Python: `capture(...)` runs a capture as `corecap run` does, from any thread.

    import corecap
    summary = corecap.capture(model="path/to/model", data="convs.jsonl", store="out.lmdb",
                              layers=(2, 16, 29, 32, "prenorm"), tensor_parallel_size=2)

Options are RunConfig's and EngineOptions' fields (vLLM's engine argument names, or the short
forms tp, batch, max_len, ...), or any other vLLM EngineArgs field. It installs no signal handler
and leaves the process environment as it found it; pass a `Stop` to end a run early (every
complete sample is kept).
"""

from __future__ import annotations

from corecap.config import RunConfig, build
from corecap.run import RunSummary, Stop, run


def capture(config: RunConfig | None = None, *, log=None, stop: Stop | None = None, terminal=None,
            **options) -> RunSummary:
    """Capture the hidden states of every sample of `data` into `store`; returns the summary.
    Raises CorecapError (one line) on anything the user can fix. `log(line)` gets corecap's log
    lines; `terminal`: where the progress line goes (default sys.stderr)."""
    if config is not None and options:
        raise TypeError("capture() takes a RunConfig or keyword options, not both")
    cfg = config if config is not None else build(**options)
    return run(cfg, log=log or (lambda message: None), stop=stop, terminal=terminal)


__all__ = ["RunConfig", "RunSummary", "Stop", "capture"]
