"""corecap's client of `corecap serve` and its dataset, without an engine: a stand-in server (the
standard library's, scripted answer by answer) for the retries and errors, a stand-in client for
the dataset's shares; then the engine thread's abort of a request whose client went away, with
its engine and sink replaced by recorders. tests/test_serve.py runs them against a live server."""

from __future__ import annotations

import http.server
import json
import os
import threading
import types

import pytest
import torch
from safetensors.torch import save_file

from corecap.client import Client, ServerError, States
from corecap.client.dataset import ServerDataset
from corecap.errors import CorecapError
from corecap.serve.engine_loop import EngineLoop
from corecap.serve.metrics import Metrics
from corecap.serve.requests import CaptureRequest


class _Scripted(http.server.BaseHTTPRequestHandler):
    script: list = []  # (status, headers, body) answered in turn

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        status, headers, body = self.script.pop(0)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        data = json.dumps(body).encode()
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def scripted():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _answer(path: str, prompt: list[int]) -> dict:
    return {"choices": [{"text": "", "token_ids": [], "prompt_token_ids": prompt, "finish_reason": "length"}],
            "kv_transfer_params": {"hidden_states_path": path}}


def _file(tmp_path, name: str, num_tokens: int, fp8: bool = False) -> tuple[str, torch.Tensor]:
    """A server's file: [T, L, H] states (fp8: codes and per-token scales) and its lock."""
    states = torch.randn(num_tokens, 3, 4)
    path = str(tmp_path / f"{name}.safetensors")
    tensors = {"hidden_states": states, "token_ids": torch.arange(num_tokens)}
    if fp8:
        scales = states.abs().amax(dim=(1, 2), keepdim=True) / 448.0
        tensors = {"hidden_states": (states / scales).to(torch.float8_e4m3fn), "hidden_states_scales": scales,
                   "token_ids": torch.arange(num_tokens)}
        states = tensors["hidden_states"].float() * scales
    save_file(tensors, path)
    open(path + ".lock", "w").close()
    return path, states


def test_states_are_the_files_layers_first_and_the_file_is_taken(scripted, tmp_path):
    server, url = scripted
    for fp8 in (False, True):
        path, states = _file(tmp_path, f"s{fp8}", 5, fp8)
        _Scripted.script = [(200, {}, _answer(path, [0, 1, 2, 3, 4]))]
        got = Client(url + "/v1").states([0, 1, 2, 3, 4])
        assert torch.equal(got.hidden_states, states.transpose(0, 1)) and got.token_ids.tolist() == [0, 1, 2, 3, 4]
        assert got.num_prompt == 5 and got.finish_reason is None
        assert not os.path.exists(path) and not os.path.exists(path + ".lock")


def test_503_is_asked_again_after_retry_after_and_4xx_is_raised_with_the_servers_message(scripted, tmp_path):
    server, url = scripted
    path, _ = _file(tmp_path, "a", 2)
    full = (503, {"Retry-After": "0"}, {"error": {"message": "quota full", "param": None}})
    _Scripted.script = [full, full, (200, {}, _answer(path, [1, 2]))]
    assert Client(url, backoff=5.0).states([1, 2]).num_prompt == 2  # Retry-After 0 over the 5 s backoff
    _Scripted.script = [full] * 3
    with pytest.raises(CorecapError, match=f"{url}/v1/completions: no answer after 3 tries .*503 quota full"):
        Client(url, max_retries=2, backoff=0.0).states([1])
    _Scripted.script = [(400, {}, {"error": {"message": "prompt: token id 900 is outside", "param": "prompt"}})]
    with pytest.raises(ServerError, match="400 prompt: token id 900") as refused:
        Client(url, backoff=60.0).states([900])  # at once: no retry
    assert refused.value.param == "prompt" and refused.value.status == 400


def test_a_server_not_there_is_one_error_naming_its_url():
    with pytest.raises(CorecapError, match=r"http://127.0.0.1:9/v1/completions: no answer after 3 tries"):
        Client("http://127.0.0.1:9", max_retries=2, backoff=0.01).states([1])


class _FakeClient(Client):
    """Answers each request with the prompt's own ids as states, and records what it was asked."""

    def __init__(self):
        super().__init__()
        self.asked = []

    def states(self, input_ids=None, *, messages=None, max_tokens=1, **fields):
        self.asked.append(list(input_ids))
        ids = torch.tensor(input_ids, dtype=torch.int64)
        return States(hidden_states=ids.float().view(1, -1, 1).expand(2, -1, 3), token_ids=ids, num_prompt=len(ids))


def _rows(n: int) -> list[dict]:
    return [{"id": f"s{i}", "input_ids": [i] * (1 + i % 3)} for i in range(n)]


def test_two_ranks_of_two_workers_ask_for_every_sample_exactly_once(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(11)))
    keys = []
    for rank in range(2):
        ds = ServerDataset(path, _FakeClient(), rank=rank, world_size=2)
        loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2)
        for batch in loader:  # padded by StoreDataset's collate
            assert batch["hidden_states"].shape[:3] == (len(batch["key"]), 2, batch["input_ids"].shape[1])
            keys += batch["key"]
    assert sorted(keys) == sorted(f"s{i}" for i in range(11)) and len(keys) == 11


def test_a_restarted_rank_asks_only_for_what_it_had_not_finished(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    first = ServerDataset(_rows(12), _FakeClient())
    mine = [key for _, key, _ in first.share()]
    assert mine == ["s1", "s4", "s7", "s10"]
    finished = []
    for item in first:
        finished.append(item["key"])
        if len(finished) == 2:
            break  # the rank fails here
    client = _FakeClient()
    again = [item["key"] for item in ServerDataset(_rows(12), client, done=finished)]
    assert again == ["s7", "s10"] and client.asked == [[7, 7], [10, 10]]


def test_loss_mask_is_the_rows_and_zero_over_a_prompt_the_model_answered():
    rows = [{"input_ids": [4, 5, 6], "loss_mask": [0, 1, 1]}]
    [item] = list(ServerDataset(rows, _FakeClient(), rank=0, world_size=1))
    assert item["key"] == "1" and item["loss_mask"].tolist() == [0, 1, 1]
    with pytest.raises(CorecapError, match="rank 2 is outside a world of 2"):
        ServerDataset(rows, _FakeClient(), rank=2, world_size=2)


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, *args)) or True


def test_a_request_whose_client_went_away_is_aborted_and_its_sample_forgotten(tmp_path):
    plan = types.SimpleNamespace(cfg=types.SimpleNamespace(hidden_states_path=str(tmp_path), quota_bytes=1 << 30,
                                                           backend="file"))
    loop = EngineLoop(plan, print, Metrics())
    loop.engine, loop.sink = _Recorder(), _Recorder()
    loop.engine.abort = lambda name: loop.engine.calls.append(("abort", name)) or 64  # 64 positions scheduled
    request = CaptureRequest(token_ids=torch.arange(3).numpy(), model="m")
    waiting, running, other = (loop.submit(request) for _ in range(3))
    loop.abandon(waiting)  # never reached the engine: dropped from the queue
    assert list(loop.waiting) == [running, other] and waiting.future.cancelled()
    loop.waiting.clear()
    loop.running = {running.name: running, other.name: other}
    loop.abandon(running)
    loop._abort()  # the engine thread's turn
    # the sink forgets it once the states of the 64 positions its steps compute are in (prefix caching)
    assert loop.engine.calls == [("abort", running.name)] and loop.sink.calls == [("forget", running.name, 64)]
    assert list(loop.running) == [other.name] and running.future.cancelled() and not other.future.done()
    assert "corecap_requests_aborted_total 2" in loop.metrics.text()


def test_the_server_admits_within_its_buffer_and_says_how_many_requests_waited(tmp_path):
    """A request waits while the states of those held, its own included, would not fit the
    sink's memory; it is counted once however many steps it waits, and the server says so at stop."""
    from corecap.sink.budget import Released, StatesBudget

    plan = types.SimpleNamespace(cfg=types.SimpleNamespace(hidden_states_path=str(tmp_path), quota_bytes=1 << 30,
                                                           backend="file"))
    log = []
    loop = EngineLoop(plan, log.append, Metrics())
    loop.sink = _Recorder()
    loop.engine = types.SimpleNamespace(max_num_seqs=8, num_unfinished=0, add=lambda *args: [])
    released = Released()
    loop.budget = StatesBudget(3 << 20, 4096, released)  # 256 tokens of 4 KiB: 1 MiB, three at once
    tickets = [loop.submit(CaptureRequest(token_ids=torch.arange(256).numpy(), model="m")) for _ in range(5)]
    for _ in range(3):  # three steps of the engine thread: the fourth request waits in each
        loop._admit()
    assert list(loop.running) == [t.name for t in tickets[:3]] and list(loop.waiting) == tickets[3:]
    assert loop.budget.num_waits == 1 and loop.budget.line().endswith(
        "held to --buffer-gb 0.00292969 (4096 bytes a token in the sink's buffers; 1 requests waited for room); "
        "a larger --buffer-gb lets more run at once")
    released.add(1 << 20)  # one sample committed: room for one more
    loop._admit()
    assert list(loop.waiting) == tickets[4:] and loop.budget.num_waits == 2 and loop.budget.most_held == 3


def test_a_full_mooncake_store_is_503_for_its_request_and_for_new_ones_a_second(tmp_path, monkeypatch):
    """The sink reports a sample the Mooncake store had no room for: its request is answered 503
    (ServerFull) naming the option, and requests that come within the next second are refused at
    once, before the engine works on them; after it, they are queued again."""
    from corecap.serve import engine_loop
    from corecap.serve.engine_loop import ServerFull
    from corecap.sink.messages import Delivered

    plan = types.SimpleNamespace(cfg=types.SimpleNamespace(hidden_states_path=str(tmp_path), quota_bytes=1 << 30,
                                                           backend="mooncake"))
    loop = EngineLoop(plan, print, Metrics())
    clock = [100.0]
    monkeypatch.setattr(engine_loop.time, "monotonic", lambda: clock[0])
    request = CaptureRequest(token_ids=torch.arange(3).numpy(), model="m")
    full, other = loop.submit(request), loop.submit(request)
    loop.waiting.clear()
    loop.running = {full.name: full, other.name: other}
    why = "the Mooncake store has no room for 4,096 bytes until the trainer takes what was put before"
    loop.sink = types.SimpleNamespace(take_delivered=lambda: [Delivered(full.name, 0, why, True),
                                                              Delivered(other.name, 0, "status -1", False)])
    loop._answer()
    with pytest.raises(ServerFull, match=r"no room for 4,096 bytes .*\(--mooncake-global-segment-gib\)$"):
        full.future.result(0)
    with pytest.raises(CorecapError, match="writing the states failed: status -1") as failed:
        other.future.result(0)
    assert not isinstance(failed.value, ServerFull)  # another failure is the server's (500), not a wait
    clock[0] += 0.5
    with pytest.raises(ServerFull, match="no room for 4,096 bytes"):
        loop.submit(request)
    assert not loop.waiting
    clock[0] += 0.6
    assert loop.submit(request) in loop.waiting


def test_the_mooncake_objects_of_a_client_that_went_away_are_removed():
    """With Mooncake the objects are hard-pinned (never evicted for room), so what nobody will read
    must go: a request answered before its client left has its object removed (SpecForge's: its
    tensors' keys), one whose client left while its sample was being written too, by the engine
    thread, on the sink's delivery thread."""
    from corecap.sink.messages import Delivered
    from corecap.sink.mooncake import Passthrough, SpecCapture

    plan = types.SimpleNamespace(cfg=types.SimpleNamespace(hidden_states_path="/h", quota_bytes=1 << 30,
                                                           backend="mooncake"))
    loop = EngineLoop(plan, print, Metrics())
    loop.engine, loop.sink = _Recorder(), _Recorder()
    loop.engine.abort = lambda name: None  # none of them runs in the engine any more
    loop.plan.positions, loop.hidden_size, loop.dtype = (0, 1), 4, torch.float32
    request = CaptureRequest(token_ids=torch.arange(3).numpy(), model="m")
    capture = SpecCapture(prefix="run/7/g0/", aux="aux", target=None, passthrough=[Passthrough("input_ids", b"")])
    answered, specforge, writing = loop.submit(request), loop.submit(request, capture), loop.submit(request)
    loop.waiting.clear()
    loop.running = {t.name: t for t in (answered, specforge, writing)}
    loop.sink.take_delivered = lambda: [Delivered(answered.name, 64), Delivered(specforge.name, 64)]
    loop._answer()
    assert answered.future.result(0)["handle"] == answered.name
    loop.abandon(answered)
    loop.abandon(specforge)
    loop.abandon(writing)  # not answered yet: its sample is being written
    loop._abort()
    loop.sink.take_delivered = lambda: [Delivered(writing.name, 64)]
    loop._answer()
    assert [c for c in loop.sink.calls if c[0] == "discard"] == [
        ("discard", [answered.name]), ("discard", ["run/7/g0/aux", "run/7/g0/input_ids"]),
        ("discard", [writing.name])]


def test_the_server_sees_a_client_go_away_with_the_api_key_on():
    """A real uvicorn (the engine thread a stand-in whose answer never comes): a client that closes
    its socket mid-request has its ticket abandoned, with the API key's middleware in the way."""
    import socket
    import time

    import uvicorn

    from corecap.serve.app import build_app
    from corecap.serve.engine_loop import Ticket

    class Loop:
        metrics, failure, started, abandoned, nixl = Metrics(), None, 0.0, [], None

        def submit(self, request, spec_capture=None, settings=None, nixl=False):
            return Ticket("corecap-000000000001", request)  # never answered

        def abandon(self, ticket):
            self.abandoned.append(ticket.name)

    plan = types.SimpleNamespace(model_name="tiny", cfg=types.SimpleNamespace(api_key="k"), tokenizer=None,
                                 vocab_size=100, max_len=50, model_dir="/m")
    loop = Loop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(plan, loop), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        body = json.dumps({"prompt": [1, 2]}).encode()
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.3)
        client.close()
        deadline = time.monotonic() + 5
        while not loop.abandoned and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loop.abandoned == ["corecap-000000000001"]
    finally:
        server.should_exit = True
        thread.join(10)
