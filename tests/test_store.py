"""The LMDB store: records round-trip exactly, metadata is checked, corruption is detected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from corecap import CorecapError
from corecap.store import (
    FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta, decode_sample, encode_sample,
)

IDENTITY = ModelIdentity("/m", "LlamaForCausalLM", "c" * 32, "w" * 32, 8, 16, 100)


def _meta(**changes) -> StoreMeta:
    fields = dict(
        format_version=FORMAT_VERSION, model=IDENTITY, layers=(2, 8), layer_meaning=LAYER_MEANING,
        dtype="bfloat16", hidden_size=16, corecap_version="0", vllm_version="0",
    )
    return StoreMeta(**{**fields, **changes})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
def test_record_round_trip(dtype, num_tokens):
    ids = np.arange(num_tokens, dtype=np.int32)
    states = torch.randn(2, num_tokens, 16).to(dtype)
    record = encode_sample("k", ids, states, (2, 8))
    sample = decode_sample("k", record.header, record.payload, 2)
    assert sample.input_ids.tolist() == ids.tolist()
    assert torch.equal(sample.hidden_states, states)
    assert sample.header.layers == (2, 8)


def test_corrupt_record_is_detected():
    record = encode_sample("k", np.arange(4), torch.randn(2, 4, 16), (2, 8))
    value = bytearray(record.payload)
    value[-3] ^= 0xFF
    with pytest.raises(CorecapError, match="checksum mismatch"):
        decode_sample("k", record.header, value, 2)
    with pytest.raises(CorecapError, match="payload is"):
        decode_sample("k", record.header, value[:-1], 2)
    with pytest.raises(CorecapError, match="unreadable header"):
        decode_sample("k", b"\x01", value, 2)


def test_store_put_get_and_meta(tmp_path):
    path = str(tmp_path / "s")
    with Store.create_or_open(path, _meta()) as store:
        states = torch.randn(2, 5, 16).bfloat16()
        store.put_many([encode_sample("a", np.arange(5), states, (2, 8))])
        assert "a" in store and "b" not in store and len(store) == 1
    with Store.open(path) as store:
        assert store.meta == _meta()
        assert list(store.keys()) == ["a"]
        assert torch.equal(store.get("a").hidden_states, states)
        with pytest.raises(CorecapError, match="no sample with key 'b'"):
            store.get("b")


def test_reopen_with_different_meta_is_refused(tmp_path):
    path = str(tmp_path / "s")
    Store.create_or_open(path, _meta()).close()
    with pytest.raises(CorecapError, match="store has dtype='bfloat16', this run has 'float32'"):
        Store.create_or_open(path, _meta(dtype="float32"))
    other = ModelIdentity("/m", "LlamaForCausalLM", "c" * 32, "x" * 32, 8, 16, 100)
    with pytest.raises(CorecapError, match="another model"):
        Store.create_or_open(path, _meta(model=other))


def test_map_grows_as_needed(tmp_path, monkeypatch):
    import corecap.store as store_mod

    monkeypatch.setattr(store_mod, "_INITIAL_MAP_SIZE", 1 << 20)
    with Store.create_or_open(str(tmp_path / "s"), _meta()) as store:
        big = torch.randn(2, 4096, 16).bfloat16()  # 256 KiB each; 12 of them overflow 1 MiB
        for i in range(12):
            store.put_many([encode_sample(f"k{i}", np.arange(4096), big, (2, 8))])
        assert len(store) == 12


def test_open_rejects_non_stores(tmp_path):
    with pytest.raises(CorecapError, match="not a corecap store"):
        Store.open(str(tmp_path))
    import lmdb

    env = lmdb.open(str(tmp_path / "plain"))
    with env.begin(write=True) as txn:
        txn.put(b"x", b"y")
    env.close()
    with pytest.raises(CorecapError, match="not a corecap store"):
        Store.open(str(tmp_path / "plain"))
    with pytest.raises(CorecapError, match="not a corecap store"):
        Store.create_or_open(str(tmp_path / "plain"), _meta())


@pytest.mark.parametrize("codec", ["raw", "zstd-planes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lossless_codecs_round_trip_bit_exact(codec, dtype):
    states = torch.randn(3, 11, 16).to(dtype)
    mask = np.array([0, 1] * 5 + [1], dtype=np.uint8)
    record = encode_sample("k", np.arange(11), states, (1, 2, 3), codec=codec, loss_mask=mask)
    sample = decode_sample("k", record.header, record.payload, 3)
    assert sample.header.codec == codec
    assert torch.equal(sample.hidden_states.view(torch.uint8), states.view(torch.uint8))
    assert sample.loss_mask.tolist() == mask.tolist()


def test_zstd_planes_writes_fewer_bytes_on_activation_like_data():
    states = (torch.randn(4, 256, 128) * torch.linspace(0.1, 10, 128)).bfloat16()
    record = encode_sample("k", np.arange(256), states, (1, 2, 3, 4), codec="zstd-planes")
    assert memoryview(record.payload).nbytes < 0.85 * states.numel() * 2


def test_fp8_storage_is_approximate_within_its_bound():
    from corecap.store import FP8

    states = torch.randn(2, 9, 64).bfloat16()
    record = encode_sample("k", np.arange(9), states, (1, 2), codec=FP8)
    assert memoryview(record.payload).nbytes == 2 * 9 * (64 + 4)
    sample = decode_sample("k", record.header, record.payload, 2)
    assert sample.hidden_states.dtype == torch.bfloat16 and sample.hidden_states.shape == states.shape
    err = (sample.hidden_states.float() - states.float()).abs()
    absmax = states.float().abs().amax(dim=-1, keepdim=True)
    assert (err <= absmax / 28 + 1e-2 * absmax).all()  # /28 from e4m3, plus the bf16 output rounding
    corrupt = bytearray(record.payload)
    corrupt[0] ^= 1
    with pytest.raises(CorecapError, match="checksum"):
        decode_sample("k", record.header, corrupt, 2)


def test_unknown_codec_is_refused():
    with pytest.raises(CorecapError, match="codec 'lzma'"):
        encode_sample("k", np.arange(2), torch.zeros(1, 2, 4), (1,), codec="lzma")
