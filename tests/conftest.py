"""Shared fixtures: a tiny Llama built from a fixed seed, its tokenizer, HF reference states,
and engine runs shared across tests (an engine start costs ~30-60 s on 2 CPU cores, so each
distinct configuration runs once per session, serially, and is always shut down)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from corecap.config import PRENORM
from corecap.demo import build_tokenizer, build_tiny_llama
from tiny_models import relative_errors  # noqa: F401  (the tests import it from here)

SEED = 1234
NUM_LAYERS = 8
VOCAB = 512
MAX_POSITIONS = 512  # the tiny model's context: exact_run captures a sample of exactly this length

# Worst relative errors seen per test case, printed at the end of the session.
ERRORS: dict[str, dict[str, float]] = {}


def pytest_sessionstart(session):
    """What runs killed before this session left in /dev/shm goes first (a run would remove it and
    say so on its first line), so each test sees only what its own session's runs left."""
    from corecap.transport import shm

    removed = shm.remove_left_behind()
    if removed.num_files:
        print(f"before the tests: {removed.line()}")


def engine_line(lines: list[str]) -> str:
    """A run's first line after any line saying what killed runs left in /dev/shm."""
    return next(line for line in lines if not line.startswith("removed "))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    # Norm weights not all ones: the pre-norm final state then differs from layer N in more than scale.
    build_tiny_llama(path, seed=SEED, num_layers=NUM_LAYERS, vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, random_norms=True)
    texts = ["the quick brown fox jumps over the lazy dog", "hidden states for a draft head"] * 20
    build_tokenizer(path, texts, vocab_size=VOCAB)
    return path


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def hf_hidden_states(hf_model, token_ids, layers) -> torch.Tensor:
    """HF transformers' output_hidden_states at `layers`, [L, T, H], float32: the reference.
    "prenorm" is the output of the last decoder layer, taken with a forward hook: HF's own
    hidden_states[N] is after the final norm."""
    seen = {}
    hook = hf_model.model.layers[-1].register_forward_hook(
        lambda module, args, output: seen.__setitem__("prenorm", output[0] if isinstance(output, tuple) else output)
    )
    try:
        with torch.no_grad():
            out = hf_model(torch.tensor([list(map(int, token_ids))]), output_hidden_states=True)
    finally:
        hook.remove()
    return torch.stack([seen["prenorm"][0] if k == PRENORM else out.hidden_states[k][0] for k in layers])


def record_error(case: str, per_sample: torch.Tensor, per_token: torch.Tensor) -> None:
    worst = ERRORS.setdefault(case, {"per_sample_layer": 0.0, "per_token": 0.0})
    worst["per_sample_layer"] = max(worst["per_sample_layer"], float(per_sample.max()))
    worst["per_token"] = max(worst["per_token"], float(per_token.max()))


def pytest_terminal_summary(terminalreporter):
    if ERRORS:
        terminalreporter.section("corecap: worst relative error vs HF transformers")
        for case, worst in sorted(ERRORS.items()):
            terminalreporter.write_line(
                f"{case:40s} per sample/layer {worst['per_sample_layer']:.2e}   per token {worst['per_token']:.2e}"
            )


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def exactness_rows(rng: np.random.Generator) -> list:
    """Every case the capture must get right, in one dataset (one engine run)."""
    prefix = rng.integers(3, VOCAB, size=200).tolist()
    dup = rng.integers(3, VOCAB, size=150).tolist()
    rows = [
        {"id": "one-token", "input_ids": [7]},
        {"id": "long-chunked", "input_ids": rng.integers(0, VOCAB, size=300).tolist()},
        {"id": "long-full-context", "input_ids": rng.integers(0, VOCAB, size=MAX_POSITIONS).tolist()},
        {"id": "prefix-a", "input_ids": prefix + rng.integers(0, VOCAB, size=40).tolist()},
        {"id": "prefix-b", "input_ids": prefix + rng.integers(0, VOCAB, size=73).tolist()},
        {"id": "dup-1", "input_ids": dup},
        {"id": "dup-2", "input_ids": dup},
        {"id": 17, "input_ids": rng.integers(0, VOCAB, size=33).tolist()},
        {"id": "text", "text": "the quick brown fox jumps over the lazy dog; hidden states"},
        "",  # blank lines are skipped but counted
        {"input_ids": rng.integers(0, VOCAB, size=64).tolist()},  # no id: key is the line number
    ]
    rows += [{"id": f"rand-{i}", "input_ids": rng.integers(0, VOCAB, size=int(n)).tolist()} for i, n in enumerate(rng.integers(2, 130, size=10))]
    return rows


RUN_LOGS: dict[str, list[str]] = {}  # the log lines of the shared runs, by fixture


@pytest.fixture(scope="session")
def exact_run(tiny_model, tmp_path_factory):
    """float32, batch 4, a 64-token step budget (chunked prefill), compile on (the default), and
    --max-len left to the model's own limit, which one sample fills exactly."""
    from corecap.config import build
    from corecap.run import run

    tmp = tmp_path_factory.mktemp("exact")
    data = write_jsonl(tmp / "data.jsonl", exactness_rows(np.random.default_rng(SEED)))
    cfg = build(
        model=tiny_model, data=data, store=str(tmp / "store"), layers=(0, 1, 2, 4, 7, 8, PRENORM),
        batch=4, max_batched_tokens=64, dtype="float32",
    )
    summary = run(cfg, log=RUN_LOGS.setdefault("exact", []).append)
    return cfg, summary


@pytest.fixture(scope="session")
def tp2_run(tiny_model, tmp_path_factory):
    from corecap.config import build
    from corecap.run import run

    # CI runs on 2 cores: a machine with fewer cannot run --tp 2, and that is a failure here,
    # not a skip that would leave the tensor-parallel path silently untested.
    assert len(os.sched_getaffinity(0)) >= 2, "--tp 2 needs 2 CPU cores"
    tmp = tmp_path_factory.mktemp("tp2")
    rng = np.random.default_rng(SEED + 1)
    dup = rng.integers(0, VOCAB, size=90).tolist()
    rows = [
        {"id": "long", "input_ids": rng.integers(0, VOCAB, size=250).tolist()},
        {"id": "one", "input_ids": [5]},
        {"id": "dup-1", "input_ids": dup},
        {"id": "dup-2", "input_ids": dup},
        {"id": "short", "input_ids": rng.integers(0, VOCAB, size=20).tolist()},
    ]
    data = write_jsonl(tmp / "data.jsonl", rows)
    # This run sends the states in the messages, not through the shared-memory ring, so that
    # the fallback path stays tested end to end.
    cfg = build(
        model=tiny_model, data=data, store=str(tmp / "store"), layers=(0, 2, 5, 8, PRENORM),
        tp=2, batch=3, max_len=512, max_batched_tokens=64, dtype="float32", ring=False,
    )
    log: list[str] = []
    summary = run(cfg, log=log.append)
    return cfg, summary, log


# --- a verifier and its captured states, for the exporters and StoreDataset (no engine) ----------

VERIFIER_LAYERS = 4
VERIFIER_HIDDEN = 64
VERIFIER_VOCAB = 256
CAPTURED_LAYERS = (1, 2, 3, VERIFIER_LAYERS, "prenorm")  # what `corecap run --layers 1,2,3,4,prenorm` stores
CAPTURED_LENGTHS = (9, 23, 1, 40, 17, 5, 31, 12, 2, 26, 8, 19)  # 12 samples: data_10 sorts after data_2 only if padded


@pytest.fixture(scope="session")
def verifier(tmp_path_factory) -> str:
    """A tiny Llama whose final norm is not all ones (a trainer that skips or doubles the norm
    then gets other logits), saved with a safetensors index as real checkpoints have (SpecForge's
    TargetHead reads only through one)."""
    import transformers
    from safetensors import safe_open

    path = str(tmp_path_factory.mktemp("verifier"))
    config = transformers.LlamaConfig(
        vocab_size=VERIFIER_VOCAB, hidden_size=VERIFIER_HIDDEN, intermediate_size=128, num_hidden_layers=VERIFIER_LAYERS,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.model.norm.weight.copy_(0.25 + 1.5 * torch.rand(VERIFIER_HIDDEN))
    model.save_pretrained(path, safe_serialization=True)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        weight_map = {}
        for name in files:
            with safe_open(os.path.join(path, name), framework="pt") as f:
                weight_map.update(dict.fromkeys(f.keys(), name))
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


@pytest.fixture(scope="session")
def verifier_model(verifier):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()


def verifier_reference(model, token_ids) -> dict:
    """HF's states for one sample, [layer] → [T, H] float32: hidden_states[k] for every k
    (k = N is after the final norm), "prenorm" (the last decoder layer's output, taken with a
    hook, before the norm) and the logits [T, V]."""
    captured = []

    def hook(module, args, output):
        captured.append((output[0] if isinstance(output, tuple) else output).detach())

    handle = model.model.layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(torch.tensor([list(map(int, token_ids))]), output_hidden_states=True)
    finally:
        handle.remove()
    ref = {k: h[0] for k, h in enumerate(out.hidden_states)}
    ref["prenorm"] = captured[0][0]
    ref["logits"] = out.logits[0]
    return ref


@pytest.fixture(scope="session")
def captured(verifier, verifier_model):
    """The samples a capture of the verifier at CAPTURED_LAYERS would store, by key, with HF's
    reference for each: {key: (token_ids int32, loss_mask uint8 or None, reference)}. One place
    to swap for a real `corecap run --layers 1,2,3,4,prenorm` once the workers capture prenorm."""
    rng = np.random.default_rng(SEED)
    out = {}
    for i, num_tokens in enumerate(CAPTURED_LENGTHS):
        key = f"sample-{(7 * i) % len(CAPTURED_LENGTHS):02d}-{i}"  # keys sort in another order than made
        ids = rng.integers(0, VERIFIER_VOCAB, size=num_tokens).astype(np.int32)
        mask = None if i % 3 == 0 else (rng.random(num_tokens) < 0.6).astype(np.uint8)
        out[key] = (ids, mask, verifier_reference(verifier_model, ids))
    return out


def write_captured_store(path: str, captured, verifier: str, *, dtype=torch.float32, codec: str = "zstd-planes",
                         layers=CAPTURED_LAYERS, replace: dict | None = None) -> str:
    """A store holding `captured` at `layers` in `dtype`, built without an engine (several
    commits, as a run makes them). `replace` maps a stored layer to the reference layer whose
    values it gets instead (to build deliberately wrong stores)."""
    from corecap.store import FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta, encode_sample

    identity = ModelIdentity(verifier, "LlamaForCausalLM", "c" * 32, "w" * 32, VERIFIER_LAYERS, VERIFIER_HIDDEN, VERIFIER_VOCAB)
    meta = StoreMeta(
        format_version=FORMAT_VERSION, model=identity, layers=tuple(layers), layer_meaning=LAYER_MEANING,
        dtype=str(dtype).removeprefix("torch."), hidden_size=VERIFIER_HIDDEN, corecap_version="test", vllm_version="none",
        codec=codec,
    )
    replace = replace or {}
    records = []
    for key, (ids, mask, ref) in captured.items():
        states = torch.stack([ref[replace.get(k, k)] for k in layers]).to(dtype)
        records.append(encode_sample(key, ids, states, tuple(layers), codec=codec, loss_mask=mask))
    with Store.create_or_open(path, meta) as store:
        store.put_many(records[:5])
        store.put_many(records[5:])
    return path
