"""`--max-tokens` runs, vLLM's half: the sampling settings in effect (the user's, then the
model's generation_config.json as `vllm serve` reads it, then vLLM's own), checked by vLLM's
SamplingParams before the model loads, and each request's SamplingParams.

vLLM is asked for one token more than the response may hold and given no end-of-sequence id:
corecap ends each response itself, one step late, so that the final token's states are computed
(corecap/generation.py says why).
"""

from __future__ import annotations

from corecap.config import SAMPLING_FIELDS, SamplingOptions
from corecap.errors import CorecapError


def effective_sampling(options: SamplingOptions, vllm_config) -> tuple[dict, dict]:
    """(settings, where each came from): the user's, else the model's generation config, by
    vLLM's SamplingParams names; settings neither gives are vLLM's defaults (left out)."""
    defaults = vllm_config.model_config.get_diff_sampling_param()
    settings, source = {}, {}
    for name in SAMPLING_FIELDS:
        given = getattr(options, name)
        if given is not None:
            settings[name], source[name] = given, "given"
        elif defaults.get(name) is not None:
            settings[name], source[name] = defaults[name], "generation_config.json"
    return settings, source


def check_sampling(settings: dict, options: SamplingOptions) -> None:
    """vLLM's own checks of the settings, as one line, before any weight loads."""
    try:
        sampling_params(settings, options.max_tokens, seed=0)
    except Exception as e:  # ValueError, or vLLM's own VLLMValidationError (not one in every release)
        given = ", ".join(f"{k}={v}" for k, v in settings.items())
        raise CorecapError(f"sampling settings ({given}): vLLM refuses them: {str(e).splitlines()[0]}") from None


def sampling_params(settings: dict, max_tokens: int, seed: int):
    from vllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens + 1, seed=seed, detokenize=False, **settings)


def eos_token_ids(vllm_config, tokenizer) -> frozenset[int]:
    """The tokens that end a response, as vLLM's frontend sets them: the tokenizer's EOS and
    every `eos_token_id` of the model's generation config."""
    ids = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = vllm_config.model_config.try_get_generation_config() or {}
    eos = config.get("eos_token_id")
    ids.update(int(t) for t in ([eos] if isinstance(eos, int) else eos or ()))
    return frozenset(ids)


def describe(options: SamplingOptions, settings: dict, source: dict, eos: frozenset[int]) -> str:
    """The generation part of the run's first line."""
    values = ", ".join(f"{k} {v}" + (" (generation_config.json)" if source[k] != "given" else "")
                       for k, v in settings.items())
    stops = f", stop {list(options.stop)}" if options.stop else ""
    ends = "EOS ignored" if options.ignore_eos else f"EOS ids {sorted(eos)}"
    return (f"generation: max tokens {options.max_tokens}, {values or 'vLLM default sampling'}{stops}, {ends}, "
            "seed per sample key")
