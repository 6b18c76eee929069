"""`corecap serve`'s HTTP side without an engine: what each request is answered, with the engine
thread replaced by one that answers at once (tests/test_serve.py runs the real one). The API key,
the 503 with Retry-After when the states not yet taken fill the quota, the refusals that come
before any model loads, and the quota's own count."""

from __future__ import annotations

import os
import socket
import types

import numpy as np
import pytest
import torch

from corecap.errors import CorecapError
from corecap.serve.config import ServeConfig
from corecap.serve.engine_loop import ServerFull, Ticket
from corecap.serve.metrics import Metrics
from corecap.serve.prepare import file_layers
from corecap.serve.quota import Quota
from support.cli import corecap

pytest.importorskip("httpx")  # starlette's TestClient; vLLM's server installs it


class _Loop:
    """The engine thread's interface, answering at once."""

    def __init__(self, full: bool = False, store_full: bool = False):
        self.metrics, self.failure, self.started, self.full = Metrics(), None, 0.0, full
        self.store_full = store_full  # each request's sample finds the Mooncake store without room
        self.quota = types.SimpleNamespace(fits=lambda: not full)
        self.asked = []
        self.nixl = None  # no --nixl-sidecar-port

    def submit(self, request, spec_capture=None, settings=None, nixl=False):
        if self.full:
            raise ServerFull("--hidden-states-path /h: 17 MiB of states not yet taken, the quota is 16 MiB")
        self.asked.append(request)
        ticket = Ticket(f"corecap-{len(self.asked):012d}", request)
        if self.store_full:
            ticket.future.set_exception(ServerFull("the Mooncake store has no room for 4,096 bytes until the "
                                                   "trainer takes what was put before"))
        else:
            ticket.future.set_result({"hidden_states_path": f"/h/{ticket.name}.safetensors"})
        return ticket

    def abandon(self, ticket):
        pass


def _client(api_key=None, full=False, store_full=False):
    from fastapi.testclient import TestClient

    from corecap.serve.app import build_app

    plan = types.SimpleNamespace(model_name="tiny", cfg=types.SimpleNamespace(api_key=api_key), tokenizer=None,
                                 vocab_size=100, max_len=50, model_dir="/models/tiny")
    loop = _Loop(full, store_full)
    return TestClient(build_app(plan, loop)), loop


def test_a_completion_is_answered_with_its_file_and_token_ids():
    client, loop = _client()
    answer = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1,
                                                  "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert body["kv_transfer_params"] == {"hidden_states_path": "/h/corecap-000000000001.safetensors"}
    assert loop.asked[0].token_ids.tolist() == [5, 6, 7]
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/health").status_code == 200


def test_the_api_key_guards_v1_only():
    client, loop = _client(api_key="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        answer = client.post("/v1/completions", json={"prompt": [1]}, headers=headers)
        assert answer.status_code == 401 and "--api-key" in answer.json()["error"]["message"]
    assert not loop.asked
    assert client.post("/v1/completions", json={"prompt": [1]},
                       headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_a_full_quota_is_503_with_retry_after():
    client, _ = _client(full=True)
    answer = client.post("/v1/completions", json={"prompt": [1, 2]})
    assert answer.status_code == 503 and int(answer.headers["Retry-After"]) >= 1
    assert "quota" in answer.json()["error"]["message"]
    assert 'corecap_requests_total{endpoint="cmpl",status="503"} 1' in client.get("/metrics").text


def test_a_sample_the_mooncake_store_had_no_room_for_is_503_with_retry_after():
    client, _ = _client(store_full=True)
    answer = client.post("/v1/completions", json={"prompt": [1, 2]})
    assert answer.status_code == 503 and int(answer.headers["Retry-After"]) >= 1
    assert "the Mooncake store has no room" in answer.json()["error"]["message"]


def test_a_chat_request_needs_a_chat_template():
    client, _ = _client()
    answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"


def test_the_quota_counts_only_the_files_still_there(tmp_path):
    quota = Quota(str(tmp_path), limit_bytes=100)
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"x" * 60)
        quota.add(name, 60)
    assert not quota.fits() and "120 " not in quota.line()
    os.remove(tmp_path / "a")  # the trainer took it
    quota.counted = 0.0
    assert quota.fits()
    quota.remove("b")  # its client went away
    assert not (tmp_path / "b").exists() and quota.used_bytes == 0


def test_a_server_reachable_from_elsewhere_needs_an_api_key():
    with pytest.raises(CorecapError, match="--api-key"):
        ServeConfig(host="0.0.0.0")
    ServeConfig(host="0.0.0.0", api_key="k")
    ServeConfig(host="::1")


def test_the_files_layers_are_the_aux_ones_then_prenorm():
    assert file_layers((2, 4, 6, 8, "prenorm"), 8) == ((2, 4, 6), (0, 1, 2, 4))
    with pytest.raises(CorecapError, match="prenorm"):
        file_layers((2, 4, 8), 8)
    with pytest.raises(CorecapError, match="no aux layer"):
        file_layers((8, "prenorm"), 8)


def test_the_prefix_caches_bound_is_a_share_of_the_sinks_memory_or_what_the_user_sets():
    """The sink keeps a copy of every cached block's states (every engine's): by default a quarter
    of --buffer-gb; a --prefix-blocks that leaves nothing for the requests in flight is refused."""
    from corecap.serve.prepare import PREFIX_MEMORY_SHARE, _prefix_blocks

    block = 4 * 16 * 4096 * 2  # an 8B model's four layers, bfloat16, 16-token blocks: 512 KiB
    assert PREFIX_MEMORY_SHARE == 0.25 and _prefix_blocks(None, 4 << 30, block, 1) == 2048
    assert _prefix_blocks(None, 4 << 30, block, 2) == 1024  # the engines' copies share it
    assert _prefix_blocks(None, 1 << 20, block, 1) == 1  # never none
    assert _prefix_blocks(7000, 4 << 30, block, 1) == 7000
    with pytest.raises(CorecapError, match=r"--prefix-blocks 8192: .* in each of 2 engines .* --buffer-gb 4"):
        _prefix_blocks(8192, 4 << 30, block, 2)


def test_metrics_show_what_the_prefix_cache_gave_where_it_is_on():
    from types import SimpleNamespace

    from corecap.serve.engine_loop import prefix_line

    metrics = Metrics()
    assert "prefix_cache" not in metrics.text()
    metrics.prefix = (640, 3, 8)
    text = metrics.text()
    for line in ("corecap_prefix_cache_hit_tokens_total 640", "corecap_prefix_cache_evicted_blocks_total 3",
                 "corecap_prefix_cache_blocks 8"):
        assert line in text.splitlines()
    plan = SimpleNamespace(block_size=16, block_bytes=1 << 19, buffer_bytes=4 << 30)
    assert prefix_line(plan, [2048]) == ("prefix caching: at most 2048 blocks of 16 tokens kept cached (1,024.0 MiB "
                                         "of the sink's --buffer-gb 4 for a copy of their states; --prefix-blocks "
                                         "sets it)")
    assert "in each of 2 engines (1,024.0 MiB" in prefix_line(plan, [1024, 1024])
    assert prefix_line(SimpleNamespace(block_size=0), []) == ""


@pytest.mark.full  # two CLI processes: ~10 s each on 2 cores
def test_refusals_come_before_the_model_loads(tiny_model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = corecap("serve", "--model", tiny_model, "--port", str(port), cwd=tmp_path, check=False)
    assert result.returncode == 2 and f"--port {port}: cannot listen there" in result.stderr, result.stderr
    result = corecap("serve", "--model", tiny_model, "--layers", "2,4", "--hidden-states-path", str(tmp_path / "h"),
                     "--port", str(_free_port()), cwd=tmp_path, check=False)
    assert result.returncode == 2 and "'prenorm'" in result.stderr.splitlines()[-1], result.stderr
    assert "vllm" not in result.stderr.lower()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_specforge_requests_are_checked_field_by_field():
    from corecap.serve import specforge
    from corecap.serve.requests import BadRequest

    good = {"store_id": "run1", "sample_id": "run1:t0", "gen": 1, "replace": False,
            "features": {"aux": "hidden_state", "last_hidden": "target"},
            "passthrough": [{"name": "loss_mask", "data": [0, 1, 1], "shape": [1, 3], "dtype": "int64"}]}
    [task] = specforge.tasks({"input_ids": [[5, 6, 7]], "spec_capture": [good],
                              "sampling_params": {"temperature": 0.0, "max_new_tokens": 0}}, "m", 100, 50)
    assert task.capture.prefix == "run1/run1:t0/g1/" and task.capture.passthrough[0].data == bytes(
        np.array([0, 1, 1], np.int64))
    row = specforge.row(task, 3, 64, torch.bfloat16, (1, 3, 5))["meta_info"]["spec_capture"]
    assert row["features"] == {"loss_mask": {"shape": [1, 3], "dtype": "int64"},
                               "hidden_state": {"shape": [1, 3, 192], "dtype": "bfloat16"},
                               "target": {"shape": [1, 3, 64], "dtype": "bfloat16"}}
    assert row["aux_layer_ids"] == [1, 3, 5] and row["gen"] == 1
    bad = [
        ({"input_ids": [[5]], "spec_capture": [good, good]}, "spec_capture"),
        ({"input_ids": [[5]], "spec_capture": [dict(good, sample_id="")]}, "spec_capture[0].sample_id"),
        ({"input_ids": [[5]], "spec_capture": [dict(good, features={"logits": "x"})]}, "spec_capture[0].features"),
        ({"input_ids": [[5]], "spec_capture": [dict(good, passthrough=[dict(good["passthrough"][0], shape=[2])])]},
         "spec_capture[0].passthrough[0].data"),
        ({"input_ids": [[5]], "spec_capture": [good], "sampling_params": {"max_new_tokens": 8}},
         "sampling_params.max_new_tokens"),
        ({"input_ids": [[500]], "spec_capture": [good]}, "input_ids[0]"),
        ({"input_ids": [[5]], "spec_capture": [good], "text": "hi"}, "text"),
    ]
    for body, field in bad:
        with pytest.raises(BadRequest) as refused:
            specforge.tasks(body, "m", 100, 50)
        assert refused.value.field == field, (body, str(refused.value))
