"""`corecap serve --nixl-sidecar-port` without an engine: ModelOpt's completions, asked on the
sidecar's port, are answered with its `kv_transfer_params`, and the sidecar's /meta, /desc and
/done answer as ModelOpt's reader expects (tests/test_serve.py has its reader fetch real states
over NIXL). Bad requests are refused naming the field, unknown ids are 404, a full pool is 503
with Retry-After, and the server goes on serving."""

from __future__ import annotations

import base64
import types

import pytest
import torch

from corecap.serve.engine_loop import ServerFull, Ticket
from corecap.serve.metrics import Metrics
from support.machine import in_ci
from support.modelopt_reader import available

pytest.importorskip("httpx")  # starlette's TestClient; vLLM's server installs it

SIDECAR_PORT = 18999
HIDDEN, LAYERS = 16, 3


def _nixl():
    missing = available()
    if missing:
        if in_ci():
            pytest.fail(f"{missing} (CI=true: mandatory)", pytrace=False)
        pytest.skip(missing)
    from corecap.serve.nixl import NixlStates

    return NixlStates


class _Loop:
    """The engine thread's interface, answering at once: a sample's states are its token ids."""

    def __init__(self, states):
        self.metrics, self.failure, self.started, self.nixl = Metrics(), None, 0.0, states
        self.quota = types.SimpleNamespace(fits=lambda: True)
        self.asked = []

    def submit(self, request, spec_capture=None, settings=None, nixl=False):
        from corecap.serve.nixl import PoolFull

        name, ids = f"corecap-{len(self.asked) + 1:012d}", request.token_ids.tolist()
        if nixl:
            try:
                self.nixl.reserve(name, len(ids) * LAYERS * HIDDEN * 4)
            except PoolFull as e:
                raise ServerFull(str(e)) from None
        self.asked.append((request, nixl))
        ticket = Ticket(name, request, nixl=nixl)
        if nixl:
            states = torch.tensor(ids, dtype=torch.float32)[:, None, None].expand(len(ids), LAYERS, HIDDEN)
            self.nixl.hold(ticket.name, states.contiguous(), ids)
            ticket.future.set_result(self.nixl.params(ticket.name))
        else:
            ticket.future.set_result({"hidden_states_path": f"/h/{ticket.name}.safetensors"})
        return ticket

    def abandon(self, ticket):
        pass


@pytest.fixture(scope="module")
def states():
    NixlStates = _nixl()
    return NixlStates(SIDECAR_PORT, pool_bytes=64 * 1024, max_tokens=50)


def _client(states):
    from fastapi.testclient import TestClient

    from corecap.serve.app import build_app

    plan = types.SimpleNamespace(model_name="tiny", cfg=types.SimpleNamespace(api_key=None), tokenizer=None,
                                 vocab_size=100, max_len=50, model_dir="/models/tiny")
    loop = _Loop(states)
    return TestClient(build_app(plan, loop), base_url=f"http://testserver:{SIDECAR_PORT}"), loop


def test_modelopt_is_answered_on_the_sidecar_port_and_frees_on_done(states):
    client, loop = _client(states)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    params = answer.json()["kv_transfer_params"]
    assert params == {"hs_req_id": "corecap-000000000001", "hs_sidecar_port": SIDECAR_PORT, "hs_max_tokens": 50}
    assert loop.asked[0][1] is True
    assert base64.b64decode(client.get("/meta").json()["agent_metadata"]) == states.metadata
    desc = client.get("/desc", params={"req_id": params["hs_req_id"]}).json()
    assert desc["ready"] and desc["hs_shape"] == [3, LAYERS, HIDDEN] and desc["hs_dtype"] == "float32"
    assert desc["token_ids"] == [5, 6, 7] and base64.b64decode(desc["hs_descs"])
    assert states.used_bytes == 3 * LAYERS * HIDDEN * 4
    assert client.get("/done", params={"req_id": params["hs_req_id"]}).json() == {
        "freed": params["hs_req_id"], "valid": True}
    assert states.used_bytes == 0
    # the API's own port still writes files, as speculators reads them
    other = client.post("http://testserver:8000/v1/completions", json=body).json()
    assert other["kv_transfer_params"] == {"hidden_states_path": "/h/corecap-000000000002.safetensors"}


def test_bad_requests_and_unknown_ids_are_refused_and_the_server_goes_on(states):
    client, loop = _client(states)
    answer = client.post("/v1/completions", json={"prompt": [1, 2], "kv_transfer_params": "hs_req_id=3"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "kv_transfer_params", answer.text
    assert "kv_transfer_params" in answer.json()["error"]["message"] and not loop.asked
    for path, query in (("/desc", {"req_id": "corecap-999"}), ("/desc", {}), ("/done", {"req_id": "nope"})):
        answer = client.get(path, params=query)
        assert answer.status_code == 404 and "req_id" in answer.json()["error"], (path, answer.text)
    answer = client.post("/v1/completions", json={"prompt": [1, 2], "kv_transfer_params": {}})
    assert answer.status_code == 200 and answer.json()["kv_transfer_params"]["hs_req_id"], answer.text
    client.get("/done", params={"req_id": answer.json()["kv_transfer_params"]["hs_req_id"]})


def test_a_full_pool_answers_503_with_retry_after_until_the_reader_takes_its_states(states):
    """The pool (64 KiB here) bounds what is held for readers that have not said /done."""
    client, _ = _client(states)
    names, answer = [], None
    for _ in range(40):  # 45 tokens × 3 layers × 16 floats: 8,640 bytes each
        answer = client.post("/v1/completions", json={"prompt": list(range(1, 46))})
        if answer.status_code != 200:
            break
        names.append(answer.json()["kv_transfer_params"]["hs_req_id"])
    assert answer.status_code == 503 and answer.headers["Retry-After"], answer.text
    assert "--nixl-pool-gb" in answer.json()["error"]["message"] and len(names) == 7
    for name in names:
        assert client.get("/done", params={"req_id": name}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": [1, 2, 3]}).status_code == 200


def test_free_ranges_are_reused_first_fit(states):
    states.held.clear()
    block = torch.zeros(1000, dtype=torch.float32)  # 4,000 bytes: ranges start 64-aligned
    for name in "abc":
        states.reserve(name, 4000)
        states.hold(name, block, [1])
    assert [states.held[n].offset for n in "abc"] == [0, 4032, 8064]
    states.release("b")
    states.reserve("d", 40)
    assert states.held["d"].offset == 4032 and states.describe("d") == {"ready": False}
    states.hold("d", torch.zeros(10, dtype=torch.float32), [1])
    assert states.describe("d")["hs_shape"] == [10]
    for name in "acd":
        states.release(name)


def test_without_nixl_the_option_is_refused_before_the_model_loads(monkeypatch):
    import sys

    from corecap.errors import CorecapError
    from corecap.serve import ServeConfig, serve
    from support.server import free_port

    monkeypatch.setitem(sys.modules, "nixl._api", None)  # import fails, as without the package
    with pytest.raises(CorecapError, match=r"--nixl-sidecar-port: NIXL is not installed .*pip install nixl-cu12"):
        serve(ServeConfig(port=free_port(), nixl_sidecar_port=free_port()), log=lambda line: None)
