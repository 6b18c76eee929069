"""The sink's writer: whole samples per commit, NaN/Inf policy, a failing disk is a clear error."""

from __future__ import annotations

import errno
import time
import zlib

import lmdb
import numpy as np
import pytest
import torch

from corecap.errors import CorecapError
from corecap.store import FORMAT_VERSION, FP8, LAYER_MEANING, ModelIdentity, Store, StoreMeta
from corecap.store.fp8 import quantize_fp8
from corecap.store.fp8rows import quantize_fp8_rows
from corecap.sink import writer
from corecap.sink.writer import NonFiniteError, Writer, all_finite

IDENTITY = ModelIdentity(path="/m", architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="w" * 32,
                         num_layers=8, hidden_size=16, vocab_size=100)


@pytest.fixture(params=["raw"])
def store(tmp_path, request):
    meta = StoreMeta(
        format_version=FORMAT_VERSION, model=IDENTITY, layers=(2, 8), layer_meaning=LAYER_MEANING, dtype="float32",
        hidden_size=16, corecap_version="0", vllm_version="0", codec=request.param,
    )
    Store.create_or_open(str(tmp_path / "s"), meta).close()
    with Store.open_for_writing(str(tmp_path / "s")) as s:
        yield s


def test_commits_everything_put_before_close(store):
    w = Writer(store, codec="zstd-planes", num_threads=2, batch_bytes=1000, buffer_bytes=4096)
    states = {f"k{i}": torch.randn(2, 5 + i, 16) for i in range(20)}
    for key, s in states.items():
        w.put(key, np.arange(s.shape[1]), s)
    w.close()
    assert w.num_committed == 20 and len(w.commits) > 1
    for key, s in states.items():
        assert torch.equal(store.get(key).hidden_states, s)


def test_nan_stops_by_default(store):
    w = Writer(store)
    bad = torch.randn(2, 4, 16)
    bad[1, 2, 3] = float("nan")
    w.put("good", np.arange(4), torch.randn(2, 4, 16))
    w.put("bad", np.arange(4), bad)
    with pytest.raises(NonFiniteError, match=r"sample 'bad': NaN/Inf in the captured states at layers \[8\]"):
        w.close()
    assert "bad" not in store


@pytest.mark.parametrize("store", [FP8], indirect=True)
def test_fp8_finds_nan_without_all_finite_and_stops_as_other_codecs_do(store, monkeypatch):
    calls = []
    monkeypatch.setattr(writer, "all_finite", lambda states: calls.append(1) or all_finite(states))
    w = Writer(store, codec=FP8)
    good = torch.randn(2, 4, 16)
    w.put("good", np.arange(4), good)
    deadline = time.monotonic() + 30  # a liveness bound: committed alone, before "bad" fails
    while w.num_committed < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    bad = torch.randn(2, 4, 16)
    bad[1, 2, 3] = float("inf")
    w.put("bad", np.arange(4), bad)
    with pytest.raises(NonFiniteError, match=r"sample 'bad': NaN/Inf in the captured states at layers \[8\]"):
        w.close()
    assert calls == [1]  # only for the sample that fp8 refused
    assert "bad" not in store
    stored = store.get("good")
    assert stored.header.codec == FP8 and stored.header.checksum == zlib.crc32(quantize_fp8(good))


@pytest.mark.parametrize("store", [FP8], indirect=True)
def test_fp8_rows_from_the_workers_are_stored_as_their_states_and_a_nan_stops(store):
    """The workers' rows (uint8 [L, T, H + 4]): stored as the states they quantise would be, the
    codec ratio counting the captured float32 bytes, and a NaN row stops as in any store."""
    good = torch.randn(2, 4, 16)
    bad = torch.randn(2, 4, 16)
    bad[1, 2, 3] = float("nan")
    w = Writer(store, codec=FP8)
    w.put("good", np.arange(4), quantize_fp8_rows(list(good), 4))
    deadline = time.monotonic() + 30  # a liveness bound: committed alone, before "bad" fails
    while w.num_committed < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.raw_bytes == good.numel() * 4
    w.put("bad", np.arange(4), quantize_fp8_rows(list(bad), 4))
    with pytest.raises(NonFiniteError, match=r"sample 'bad': NaN/Inf in the captured states at layers \[8\]"):
        w.close()
    assert "bad" not in store
    stored = store.get("good")
    assert stored.header.dtype == "float32" and stored.header.hidden_size == 16
    assert stored.header.checksum == zlib.crc32(quantize_fp8(good))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_finds_every_nan_and_inf(dtype):
    g = torch.Generator().manual_seed(0)
    states = torch.randn(3, 50, 64, generator=g).to(dtype)
    assert all_finite(states)
    for i, value in enumerate([float("nan"), float("inf"), float("-inf")] * 20):
        bad = states.clone()
        bad.view(-1)[int(torch.randint(0, bad.numel(), (1,), generator=g))] = value
        if i % 4 == 0:  # +Inf and -Inf together sum to NaN; NaN with either stays NaN
            bad.view(-1)[int(torch.randint(0, bad.numel(), (1,), generator=g))] = -value
        assert not all_finite(bad), f"missed {value} in {dtype}"


def test_all_finite_when_only_the_sum_overflows():
    big = torch.full((2, 8, 16), torch.finfo(torch.float32).max / 2)
    assert not torch.isfinite(big.sum()) and all_finite(big)
    assert all_finite(torch.arange(12).view(1, 3, 4))  # integer states: nothing to check


def test_nan_stored_and_flagged_on_request(store):
    w = Writer(store, nonfinite="store")
    bad = torch.randn(2, 4, 16)
    bad[0, 0, 0] = float("inf")
    w.put("bad", np.arange(4), bad)
    w.close()
    assert w.flagged == ["bad"] and store.get("bad").header.nonfinite


@pytest.mark.parametrize("where", ["append", "commit"])
def test_disk_full_is_a_clear_error_and_the_store_stays_readable(store, monkeypatch, where):
    w = Writer(store)
    w.put("first", np.arange(3), torch.randn(2, 3, 16))
    w.close()

    def no_space(self, arg):
        if where == "append":  # writing the states
            raise OSError(errno.ENOSPC, "No space left on device")
        raise lmdb.Error(f"mdb_txn_commit: {errno.errorcode[errno.ENOSPC]}: No space left on device")

    monkeypatch.setattr(Store, where, no_space)
    w = Writer(store)
    w.put("second", np.arange(3), torch.randn(2, 3, 16))
    with pytest.raises(CorecapError, match="the disk is full"):
        w.close()
    monkeypatch.undo()
    assert list(store.keys()) == ["first"] and store.get("first").hidden_states.shape == (2, 3, 16)


@pytest.mark.parametrize("codec", ["raw", "zstd-planes"])
def test_reused_buffers_go_back_only_once_nothing_reads_them(store, codec):
    """The sink reuses reassembly buffers (corecap/collect.py BufferPool). With the raw codec the
    encoded bytes are views of the buffer, so it may go back only after its sample is committed;
    zstd-planes' are a copy, so it goes back once encoded, and its copy is counted in the pool
    until the commit: overwriting it at release (what reuse does) must not change what was stored."""
    from corecap.sink.collect import BufferPool

    pool = BufferPool(1 << 20)
    w = Writer(store, codec=codec, num_threads=2, batch_bytes=600, buffer_bytes=1 << 20, ledger=pool)
    originals, released = {}, []

    def release(states):
        released.append((w.num_committed, states.data_ptr()))
        states.fill_(float("nan"))  # what the next sample reassembled into it would do
        pool.give(states)

    for i in range(12):
        states = pool.take((2, 3 + i % 4, 16), torch.float32)
        states.copy_(torch.randn(states.shape))
        originals[f"k{i}"] = states.clone()
        w.put(f"k{i}", np.arange(states.shape[1]), states, release=release)
    w.close()
    assert len(released) == 12
    if codec == "raw":
        assert all(committed > 0 for committed, _ in released)
    for key, expected in originals.items():
        assert torch.equal(store.get(key).hidden_states, expected), key
    assert pool.free_bytes > 0 and not pool.lent and pool.held_bytes == 0
    assert 0 < pool.peak_bytes <= 1 << 20
