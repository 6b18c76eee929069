"""The requests `corecap serve` answers, read from their JSON bodies: the OpenAI fields that
speculators' and ModelOpt's online readers send (`/v1/completions` with the token ids, or
`/v1/chat/completions` with the messages), checked before anything reaches the engine. A body
that is not what a field expects is a `BadRequest` naming the field (HTTP 400)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from corecap.config import SamplingOptions
from corecap.errors import CorecapError
from corecap.store.format import MAX_KEY_BYTES


class BadRequest(CorecapError):
    """A request the server refuses as given (HTTP 400): `field` names what is wrong."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.status = status


@dataclass(frozen=True)
class CaptureRequest:
    """The tokens whose states a request asks for; with `max_tokens`, the model first writes a
    response of at most that many tokens after them, sampled as `sampling` says."""

    token_ids: np.ndarray  # int32 [T]
    model: str
    max_tokens: int = 0  # 0: the prompt's states only
    sampling: SamplingOptions | None = None  # the request's own settings (the model's fill the rest)
    seed: int | None = None
    # The client's own name for the sample (vLLM's `request_id`; SpecForge's store_id/sample_id/gen):
    # its key in --store (None: the server's name for the request, corecap-NNNNNNNNNNNN)
    request_id: str | None = None
    loss_mask: np.ndarray | None = None  # uint8 [T], the client's (SpecForge's passthrough), kept in --store


# The fields each endpoint takes; OpenAI's and vLLM's extra ones that do not change what is
# captured are accepted and left alone. A field outside these is refused (a typo, or a feature
# this server does not have), never silently ignored.
_COMMON = {"model", "max_tokens", "n", "stream", "temperature", "top_p", "top_k", "seed", "user",
           "return_token_ids", "kv_transfer_params", "logprobs", "stop", "ignore_eos", "min_tokens", "request_id"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "add_special_tokens"}
CHAT_FIELDS = _COMMON | {"messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                         "max_completion_tokens", "top_logprobs"}


def completion(body, model: str, tokenizer, vocab_size: int, max_len: int) -> CaptureRequest:
    _check_fields(body, COMPLETION_FIELDS)
    _check_common(body, model, max_len)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest("prompt", "a string needs the model's tokenizer, and the model has none: send token ids")
        ids = tokenizer(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))["input_ids"]
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        raise BadRequest("prompt", "one prompt per request, given as a list of token ids or a string")
    elif isinstance(prompt, list):
        ids = prompt
    else:
        raise BadRequest("prompt", "expected a list of token ids or a string")
    return _request(body, token_ids(ids, "prompt", vocab_size, max_len), model, max_len)


def chat(body, model: str, tokenizer, vocab_size: int, max_len: int) -> CaptureRequest:
    _check_fields(body, CHAT_FIELDS)
    _check_common(body, model, max_len)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "expected a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}]", "expected an object with a role and a content")
        if not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}].content", "expected a string (text conversations only)")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BadRequest("messages", "the model has no chat template: send token ids to /v1/completions")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs", "expected an object")
    continue_final = _flag(body, "continue_final_message", False)
    add_prompt = _flag(body, "add_generation_prompt", not continue_final)
    if add_prompt and continue_final:
        raise BadRequest("continue_final_message", "excludes add_generation_prompt")
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_prompt,
                                            continue_final_message=continue_final, **kwargs)
    except Exception as e:  # jinja's and transformers' many errors: the template refused these messages
        raise BadRequest("messages", f"the chat template refused them ({e})") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return _request(body, token_ids(ids, "messages", vocab_size, max_len), model, max_len)


def _check_fields(body, allowed: set) -> None:
    if not isinstance(body, dict):
        raise BadRequest("body", "expected a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(unknown[0], f"unknown field (this server takes {', '.join(sorted(allowed))})")


def _check_common(body: dict, model: str, max_len: int) -> None:
    name = body.get("model")
    if name is not None and name != model:
        raise BadRequest("model", f"{name!r} is not served here (this server serves {model!r})", status=404)
    if body.get("n", 1) != 1:
        raise BadRequest("n", "expected 1")
    if body.get("stream", False) is not False:
        raise BadRequest("stream", "streaming is not offered: expected false")
    for name in _NUMBERS:
        value = body.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise BadRequest(name, "expected a number")
    for name in ("top_k", "seed"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise BadRequest(name, "expected an integer")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or isinstance(stop, list) and all(
            isinstance(s, str) and s for s in stop)):
        raise BadRequest("stop", "expected a string or a list of strings")
    if body.get("request_id") is not None:
        check_key(body["request_id"], "request_id")


def check_key(key, field: str) -> None:
    """A client's name for its sample, which --store keys it by: a string of 1 to MAX_KEY_BYTES bytes."""
    try:
        size = len(key.encode()) if isinstance(key, str) else 0
    except UnicodeEncodeError:  # a lone surrogate, which JSON allows
        size = 0
    if not 0 < size <= MAX_KEY_BYTES:
        raise BadRequest(field, f"expected a string of 1 to {MAX_KEY_BYTES} bytes of UTF-8 (a corecap store's key)")


_NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _request(body: dict, ids: np.ndarray, model: str, max_len: int) -> CaptureRequest:
    """max_tokens 0 or 1: the prompt's states, as speculators asks for them (vLLM's extraction
    returns the prompt's with max_tokens 1). More: the model writes the response first, and the
    states cover prompt and response, every token, as `corecap run --max-tokens` stores them."""
    field = "max_tokens" if "max_tokens" in body else "max_completion_tokens"
    max_tokens = body.get(field, 1)
    if max_tokens is None:
        max_tokens = max_len - len(ids)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise BadRequest(field, "expected an integer of 0 or more")
    if max_tokens <= 1:
        return CaptureRequest(ids, body.get("model") or model, request_id=body.get("request_id"))
    if len(ids) + max_tokens > max_len:
        raise BadRequest(field, f"{max_tokens}: the prompt's {len(ids)} tokens and the response's must fit the "
                                f"server's --max-model-len ({max_len} tokens in all)")
    stop = body.get("stop") or ()
    options = SamplingOptions(
        max_tokens=max_tokens, stop=(stop,) if isinstance(stop, str) else tuple(stop),
        ignore_eos=_flag(body, "ignore_eos", False),
        **{name: body[name] for name in (*_NUMBERS, "top_k") if body.get(name) is not None},
    )
    return CaptureRequest(ids, body.get("model") or model, max_tokens, options, body.get("seed"),
                          body.get("request_id"))


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(name, "expected true or false")
    return value


def token_ids(ids, field: str, vocab_size: int, max_len: int) -> np.ndarray:
    if not ids:
        raise BadRequest(field, "no tokens")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest(field, "expected integer token ids")
    array = np.asarray(ids, dtype=np.int64)
    bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    if len(bad):
        raise BadRequest(field, f"token id {int(array[bad[0]])} at position {int(bad[0])} is outside the model's "
                                f"vocabulary (0..{vocab_size - 1})")
    if len(array) > max_len:
        raise BadRequest(field, f"{len(array)} tokens, more than this server's --max-model-len allows ({max_len})")
    return array.astype(np.int32)
