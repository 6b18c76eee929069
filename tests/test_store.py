"""The store: records round-trip exactly, metadata is checked, corruption is detected, state files
keep only committed bytes, one writer at a time."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from corecap.errors import CorecapError
from corecap.store import segments
from corecap.store import (
    FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta, decode_sample, encode_sample,
)

IDENTITY = ModelIdentity(path="/m", architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="w" * 32,
                         num_layers=8, hidden_size=16, vocab_size=100)


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
    other = ModelIdentity(
        path="/m", architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="x" * 32, num_layers=8,
        hidden_size=16, vocab_size=100,
    )
    with pytest.raises(CorecapError, match="another model"):
        Store.create_or_open(path, _meta(model=other))


def test_map_grows_as_needed(tmp_path, monkeypatch):
    import corecap.store.store as store_mod

    monkeypatch.setattr(store_mod, "_INITIAL_MAP_SIZE", 1 << 17)
    # Only headers and pointers are in LMDB: 16 KiB of input ids per header; 12 overflow 128 KiB.
    with Store.create_or_open(str(tmp_path / "s"), _meta()) as store:
        big = torch.randn(2, 4096, 16).bfloat16()
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


def _sample(key: str, num_tokens: int, seed: int = 0):
    states = torch.randn(2, num_tokens, 16, generator=torch.Generator().manual_seed(seed)).bfloat16()
    return encode_sample(key, np.arange(num_tokens), states, (2, 8)), states


def _state_files(path: str) -> dict[int, int]:
    return {n: os.path.getsize(segments.segment_path(path, n)) for n in segments.segment_numbers(path)}


def test_uncommitted_states_are_cut_off_by_the_next_writer(tmp_path, monkeypatch):
    """A writer killed between writing states and committing their pointers leaves bytes that
    belong to no sample, possibly in a newer state file: the next writer removes them."""
    monkeypatch.setattr(segments, "SEGMENT_BYTES", 1000)  # 2 x 10 tokens x 16 x bf16 = 640 bytes
    path = str(tmp_path / "s")
    originals = {}
    with Store.create_or_open(path, _meta()) as store:
        for i in range(3):
            record, originals[f"k{i}"] = _sample(f"k{i}", 10, seed=i)
            store.put_many([record])
        committed = _state_files(path)
        assert sorted(committed) == [0, 1, 2]  # each 640-byte sample started a new file
        store.append([_sample("lost", 10, seed=9)[0], _sample("lost2", 10, seed=8)[0]])  # no commit
        assert sorted(_state_files(path)) == [0, 1, 2, 3, 4]
    with Store.open(path) as store:
        assert sorted(store.keys()) == ["k0", "k1", "k2"]
    with Store.create_or_open(path, _meta()) as store:
        record, originals["k3"] = _sample("k3", 4, seed=3)
        store.put_many([record])  # 256 bytes: fits after k2 once the tail is gone
        assert _state_files(path) == {**committed, 2: committed[2] + 256}
    with Store.open(path) as store:
        for key, states in originals.items():
            assert torch.equal(store.get(key).hidden_states, states)


def test_a_payload_in_parts_goes_whole_into_one_state_file(tmp_path, monkeypatch):
    """zstd-planes payloads are written as the codec's parts, one after another, never split
    across state files, and read back whole."""
    monkeypatch.setattr(segments, "SEGMENT_BYTES", 2500)
    path = str(tmp_path / "s")
    originals, sizes = {}, []
    with Store.create_or_open(path, _meta()) as store:
        for i in range(5):
            states = torch.randn(2, 30, 16, generator=torch.Generator().manual_seed(i)).bfloat16()
            record = encode_sample(f"k{i}", np.arange(30), states, (2, 8), codec="zstd-planes")
            assert len(record.parts) > 1
            originals[f"k{i}"] = states
            sizes.append(len(record.payload))
            store.put_many([record])
    files = _state_files(path)
    expected, current = [], 0
    for size in sizes:  # a payload that does not fit starts the next file
        if current and current + size > 2500:
            expected.append(current)
            current = 0
        current += size
    assert list(files.values()) == expected + [current] and len(files) > 1
    with Store.open(path) as store:
        for key, states in originals.items():
            assert torch.equal(store.get(key).hidden_states, states)


def test_one_writer_at_a_time(tmp_path):
    path = str(tmp_path / "s")
    with Store.create_or_open(path, _meta()) as store:
        store.put_many([_sample("a", 3)[0]])
    # Another process writing the store (LMDB allows one environment per process, hence a child).
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from corecap.store.segments import _take_lock; _take_lock(sys.argv[1]); "
         "print('locked', flush=True); sys.stdin.read()", path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CorecapError, match=rf"another process \(pid {holder.pid}\) is writing this store"):
            Store.create_or_open(path, _meta())
        with Store.open(path) as reader:  # readers are never blocked
            assert list(reader.keys()) == ["a"]
    finally:
        holder.communicate("", timeout=60)
    with Store.create_or_open(path, _meta()) as store:  # the lock went with its process
        store.put_many([_sample("b", 3)[0]])
        assert len(store) == 2


def test_format_2_store_is_read_and_resumed(tmp_path):
    """Format 2 (integer layers only) is format 3's layout: read, verified and resumed as it is."""
    path = str(tmp_path / "s")
    record, states = _sample("old", 5)
    with Store.create_or_open(path, _meta(format_version=2)) as store:
        store.put_many([record])
    with Store.create_or_open(path, _meta()) as store:  # a run of this corecap resumes it
        assert store.meta.format_version == 2
        record2, states2 = _sample("new", 6, seed=1)
        store.put_many([record2])
    with Store.open(path) as store:
        assert torch.equal(store.get("old").hidden_states, states)
        assert torch.equal(store.get("new").hidden_states, states2)


@pytest.mark.parametrize("version", [1, 5])
def test_unreadable_format_version_is_refused(tmp_path, version):
    """Format 1 (states inline in LMDB) was replaced before any release; 5 is from the future."""
    path = str(tmp_path / "s")
    Store.create_or_open(path, _meta(format_version=version)).close()
    with pytest.raises(CorecapError, match=rf"store format version {version}, this corecap reads \[2, 3, 4\]"):
        Store.open(path)


def test_a_run_holds_the_writer_lock_from_its_start(tmp_path):
    """corecap/writer_lock.py: `held` makes the directory for the lock, refuses another process naming the
    holder's pid and command line, lets this process and a child it trusts write (the sink), and
    removes the directory again when nothing was stored."""
    from corecap import writer_lock as lock

    path = str(tmp_path / "new.lmdb")
    child = ("import os, sys; from corecap import writer_lock as lock\n"
             "if sys.argv[2] == 'trust': lock.trust_parent(sys.argv[1])\n"
             "os.close(lock.take(sys.argv[1])); print('took it')")
    with lock.held(path):
        with lock.held(path):  # re-entrant: the CLI, then run()
            assert lock.holds(path)
        assert os.path.isdir(path) and lock.holds(path)
        os.close(lock.take(path))  # this process's own writer (Store.append) may
        segments.check_unlocked(path)
        trusted = subprocess.run([sys.executable, "-c", child, path, "trust"], capture_output=True, text=True)
        assert trusted.stdout.strip() == "took it", trusted.stderr
        other = subprocess.run([sys.executable, "-c", child, path, "-"], capture_output=True, text=True)
        assert other.returncode != 0 and (f"new.lmdb: another process (pid {os.getpid()}) is writing this store: "
                                          in other.stderr)
        assert open(os.path.join(path, "writer.lock")).read().split("\n")[0] == str(os.getpid())
    assert not os.path.exists(path) and not lock.holds(path)


def test_a_second_run_is_refused_in_its_first_seconds(tmp_path):
    """`corecap run` on a store another run holds: refused within 2 s, naming that run's pid and
    command line, with nothing written to the first run's log and no log of its own."""
    store = tmp_path / "busy.lmdb"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from corecap import writer_lock as lock\n"
         "with lock.held(sys.argv[1]):\n    print('locked', flush=True); sys.stdin.read()", str(store), "--first"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        (store / "corecap.log").write_text("the first run's log\n")
        start = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "corecap", "run", "--store", str(store)], cwd=tmp_path,
                           env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - start
    finally:
        holder.communicate("", timeout=60)
    command = shlex.join([sys.executable, "-c", "import sys; from corecap import writer_lock as lock\n"
                          "with lock.held(sys.argv[1]):\n    print('locked', flush=True); sys.stdin.read()",
                          str(store), "--first"]).replace("\n", " ")
    assert r.returncode == 2 and r.stderr.strip() == (
        f"corecap: error: {store}: another process (pid {holder.pid}) is writing this store: {command}")
    assert elapsed < 2, f"refused after {elapsed:.1f} s"
    assert (store / "corecap.log").read_text() == "the first run's log\n" and not list(tmp_path.glob("corecap-*"))
