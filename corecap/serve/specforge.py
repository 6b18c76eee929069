"""SpecForge's `/generate` with `spec_capture`, as its online producer sends it (the request
its patched SGLang server takes): one batch of token-id prompts, each with where its tensors
go in the Mooncake store and which of the client's own tensors to store beside them. Read and
checked here (a `BadRequest` naming the field), answered in SGLang's shape: a row per prompt,
its `meta_info.spec_capture` naming each tensor's shape and dtype, or the error that failed it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from corecap.serve.requests import BadRequest, CaptureRequest, check_key, token_ids
from corecap.sink.mooncake import Passthrough, SpecCapture

FIELDS = {"input_ids", "spec_capture", "sampling_params", "extra_key", "rid", "stream", "return_logprob"}
_FEATURES = {"aux", "last_hidden"}  # the server's two artifacts, as SpecForge names them
_INT_DTYPES = {"int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
               "uint8": torch.uint8, "bool": torch.bool}


@dataclass(frozen=True)
class SpecTask:
    """One prompt of a /generate batch: its tokens, where its tensors go, what to answer."""

    request: CaptureRequest
    capture: SpecCapture
    sample_id: str
    store_id: str
    gen: int
    passthrough: dict  # name → (shape, dtype name)


def tasks(body, model: str, vocab_size: int, max_len: int) -> list[SpecTask]:
    if not isinstance(body, dict):
        raise BadRequest("body", "expected a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(unknown[0], f"unknown field (this server takes {', '.join(sorted(FIELDS))})")
    if body.get("stream", False) is not False:
        raise BadRequest("stream", "streaming is not offered: expected false")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict) or sampling.get("max_new_tokens", 0) != 0:
        raise BadRequest("sampling_params.max_new_tokens", "expected 0: this server captures the prompts' states")
    prompts, captures = body.get("input_ids"), body.get("spec_capture")
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        prompts = [prompts]
    if isinstance(captures, dict):
        captures = [captures]
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) for p in prompts):
        raise BadRequest("input_ids", "expected a list of token-id lists")
    if not isinstance(captures, list) or len(captures) != len(prompts):
        raise BadRequest("spec_capture", f"expected one object a prompt ({len(prompts)})")
    return [_task(i, ids, c, model, vocab_size, max_len) for i, (ids, c) in enumerate(zip(prompts, captures))]


def _task(i: int, ids: list, capture, model: str, vocab_size: int, max_len: int) -> SpecTask:
    where = f"spec_capture[{i}]"
    if not isinstance(capture, dict):
        raise BadRequest(where, "expected an object")
    for name in ("store_id", "sample_id"):
        if not isinstance(capture.get(name), str) or not capture[name]:
            raise BadRequest(f"{where}.{name}", "expected a non-empty string")
    gen = capture.get("gen", 1)
    if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
        raise BadRequest(f"{where}.gen", "expected an integer of 0 or more")
    features = capture.get("features") or {}
    if not isinstance(features, dict) or set(features) - _FEATURES or not all(
            isinstance(v, str) and v for v in features.values()):
        raise BadRequest(f"{where}.features", f"expected names for {' and/or '.join(sorted(_FEATURES))}")
    ids = token_ids(ids, f"input_ids[{i}]", vocab_size, max_len)
    key = f"{capture['store_id']}/{capture['sample_id']}/g{gen}"  # its objects' prefix: with --store, its key
    check_key(key, f"{where}.sample_id")
    passthrough, shapes, loss_mask = [], {}, None
    for k, item in enumerate(capture.get("passthrough") or []):
        name, data, shape, dtype = (item.get(f) if isinstance(item, dict) else None
                                    for f in ("name", "data", "shape", "dtype"))
        field = f"{where}.passthrough[{k}]"
        if not isinstance(name, str) or not name or name in features.values() or name in shapes:
            raise BadRequest(f"{field}.name", "expected a name of its own")
        if dtype not in _INT_DTYPES:
            raise BadRequest(f"{field}.dtype", f"expected one of {', '.join(sorted(_INT_DTYPES))}")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(data, list) or int(np.prod(shape)) != len(data)):
            raise BadRequest(f"{field}.data", "expected as many values as its shape holds")
        try:
            tensor = torch.tensor(data, dtype=_INT_DTYPES[dtype])
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise BadRequest(f"{field}.data", f"expected {dtype} values") from None
        passthrough.append(Passthrough(name, tensor.numpy().tobytes()))
        shapes[name] = (shape, dtype)
        if name == "loss_mask" and tensor.numel() == len(ids):  # SpecForge's own: --store keeps it as the mask
            loss_mask = (tensor.reshape(-1) != 0).numpy().astype(np.uint8)
    request = CaptureRequest(ids, model, request_id=key, loss_mask=loss_mask)
    return SpecTask(
        request=request, sample_id=capture["sample_id"], store_id=capture["store_id"], gen=gen, passthrough=shapes,
        capture=SpecCapture(prefix=f"{key}/",
                            aux=features.get("aux"), target=features.get("last_hidden"),
                            replace=bool(capture.get("replace", False)), passthrough=passthrough),
    )


def row(task: SpecTask, num_tokens: int, hidden_size: int, dtype: torch.dtype, layer_ids: tuple[int, ...],
        error: str | None = None) -> dict:
    """SGLang's answer for one prompt: `meta_info.spec_capture` names the tensors written."""
    if error is not None:
        result = {"sample_id": task.sample_id, "error": error}
    else:
        name = str(dtype).removeprefix("torch.")
        features = {n: {"shape": list(shape), "dtype": d} for n, (shape, d) in task.passthrough.items()}
        if task.capture.aux is not None:
            features[task.capture.aux] = {"shape": [1, num_tokens, len(layer_ids) * hidden_size], "dtype": name}
        if task.capture.target is not None:
            features[task.capture.target] = {"shape": [1, num_tokens, hidden_size], "dtype": name}
        result = {"sample_id": task.sample_id, "store_id": task.store_id, "gen": task.gen,
                  "aux_layer_ids": list(layer_ids), "features": features}
    return {"text": "", "output_ids": [], "meta_info": {
        "id": task.sample_id, "prompt_tokens": num_tokens, "completion_tokens": 0,
        "finish_reason": {"type": "length", "length": 0}, "spec_capture": result,
    }}
