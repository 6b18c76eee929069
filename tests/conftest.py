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

SEED = 1234
NUM_LAYERS = 8
VOCAB = 512
MAX_POSITIONS = 512  # the tiny model's context: exact_run captures a sample of exactly this length

# Worst relative errors seen per test case, printed at the end of the session.
ERRORS: dict[str, dict[str, float]] = {}


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


def relative_errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer: ||got - ref|| / ||ref|| over the sample, and the worst per-token ratio."""
    got, ref = got.float(), ref.float()
    diff = got - ref
    per_sample = diff.flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    per_token = (diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max(dim=1).values
    return per_sample, per_token


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
