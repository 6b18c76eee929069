"""Every stored sample against HF transformers' output_hidden_states (the independent reference),
per sample and layer and per token, across batching, chunked prefill, shared prefixes,
duplicate inputs, a 1-token sample and tensor parallelism; the states through the shared-memory
ring (the default) and, in the TP=2 run, through the socket (the fallback)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from corecap.config import PRENORM
from corecap.store import Store, input_fingerprint
from support.reference import INPUT_PASSES, NUM_LAYERS, RUN_LOGS, hf_hidden_states, record_error, relative_errors

pytestmark = pytest.mark.engine
TOLERANCE = 1e-4  # float32; a correct capture measures ~1e-7 here


def _dataset(cfg) -> dict[str, list[int]]:
    """key -> token ids, read independently of corecap.data."""
    rows = {}
    with open(cfg.data) as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                obj = json.loads(line)
                rows[str(obj.get("id", line_no))] = obj.get("input_ids")
    return rows


def _check_store(cfg, summary, hf_model, tokenizer_case: str) -> None:
    rows = _dataset(cfg)
    with Store.open(cfg.store) as store:
        assert sorted(store.keys()) == sorted(rows)
        assert summary.num_committed == len(rows)
        assert store.meta.layers == cfg.layers
        assert store.meta.dtype == "float32"
        for key, ids in rows.items():
            sample = store.get(key)
            if ids is not None:
                assert sample.input_ids.tolist() == ids, key
            assert sample.header.input_fingerprint == input_fingerprint(sample.input_ids)
            ref = hf_hidden_states(hf_model, sample.input_ids, cfg.layers)
            assert sample.hidden_states.shape == ref.shape, key
            per_sample, per_token = relative_errors(sample.hidden_states, ref)
            case = tokenizer_case if ids is None else _case_of(key)
            record_error(case, per_sample, per_token)
            assert per_sample.max() <= TOLERANCE, (key, per_sample.tolist())
            assert per_token.max() <= TOLERANCE, (key, per_token.tolist())


def _case_of(key: str) -> str:
    for prefix in ("one", "long", "prefix", "dup", "rand"):
        if key.startswith(prefix):
            return f"{prefix}"
    return "other (int id, no id)"


def test_every_sample_matches_hf(exact_run, hf_model):
    cfg, summary = exact_run
    ring_line = next(line for line in RUN_LOGS["exact"]
                     if line.startswith("states to the store: shared-memory ring 4 slots of"))
    assert re.search(r"slots of [1-9]\d* (KiB|MiB) in ", ring_line), ring_line  # never "0 MiB"
    _check_store(cfg, summary, hf_model, "text (tokenized)")


def test_the_input_is_read_once_to_check_it_and_once_to_tokenize_it(exact_run):
    """The rows are checked whole before vLLM's import (a pass that tokenizes nothing), then read
    and tokenized once: the step loop takes the samples that pass made (corecap/data/todo.py)."""
    assert INPUT_PASSES["exact"] == [False, True]


def test_layers_are_distinct(exact_run, hf_model):
    """Guard against an off-by-one in layer indices: neighbouring layers differ far above tolerance."""
    cfg, _ = exact_run
    with Store.open(cfg.store) as store:
        hs = store.get("long-chunked").hidden_states
    for i in range(len(cfg.layers) - 1):
        a, b = hs[i], hs[i + 1]
        assert float((a - b).norm() / b.norm()) > 1e-2


def test_prenorm_is_not_layer_n(exact_run):
    """The pre-norm final state and HF's hidden_states[N] (after the final norm, whose weights
    the tiny model draws at random) differ by far more than the tolerance: a capture that
    returned one for the other fails here and against HF above."""
    cfg, _ = exact_run
    assert cfg.layers[-2:] == (NUM_LAYERS, PRENORM)
    with Store.open(cfg.store) as store:
        for key in ("long-chunked", "one-token", "rand-0"):
            hs = store.get(key).hidden_states
            per_token = (hs[-1] - hs[-2]).norm(dim=-1) / hs[-2].norm(dim=-1)
            assert float(per_token.min()) > 1000 * TOLERANCE, key


def test_duplicates_and_shared_prefix_are_consistent(exact_run):
    cfg, _ = exact_run
    with Store.open(cfg.store) as store:
        d1, d2 = store.get("dup-1").hidden_states, store.get("dup-2").hidden_states
        pa, pb = store.get("prefix-a").hidden_states, store.get("prefix-b").hidden_states
    rel = float((d1 - d2).norm() / d1.norm())
    assert rel <= 1e-6
    rel = float((pa[:, :200] - pb[:, :200]).norm() / pa[:, :200].norm())
    assert rel <= 1e-6


@pytest.mark.full
@pytest.mark.matrix  # CI's one end-to-end run on every vLLM release of its version matrix (.ci/matrix.sh)
def test_tensor_parallel_matches_hf(tp2_run, hf_model):
    cfg, summary, log = tp2_run
    assert "states to the store: shared-memory ring off (RunConfig.ring=False)" in log  # the socket path
    rows = _dataset(cfg)
    with Store.open(cfg.store) as store:
        assert sorted(store.keys()) == sorted(rows)
        for key, ids in rows.items():
            sample = store.get(key)
            assert sample.input_ids.tolist() == ids
            per_sample, per_token = relative_errors(sample.hidden_states, hf_hidden_states(hf_model, ids, cfg.layers))
            record_error("tp=2", per_sample, per_token)
            assert per_sample.max() <= TOLERANCE and per_token.max() <= TOLERANCE, key


def test_rerun_skips_committed_keys(exact_run):
    """A second run on a complete store starts no engine and changes nothing."""
    from corecap.run import run

    cfg, _ = exact_run
    with Store.open(cfg.store) as store:
        before = {k: store.get(k).hidden_states.clone() for k in store.keys()}
    summary = run(cfg)
    assert summary.num_committed == 0 and summary.num_skipped == len(before)
    with Store.open(cfg.store) as store:
        for k, v in before.items():
            assert np.array_equal(store.get(k).hidden_states.numpy(), v.numpy())


def test_steps_were_pipelined(exact_run):
    """The next batch is scheduled and at the workers while the current one runs (Engine._step),
    and the exactness above held with it: chunks of one long sample were in flight together."""
    cfg, _ = exact_run
    with open(f"{cfg.store}/trace.json") as f:
        steps = json.load(f)["steps"]
    assert max(s["in_flight"] for s in steps) == 2
    assert sum(s["num_tokens"] for s in steps if s["in_flight"] == 2) > 0


@pytest.mark.full
def test_fp8_quantised_by_the_workers_is_the_sinks_quantisation_of_the_same_states(exact_run, tmp_path):
    """--store-dtype fp8: the workers quantise each step (corecap/store/fp8rows.py) and the store
    holds, sample by sample, exactly what quantising the lossless capture gives (the same
    configuration, so the same batches: this CPU engine's float32 states are bit-identical)."""
    from corecap.config import build
    from corecap.run import run
    from corecap.store import FP8
    from corecap.store.fp8 import dequantize_fp8, quantize_fp8

    cfg, _ = exact_run
    fp8 = build(model=cfg.model, data=cfg.data, store=str(tmp_path / "fp8"), layers=cfg.layers,
                batch=4, max_batched_tokens=64, dtype="float32", codec=FP8)
    summary = run(fp8)
    with Store.open(cfg.store) as exact, Store.open(fp8.store) as store:
        keys = sorted(exact.keys())
        assert summary.num_committed == len(keys) and sorted(store.keys()) == keys
        for key in keys:
            states = exact.get(key).hidden_states
            sample = store.get(key)
            assert (sample.header.codec, sample.header.dtype, sample.header.hidden_size) == (
                FP8, "float32", states.shape[-1]
            )
            assert sample.header.payload_bytes == states[:, sample.header.num_prefix :].numel() * 4  # its own positions
            expected = dequantize_fp8(quantize_fp8(states), tuple(states.shape), states.dtype)
            assert np.array_equal(sample.hidden_states.numpy(), expected.numpy()), key
