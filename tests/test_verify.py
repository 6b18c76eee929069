"""`corecap verify`: a clean store passes; each kind of damage is found, on exactly the damaged keys.

Stores are built directly (no engine) and then damaged with raw LMDB writes or by editing their
state files, as a bad disk, a killed writer or a buggy capture would leave them.
"""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from corecap.store import (
    FP8, FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta, decode_header, encode_sample,
)
from corecap.store.segments import POINTER, segment_path
from corecap.cli import verify
from corecap.store.verify import verify_store

LAYERS = (0, 2, 8)
HIDDEN = 16
IDENTITY = ModelIdentity(path="/m", architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="w" * 32,
                         num_layers=8, hidden_size=HIDDEN, vocab_size=100)


def _meta(codec: str, format_version: int = FORMAT_VERSION) -> StoreMeta:
    return StoreMeta(
        format_version=format_version, model=IDENTITY, layers=LAYERS, layer_meaning=LAYER_MEANING,
        dtype="bfloat16", hidden_size=HIDDEN, corecap_version="0", vllm_version="0", codec=codec,
    )


def _states(seed: int, num_tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(LAYERS), num_tokens, HIDDEN, generator=g).bfloat16()


def _ids(seed: int, num_tokens: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100, size=num_tokens).astype(np.int32)


def _make_store(path: str, codec: str = "raw", num_samples: int = 12,
                format_version: int = FORMAT_VERSION) -> list[str]:
    keys = [f"s{i:02d}" for i in range(num_samples)]
    with Store.create_or_open(path, _meta(codec, format_version)) as store:
        records = [encode_sample(k, _ids(i, 5 + i), _states(i, 5 + i), LAYERS, codec=codec) for i, k in enumerate(keys)]
        store.put_many(records[:5])  # several commits, as a run makes
        store.put_many(records[5:])
    return keys


def _raw_update(path: str, fn) -> None:
    """fn(txn, headers_db, samples_db) inside one raw LMDB write transaction."""
    with Store.open(path) as store:
        meta = store.meta
    with Store.create_or_open(path, meta) as store:
        with store.env.begin(write=True) as txn:
            fn(txn, store.headers_db, store.samples_db)


def _flip_states_byte(path: str, key: str) -> None:
    """Flip one bit in the middle of a sample's states, where they lie in their state file."""
    with Store.open(path) as store, store.env.begin() as txn:
        segment, offset, length = POINTER.unpack(txn.get(key.encode(), db=store.samples_db))
    with open(segment_path(path, segment), "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)[0]
        f.seek(offset + length // 2)
        f.write(bytes([byte ^ 0x10]))


def _invoke(path: str):
    return CliRunner().invoke(verify, ["--store", path])


@pytest.mark.parametrize("codec", ["raw", "zstd-planes"])
def test_clean_store_passes(tmp_path, codec):
    path = str(tmp_path / "s")
    keys = _make_store(path, codec)
    report = verify_store(path)
    assert report.ok and report.num_samples == len(keys) and report.problems == {}
    result = _invoke(path)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines() == [f"{path}: {len(keys)} samples OK ({report.num_tokens} tokens)"]


def test_empty_store_passes(tmp_path):
    path = str(tmp_path / "s")
    Store.create_or_open(path, _meta("raw")).close()
    result = _invoke(path)
    assert result.exit_code == 0 and "0 samples OK" in result.stdout


@pytest.mark.parametrize("codec", ["raw", "zstd-planes"])
def test_flipped_states_byte(tmp_path, codec):
    path = str(tmp_path / "s")
    _make_store(path, codec)
    _flip_states_byte(path, "s03")
    report = verify_store(path)
    assert list(report.problems) == ["s03"]
    assert "checksum mismatch" in report.problems["s03"][0]


def test_short_pointer_and_cut_state_file(tmp_path):
    path = str(tmp_path / "s")
    _make_store(path)

    def shorten(txn, headers_db, samples_db):
        segment, offset, length = POINTER.unpack(txn.get(b"s04", db=samples_db))
        txn.put(b"s04", POINTER.pack(segment, offset, length - 2), db=samples_db)

    _raw_update(path, shorten)
    os.truncate(segment_path(path, 0), os.path.getsize(segment_path(path, 0)) - 1)  # s11 is last
    report = verify_store(path)
    assert sorted(report.problems) == ["s04", "s11"]
    assert "payload is" in report.problems["s04"][0]
    assert "the file was cut short" in report.problems["s11"][0]
    os.unlink(segment_path(path, 0))
    report = verify_store(path)
    assert len(report.problems) == 12 and "states file states-000000.bin is missing" in report.problems["s00"][0]


def test_header_without_states_and_states_without_header(tmp_path):
    path = str(tmp_path / "s")
    _make_store(path)

    def damage(txn, headers_db, samples_db):
        assert txn.delete(b"s01", db=samples_db)
        assert txn.delete(b"s07", db=headers_db)
        txn.put(b"zz-orphan", b"\x00" * 8, db=samples_db)  # sorts after every header key

    _raw_update(path, damage)
    report = verify_store(path)
    assert sorted(report.problems) == ["s01", "s07", "zz-orphan"]
    assert report.num_samples == 13  # the union of both dbs' keys
    assert "header but no states" in report.problems["s01"][0]
    assert "states but no header" in report.problems["s07"][0]
    assert "states but no header" in report.problems["zz-orphan"][0]


def test_header_disagreeing_with_metadata(tmp_path):
    path = str(tmp_path / "s")
    _make_store(path)
    with Store.create_or_open(path, _meta("raw")) as store:
        store.put_many([
            encode_sample("wrong-layers", _ids(1, 4), _states(1, 4), (0, 2, 7)),
            encode_sample("wrong-dtype", _ids(2, 4), _states(2, 4).half(), LAYERS),
            encode_sample("wrong-hidden", _ids(3, 4), _states(3, 4)[..., :8], LAYERS),
            encode_sample("wrong-codec", _ids(4, 4), _states(4, 4), LAYERS, codec=FP8),
            # lossless codecs may mix in one store (a resumed run may use another): no problem
            encode_sample("other-lossless", _ids(5, 4), _states(5, 4), LAYERS, codec="zstd-planes"),
        ])
    report = verify_store(path)
    assert sorted(report.problems) == ["wrong-codec", "wrong-dtype", "wrong-hidden", "wrong-layers"]
    assert report.problems["wrong-layers"] == ["header has layers=(0, 2, 7), the store's metadata (0, 2, 8)"]
    assert "dtype='float16'" in report.problems["wrong-dtype"][0]
    assert "hidden_size=8" in report.problems["wrong-hidden"][0]
    assert f"codec={FP8!r}" in report.problems["wrong-codec"][0]


def test_unreadable_header_and_header_for_another_key(tmp_path):
    path = str(tmp_path / "s")
    _make_store(path)
    _raw_update(path, lambda txn, h, s: (
        txn.put(b"s02", b"\x01garbage", db=h),
        txn.put(b"s05", bytes(txn.get(b"s06", db=h)), db=h),  # s06's header under s05's key
    ))
    report = verify_store(path)
    assert sorted(report.problems) == ["s02", "s05"]
    assert "unreadable header" in report.problems["s02"][0]
    assert report.problems["s05"][0] == "header is for sample 's06'"


@pytest.mark.parametrize("codec", ["raw", "zstd-planes"])
def test_nan_inf_and_all_zero_layer(tmp_path, codec):
    path = str(tmp_path / "s")
    _make_store(path, codec)
    nan, inf, zero, zero_token = _states(20, 6), _states(21, 6), _states(22, 6), _states(23, 6)
    nan[1, 3, 5] = float("nan")
    nan[1, 4, 0] = float("nan")
    inf[2, 0, 0] = float("-inf")
    zero[0] = 0.0
    zero_token[1, 2] = 0.0  # one zero token is a value, not a missing layer
    # finite values whose sum overflows bf16, and values that sum to exactly zero: both fine
    overflow, cancel = _states(24, 6), _states(25, 6)
    overflow[0] = torch.finfo(torch.bfloat16).max
    cancel[2] = 0.0
    cancel[2, 0, 0], cancel[2, 5, 3] = 1.5, -1.5
    samples = [("nan", nan), ("inf", inf), ("zero", zero), ("zero-token", zero_token), ("overflow", overflow),
               ("cancel", cancel)]
    with Store.create_or_open(path, _meta(codec)) as store:
        store.put_many([encode_sample(k, _ids(i, 6), s, LAYERS, codec=codec) for i, (k, s) in enumerate(samples)])
    report = verify_store(path)
    assert sorted(report.problems) == ["inf", "nan", "zero"]
    assert report.problems["nan"] == ["layer 2: 2 NaN and 0 Inf values (first at token 3)"]
    assert report.problems["inf"] == ["layer 8: 0 NaN and 1 Inf values (first at token 0)"]
    assert report.problems["zero"][0].startswith("layer 0: all 6 tokens are exactly zero")


def test_sample_stored_and_flagged_under_nonfinite_store_is_reported(tmp_path):
    path = str(tmp_path / "s")
    _make_store(path)
    states = _states(30, 4)
    states[0, 1, 1] = float("inf")
    with Store.create_or_open(path, _meta("raw")) as store:
        store.put_many([encode_sample("flagged", _ids(30, 4), states, LAYERS, nonfinite=True)])
    report = verify_store(path)
    assert report.problems == {"flagged": ["layer 0: 0 NaN and 1 Inf values (first at token 1) (flagged at capture)"]}


def test_wrong_fingerprint(tmp_path):
    path = str(tmp_path / "s")
    _make_store(path)

    def damage(txn, headers_db, samples_db):
        header = decode_header("s08", txn.get(b"s08", db=headers_db))
        forged = msgspec.structs.replace(header, input_fingerprint="0" * 32)
        txn.put(b"s08", msgspec.msgpack.encode(forged), db=headers_db)
        # s09: its input ids changed under an unchanged fingerprint
        header = decode_header("s09", txn.get(b"s09", db=headers_db))
        ids = np.frombuffer(header.input_ids, "<i4").copy()
        ids[0] += 1
        txn.put(b"s09", msgspec.msgpack.encode(msgspec.structs.replace(header, input_ids=ids.tobytes())), db=headers_db)

    _raw_update(path, damage)
    report = verify_store(path)
    assert sorted(report.problems) == ["s08", "s09"]
    assert all("input fingerprint" in p[0] for p in report.problems.values())


def test_cli_lists_each_problem_and_exits_1(tmp_path):
    path = str(tmp_path / "s")
    _make_store(path)

    _raw_update(path, lambda txn, headers_db, samples_db: txn.delete(b"s00", db=samples_db))
    _flip_states_byte(path, "s10")
    result = _invoke(path)
    assert result.exit_code == 1
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("s00: header but no states")
    assert lines[1].startswith("s10: checksum mismatch")
    assert lines[-1] == f"{path}: 2 of 12 samples have problems"
    assert len(lines) == 3


@pytest.mark.parametrize("codec", ["raw", "zstd-planes"])
def test_problems_come_in_key_order_whatever_the_threads(tmp_path, codec):
    path = str(tmp_path / "s")
    keys = _make_store(path, codec, num_samples=40)
    damaged = keys[3::7]  # decoded ones (flipped bytes) and ones wrong before decoding (no states)
    for key in damaged[::2]:
        _flip_states_byte(path, key)
    _raw_update(path,
                lambda txn, headers_db, samples_db: [txn.delete(k.encode(), db=samples_db) for k in damaged[1::2]])
    seen = {}
    for threads in (1, 3, 16):
        seen[threads] = []
        report = verify_store(path, on_problem=lambda key, problems: seen[threads].append((key, problems)),
                              num_threads=threads)
        assert report.num_samples == 40 and sorted(report.problems) == damaged
    assert [k for k, _ in seen[1]] == damaged
    assert seen[1] == seen[3] == seen[16]
    assert CliRunner().invoke(verify, ["--store", path, "--threads", "0"]).exit_code == 2


def test_not_a_store_is_one_line_exit_2(tmp_path):
    result = _invoke(str(tmp_path / "none"))
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"corecap: error: {tmp_path / 'none'}: not a corecap store (the path does not exist)"
    ]
    import lmdb

    plain = tmp_path / "plain"
    with lmdb.open(str(plain)) as env, env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    result = _invoke(str(plain))
    assert (result.exit_code == 2 and "not a corecap store" in result.stderr
            and len(result.stderr.strip().splitlines()) == 1)
