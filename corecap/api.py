"""corecap from Python: `capture(...)` runs a capture as `corecap run` does, from any thread.

    import corecap

    if __name__ == "__main__":  # vLLM's workers re-import this script: the guard keeps them from capturing
        summary = corecap.capture(model="path/to/model", data="convs.jsonl", store="out.lmdb",
                                  layers=(2, 16, 29, 32, "prenorm"), tensor_parallel_size=2)

Options are RunConfig's, EngineOptions' (vLLM's engine argument names) and SamplingOptions'
fields, the short forms tp, batch, max_len, ... (config.ALIASES), or any other vLLM EngineArgs
field; `help(corecap.capture)` lists them, and a misspelt one is refused before anything starts,
naming the closest. It installs no signal handler and leaves the process environment as it found
it; pass a `Stop` to end a run early (every complete sample is kept).

corecap's own lines go to the `corecap` logger (INFO; `log=` takes them instead), vLLM's to
its `vllm` logger at ERROR only unless VLLM_LOGGING_LEVEL says otherwise (corecap/logs.py).
"""

from __future__ import annotations

import dataclasses
import inspect

from corecap.config import RunConfig, build, check_option_names, option_fields
from corecap.errors import CorecapError
from corecap.run import RunSummary, Stop, run


def capture(config: RunConfig | None = None, *, log=None, stop: Stop | None = None, terminal=None,
            **options) -> RunSummary:
    """Capture the hidden states of every sample of `data` into `store`; returns the summary.
    Raises CorecapError (one line) on anything the user can fix; an unknown option is an
    UnknownOption, both a CorecapError and a TypeError. `log(line)` gets corecap's log lines
    (default: the `corecap` logger); `terminal`: where the progress line goes (default sys.stderr);
    `stop`: a Stop to end the run early, or the strings that end a response (with max_tokens)."""
    from corecap.logs import api_logging, guard_spawned_main

    guard_spawned_main()
    if stop is not None and not isinstance(stop, Stop):  # SamplingOptions.stop: strings that end a response
        options["stop"], stop = stop, None
    if config is not None and options:
        raise TypeError("capture() takes a RunConfig or keyword options, not both")
    if config is None:
        from corecap._vllm.vllm_source import vllm_engine_arg_names

        check_option_names(options, vllm_engine_arg_names())
        config = build(**options)
    with api_logging(log) as say:
        return run(config, log=say, stop=stop, terminal=terminal)


def _signature() -> inspect.Signature:
    """capture's signature as help() and editors show it: each option with its owner's type and
    default (config.option_fields), none listed twice by hand."""
    own = list(inspect.signature(capture).parameters.values())
    names = {p.name for p in own}
    options = []
    for f in option_fields():
        if f.name in names:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        options.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.type))
    return inspect.Signature([*own[:-1], *options, own[-1]], return_annotation="RunSummary")


capture.__signature__ = _signature()
capture.__doc__ += "\n\n    Options (their types and defaults are in the signature):\n    " + ", ".join(
    p.name for p in capture.__signature__.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
) + ", and any other field of vLLM's EngineArgs."

__all__ = ["CorecapError", "RunConfig", "RunSummary", "Stop", "capture"]
