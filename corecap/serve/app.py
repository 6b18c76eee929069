"""The HTTP side of `corecap serve`: the routes, their JSON answers and errors. Handlers run on
uvicorn's event loop; each capture request is handed to the engine thread (engine_loop.py) and
awaited, so one slow request never holds up another.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a body a
field of which is wrong (`param` names it), 401 without the API key, 404 for another model,
503 with Retry-After when the states not yet taken fill the quota or the Mooncake store, 500 when
the engine failed."""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from corecap.errors import CorecapError
from corecap.generation import FINISH_EOS, FINISH_STOP
from corecap.serve import modelopt, requests, specforge
from corecap.serve.engine_loop import EngineLoop, ServerFull, Ticket, retry_after
from corecap.serve.prepare import ServePlan

_DISCONNECT_POLL_S = 0.5  # how often a waiting handler checks that its client is still there


def build_app(plan: ServePlan, loop: EngineLoop) -> FastAPI:
    app = FastAPI(title="corecap serve", docs_url=None, redoc_url=None, openapi_url=None)
    metrics, name = loop.metrics, plan.model_name
    api_key = plan.cfg.api_key
    nixl_states = loop.nixl  # ModelOpt's reader's pool (--nixl-sidecar-port), or None
    if nixl_states is not None:
        modelopt.add_routes(app, nixl_states)

    def error(status: int, message: str, param: str | None = None, headers=None):
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                            status_code=status, headers=headers)

    if api_key:
        app.add_middleware(_Authorize, api_key=api_key,
                           refused=error(401, "missing or wrong API key: send `Authorization: Bearer KEY` (--api-key)"))

    @app.get("/health")
    async def health():
        return Response(status_code=200 if loop.failure is None else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(loop.started), "owned_by": "corecap",
            "root": plan.model_dir, "max_model_len": plan.max_len + 1,
        }]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")

    async def json_body(request: Request, endpoint: str):
        """(the request's JSON, None), or (None, the 400 that says it is not JSON)."""
        try:
            return json.loads(await request.body() or b"null"), None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            metrics.answered(endpoint, 400)
            return None, error(400, f"body: not JSON ({e})", "body")

    async def capture(request: Request, endpoint: str, parse):
        body, refused = await json_body(request, endpoint)
        if refused is not None:
            return None, refused
        nixl = modelopt.over_nixl(request, nixl_states)
        try:
            wanted = parse(body, name, plan.tokenizer, plan.vocab_size, plan.max_len)
            if nixl:
                modelopt.check_body(body)
            settings = loop.sampling(wanted) if wanted.max_tokens else None
            ticket = loop.submit(wanted, settings=settings, nixl=nixl)
        except requests.BadRequest as e:
            metrics.answered(endpoint, e.status)
            return None, error(e.status, str(e), e.field)
        except ServerFull as e:
            metrics.answered(endpoint, 503)
            return None, error(503, str(e), headers={"Retry-After": str(retry_after(loop))})
        except CorecapError as e:
            metrics.answered(endpoint, 500)
            return None, error(500, str(e))
        try:
            params = await _delivered(request, ticket, loop)
        except ServerFull as e:
            metrics.answered(endpoint, 503)
            return None, error(503, str(e), headers={"Retry-After": str(retry_after(loop))})
        except CorecapError as e:
            metrics.answered(endpoint, 500)
            return None, error(500, str(e))
        if params is None:  # the client went away
            metrics.answered(endpoint, 499)
            return None, Response(status_code=499)
        metrics.answered(endpoint, 200)
        ids, response = ticket.request.token_ids.tolist(), ticket.response
        written = response.token_ids if response is not None else []
        text = plan.tokenizer.decode(written, skip_special_tokens=True) if written and plan.tokenizer else ""
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(written), "total_tokens": len(ids) + len(written)}
        choice = {"index": 0, "logprobs": None, "token_ids": list(written),
                  "finish_reason": openai_finish_reason(response.finish_reason) if response is not None else "length",
                  "stop_reason": response.stop_reason if response is not None else None}
        common = {"id": f"{endpoint}-{ticket.name}", "created": int(time.time()), "model": name,
                  "usage": usage, "kv_transfer_params": params}
        return ids, (common, choice, text)

    @app.post("/v1/completions")
    async def completions(request: Request):
        ids, answer = await capture(request, "cmpl", requests.completion)
        if ids is None:
            return answer
        common, choice, text = answer
        return {**common, "object": "text_completion", "choices": [{**choice, "text": text, "prompt_token_ids": ids}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        ids, answer = await capture(request, "chatcmpl", requests.chat)
        if ids is None:
            return answer
        common, choice, text = answer
        return {**common, "object": "chat.completion", "prompt_token_ids": ids,
                "choices": [{**choice, "message": {"role": "assistant", "content": text}}]}

    @app.post("/generate")
    async def generate(request: Request):
        """SpecForge's online producer: a batch of prompts, each one's tensors to Mooncake."""
        body, refused = await json_body(request, "generate")
        if refused is not None:
            return refused
        try:
            if plan.spec_positions is None or plan.cfg.backend != "mooncake":
                raise requests.BadRequest("spec_capture", "SpecForge's tensors go to a Mooncake store, the state after "
                                          "the final norm among them: serve with --hidden-states-backend mooncake "
                                          "and --layers holding N (not 0)")
            tasks = specforge.tasks(body, name, plan.vocab_size, plan.max_len)
        except requests.BadRequest as e:
            metrics.answered("generate", e.status)
            return error(e.status, str(e), e.field)
        tickets = []
        for task in tasks:
            try:
                tickets.append(loop.submit(task.request, task.capture))
            except CorecapError as e:  # full, or the engine failed: this prompt's row says so
                tickets.append(str(e))
        rows = []
        for task, ticket in zip(tasks, tickets):
            why = ticket if isinstance(ticket, str) else None
            if why is None:
                try:
                    if await _delivered(request, ticket, loop) is None:
                        for other in tickets:  # the batch's other prompts too: nobody will take them
                            if not isinstance(other, str):
                                loop.abandon(other)
                        metrics.answered("generate", 499)
                        return Response(status_code=499)
                except CorecapError as e:
                    why = str(e)
            rows.append(specforge.row(task, len(task.request.token_ids), loop.hidden_size, loop.dtype,
                                      plan.spec_layer_ids, why))
        metrics.answered("generate", 200)
        return rows

    return app


class _Authorize:
    """The API key on every /v1/ request. A plain ASGI middleware: Starlette's `@app.middleware`
    wraps the handlers' `receive`, which then never reports the client's disconnect."""

    def __init__(self, app, api_key: str, refused: Response):
        self.app, self.expected, self.refused = app, f"Bearer {api_key}".encode(), refused

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await self.refused(scope, receive, send)
        await self.app(scope, receive, send)


async def _delivered(request, ticket: Ticket, loop: EngineLoop) -> dict | None:
    """Where the states are once written (`kv_transfer_params`); None if the client disconnected
    first: its request is then aborted and its states freed (engine_loop.py, `abandon`)."""
    waiting = asyncio.wrap_future(ticket.future)
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=_DISCONNECT_POLL_S)
        if done:
            return waiting.result()
        if await request.is_disconnected():
            loop.abandon(ticket)
            return None


def openai_finish_reason(reason: str) -> str:
    """OpenAI's name for why a response ended, as vLLM's server answers it: "stop" for an
    end-of-sequence token too (corecap stores "eos"; `stop_reason` is None then), else "length"."""
    return FINISH_STOP if reason == FINISH_EOS else reason
