"""corecap's own Python client of `corecap serve`: one sample's hidden states, asked for over HTTP
and loaded from the file the server names (docs/serve.md, "From Python").

    from corecap import Client
    client = Client("http://127.0.0.1:8000")
    got = client.states([1, 2, 3])              # the prompt's states
    got = client.states(messages=[{"role": "user", "content": "hi"}], max_tokens=64)  # and a response
    # got.hidden_states: [L, T, H] (the file's layers, float32 for an fp8 server), got.token_ids: [T]
    # int64 (prompt, then the response), got.num_prompt, got.text, got.finish_reason

The file is read as speculators' own reader reads it: wait for its `.lock` (flock, held while the
server writes it), load it, then remove both, so the server's quota counts it taken. The client
and the server must see the same --hidden-states-path (one machine or a shared file system).

A 503 (the server's quota is full, or it is stopping) and a refused or dropped connection are
tried again after a pause (the server's Retry-After, else doubling from `backoff`), up to
`max_retries` times, then a CorecapError names the URL. A 4xx answer is a `ServerError` with
the server's own message and the field it names (`param`), at once. The server names every file
itself, so asking again after a dropped connection is safe: the first request, its client gone,
is aborted and its states freed."""

from __future__ import annotations

import fcntl
import http.client
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import torch

from corecap.errors import CorecapError
from corecap.export.fp8_per_token import SCALES_KEY


class ServerError(CorecapError):
    """The server refused a request: `status` (HTTP), `param` (the field it names, if any)."""

    def __init__(self, message: str, status: int, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(kw_only=True)
class States:
    """One sample as the server captured it."""

    hidden_states: torch.Tensor  # [L, T, H]: the file's layers (the aux ones, then prenorm)
    token_ids: torch.Tensor  # [T] int64: the prompt, then the response the model wrote
    num_prompt: int  # tokens [0, num_prompt) are the prompt
    text: str = ""  # the response, decoded by the server
    finish_reason: str | None = None  # the response's ("stop", "length"); None without one


class Client:
    """A client of one `corecap serve` at `url`; thread-safe (each call its own connection)."""

    def __init__(self, url: str = "http://127.0.0.1:8000", *, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0, max_retries: int = 8, backoff: float = 0.5, max_backoff: float = 30.0):
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):  # speculators' --vllm-endpoint spelling
            self.url = self.url[: -len("/v1")]
        self.api_key, self.model, self.timeout = api_key, model, timeout
        self.max_retries, self.backoff, self.max_backoff = max_retries, backoff, max_backoff

    def states(self, input_ids=None, *, messages: list[dict] | None = None, max_tokens: int = 1,
               **fields) -> States:
        """The states of `input_ids` (token ids, or a string the server tokenizes) or of a
        conversation (`messages`, rendered with the model's chat template). `max_tokens` > 1: the
        model first writes a response of up to that many tokens, and the states cover both.
        `fields`: more of the request (`temperature`, `seed`, `stop`, `chat_template_kwargs`, ...)."""
        if (input_ids is None) == (messages is None):
            raise CorecapError("Client.states: give input_ids or messages, one of the two")
        body = {"max_tokens": max_tokens, **fields}
        if self.model is not None:
            body["model"] = self.model
        if messages is not None:
            endpoint, body["messages"] = "/v1/chat/completions", messages
        else:
            endpoint = "/v1/completions"
            body["prompt"] = input_ids if isinstance(input_ids, str) else [int(t) for t in input_ids]
        answer = self.post(endpoint, body)
        choice = answer["choices"][0]
        prompt = choice.get("prompt_token_ids", answer.get("prompt_token_ids"))
        params = answer.get("kv_transfer_params") or {}
        if "hidden_states_path" not in params:
            raise CorecapError(f"{self.url}: the answer names no file (kv_transfer_params {sorted(params)}): "
                               "the client reads the file and fp8 backends, not Mooncake")
        states, token_ids = take_file(params["hidden_states_path"])
        response = choice.get("token_ids") or []
        return States(hidden_states=states, token_ids=token_ids, num_prompt=len(prompt),
                      text=choice.get("text", (choice.get("message") or {}).get("content", "")),
                      finish_reason=choice.get("finish_reason") if response else None)

    def post(self, endpoint: str, body: dict) -> dict:
        """POST `body` as JSON; the answer's JSON, trying again as the module's docstring says."""
        url = self.url + endpoint
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode()
        why = ""
        for attempt in range(self.max_retries + 1):
            wait = min(self.max_backoff, self.backoff * 2**attempt)
            try:
                request = urllib.request.Request(url, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                message, param = _error_of(e)
                if e.code != 503:
                    raise ServerError(f"{url}: {e.code} {message}", e.code, param) from None
                why = f"503 {message}"
                wait = _retry_after(e, wait)
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException, TimeoutError) as e:
                why = str(getattr(e, "reason", None) or e) or type(e).__name__
            if attempt < self.max_retries:
                time.sleep(wait)
        raise CorecapError(f"{url}: no answer after {self.max_retries + 1} tries (last: {why})")


def take_file(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden_states [L, T, H], token_ids [T] int64) of a server's file, which is then removed
    with its lock. fp8 codes come back as float32, each token times its scale."""
    from safetensors.torch import load_file

    lock = path + ".lock"
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held by the server while it writes the file
        finally:
            os.close(fd)
    try:
        tensors = load_file(path)
    except FileNotFoundError:
        raise CorecapError(f"{path}: the file the server named is not there (another machine's "
                           "--hidden-states-path, or another reader took it)") from None
    for name in (path, lock):
        try:
            os.remove(name)
        except FileNotFoundError:
            pass
    states = tensors["hidden_states"]
    if SCALES_KEY in tensors:
        states = states.to(torch.float32) * tensors[SCALES_KEY]
    return states.transpose(0, 1).contiguous(), tensors["token_ids"].to(torch.int64)


def _error_of(e: urllib.error.HTTPError) -> tuple[str, str | None]:
    """The server's message and field from its OpenAI-shaped error body, else the HTTP reason."""
    try:
        error = json.loads(e.read() or b"{}").get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    return error.get("message") or str(e.reason), error.get("param")


def _retry_after(e: urllib.error.HTTPError, default: float) -> float:
    try:
        return max(0.0, float(e.headers.get("Retry-After", default)))
    except (TypeError, ValueError):
        return default
