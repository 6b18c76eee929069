"""Long samples streamed to disk (corecap/sink/stream.py, corecap/store/spill.py), without an
engine: chunks in any order into the spill file, the writer's commit of it as a state file of its
own, readers' view of it (exact, `corecap verify` clean), a crash before its commit (the store as
before, the spill file gone at the next writer), NaN/Inf, and the refusals before the model loads."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from corecap.config import build
from corecap.errors import CorecapError
from corecap.plan import check_long_samples
from corecap.resume import ResumeCheck
from corecap.sink.collect import Collector
from corecap.sink.stream import SpilledRows
from corecap.sink.writer import NonFiniteError, Writer
from corecap.store import FORMAT_VERSION, FP8, LAYER_MEANING, ModelIdentity, Store, StoreMeta, input_fingerprint
from corecap.store import segments
from corecap.store.format import spilled_record
from corecap.store.fp8rows import quantize_fp8_rows
from corecap.store.segments import segment_numbers
from corecap.store.spill import SpillFile
from corecap.store.verify import verify_store
from corecap.transport import wire

LAYERS = (1, 3, 5)
HIDDEN = 8
ROW = HIDDEN * 4  # float32
IDENTITY = ModelIdentity(path="/m", architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="w" * 32,
                         num_layers=8, hidden_size=HIDDEN, vocab_size=100)


@pytest.fixture
def path(tmp_path) -> str:
    meta = StoreMeta(
        format_version=FORMAT_VERSION, model=IDENTITY, layers=LAYERS, layer_meaning=LAYER_MEANING, dtype="float32",
        hidden_size=HIDDEN, corecap_version="0", vllm_version="0", codec="zstd-planes",
    )
    Store.create_or_open(str(tmp_path / "s"), meta).close()
    return str(tmp_path / "s")


def _chunk(step: int, parts: list[tuple[str, np.ndarray, int]], states: torch.Tensor) -> wire.DecodedChunk:
    """A worker's chunk: (request id, token ids, first position) per segment, with `states`."""
    segments = tuple(wire.Segment(req, len(ids)) for req, ids, _ in parts)
    token_ids = np.concatenate([ids for _, ids, _ in parts]).astype(np.int32)
    positions = np.concatenate([np.arange(start, start + len(ids)) for _, ids, start in parts]).astype(np.int32)
    states = states.contiguous()
    header = wire.Chunk(
        version=wire.WIRE_VERSION, rank=0, step=step, dtype="float32", layers=LAYERS, hidden_size=HIDDEN,
        num_tokens=len(token_ids), segments=segments, crcs=wire.checksums(segments, token_ids, positions, states),
    )
    return wire.DecodedChunk(header, token_ids, positions, states)


def _spill_files(path: str) -> list[str]:
    return [name for name in os.listdir(path) if name.startswith("spill-")]


def _pointers(store, keys) -> dict:
    with store.env.begin() as txn:
        return {k: segments.POINTER.unpack(txn.get(k.encode(), db=store.samples_db)) for k in keys}


def _spilled(directory: str, states: torch.Tensor) -> SpillFile:
    """A spill file holding `states` whole, as the collector leaves it once every chunk came."""
    spill = SpillFile(directory, states.numel() * states.element_size())
    spill.write(0, states.contiguous().view(torch.uint8).numpy())
    return spill


def test_a_long_sample_streams_in_any_chunk_order_and_reads_back_exact(path):
    """Buffer 1 KiB: the 40-token sample (1,280 bytes, more than half) streams, the 2-token one
    (64) is held. Its chunks come out of order, one of them as one-token segments among many (a
    decode-shaped chunk, `wire.crc_per_layer`), so both of the copy's paths write the file."""
    rng = np.random.default_rng(0)
    long_ids, short_ids = rng.integers(0, 100, 40).astype(np.int32), np.array([5, 6], np.int32)
    long_states, short_states = torch.randn(len(LAYERS), 40, HIDDEN), torch.randn(len(LAYERS), 2, HIDDEN)
    held = []
    with Store.open_for_writing(path) as store:
        store.append([])  # the writer lock, as the sink takes it at its start: spill files are its holder's
        w = Writer(store, codec="zstd-planes", buffer_bytes=1024)

        def complete(p):
            if p.spill is not None:
                w.put_spilled(p.key, p.token_ids, p.spill)
            else:
                held.append(p.key)
                w.put(p.key, p.token_ids, p.stored_states())

        c = Collector(LAYERS, complete, copy_threads=2, spill_dir=path, buffer_bytes=1024)
        c.expect("s", "short", short_ids)
        c.expect("l", "long", long_ids)
        c.take(_chunk(0, [("l", long_ids[20:40], 20)], long_states[:, 20:40]), 0.0)
        assert c.pending["l"].spill is not None and c.pending["l"].states is None and len(_spill_files(path)) == 1
        many = [("l", long_ids[i : i + 1], i) for i in range(5, 20)] + [("s", short_ids, 0)]
        assert wire.crc_per_layer(len(many))
        c.take(_chunk(1, many, torch.cat([long_states[:, 5:20], short_states], dim=1)), 0.0)
        c.take(_chunk(2, [("l", long_ids[:5], 0)], long_states[:, :5]), 0.0)
        c.close()
        w.close()
        assert held == ["short"] and c.num_streamed == 1 and not _spill_files(path)
        long = store.get("long")
        assert torch.equal(long.hidden_states, long_states) and long.input_ids.tolist() == long_ids.tolist()
        assert long.header.codec == "raw" and torch.equal(store.get("short").hidden_states, short_states)
    assert verify_store(path).ok


def test_a_spilled_sample_becomes_a_state_file_of_its_own_and_writing_goes_on_after_it(path):
    before, long, after = (torch.randn(len(LAYERS), n, HIDDEN) for n in (3, 50, 4))
    with Store.open_for_writing(path) as store:
        store.append([])  # the writer lock, as the sink takes it at its start: spill files are its holder's
        w = Writer(store, buffer_bytes=1024)
        w.put("before", np.arange(3), before)
        w.put_spilled("long", np.arange(50), _spilled(path, long))
        w.put("after", np.arange(4), after)
        w.close()
        pointers = _pointers(store, ("before", "long", "after"))
        for key, states in (("before", before), ("long", long), ("after", after)):
            assert torch.equal(store.get(key).hidden_states, states), key
    nbytes = long.numel() * 4
    assert pointers["long"] == (pointers["before"][0] + 1, 0, nbytes)
    assert pointers["after"][:2] == (pointers["long"][0], nbytes)
    assert verify_store(path).ok


def test_a_crash_before_the_commit_leaves_the_store_as_before_and_the_next_writer_cleans_up(path):
    """One long sample still arriving (its spill file), one renamed into a state file whose
    commit never came: the next writer removes both, and the store reads as before."""
    kept = torch.randn(len(LAYERS), 3, HIDDEN)
    with Store.open_for_writing(path) as store:
        store.append([])  # the writer lock, as the sink takes it at its start: spill files are its holder's
        w = Writer(store)
        w.put("kept", np.arange(3), kept)
        w.close()
        files_before = {n: os.path.getsize(segments.segment_path(path, n)) for n in segment_numbers(path)}
        arriving = SpillFile(path, 50 * len(LAYERS) * HIDDEN * 4)
        arriving.write(0, np.ones(100, np.uint8))
        done = _spilled(path, torch.randn(len(LAYERS), 60, HIDDEN))
        store.append([spilled_record("lost", np.arange(60), LAYERS, "float32", HIDDEN, 0, done.sync())])
        assert len(segment_numbers(path)) == len(files_before) + 1 and len(_spill_files(path)) == 1
    with Store.open_for_writing(path) as store:  # a later run: its writer takes the lock
        store.append([])
        assert {n: os.path.getsize(segments.segment_path(path, n)) for n in segment_numbers(path)} == files_before
        assert not _spill_files(path) and list(store.keys()) == ["kept"]
        assert torch.equal(store.get("kept").hidden_states, kept)
    assert verify_store(path).ok


def test_nan_in_a_spilled_sample_stops_and_its_file_goes(path):
    bad = torch.randn(len(LAYERS), 30, HIDDEN)
    bad[2, 17, 3] = float("nan")
    with Store.open_for_writing(path) as store:
        store.append([])  # the writer lock, as the sink takes it at its start: spill files are its holder's
        w = Writer(store, buffer_bytes=1024)
        w.put_spilled("bad", np.arange(30), _spilled(path, bad))
        with pytest.raises(NonFiniteError, match=r"sample 'bad': NaN/Inf in the captured states at layers \[5\]"):
            w.close()
        assert "bad" not in store and not _spill_files(path)


def test_nan_in_a_spilled_sample_is_stored_flagged_under_nonfinite_store(path):
    bad = torch.randn(len(LAYERS), 30, HIDDEN)
    bad[0, 0, 0] = float("inf")
    with Store.open_for_writing(path) as store:
        store.append([])  # the writer lock, as the sink takes it at its start: spill files are its holder's
        w = Writer(store, nonfinite="store", buffer_bytes=1024)
        w.put_spilled("bad", np.arange(30), _spilled(path, bad))
        w.close()
        sample = store.get("bad")
        assert w.flagged == ["bad"] and sample.header.nonfinite and torch.equal(sample.hidden_states, bad)


def test_prefix_caching_with_a_sample_that_would_stream_is_refused_before_the_model_loads():
    """1,000 tokens of 1 KiB against 1 MiB: more than half, so it would stream; 400 would not."""
    cfg = build(codec="zstd-planes")
    with pytest.raises(CorecapError, match="--buffer-gb 0.000976562: a sample of 1000 tokens holds 1 MiB of states, "
                                           "more than half of that, and such a sample streams to disk, which prefix "
                                           "caching cannot do yet; raise --buffer-gb to 0.00195 or add "
                                           "--no-enable-prefix-caching"):
        check_long_samples(cfg, 1000, 4096, 1024, 1 << 20, block_size=16)
    check_long_samples(cfg, 400, 4096, 1024, 1 << 20, block_size=16)


@pytest.mark.parametrize("codec", ["zstd-planes", FP8])
def test_a_long_sample_of_given_tokens_is_let_through_to_stream(codec):
    check_long_samples(build(codec=codec), 10**6, 10**6, 1024, 1 << 20, block_size=0)


def test_a_response_is_held_whole_so_one_longer_than_the_bound_is_refused():
    """Prompt and --max-tokens (at most --max-len) against all of --buffer-gb: a response never streams."""
    cfg = build(codec="zstd-planes", max_tokens=100)
    with pytest.raises(CorecapError, match=r"a sample of up to 1100 tokens with its response holds 1 MiB of states, "
                                           r"more than that, .* raise --buffer-gb to 0.00195 or lower --max-tokens"):
        check_long_samples(cfg, 1000, 4096, 1024, 1 << 20, block_size=16)
    check_long_samples(cfg, 900, 4096, 1024, 1 << 20, block_size=16)  # 1,000 KiB: held within the bound
    check_long_samples(cfg, 10**6, 1000, 1024, 1 << 20, block_size=16)  # --max-len caps it at 1,000 tokens


def test_only_the_samples_still_to_do_count_as_long():
    """A rerun whose long sample is stored already streams nothing: nothing to refuse."""
    long, short = np.arange(5000, dtype=np.int32), np.arange(10, dtype=np.int32)
    check = ResumeCheck({"long": input_fingerprint(long)})
    for key, ids in (("long", long), ("short", short)):
        check(SimpleNamespace(key=key, points=(), token_ids=ids, where=f"data.jsonl:{key}"))
    assert (check.todo, check.longest) == (1, 10)


def test_fp8_rows_stream_into_the_stored_fp8_payload(tmp_path):
    """The workers' rows (codes, then a scale) of a streamed sample land as fp8's stored payload
    (codes [L, T, H], then scales [L, T]): the same header checksum and decoded states as the same
    rows held and encoded whole, chunks out of order and one as one-token segments."""
    meta = StoreMeta(
        format_version=FORMAT_VERSION, model=IDENTITY, layers=LAYERS, layer_meaning=LAYER_MEANING, dtype="float32",
        hidden_size=HIDDEN, corecap_version="0", vllm_version="0", codec=FP8,
    )
    path = str(tmp_path / "fp8")
    Store.create_or_open(path, meta).close()
    states = torch.randn(len(LAYERS), 30, HIDDEN)
    rows = quantize_fp8_rows(list(states), 30)  # uint8 [L, 30, H + 4]
    with Store.open_for_writing(path) as store:
        store.append([])
        w = Writer(store, codec=FP8, buffer_bytes=1024)
        w.put("held", np.arange(30), rows)
        spill = SpillFile(path, rows.numel())
        target = SpilledRows(spill, len(LAYERS), 30, HIDDEN + 4, fp8=True)
        a = rows.numpy()
        for i in range(len(LAYERS)):
            target[i, 10:30] = a[i, 10:30]
        for t in range(10):
            target[:, t] = a[:, t]
        w.put_spilled("streamed", np.arange(30), spill)
        w.close()
        held, streamed = store.get("held"), store.get("streamed")
    assert streamed.header.codec == FP8 and streamed.header.checksum == held.header.checksum
    assert streamed.header.payload_bytes == held.header.payload_bytes
    assert torch.equal(streamed.hidden_states, held.hidden_states)
    assert verify_store(path).ok


def test_a_nan_row_in_streamed_fp8_stops_and_names_its_layer(tmp_path):
    meta = StoreMeta(
        format_version=FORMAT_VERSION, model=IDENTITY, layers=LAYERS, layer_meaning=LAYER_MEANING, dtype="float32",
        hidden_size=HIDDEN, corecap_version="0", vllm_version="0", codec=FP8,
    )
    path = str(tmp_path / "fp8")
    Store.create_or_open(path, meta).close()
    states = torch.randn(len(LAYERS), 30, HIDDEN)
    states[1, 29, 0] = float("nan")
    rows = quantize_fp8_rows(list(states), 30)
    with Store.open_for_writing(path) as store:
        store.append([])
        w = Writer(store, codec=FP8, buffer_bytes=1024)
        spill = SpillFile(path, rows.numel())
        target = SpilledRows(spill, len(LAYERS), 30, HIDDEN + 4, fp8=True)
        for i in range(len(LAYERS)):
            target[i, 0:30] = rows.numpy()[i]
        w.put_spilled("bad", np.arange(30), spill)
        with pytest.raises(NonFiniteError, match=r"sample 'bad': NaN/Inf in the captured states at layers \[3\]"):
            w.close()
        assert "bad" not in store and not _spill_files(path)
