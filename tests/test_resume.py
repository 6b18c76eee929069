"""Runs that are interrupted, sharded or fed conversations end up with the same store as one
uninterrupted run: keys, ids, masks and metadata exactly; hidden states within the float32 band
(the batches differ, and this CPU engine is not batch-invariant: the measured difference is
printed at the end of the test session)."""

from __future__ import annotations

import dataclasses

import pytest

from corecap import data
from corecap.errors import CorecapError
from corecap.store import Store
from support.reference import hf_hidden_states, record_error, relative_errors, write_jsonl, same_meta

pytestmark = pytest.mark.engine
BAND = 1e-6


def _same_store(reference: str, other: str, case: str) -> None:
    with Store.open(reference) as ref, Store.open(other) as got:
        assert sorted(ref.keys()) == sorted(got.keys())
        assert same_meta(got.meta, ref.meta)
        for key in ref.keys():
            a, b = ref.get(key), got.get(key)
            assert a.input_ids.tolist() == b.input_ids.tolist()
            assert a.header.input_fingerprint == b.header.input_fingerprint
            assert (a.loss_mask is None) == (b.loss_mask is None)
            per_sample, per_token = relative_errors(b.hidden_states, a.hidden_states)
            record_error(f"{case} vs uninterrupted run", per_sample, per_token)
            assert per_token.max() <= BAND, (key, per_token.tolist())


@pytest.mark.full
def test_an_interrupted_shard_resumes_and_the_shards_merge_to_the_unsharded_run(exact_run, tmp_path, monkeypatch):
    """Shard 0 of 2 fails at its 12th step (an exception in the step loop) after some commits and
    is rerun; shard 1 runs through; merged, they are the uninterrupted, unsharded store."""
    from corecap._vllm.engine import Engine
    from corecap.run import run
    from corecap.store.merge import merge_stores

    cfg, _ = exact_run
    real_step, calls = Engine.step, []

    def failing_step(self):
        calls.append(1)
        if len(calls) == 12:
            raise RuntimeError("injected failure")
        return real_step(self)

    first = dataclasses.replace(cfg, store=str(tmp_path / "shard0"), shard=(0, 2))
    monkeypatch.setattr(Engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="injected failure"):
        run(first)
    monkeypatch.setattr(Engine, "step", real_step)
    with Store.open(first.store) as store:
        kept = len(store)
    assert kept > 0  # some samples were committed before the failure
    summary = run(first)
    assert summary.num_skipped == kept and summary.num_committed > 0  # not all were
    second = dataclasses.replace(cfg, store=str(tmp_path / "shard1"), shard=(1, 2))
    assert run(second).num_committed > 0
    with Store.open(first.store) as a, Store.open(second.store) as b:
        assert not set(a.keys()) & set(b.keys())
    merge_stores(str(tmp_path / "merged"), [first.store, second.store])
    _same_store(cfg.store, str(tmp_path / "merged"), "interrupted shard + rerun, 2 shards merged")


@pytest.mark.full
def test_conversations_end_to_end(tiny_model, hf_model, tmp_path):
    """A chat dataset: token ids from the model's chat template, loss masks on assistant turns."""
    from corecap.config import build
    from corecap.model import load_tokenizer
    from corecap.run import run

    rows = [
        {"id": "openai", "messages": [
            {"role": "system", "content": "the quick brown fox"},
            {"role": "user", "content": "hidden states for a draft head"},
            {"role": "assistant", "content": "the lazy dog jumps over the quick brown fox"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "hidden states"},
        ]},
        {"id": "sharegpt", "conversations": [
            {"from": "human", "value": "the lazy dog"},
            {"from": "gpt", "value": "over the quick brown fox, hidden states for a draft head"},
        ]},
        {"id": "ids", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = build(model=tiny_model, data=path, store=str(tmp_path / "store"), layers=(0, 4, 8), max_len=512,
                dtype="float32")
    assert run(cfg).num_committed == 3
    expected = {
        s.key: s for s in data.read_samples(path, tokenizer=load_tokenizer(tiny_model), vocab_size=512, max_len=512)
    }
    with Store.open(cfg.store) as store:
        for key, sample in expected.items():
            got = store.get(key)
            assert got.input_ids.tolist() == sample.token_ids.tolist()
            assert got.loss_mask.tolist() == sample.loss_mask.tolist()
            assert 0 < got.loss_mask.sum() < len(got.loss_mask)
            per_sample, per_token = relative_errors(got.hidden_states,
                                                    hf_hidden_states(hf_model, got.input_ids, cfg.layers))
            record_error("conversations", per_sample, per_token)
            assert per_token.max() <= 1e-4


def test_resume_refuses_a_changed_input(exact_run, tmp_path):
    """A key whose input changed must never keep its old states."""
    import json

    from corecap.run import run

    cfg, _ = exact_run
    rows = [json.loads(line) for line in open(cfg.data) if line.strip()]
    rows[0]["input_ids"] = [8, 9]
    changed = write_jsonl(tmp_path / "changed.jsonl", rows)
    with pytest.raises(CorecapError, match="'one-token' is already stored with input fingerprint"):
        run(dataclasses.replace(cfg, data=changed))
