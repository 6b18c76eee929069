"""`corecap serve` against a trainer's own online reader: speculators' `ArrowDataset` (its vLLM
client, `generate_hidden_states`, and hs_connectors' `FileTransfer`, `FP8Transfer` and
`MooncakeTransfer`) asks a live server for each sample's states while several clients ask at
once (batched; the Llama's prompts chunked at 64 tokens). What the reader loads must equal HF
transformers' `output_hidden_states` (float32, 1e-4 per token; fp8 within its own rounding) for
DeepSeek-V3's MLA, which vLLM's own hidden-states connector refuses (file), and a dense Llama
(fp8; Mooncake, through a `mooncake_master` the test starts). The Llama servers run with vLLM's
prefix caching on (as by default): prompts sharing prefixes within and across requests take
blocks from it, exactly, with a roomy bound (Mooncake) and one small enough to evict (fp8: a KV
cache of 32 blocks, --prefix-blocks 8); vLLM turns it off for the MLA model on the CPU. Then the
requests a server must survive, a dead worker, and SIGTERM: every file whole, none left
half-written. The servers run --enforce-eager (their engine starts in seconds): compiled capture
is tests/test_capture.py's."""

from __future__ import annotations

import concurrent.futures
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from support import modelopt_reader, speculators_reader, tiny_models
from support.machine import in_ci
from support.reference import NUM_LAYERS, VOCAB, hf_hidden_states, record_error, relative_errors, write_jsonl
from support.server import MooncakeMaster, Server, free_port
from support.speculators_reader import prepared_data

pytestmark = [pytest.mark.engine, pytest.mark.full]

LLAMA_LAYERS = (2, 4, 6, 8, "prenorm")  # the file holds 2, 4, 6 and prenorm (8 is after the final norm)
MLA_LAYERS = (1, 2, 3, "prenorm")
NUM_CLIENTS = 6
LLAMA_BLOCK, LLAMA_KV_BLOCKS, LLAMA_PREFIX_BLOCKS = 32, 32, 8  # the fp8 server's prefix cache: tight
MOONCAKE_BLOCK = 32  # the Mooncake server's: roomy (its bound is what a quarter of --buffer-gb holds)


def _speculators():
    try:
        from hs_connectors import FileTransfer, FP8Transfer
        from speculators.train.data import ArrowDataset
    except ImportError:
        message = "speculators' online reader: pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0"
        if in_ci():
            pytest.fail(f"{message} (CI=true: mandatory)", pytrace=False)
        pytest.skip(message)
    return ArrowDataset, FileTransfer, FP8Transfer


def _rows(vocab: int) -> list[dict]:
    """Lengths from 1 token to 300 (chunked at 64), duplicates, a shared prefix."""
    rng = np.random.default_rng(11)
    prefix = rng.integers(3, vocab, size=90).tolist()
    rows = [[7], rng.integers(3, vocab, size=300).tolist(), prefix + [5, 6], prefix + [9] * 20]
    rows += [rows[1]] + [rng.integers(3, vocab, size=int(n)).tolist() for n in rng.integers(2, 120, size=7)]
    return [{"id": f"r{i}", "input_ids": ids} for i, ids in enumerate(rows)]


def _prefix_rows(vocab: int) -> tuple[list[dict], list[dict]]:
    """Two waves of prompts sharing prefixes (the second sent once the first is answered): a
    system prompt shared by several concurrent requests, identical prompts, prompts that are a
    prefix of another or have one, a shared part ending mid-block, and a prompt whose prefill,
    chunked at 64 tokens, runs on past a cached prefix."""
    rng = np.random.default_rng(23)
    tokens = lambda n: rng.integers(3, vocab, size=n).tolist()  # noqa: E731
    system, x, dup, mid = tokens(100), tokens(160), tokens(90), tokens(70)
    first = [{"id": f"system-{i}", "input_ids": system + tokens(int(n))} for i, n in enumerate((20, 47, 66, 81))]
    first += [{"id": "x", "input_ids": x}, {"id": "dup-1", "input_ids": dup},
              {"id": "mid-a", "input_ids": mid + tokens(30)}]
    second = [
        {"id": "dup-2", "input_ids": dup}, {"id": "dup-3", "input_ids": dup},
        {"id": "x-96", "input_ids": x[:96]},  # all of it cached: vLLM computes its last block again
        {"id": "x-50", "input_ids": x[:50]},
        {"id": "x-more", "input_ids": x + tokens(60)},
        {"id": "mid-b", "input_ids": mid + tokens(45)},  # 70 shared: the shared part ends mid-block
        {"id": "system-chunked", "input_ids": system + tokens(200)},
        {"id": "system-late", "input_ids": system + tokens(33)},
    ]
    return first, second


def _hit_tokens_at_least(first: list[dict], second: list[dict], block: int) -> int:
    """The prompt tokens the second wave takes from an unbounded prefix cache, at least: each
    prompt's full blocks shared with one of the first wave, but never its last token's block."""
    def shared(a, b):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return n // block * block

    return sum(min(max(shared(r["input_ids"], f["input_ids"]) for f in first),
                   (len(r["input_ids"]) - 1) // block * block) for r in second)


def _metric(server: Server, name: str) -> int:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        line = next(n for n in response.read().decode().splitlines() if n.startswith(name + " "))
    return int(float(line.split()[-1]))


def _mooncake():
    try:
        from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
        from hs_connectors.transfer import MooncakeTransfer
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        message = (f"Mooncake ({e}): apt-get install libibverbs1; "
                   "pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1")
        if in_ci():
            pytest.fail(f"{message} (CI=true: mandatory)", pytrace=False)
        pytest.skip(message)
    return MooncakeHiddenStatesStore, MooncakeStoreConfig, MooncakeTransfer


def _read_all(server: Server, rows: list[dict], tmp: Path, fp8: bool = False, transfer=None,
              name: str = "prepared") -> list[dict]:
    """Every row through speculators' own online path, NUM_CLIENTS at a time."""
    _, FileTransfer, FP8Transfer = _speculators()
    hidden = Path(server.hidden_states_path)
    if transfer is None:
        transfer = FP8Transfer(hidden, dequantize_dtype=torch.float32) if fp8 else FileTransfer(hidden)
    return speculators_reader.read_online(server.url, transfer, prepared_data(str(tmp / name), rows), len(rows),
                                          NUM_CLIENTS)


def _check_against_hf(got: list[dict], rows: list[dict], reference: dict, aux: tuple, case: str, tolerance: float,
                      fp8_tolerance: float | None = None):
    """Each sample as the reader loaded it against HF's states; with `fp8_tolerance`, also against
    HF's states quantized and dequantized by hs_connectors' own fp8 functions (the same formula:
    only codes on a rounding boundary may differ)."""
    for sample, row in zip(got, rows):
        assert sample["input_ids"].tolist() == row["input_ids"], row["id"]
        loaded = speculators_reader.loaded_layers(sample, len(aux))
        ref = tiny_models.stacked(reference[row["id"]], (*aux, "prenorm"))
        per_sample, per_token = relative_errors(loaded, ref)
        record_error(case, per_sample, per_token)
        assert float(per_token.max()) <= tolerance, (row["id"], per_token.tolist())
        if fp8_tolerance is not None:
            from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

            codes, scales = quantize_tensor_to_fp8(ref.transpose(0, 1))
            ref8 = dequantize_fp8_tensor(codes, scales, dtype=torch.float32).transpose(0, 1)
            per_sample, per_token = relative_errors(loaded, ref8)
            record_error(f"{case} vs HF through fp8", per_sample, per_token)
            assert float(per_token.max()) <= fp8_tolerance, (row["id"], per_token.tolist())


@pytest.fixture(scope="module")
def llama(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-llama")
    sidecar = free_port() if modelopt_reader.available() is None else None  # ModelOpt's reader's port
    server = Server("--model", tiny_model, "--dtype", "float32", "--layers", ",".join(map(str, LLAMA_LAYERS)),
                    "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--hidden-states-backend", "fp8",
                    "--enforce-eager", *(("--nixl-sidecar-port", str(sidecar)) if sidecar else ()),
                    "--store", str(tmp / "store"),
                    "--block-size", str(LLAMA_BLOCK), "--num-gpu-blocks-override", str(LLAMA_KV_BLOCKS),
                    "--prefix-blocks", str(LLAMA_PREFIX_BLOCKS),
                    hidden_states_path=str(tmp / "hidden"), log_path=str(tmp / "serve.log"), cwd=str(tmp))
    server.sidecar_port = sidecar
    yield server, tmp
    server.stop()


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-mla")
    model = tiny_models.build("deepseek_v3", str(tmp / "model"), seed=3)
    server = Server("--model", model, "--dtype", "float32", "--layers", ",".join(map(str, MLA_LAYERS)),
                    "--max-num-seqs", "4", "--attention-backend", "CPU_MLA", "--enforce-eager",
                    "--data-parallel-size", "2",
                    hidden_states_path=str(tmp / "hidden"), log_path=str(tmp / "serve.log"), cwd=str(tmp))
    yield server, tmp, model
    server.stop()


def test_speculators_reads_mla_states_equal_to_hf(mla):
    """DeepSeek-V3 (MLA, MoE), two data-parallel replicas (each request to the one with the
    fewest tokens outstanding): the states speculators' file backend loads are HF's, to 1e-4."""
    server, tmp, model = mla
    rows = _rows(tiny_models.VOCAB)
    got = _read_all(server, rows, tmp, fp8=False)
    reference = tiny_models.reference_in_a_process(model, write_jsonl(tmp / "rows.jsonl", rows), str(tmp / "ref.pt"))
    _check_against_hf(got, rows, reference, MLA_LAYERS[:-1], "serve deepseek_v3 file", 1e-4)
    assert "prefix caching off" in server.output()  # vLLM turns it off for MLA on the CPU
    assert ", 2 replicas" in server.output(), server.output()[-3000:]
    # speculators took every file and removed it, with its lock: nothing is left behind
    assert os.listdir(server.hidden_states_path) == [] or set(os.listdir(server.hidden_states_path)) <= {"corecap.log"}


def test_a_dead_worker_ends_the_server_with_one_line(mla):
    """After the MLA server's exactness test: its vLLM worker SIGKILLed while it serves. The
    request in flight gets a 500, and the server exits 2 with `corecap run`'s one line."""
    import psutil

    server, _, _ = mla
    workers = [p for p in psutil.Process(server.proc.pid).children(recursive=True) if p.name().startswith("VLLM::")]
    assert workers, [p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = pool.submit(_post, f"{server.url}/v1/completions", {"prompt": list(range(3, 400))})
        workers[0].kill()
        status, answer = asked.result()
    assert status in (200, 500), answer  # answered before the kill, or told why not
    returncode = server.proc.wait(120)
    last = server.output().strip().splitlines()[-1]
    assert returncode == 2 and last.startswith("corecap: error: ") and "worker" in last, server.output()[-3000:]


def test_speculators_reads_fp8_states_within_their_rounding(llama, tiny_model):
    """The fp8 backend: per-token scaled e4m3 (3 mantissa bits: a relative error up to 2^-4 an
    element), dequantized by speculators' FP8Transfer, against HF float32."""
    server, tmp = llama
    rows = _rows(VOCAB)
    got = _read_all(server, rows, tmp, fp8=True)
    reference = tiny_models.reference_in_a_process(tiny_model, write_jsonl(tmp / "rows.jsonl", rows),
                                                   str(tmp / "ref.pt"))
    _check_against_hf(got, rows, reference, LLAMA_LAYERS[:-2], "serve llama fp8", 0.05, fp8_tolerance=0.02)


TRAIN_STEPS = 4


def test_speculators_trains_an_eagle3_draft_on_served_states(llama, tiny_model, hf_model, monkeypatch):
    """`speculators train --vllm-endpoint URL --on-missing generate --hidden-states-backend fp8`
    on the CPU, by speculators' own code (tests/support/speculators_training.py: its options,
    its EAGLE-3 draft of one layer over the verifier's whole vocabulary, its loaders, its Trainer's
    step; what the CPU changes is said there). Every batch its loader fetched from the server is
    what the draft's forward takes, and the draft's teacher, its verifier lm_head(norm(last
    state)), gives HF's logits for the same tokens within the fp8 and bfloat16 rounding. Then
    TRAIN_STEPS steps on one batch: a finite loss, a finite gradient on every trainable parameter
    and none on the verifier's, each trainable parameter moved, and each step's loss below the last."""
    from torch.utils.data import DataLoader

    from support import speculators_training as training

    _speculators()
    server, tmp = llama
    rows = _rows(VOCAB)
    args = training.train_options(
        "--verifier-name-or-path", tiny_model, "--data-path", prepared_data(str(tmp / "train-prepared"), rows),
        "--save-path", str(tmp / "draft"), "--vllm-endpoint", f"{server.url}/v1", "--on-missing", "generate",
        "--hidden-states-backend", "fp8", "--target-layer-ids", *map(str, LLAMA_LAYERS[:-2]), "--num-layers", "1",
        "--total-seq-len", "512", "--num-workers", "0", "--epochs", "1",
        "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
    )
    draft = training.build_draft(args)
    batches = list(training.loaders(args, draft)[0])
    hidden = draft.config.transformer_layer_config.hidden_size
    for batch in batches:
        assert batch["hidden_states"].shape == (1, 512, len(LLAMA_LAYERS[:-2]) * hidden)
        assert batch["verifier_last_hidden_states"].shape == (1, 512, hidden) and batch["error_records"] == 0
        assert {batch[k].dtype for k in ("hidden_states", "verifier_last_hidden_states")} == {torch.bfloat16}
        assert {batch[k].shape for k in ("input_ids", "loss_mask", "position_ids", "document_ids")} == {(1, 512)}
        for ids, last in training.documents(batch):
            row = next(r["input_ids"] for r in rows if r["input_ids"][1: 1 + len(ids)] == ids)  # shifted by one
            with torch.no_grad():
                teacher = draft.verifier_lm_head(draft.verifier_norm(last.float()))
                ref = hf_model(torch.tensor([row])).logits[0, 1: 1 + len(ids)]
            per_sample, per_token = relative_errors(teacher[None], ref[None])
            record_error("serve llama fp8 teacher logits", per_sample, per_token)
            assert float(per_token.max()) <= 0.05, per_token
    train_rows = rows[: int(len(rows) * args.train_data_ratio)]  # ArrowDataset's train split
    expected = sorted(r["input_ids"][1:] for r in train_rows if len(r["input_ids"]) > 1)
    assert sorted(ids for b in batches for ids, _ in training.documents(b)) == expected

    trainable = {name: p.detach().clone() for name, p in draft.named_parameters() if p.requires_grad}
    trainer = training.cpu_trainer(args, draft, DataLoader([batches[0]] * TRAIN_STEPS, batch_size=None), monkeypatch)
    losses = [step["loss"] for step in training.train_epoch(trainer)]
    assert len(losses) == TRAIN_STEPS and all(np.isfinite(losses)), losses
    for name, param in draft.named_parameters():
        if name in trainable:
            assert param.grad is not None and bool(param.grad.isfinite().all()) and bool(param.grad.any()), name
            assert not torch.equal(param.detach(), trainable[name]), name
        else:
            assert param.grad is None, name
    assert {"fc.weight", "verifier_lm_head.weight"} <= {name for name, _ in draft.named_parameters()}
    assert "fc.weight" in trainable and "verifier_lm_head.weight" not in trainable
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses  # each step's update helped


@pytest.fixture(scope="module")
def mooncake(tiny_model, tmp_path_factory):
    _mooncake()
    tmp = tmp_path_factory.mktemp("serve-mooncake")
    master = MooncakeMaster(str(tmp / "master.log"))
    try:
        server = Server("--model", tiny_model, "--dtype", "float32", "--layers", ",".join(map(str, LLAMA_LAYERS)),
                        "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--enforce-eager",
                        "--block-size", str(MOONCAKE_BLOCK),
                        "--hidden-states-backend", "mooncake", "--mooncake-master", master.address,
                        "--mooncake-local-hostname", "127.0.0.1", "--mooncake-global-segment-gib", "0.25",
                        "--mooncake-local-buffer-gib", "0.0625",
                        hidden_states_path=str(tmp / "hidden"), log_path=str(tmp / "serve.log"), cwd=str(tmp))
        yield server, tmp, master
        server.stop()
    finally:
        master.stop()


def test_speculators_reads_states_from_mooncake_equal_to_hf(mooncake, tiny_model):
    """No shared file system: each sample an object in the Mooncake store, read with speculators'
    MooncakeTransfer (another client of the same master), which removes it once read."""
    server, tmp, master = mooncake
    rows = _rows(VOCAB)
    got = _read_all(server, rows, tmp, transfer=_mooncake_transfer(master))
    reference = tiny_models.reference_in_a_process(tiny_model, write_jsonl(tmp / "rows.jsonl", rows),
                                                   str(tmp / "ref.pt"))
    _check_against_hf(got, rows, reference, LLAMA_LAYERS[:-2], "serve llama mooncake", 1e-4)
    assert not os.path.exists(server.hidden_states_path) or not [
        n for n in os.listdir(server.hidden_states_path) if n.startswith("corecap-")]


def _mooncake_transfer(master):
    """speculators' MooncakeTransfer, another client of the server's master."""
    MooncakeHiddenStatesStore, MooncakeStoreConfig, MooncakeTransfer = _mooncake()
    return MooncakeTransfer(MooncakeHiddenStatesStore(MooncakeStoreConfig(
        local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", master_server_address=master.address,
        global_segment_size=0, local_buffer_size=64 << 20, protocol="tcp", device_name="")))


def test_prefix_cache_hits_while_serving_are_exact_through_speculators_mooncake_reader(mooncake, tiny_model):
    """Two waves of prompts that share prefixes, 6 clients at a time: the blocks the second takes
    from vLLM's prefix cache (every one it shares with the first: the bound is roomy) are completed
    from the server's copies, and what speculators' reader loads equals HF's, float32, to 1e-4."""
    server, tmp, master = mooncake
    transfer = _mooncake_transfer(master)
    first, second = _prefix_rows(VOCAB)
    hits = _metric(server, "corecap_prefix_cache_hit_tokens_total")
    got = _read_all(server, first, tmp, transfer=transfer, name="prefix-1")
    got += _read_all(server, second, tmp, transfer=transfer, name="prefix-2")
    hits = _metric(server, "corecap_prefix_cache_hit_tokens_total") - hits
    reference = tiny_models.reference_in_a_process(tiny_model, write_jsonl(tmp / "prefix.jsonl", first + second),
                                                   str(tmp / "prefix-ref.pt"))
    _check_against_hf(got, first + second, reference, LLAMA_LAYERS[:-2], "serve llama mooncake, prefix hits", 1e-4)
    assert hits >= _hit_tokens_at_least(first, second, MOONCAKE_BLOCK) >= 20 * MOONCAKE_BLOCK, hits
    assert _metric(server, "corecap_prefix_cache_evicted_blocks_total") == 0
    assert "prefix caching on" in server.output() and "prefix caching: at most" in server.output()


def test_an_aborted_requests_cached_blocks_serve_a_later_request_exactly(mooncake, tiny_model):
    """A client goes away while its request generates: the blocks its steps computed stay in vLLM's
    prefix cache, and the states the server keeps of them complete the requests that hit them
    next (the same prompt, and one that extends it), equal to HF's."""
    import socket
    import time

    server, tmp, master = mooncake
    rng = np.random.default_rng(29)
    prompt = rng.integers(3, VOCAB, size=150).tolist()
    aborted, hits = _aborted(server), _metric(server, "corecap_prefix_cache_hit_tokens_total")
    body = json.dumps({"prompt": prompt, "max_tokens": 300, "ignore_eos": True, "temperature": 0}).encode()
    gone = socket.create_connection(("127.0.0.1", server.port))
    gone.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(1.0)
    gone.close()
    deadline = time.monotonic() + 30
    while _aborted(server) == aborted and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _aborted(server) == aborted + 1
    rows = [{"id": "again", "input_ids": prompt},
            {"id": "longer", "input_ids": prompt + rng.integers(3, VOCAB, 40).tolist()}]
    got = _read_all(server, rows, tmp, transfer=_mooncake_transfer(master), name="after-abort")
    hits = _metric(server, "corecap_prefix_cache_hit_tokens_total") - hits
    assert hits >= 2 * (150 // MOONCAKE_BLOCK) * MOONCAKE_BLOCK, hits  # each, the prompt's 4 full blocks
    reference = tiny_models.reference_in_a_process(tiny_model, write_jsonl(tmp / "abort.jsonl", rows),
                                                   str(tmp / "abort-ref.pt"))
    _check_against_hf(got, rows, reference, LLAMA_LAYERS[:-2], "serve llama mooncake, hits on an aborted request",
                      1e-4)


def test_specforge_reads_states_from_mooncake_equal_to_hf(mooncake, tiny_model):
    """SpecForge's online producer (its SGLangServerCaptureAdapter, posting /generate with
    spec_capture) against the same server; its MooncakeFeatureStore reads what the server wrote:
    the aux layers concatenated (ids one lower than HF's) and the state after the final norm,
    HF's, and its own input_ids and loss_mask as it sent them."""
    server, tmp, master = mooncake
    _mooncake()
    from specforge.inference.adapters.server_capture import SGLangServerCaptureAdapter, ServerCaptureSchema
    from specforge.inference.capture import CaptureConfig
    from specforge.runtime.contracts import PromptTask
    from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

    hidden = json.loads((Path(tiny_model) / "config.json").read_text())["hidden_size"]
    store = MooncakeFeatureStore(store_id="run1", setup_kwargs=dict(
        local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", master_server_addr=master.address,
        protocol="tcp", rdma_devices="", global_segment_size=0, local_buffer_size=64 << 20))
    schema = ServerCaptureSchema(aux_feature="hidden_state", last_hidden_feature="target",
                                 passthrough=(("input_ids", "input_ids", ()), ("loss_mask", "loss_mask", ())),
                                 attention_mask_feature="attention_mask")
    adapter = SGLangServerCaptureAdapter(server.url, store, run_id="run1", algorithm="eagle3", schema=schema)
    aux = LLAMA_LAYERS[:-2]
    capture = CaptureConfig.from_strategy(
        ["hidden_state", "target", "input_ids", "loss_mask", "attention_mask"], [k - 1 for k in aux],
        target_repr="hidden_state", target_hidden_size=hidden)
    rows = _rows(VOCAB)[:6]
    masks = [[i % 2 for i in range(len(r["input_ids"]))] for r in rows]
    tasks = [PromptTask(task_id=r["id"], run_id="run1", source_id="test", max_length=512,
                        payload={"input_ids": r["input_ids"], "loss_mask": m}) for r, m in zip(rows, masks)]
    refs = adapter.produce_refs(tasks, capture=capture)
    reference = tiny_models.reference_in_a_process(tiny_model, write_jsonl(tmp / "sf-rows.jsonl", rows),
                                                   str(tmp / "sf-ref.pt"))
    for ref, row, mask in zip(refs, rows, masks):
        assert not hasattr(ref, "reason"), ref  # a ServerCaptureFailure
        tensors, _ = store.get(ref)
        num_tokens = len(row["input_ids"])
        assert tensors["input_ids"].tolist() == [row["input_ids"]] and tensors["loss_mask"].tolist() == [mask]
        assert tensors["attention_mask"].tolist() == [[1] * num_tokens]
        got = torch.cat([tensors["hidden_state"][0].view(num_tokens, len(aux), hidden).transpose(0, 1),
                         tensors["target"]], dim=0)
        ref_states = tiny_models.stacked(reference[row["id"]], (*aux, NUM_LAYERS))
        per_sample, per_token = relative_errors(got, ref_states)
        record_error("serve llama specforge", per_sample, per_token)
        assert float(per_token.max()) <= 1e-4, (row["id"], per_token.tolist())


def _post(url: str, body, headers=None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


BAD_REQUESTS = [
    (b"{not json", 400, "body"),
    ({"prompt": [1, 2, 3], "max_tokns": 1}, 400, "max_tokns"),
    ({"prompt": "a", "n": 2}, 400, "n"),
    ({"prompt": [1, 2], "stream": True}, 400, "stream"),
    ({"prompt": [1, 2], "max_tokens": 600}, 400, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 5, "temperature": -1}, 400, "sampling"),
    ({"prompt": [1, 2], "temperature": "hot"}, 400, "temperature"),
    ({"prompt": [1, VOCAB]}, 400, "prompt"),
    ({"prompt": [1] * 600}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[1, 2]]}, 400, "prompt"),
    ({"model": "another", "prompt": [1, 2]}, 404, "model"),
]


def test_bad_requests_are_refused_naming_the_field_and_the_server_goes_on(llama):
    server, _ = llama
    for body, status, field in BAD_REQUESTS:
        code, answer = _post(f"{server.url}/v1/completions", body)
        assert (code, answer["error"]["param"]) == (status, field), (body, answer)
        assert field in answer["error"]["message"]
    code, answer = _post(f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]})
    assert (code, answer["error"]["param"]) == (400, "messages[0].content"), answer
    code, answer = _post(f"{server.url}/generate", {"input_ids": [[1, 2]], "spec_capture": [{"sample_id": "a"}]})
    assert (code, answer["error"]["param"]) == (400, "spec_capture"), answer  # SpecForge's needs Mooncake
    code, answer = _post(f"{server.url}/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})
    assert code == 200 and answer["choices"][0]["prompt_token_ids"] == [1, 2, 3], answer
    path = answer["kv_transfer_params"]["hidden_states_path"]
    assert os.path.dirname(path) == os.path.abspath(server.hidden_states_path)
    from safetensors.torch import load_file

    written = load_file(path)
    assert written["hidden_states"].shape[:2] == (3, 4) and written["token_ids"].tolist() == [1, 2, 3]
    assert written["hidden_states"].dtype == torch.float8_e4m3fn and written["hidden_states_scales"].shape == (3, 1, 1)
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'corecap_requests_total{endpoint="cmpl",status="400"} 11' in metrics, metrics


def test_modelopt_reads_states_over_nixl_equal_to_hf(llama, tiny_model):
    """ModelOpt's streaming dataset (`EagleVllmStreamingDataset._fetch`, then `_format`) on the fp8
    server's sidecar port: each sample read with a NIXL READ from the server's memory, in the
    stored dtype whatever the files' backend, equal to HF's (1e-4 per token); the pool empty after."""
    missing = modelopt_reader.available()
    if missing:
        if in_ci():
            pytest.fail(f"{missing} (CI=true: mandatory)", pytrace=False)
        pytest.skip(missing)
    server, tmp = llama
    rows = _rows(VOCAB)
    files = set(os.listdir(server.hidden_states_path))
    got = modelopt_reader.read_in_a_process(f"http://127.0.0.1:{server.sidecar_port}", tiny_model,
                                            write_jsonl(tmp / "mo-rows.jsonl", rows), str(tmp / "mo.pt"), 300)
    if (tmp / "ref.pt").exists():  # the fp8 test's, for the same rows
        reference = torch.load(tmp / "ref.pt")
    else:
        reference = tiny_models.reference_in_a_process(tiny_model, write_jsonl(tmp / "rows.jsonl", rows),
                                                       str(tmp / "ref.pt"))
    layers = (*LLAMA_LAYERS[:-2], "prenorm")
    for row in rows:
        sample = got[row["id"]]
        assert sample["token_ids"].tolist() == row["input_ids"] and sample["hidden_states"].dtype == torch.float32
        assert sample["formatted"]["aux_hidden_states"].shape == (len(row["input_ids"]), 3 * sample[
            "hidden_states"].shape[-1])
        per_sample, per_token = relative_errors(sample["hidden_states"].transpose(0, 1),
                                                tiny_models.stacked(reference[row["id"]], layers))
        record_error("serve llama modelopt nixl", per_sample, per_token)
        assert float(per_token.max()) <= 1e-4, (row["id"], per_token.tolist())
    assert set(os.listdir(server.hidden_states_path)) == files  # each file went to the pool, then away


NEAR_TIE = 1e-4  # HF's own top-2 logit gap below which a greedy difference is a tie, not a bug


def test_the_model_writes_responses_while_serving_and_their_states_are_hf(llama, hf_model):
    """max_tokens > 1: the model answers each prompt first (greedy here: HF's greedy decoding, up
    to a near tie), and the file holds the states of prompt and response, every token, the last
    included, against HF's over the same tokens (fp8: within its rounding)."""
    from hs_connectors.fp8_utils import dequantize_fp8_tensor
    from safetensors.torch import load_file

    server, _ = llama
    prompts = [r["input_ids"] for r in _rows(VOCAB) if 5 <= len(r["input_ids"]) <= 200][:4]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: _post(f"{server.url}/v1/completions",
                                                {"prompt": p, "max_tokens": 12, "temperature": 0}), prompts))
    for prompt, (code, answer) in zip(prompts, answers):
        assert code == 200, answer
        choice = answer["choices"][0]
        response = choice["token_ids"]
        assert 1 <= len(response) <= 12 and choice["finish_reason"] in ("stop", "length"), choice
        assert answer["usage"]["completion_tokens"] == len(response) and choice["prompt_token_ids"] == prompt
        written = load_file(answer["kv_transfer_params"]["hidden_states_path"])
        assert written["token_ids"].tolist() == prompt + response
        states = dequantize_fp8_tensor(written["hidden_states"], written["hidden_states_scales"], torch.float32)
        ref = hf_hidden_states(hf_model, prompt + response, LLAMA_LAYERS[:-2] + ("prenorm",))
        per_sample, per_token = relative_errors(states.transpose(0, 1), ref)
        record_error("serve llama fp8, prompt + response", per_sample, per_token)
        assert float(per_token.max()) <= 0.05, per_token.max()
        ids = list(prompt)
        with torch.no_grad():
            for k, token in enumerate(response):
                top = torch.topk(hf_model(torch.tensor([ids])).logits[0, -1], 2)
                if int(top.indices[0]) != token:
                    assert float(top.values[0] - top.values[1]) < NEAR_TIE, (k, response)
                    break
                ids.append(token)


def test_corecaps_client_reads_states_equal_to_hf_and_its_dataset_yields_each_sample_once(llama, hf_model):
    """corecap.Client against the fp8 server: HF's states within fp8's rounding, the file taken;
    then a DataLoader of 2 workers over ServerDataset: every row once, padded."""
    from corecap import Client, ServerDataset

    server, _ = llama
    before = set(os.listdir(server.hidden_states_path))
    prompt = _rows(VOCAB)[2]["input_ids"]
    got = Client(server.url).states(prompt)
    ref = hf_hidden_states(hf_model, prompt, LLAMA_LAYERS[:-2] + ("prenorm",))
    per_sample, per_token = relative_errors(got.hidden_states, ref)
    record_error("serve llama fp8, corecap's client", per_sample, per_token)
    assert float(per_token.max()) <= 0.05 and got.token_ids.tolist() == prompt
    rows = _rows(VOCAB)[:6]
    loader = torch.utils.data.DataLoader(ServerDataset(rows, server.url), batch_size=2, num_workers=2)
    keys = [key for batch in loader for key in batch["key"]]
    assert sorted(keys) == sorted(r["id"] for r in rows), keys
    assert set(os.listdir(server.hidden_states_path)) <= before  # every file taken


def test_prefix_cache_hits_under_a_small_bound_are_exact_through_each_reader(llama, tiny_model):
    """The fp8 server keeps at most 8 blocks cached (of a KV cache of 32): the prompts sharing
    prefixes evict each other's blocks, from vLLM for corecap's bound and by vLLM for room. Read
    by speculators' fp8 reader, 6 clients at a time (HF's states within fp8's rounding), then one at
    a time by ModelOpt's reader over NIXL (the stored dtype: HF's to 1e-4)."""
    server, tmp = llama
    first, second = _prefix_rows(VOCAB)
    rows = first + second
    hits, evicted = (_metric(server, f"corecap_prefix_cache_{n}_total") for n in ("hit_tokens", "evicted_blocks"))
    got = _read_all(server, first, tmp, fp8=True, name="prefix-1") + _read_all(server, second, tmp, fp8=True,
                                                                                  name="prefix-2")
    reference = tiny_models.reference_in_a_process(tiny_model, write_jsonl(tmp / "prefix.jsonl", rows),
                                                   str(tmp / "prefix-ref.pt"))
    # fp8's rounding (a block of another sample would be ~1 off); against HF through fp8 too, a
    # code on a rounding boundary at a token's largest element can alone differ by ~0.02 (H = 128),
    # and these 2,300 tokens have several such codes: the exact check is ModelOpt's, below
    _check_against_hf(got, rows, reference, LLAMA_LAYERS[:-2], "serve llama fp8, prefix hits", 0.05)
    assert _metric(server, "corecap_prefix_cache_hit_tokens_total") > hits
    assert _metric(server, "corecap_prefix_cache_evicted_blocks_total") > evicted
    assert _metric(server, "corecap_prefix_cache_blocks") <= LLAMA_PREFIX_BLOCKS
    assert f"prefix caching: at most {LLAMA_PREFIX_BLOCKS} blocks of {LLAMA_BLOCK} tokens" in server.output()
    missing = modelopt_reader.available()
    if missing:
        if in_ci():
            pytest.fail(f"{missing} (CI=true: mandatory)", pytrace=False)
        return
    hits = _metric(server, "corecap_prefix_cache_hit_tokens_total")
    got = modelopt_reader.read_in_a_process(f"http://127.0.0.1:{server.sidecar_port}", tiny_model,
                                            write_jsonl(tmp / "mo-prefix.jsonl", rows), str(tmp / "mo-prefix.pt"), 300)
    assert _metric(server, "corecap_prefix_cache_hit_tokens_total") > hits  # one at a time: dup-2 hits dup-1's
    layers = (*LLAMA_LAYERS[:-2], "prenorm")
    for row in rows:
        per_sample, per_token = relative_errors(got[row["id"]]["hidden_states"].transpose(0, 1),
                                                tiny_models.stacked(reference[row["id"]], layers))
        record_error("serve llama modelopt nixl, prefix hits", per_sample, per_token)
        assert float(per_token.max()) <= 1e-4, (row["id"], per_token.tolist())


def test_a_prompt_that_extends_an_earlier_answer_hits_the_blocks_of_its_response(llama, tiny_model, hf_model):
    """A conversation's next turn: the model answers a prompt (its response completes a block, which
    vLLM caches), then the prompt, that answer and a new turn are asked for: its first blocks, the
    response's among them, come from the cache, and ModelOpt's reader loads HF's states for all of
    it (1e-4; where it does not run, speculators' fp8 file within fp8's rounding)."""
    from hs_connectors.fp8_utils import dequantize_fp8_tensor
    from safetensors.torch import load_file

    server, tmp = llama
    rng = np.random.default_rng(31)
    prompt = rng.integers(3, VOCAB, size=50).tolist()
    code, answer = _post(f"{server.url}/v1/completions",
                         {"prompt": prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 0})
    assert code == 200, answer
    response = answer["choices"][0]["token_ids"]
    os.remove(answer["kv_transfer_params"]["hidden_states_path"])
    assert len(prompt + response) == 90  # blocks 0 and 1 (64 tokens) complete, block 1 by the response
    hits = _metric(server, "corecap_prefix_cache_hit_tokens_total")
    turn = prompt + response + rng.integers(3, VOCAB, size=30).tolist()
    layers = LLAMA_LAYERS[:-2] + ("prenorm",)
    ref = hf_hidden_states(hf_model, turn, layers)
    if modelopt_reader.available() is None:
        got = modelopt_reader.read_in_a_process(f"http://127.0.0.1:{server.sidecar_port}", tiny_model,
                                                write_jsonl(tmp / "turn.jsonl", [{"id": "turn", "input_ids": turn}]),
                                                str(tmp / "turn.pt"), 300)["turn"]
        assert got["token_ids"].tolist() == turn
        states, case, tolerance = got["hidden_states"].transpose(0, 1), "modelopt nixl", 1e-4
    else:
        if in_ci():
            pytest.fail(f"{modelopt_reader.available()} (CI=true: mandatory)", pytrace=False)
        code, answer = _post(f"{server.url}/v1/completions", {"prompt": turn, "max_tokens": 1})
        assert code == 200, answer
        written = load_file(answer["kv_transfer_params"]["hidden_states_path"])
        os.remove(answer["kv_transfer_params"]["hidden_states_path"])
        assert written["token_ids"].tolist() == turn
        states = dequantize_fp8_tensor(written["hidden_states"], written["hidden_states_scales"], torch.float32)
        states, case, tolerance = states.transpose(0, 1), "fp8", 0.05
    assert _metric(server, "corecap_prefix_cache_hit_tokens_total") - hits == 2 * LLAMA_BLOCK
    per_sample, per_token = relative_errors(states, ref)
    record_error(f"serve llama {case}, a hit on a response's block", per_sample, per_token)
    assert float(per_token.max()) <= tolerance, per_token.max()


def _aborted(server: Server) -> int:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        line = next(n for n in response.read().decode().splitlines() if n.startswith("corecap_requests_aborted_total"))
    return int(line.split()[-1])


def test_a_client_that_disconnects_has_its_request_aborted_while_another_is_answered(llama):
    """A long generation whose client closes its socket mid-request: the server aborts it (counted
    in /metrics), no file is left, and a request sent beside it is answered."""
    import socket
    import time

    server, _ = llama
    before, aborted = set(os.listdir(server.hidden_states_path)), _aborted(server)
    body = json.dumps({"prompt": list(range(3, 13)), "max_tokens": 480, "ignore_eos": True,
                       "temperature": 0}).encode()
    gone = socket.create_connection(("127.0.0.1", server.port))
    gone.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(_post, f"{server.url}/v1/completions", {"prompt": list(range(3, 40)), "max_tokens": 4})
        time.sleep(1.5)
        gone.close()  # the client goes away mid-generation
        code, answer = beside.result()
    assert code == 200, answer
    os.remove(answer["kv_transfer_params"]["hidden_states_path"])
    deadline = time.monotonic() + 30
    while _aborted(server) == aborted and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _aborted(server) == aborted + 1
    time.sleep(1)  # a file written after the abort would appear by now
    left = {n for n in set(os.listdir(server.hidden_states_path)) - before if not n.endswith(".lock")}
    assert not left, left


def _committed(path: str, keys: set, timeout: float = 60) -> None:
    """Wait until the store holds `keys`: the server commits each sample after its answer."""
    import time

    import corecap

    deadline = time.monotonic() + timeout
    while True:
        with corecap.open_store(path) as store:
            missing = keys - set(store.keys())
        if not missing:
            return
        assert time.monotonic() < deadline, f"not committed in {timeout} s: {sorted(missing)}"
        time.sleep(0.2)


def test_the_store_keeps_each_sample_delivered_as_corecap_run_stores_it(llama, tiny_model, hf_model):
    """--store (the fixture's): each sample the server delivered is also committed to a corecap
    store, read back here with corecap's reading API and `corecap export`. Keyed by the client's
    `request_id` (corecap's ServerDataset sends the row's key), else by the server's own name for
    the request (the answer's id); the prompt's ids and the response's, the generation record and
    loss mask (0 over the prompt, 1 over the response) as `corecap run --max-tokens` stores them;
    the states exact (float32, HF's within 1e-4, the post-norm layer 8 that the files lack
    included), and exactly those the fp8 files were made of: quantized again, by the server's own
    function or by `corecap export --dtype fp8`, they are the delivered files bit for bit. A
    request whose client went away, and a key stored already with another input, are not stored."""
    import socket
    import time

    import corecap
    from corecap import ServerDataset
    from corecap.export.fp8_per_token import SCALES_KEY, quantize_per_token
    from corecap.model import model_identity
    from safetensors.torch import load_file
    from support.cli import corecap as corecap_cli

    server, tmp = llama
    path, rows = str(tmp / "store"), _rows(VOCAB)
    aborted = _aborted(server)
    gone = socket.create_connection(("127.0.0.1", server.port))  # a client that goes away mid-request
    body = json.dumps({"prompt": list(range(3, 13)), "max_tokens": 480, "ignore_eos": True, "temperature": 0,
                       "request_id": "audit/gone"}).encode()
    gone.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    bodies = [{"prompt": rows[3]["input_ids"], "request_id": "audit/prompt"},
              {"prompt": rows[2]["input_ids"][:40], "max_tokens": 10, "temperature": 0, "request_id": "audit/gen"},
              {"prompt": rows[5]["input_ids"]}]  # no id: the server's name for it
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        asked = [pool.submit(_post, f"{server.url}/v1/completions", b) for b in bodies]
        time.sleep(1.5)
        gone.close()  # mid-generation (480 tokens), as in the disconnect test above
        answers = [a.result() for a in asked]
    delivered = {}  # key → (the answer's choice, the file as the trainer's reader found it)
    for body, (code, answer) in zip(bodies, answers):
        assert code == 200, answer
        key = body.get("request_id") or answer["id"].removeprefix("cmpl-")
        file = answer["kv_transfer_params"]["hidden_states_path"]
        delivered[key] = (answer["choices"][0], load_file(file))
        for name in (file, file + ".lock"):
            os.remove(name)
    assert any(key.startswith("corecap-") for key in delivered), sorted(delivered)
    epoch = [{"id": "ds/a", "input_ids": rows[4]["input_ids"]}, {"id": "ds/b", "input_ids": rows[6]["input_ids"]}]
    got = {item["key"]: item for item in ServerDataset(epoch, server.url)}
    code, answer = _post(f"{server.url}/v1/completions", {"prompt": [5, 6, 7], "request_id": "audit/prompt"})
    assert code == 200, answer  # delivered; the key is stored already, with another input
    os.remove(answer["kv_transfer_params"]["hidden_states_path"])
    _committed(path, set(delivered) | set(got))
    deadline = time.monotonic() + 30
    while _aborted(server) == aborted and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _aborted(server) == aborted + 1

    files = (*LLAMA_LAYERS[:-2], "prenorm")
    positions = tuple(LLAMA_LAYERS.index(k) for k in files)
    with corecap.open_store(path) as store:
        meta = store.meta
        identity = model_identity(tiny_model, "auto")
        assert (tuple(meta.layers), meta.dtype, meta.hidden_size) == (LLAMA_LAYERS, "float32", identity.hidden_size)
        assert (meta.model.config_hash, meta.model.weights_fingerprint) == (identity.config_hash,
                                                                             identity.weights_fingerprint)
        assert "audit/gone" not in store
        for key, (choice, file) in delivered.items():
            sample = store.get(key)
            ids = choice["prompt_token_ids"] + choice["token_ids"]
            assert sample.input_ids.tolist() == ids == file["token_ids"].tolist(), key
            generation = sample.header.generation
            if choice["token_ids"]:
                assert (generation.num_prompt, generation.num_generated) == (
                    len(choice["prompt_token_ids"]), len(choice["token_ids"]))
                # OpenAI's answer says "stop" where the store says "eos" (an end-of-sequence token)
                stored = generation.finish_reason
                assert {"eos": "stop"}.get(stored, stored) == choice["finish_reason"]
                assert sample.loss_mask.tolist() == [0] * generation.num_prompt + [1] * generation.num_generated
            else:
                assert generation is None and sample.loss_mask is None, key
            codes, scales = quantize_per_token(sample.hidden_states, positions)
            assert torch.equal(codes.view(torch.uint8), file["hidden_states"].view(torch.uint8)), key
            assert torch.equal(scales, file[SCALES_KEY]), key
            per_sample, per_token = relative_errors(sample.hidden_states, hf_hidden_states(hf_model, ids, LLAMA_LAYERS))
            record_error("serve llama, its --store", per_sample, per_token)
            assert float(per_token.max()) <= 1e-4, (key, per_token.max())
        for key, item in got.items():  # what ServerDataset yielded: the fp8 file dequantized, the stored states
            sample = store.get(key)
            assert sample.input_ids.tolist() == item["input_ids"].tolist() and sample.loss_mask is None
            codes, scales = quantize_per_token(sample.hidden_states, positions)
            assert torch.equal((codes.to(torch.float32) * scales).transpose(0, 1), item["hidden_states"]), key
        assert store.get("audit/prompt").input_ids.tolist() == rows[3]["input_ids"]  # the first copy stayed
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'corecap_store_skipped_total{input="other"} 1' in metrics and "corecap_store_failed 0" in metrics

    out = tmp / "exported"
    corecap_cli("export", "--store", path, "--format", "speculators", "--dtype", "fp8", "--out", str(out), cwd=tmp)
    manifest = [json.loads(line) for line in (out / "corecap_manifest.jsonl").read_text().splitlines()]
    exported = {m["key"]: load_file(out / m["file"]) for m in manifest if m["key"] in delivered}
    assert set(exported) == set(delivered)
    for key, (_, file) in delivered.items():
        assert exported[key].keys() == file.keys(), key
        for name, tensor in file.items():
            assert torch.equal(exported[key][name].view(torch.uint8), tensor.view(torch.uint8)), (key, name)


def test_sigterm_answers_in_flight_requests_and_leaves_no_partial_file(llama):
    """Last in this module: it stops the shared server."""
    server, _ = llama
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_post, f"{server.url}/v1/completions", {"prompt": list(range(3, 300))})
                   for _ in range(4)]
        assert futures[0].result()[0] == 200
        assert server.stop() == 0, server.output()[-2000:]
        statuses = [f.result()[0] for f in futures]
    assert set(statuses) <= {200, 503}, statuses
    left = os.listdir(server.hidden_states_path)
    assert not [name for name in left if name.endswith(".partial")], left
    assert "stopped" in server.output()
