"""The HTTP side of ModelOpt's streaming dataset: its completions arrive on the sidecar's port
(`--nixl-sidecar-port`, the port of `data.streaming_server_url`), and so does its sidecar's
`/meta`, `/desc` and `/done` (corecap/serve/nixl.py holds the states and says what each answers).
The sidecar's routes take no API key, as vLLM's connector's take none."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from corecap.serve.requests import BadRequest


def over_nixl(request: Request, states) -> bool:
    """The request came to the sidecar's port: its states go to NIXL's pool."""
    server = request.scope.get("server") or (None, None)
    return states is not None and server[1] == states.port


def check_body(body: dict) -> None:
    """What ModelOpt's reader may send besides the OpenAI fields: `kv_transfer_params`, an object
    (vLLM's connector reads nothing from it; this server neither)."""
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise BadRequest("kv_transfer_params", "expected an object")


def add_routes(app: FastAPI, states) -> None:
    def unknown(req_id) -> JSONResponse:
        why = "expected ?req_id=ID" if not req_id else "not held here (never answered, or already /done)"
        return JSONResponse({"error": f"req_id {req_id!r}: {why}", "req_id": req_id}, status_code=404)

    @app.get("/meta")
    async def meta():
        import base64

        return {"agent_metadata": base64.b64encode(states.metadata).decode()}

    @app.get("/desc")
    async def desc(request: Request):
        req_id = request.query_params.get("req_id")
        answer = states.describe(req_id) if req_id else None
        if answer is None:
            return unknown(req_id)
        return answer if answer["ready"] else JSONResponse(answer, status_code=202)

    @app.get("/done")
    async def done(request: Request):
        req_id = request.query_params.get("req_id")
        if not req_id or not states.release(req_id):
            return unknown(req_id)
        return {"freed": req_id, "valid": True}
