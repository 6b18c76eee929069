"""Prefix caching on, exact: every sample of a dataset full of shared prefixes, captured with
vLLM's prefix caching on, equals the same sample captured with it off (keys, ids, masks
exactly, states within 1e-6) and HF transformers (1e-4). The dataset has a prefix shared across
batches and steps, identical prompts, a shared part that ends mid-block, prompts that are all
prefix of another, chunked prefill through a cached prefix and multi-turn samples; it runs with
room to spare, and again with a KV cache and a --prefix-blocks bound too small for the shared
prefixes (vLLM evicts on its own, and corecap evicts from vLLM for its bound), with --tp 2 and
with -dp 2.
Then a prefix-caching run is SIGKILLed mid-capture and resumed."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest

from corecap.config import PRENORM
from corecap.store import Store, decode_header
from corecap.store.verify import verify_store
from support import kill_loop
from support.reference import VOCAB, hf_hidden_states, record_error, relative_errors, write_jsonl

pytestmark = [pytest.mark.engine, pytest.mark.full]  # every test here starts engines of its own
LAYERS = (0, 2, 4, 8, PRENORM)
BLOCK = 32  # vLLM's CPU default is 128: smaller blocks share more (and test more boundaries)
RUN_LOG: dict[str, list[str]] = {}
NUM_SAMPLES = 28  # _rows
PAUSE_AT_STEP = 24  # of the killed run's ~70 steps (32 tokens each): about a third of the samples committed


def _rows(rng: np.random.Generator) -> list[dict]:
    tokens = lambda n: rng.integers(3, VOCAB, size=n).tolist()  # noqa: E731
    system, x, dup, mid = tokens(100), tokens(160), tokens(90), tokens(70)
    turns = [tokens(40), tokens(35), tokens(50)]
    rows = [{"id": f"shared-{i}", "input_ids": system + tokens(int(n))}
            for i, n in enumerate(rng.integers(20, 90, size=8))]
    rows += [
        {"id": "x-whole", "input_ids": x},
        {"id": "dup-1", "input_ids": dup},
        {"id": "dup-2", "input_ids": dup},
        {"id": "mid-a", "input_ids": mid + tokens(30)},  # 2 full blocks + 6 tokens shared
        {"id": "mid-b", "input_ids": mid + tokens(45), "loss_mask": [0] * 70 + [1] * 45},
        {"id": "x-96", "input_ids": x[:96]},  # all cached blocks: vLLM recomputes the last one
        {"id": "x-50", "input_ids": x[:50]},
        {"id": "x-more", "input_ids": x + tokens(60)},
        {"id": "chunked", "input_ids": system + tokens(200)},  # 64-token steps through a cached prefix
    ]
    rows += [{"id": f"turn-{k}", "input_ids": sum(turns[: k + 1], [])} for k in range(3)]
    rows += [{"id": f"rand-{i}", "input_ids": tokens(int(n))} for i, n in enumerate(rng.integers(5, 120, size=6))]
    rows += [{"id": "dup-3", "input_ids": dup}, {"id": "shared-late", "input_ids": system + tokens(33)}]
    return rows


@pytest.fixture(scope="module")
def prefix_data(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("prefix") / "data.jsonl", _rows(np.random.default_rng(19)))


def _run(name: str, tiny_model, data, tmp_path_factory, **options):
    from corecap.config import build
    from corecap.run import run

    store = str(tmp_path_factory.mktemp(f"prefix-{name}") / "store")
    cfg = build(model=tiny_model, data=data, store=store, layers=LAYERS, batch=4, max_batched_tokens=64, max_len=320,
                dtype="float32", enforce_eager=True, block_size=BLOCK, **options)
    summary = run(cfg, log=RUN_LOG.setdefault(name, []).append)
    return cfg, summary


@pytest.fixture(scope="module")
def off_run(tiny_model, prefix_data, tmp_path_factory):
    return _run("off", tiny_model, prefix_data, tmp_path_factory, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def on_run(tiny_model, prefix_data, tmp_path_factory):
    return _run("on", tiny_model, prefix_data, tmp_path_factory, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def tight_run(tiny_model, prefix_data, tmp_path_factory):
    """16 KV blocks (512 tokens: a batch's requests evict each other's cached blocks) and 5
    blocks tracked (fewer than the 100-token system prompt's 3 plus a batch's own)."""
    return _run("tight", tiny_model, prefix_data, tmp_path_factory, enable_prefix_caching=True,
                num_gpu_blocks_override=16, prefix_blocks=5)


@pytest.fixture(scope="module")
def tp2_on_run(tiny_model, prefix_data, tmp_path_factory):

    assert len(os.sched_getaffinity(0)) >= 2, "--tp 2 needs 2 CPU cores"  # a failure, not a skip (conftest.tp2_run)
    return _run("tp2", tiny_model, prefix_data, tmp_path_factory, enable_prefix_caching=True, tp=2)


@pytest.fixture(scope="module")
def dp2_run(tiny_model, prefix_data, tmp_path_factory):
    """Two replicas, each with a vLLM prefix cache of its own, one sink's states cache, and 3
    blocks tracked each: both replicas produce, hit and drop the same hashes."""
    return _run("dp2", tiny_model, prefix_data, tmp_path_factory, enable_prefix_caching=True, dp=2,
                prefix_blocks=3)


def _prefix_counts(name: str) -> tuple[int, int]:
    line = next(x for x in RUN_LOG[name] if x.startswith("prefix cache: "))
    hits, evicted = re.match(r"prefix cache: (\d+) prompt tokens taken from it; (\d+) blocks evicted", line).groups()
    return int(hits), int(evicted)


def _states_bytes(store: str) -> int:
    return sum(os.path.getsize(os.path.join(store, f)) for f in os.listdir(store) if f.startswith("states-"))


def _assert_stored_once(store: str, off_store: str, hit_tokens: int | None = None) -> int:
    """Stored once: every reference checks out (verify), and the state files hold the positions
    no other sample stores, no more: their size against caching off's is at most the share of
    positions stored (derived from the headers), which the cache hits bound. Returns the
    number of samples that refer to others."""
    report = verify_store(store)
    assert report.ok, report.problems
    with Store.open(store) as s, s.env.begin() as txn:
        headers = [decode_header(k, v) for k, v in txn.cursor(db=s.headers_db)]
        assert s.meta.format_version == (4 if report.num_referring else 3)
    logical, referred = sum(h.num_tokens for h in headers), sum(h.num_prefix for h in headers)
    assert report.num_referring == sum(1 for h in headers if h.prefix)
    if hit_tokens is not None:  # a sample refers for exactly its hits, or stores them itself
        assert referred <= hit_tokens
    assert _states_bytes(store) <= 1.05 * _states_bytes(off_store) * (logical - referred) / logical
    return report.num_referring


def _assert_same_store(reference: str, got: str) -> None:
    with Store.open(reference) as a, Store.open(got) as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            x, y = a.get(key), b.get(key)
            assert np.array_equal(x.input_ids, y.input_ids), key
            assert x.header.input_fingerprint == y.header.input_fingerprint
            mx, my = x.loss_mask, y.loss_mask
            assert (mx is None and my is None) or np.array_equal(mx, my), key
            assert x.hidden_states.shape == y.hidden_states.shape, key
            rel = float((x.hidden_states - y.hidden_states).norm() / x.hidden_states.norm())
            per_token = ((x.hidden_states - y.hidden_states).norm(dim=-1) / x.hidden_states.norm(dim=-1)).max()
            assert rel <= 1e-6 and float(per_token) <= 1e-6, (key, rel, float(per_token))


@pytest.mark.parametrize("name", ["on", "tight", "tp2", "dp2"])
def test_caching_on_equals_caching_off(name, request, off_run, hf_model):
    cfg, summary = request.getfixturevalue(f"{name}_run" if name != "tp2" else "tp2_on_run")
    off_cfg, off_summary = off_run
    assert summary.num_committed == off_summary.num_committed == NUM_SAMPLES
    assert any("prefix caching on" in line for line in RUN_LOG[name])
    _assert_same_store(off_cfg.store, cfg.store)
    num_referring = _assert_stored_once(cfg.store, off_cfg.store, _prefix_counts(name)[0])
    assert num_referring == summary.num_referring > 0 and f"stored once: {num_referring} samples" in summary.line()
    assert summary.num_stored_whole <= num_referring // 2, summary.line()  # most producers are committed first
    with Store.open(cfg.store) as store:
        for key in store.keys():
            sample = store.get(key)
            per_sample, per_token = relative_errors(sample.hidden_states,
                                                    hf_hidden_states(hf_model, sample.input_ids, LAYERS))
            record_error(f"prefix caching ({name})", per_sample, per_token)
            assert per_sample.max() <= 1e-4 and per_token.max() <= 1e-4, key


def test_the_cache_was_used_and_evicted(on_run, tight_run, tp2_on_run, dp2_run):
    """Not vacuous: the roomy run took most shared blocks from the cache; the tight one fewer,
    and evicted blocks from vLLM for its --prefix-blocks bound."""
    on_hits, on_evicted = _prefix_counts("on")
    tight_hits, tight_evicted = _prefix_counts("tight")
    # shared-1..7, chunked, shared-late: 3 system blocks each; dup-2/3: 2; x-96: 2, x-50: 1, x-more: 5; turns: 2+3
    assert on_hits >= 30 * BLOCK and on_evicted == 0
    assert _prefix_counts("tp2") == (on_hits, 0)  # the same schedule: TP changes no scheduling decision
    assert 0 < tight_hits < on_hits and tight_evicted > 0
    dp2_hits, dp2_evicted = _prefix_counts("dp2")
    assert dp2_hits > 0 and dp2_evicted > 0
    assert not any("prefix cache" in line for line in RUN_LOG["off"])


def test_kill_then_resume_with_caching_on(off_run, tiny_model, prefix_data, tmp_path):
    """SIGKILL mid-capture (the first samples committed), then the same command again: the store
    equals the caching-off one. The killed run's worker waits at step PAUSE_AT_STEP
    (config.TestHooks, through a script, as no user can; kill_loop.kill_at_pause): polled for its
    third commit instead, a run on CI had committed all 28 samples by the time the kill landed."""
    off_cfg, _ = off_run
    store = str(tmp_path / "killed")
    argv = (
        sys.executable, "-m", "corecap.cli", "run", "--model", tiny_model, "--data", prefix_data, "--store", store,
        "--layers", "0,2,4,8,prenorm", "--dtype", "float32", "--max-batched-tokens", "32", "--max-len", "320",
        "--max-num-seqs", "2", "--enforce-eager", "--enable-prefix-caching", "--block-size", str(BLOCK),
    )
    cmd = kill_loop.RunCommand(argv, store, str(tmp_path), {})
    killed_at = kill_loop.kill_at_pause(cmd, "killed", PAUSE_AT_STEP, committed=3, timeout=300)
    assert 3 <= killed_at < NUM_SAMPLES, f"{killed_at} of {NUM_SAMPLES} samples committed at the kill"
    outcome, _ = kill_loop.timed_run(cmd, "resumed", timeout=600)
    assert not outcome.failed, outcome.line()
    assert kill_loop.num_committed(store) == NUM_SAMPLES
    _assert_same_store(off_cfg.store, store)
    assert _assert_stored_once(store, off_cfg.store) > 0  # the resumed run refers to its own earlier samples
    assert os.path.exists(os.path.join(store, "data.mdb"))
