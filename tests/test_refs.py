"""Stored once (corecap/store/refs.py), without an engine: samples that refer to other samples for
their prefix, written by hand through the store's API, read back whole by every reader (get,
export, StoreDataset) exactly as the same samples stored whole; verify names each broken
reference; merge keeps references valid; stores without references stay format 3."""

from __future__ import annotations

import filecmp
import os
import zlib

import msgspec
import numpy as np
import pytest
import torch
import torch.utils.data
from click.testing import CliRunner

from corecap.cli import main
from corecap.errors import CorecapError
from corecap.store import FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta, encode_sample
from corecap.store.format import REFERENCE_VERSION, Segment, decode_header, encode_header
from corecap.store import merge
from corecap.store.merge import merge_stores
from corecap.store.refs import layout, within
from corecap.store.verify import verify_store
from support.verifier import CAPTURED_LAYERS, VERIFIER_HIDDEN, VERIFIER_LAYERS, VERIFIER_VOCAB

LAYERS = CAPTURED_LAYERS
H = VERIFIER_HIDDEN


def _meta(path: str = "/m", codec: str = "zstd-planes") -> StoreMeta:
    identity = ModelIdentity(
        path=path, architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="w" * 32,
        num_layers=VERIFIER_LAYERS, hidden_size=VERIFIER_HIDDEN, vocab_size=VERIFIER_VOCAB,
    )
    return StoreMeta(
        format_version=FORMAT_VERSION, model=identity, layers=LAYERS, layer_meaning=LAYER_MEANING, dtype="float32",
        hidden_size=H, corecap_version="test", vllm_version="none", codec=codec,
    )


def _conversation(seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray, torch.Tensor]]:
    """Samples shaped like the data that prefix caching shares: a system prompt in every sample and
    a conversation stored one sample per turn (turn k is a prefix of turn k + 1): key → (ids, loss
    mask, states [L, T, H])."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VERIFIER_VOCAB, 24)
    rows = {f"sys-{i}": np.concatenate([system, rng.integers(0, VERIFIER_VOCAB, 5 + 3 * i)]) for i in range(3)}
    turn = system
    for k in range(4):
        turn = np.concatenate([turn, rng.integers(0, VERIFIER_VOCAB, 9)])
        rows[f"turn-{k}"] = turn
    out = {}
    for key, ids in rows.items():
        ids = ids.astype(np.int32)
        mask = (np.arange(len(ids)) % 3 == 0).astype(np.uint8)
        # a causal model's states at t depend on ids[: t + 1] alone: shared prefixes share them
        seeds = [zlib.crc32(ids[: t + 1].tobytes()) for t in range(len(ids))]
        states = torch.stack([torch.randn(len(LAYERS), H, generator=torch.Generator().manual_seed(s)) for s in seeds],
                             dim=1)
        out[key] = (ids, mask, states)
    return out


# Who refers to whom, as the sink decides it (the producer's layout, clipped): (key, owner, n).
PLAN = [("sys-0", None, 0), ("sys-1", "sys-0", 24), ("sys-2", "sys-1", 24),
        ("turn-0", "sys-2", 24), ("turn-1", "turn-0", 32), ("turn-2", "turn-1", 40), ("turn-3", "turn-2", 48)]


def _write(path: str, rows, plan=PLAN, codec: str = "zstd-planes", meta_path: str = "/m") -> dict[str, tuple]:
    """The samples in `plan` order, each referring as planned (None: stored whole), two commits;
    returns each key's prefix segments."""
    layouts, prefixes, records = {}, {}, []
    for key, owner, n in plan:
        ids, mask, states = rows[key]
        prefix = within(layouts[owner], 0, n) if owner else ()
        prefixes[key] = prefix
        layouts[key] = layout(key, prefix, n if owner else 0, len(ids))
        records.append(encode_sample(key, ids, states, LAYERS, codec=codec, loss_mask=mask, prefix=prefix or None))
    with Store.create_or_open(path, _meta(meta_path, codec)) as store:
        store.put_many(records[:3])
        store.put_many(records[3:])
    return prefixes


def _whole(path: str, rows, codec: str = "zstd-planes", meta_path: str = "/m") -> None:
    _write(path, rows, [(key, None, 0) for key, _, _ in PLAN], codec, meta_path)


def _edit_header(path: str, key: str, **changes) -> None:
    with Store.open_for_writing(path) as store, store.env.begin(write=True) as txn:
        header = decode_header(key, txn.get(key.encode(), db=store.headers_db))
        header = msgspec.structs.replace(header, **changes)
        if "prefix" in changes and header.num_prefix <= header.num_tokens:  # the payload's size follows n
            header = msgspec.structs.replace(
                header, payload_bytes=len(LAYERS) * (header.num_tokens - header.num_prefix) * H * 4
            )
        txn.put(key.encode(), encode_header(header), db=store.headers_db)


@pytest.mark.parametrize("codec", ["raw", "zstd-planes"])
def test_references_read_back_whole_and_store_only_their_tails(tmp_path, codec):
    rows = _conversation()
    refs, whole = str(tmp_path / "refs"), str(tmp_path / "whole")
    prefixes = _write(refs, rows, codec=codec)
    _whole(whole, rows, codec)
    # turn-3 names the system prompt's sample and every earlier turn, never a reference of theirs
    assert [(s.key, s.end) for s in prefixes["turn-3"]] == [
        ("sys-0", 24), ("turn-0", 32), ("turn-1", 40), ("turn-2", 48),
    ]
    assert prefixes["turn-3"][0] == Segment("sys-0", 0, 24)
    with Store.open(refs) as store:
        assert store.meta.format_version == REFERENCE_VERSION
        for key, (ids, mask, states) in rows.items():
            sample = store.get(key)
            assert sample.input_ids.tolist() == ids.tolist() and sample.loss_mask.tolist() == mask.tolist()
            assert torch.equal(sample.hidden_states, states), key
    with Store.open(whole) as store:
        assert store.meta.format_version == FORMAT_VERSION  # no reference: format 3, as before
    size = lambda p: sum(os.path.getsize(os.path.join(p, f))  # noqa: E731
                         for f in os.listdir(p) if f.startswith("states-"))
    logical = sum(len(ids) for ids, _, _ in rows.values())
    stored = logical - sum(n for _, _, n in PLAN)
    assert size(refs) < size(whole) * (stored / logical) * 1.1
    report = verify_store(refs)
    assert report.ok and report.num_referring == 6, report.problems
    # `corecap info` shows what is stored once: tokens, those stored, the referring samples, the bytes
    for path, num_stored, num_referring in ((refs, stored, 6), (whole, logical, 0)):
        result = CliRunner().invoke(main, ["info", "--store", path])
        assert result.exit_code == 0, result.output
        info = msgspec.json.decode(result.output)
        assert (info["num_samples"], info["num_tokens"], info["num_stored_tokens"], info["num_referring_samples"]) == (
            len(rows), logical, num_stored, num_referring)
        assert info["state_file_bytes"] == size(path)


def _problems(path: str) -> dict[str, list[str]]:
    return verify_store(path).problems


@pytest.mark.parametrize("damage, key, expected", [
    (dict(prefix=(Segment("nobody", 0, 24),)), "sys-1",
     "positions [0, 24) come from sample 'nobody', which is not in the store"),
    (dict(prefix=(Segment("sys-0", 0, 30),)), "sys-1", "which stores positions [0, 29) itself, not [0, 30)"),
    (dict(prefix=(Segment("sys-1", 0, 24),)), "sys-2", "which stores positions [24, 32) itself, not [0, 24)"),
    (dict(prefix=(Segment("sys-0", 0, 29),)), "turn-0", "whose token ids at [0, 29) differ from this sample's"),
    (dict(prefix=(Segment("sys-0", 0, 10), Segment("sys-0", 12, 24))), "sys-1", "does not continue at position 10"),
    (dict(prefix=(Segment("sys-0", 0, 99),)), "sys-1", "covers positions [0, 99), expected 1 to 32"),
    (dict(prefix=(Segment("sys-1", 0, 24),)), "sys-1", "naming other keys"),
])
def test_verify_names_each_broken_reference(tmp_path, damage, key, expected):
    rows = _conversation()
    path = str(tmp_path / "s")
    _write(path, rows)
    _edit_header(path, key, **damage)
    problems = _problems(path)
    assert expected in " ".join(problems.get(key, [])), problems
    with pytest.raises(CorecapError), Store.open(path) as store:
        store.get(key)
    result = CliRunner().invoke(main, ["verify", "--store", path])
    assert result.exit_code == 1 and f"{key}: " in result.output


def test_a_referrer_of_a_damaged_sample_is_reported_and_unreadable(tmp_path):
    rows = _conversation()
    path = str(tmp_path / "s")
    _write(path, rows, codec="raw")
    with Store.open(path) as store, store.env.begin() as txn:
        from corecap.store.segments import POINTER, segment_path

        number, offset, _ = POINTER.unpack(txn.get(b"sys-0", db=store.samples_db))
    with open(segment_path(path, number), "r+b") as f:  # a byte of sys-0's first positions
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    problems = _problems(path)
    assert "checksum mismatch" in " ".join(problems["sys-0"])
    assert "its prefix comes from sample 'sys-0', which has problems" in problems["turn-3"]
    with Store.open(path) as store, pytest.raises(
        CorecapError, match=r"sample 'turn-3': positions \[0, 24\) come from sample 'sys-0': checksum"
    ):
        store.get("turn-3")


def test_merge_keeps_references_valid_and_resolves_them_through_the_record_it_keeps(tmp_path):
    """OUT already holds sys-0 and turn-0, whose [0, 24) refers to sys-0; the input's turn-0 is
    stored whole and its turn-1 refers to it for [0, 32): in OUT, turn-1 must name sys-0 for
    [0, 24), the positions OUT's turn-0 does not hold itself."""
    rows = _conversation()
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    _write(src, rows, [("sys-0", None, 0), ("turn-0", None, 0)] + PLAN[4:] + PLAN[1:3])
    _write(out, rows, [("sys-0", None, 0), ("turn-0", "sys-0", 24)])
    summary = merge_stores(out, [src])
    assert summary.num_duplicates == 2 and summary.num_samples == len(rows)
    assert verify_store(out).ok
    with Store.open(out) as store:
        assert store.meta.format_version == REFERENCE_VERSION
        for key, (_ids, _, states) in rows.items():
            assert torch.equal(store.get(key).hidden_states, states), key
        with store.env.begin() as txn:
            header = decode_header("turn-1", txn.get(b"turn-1", db=store.headers_db))
    assert header.prefix == (Segment("sys-0", 0, 24), Segment("turn-0", 24, 32))
    fresh = str(tmp_path / "fresh")
    merge_stores(fresh, [src])  # into a new store: copied as they are
    assert verify_store(fresh).ok and verify_store(fresh).num_referring == 5


def test_merge_refuses_an_input_whose_reference_is_broken(tmp_path):
    rows = _conversation()
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    _write(src, rows)
    _edit_header(src, "turn-1", prefix=(Segment("gone", 0, 32),))
    with pytest.raises(CorecapError, match="sample 'turn-1': positions \\[0, 32\\) come from sample 'gone', "
                                           "which is not in the store"):
        merge_stores(out, [src])
    assert not os.path.exists(os.path.join(out, "data.mdb"))


def test_commits_put_owners_first(tmp_path, monkeypatch):
    """merge commits headers in order of prefix length: an owner's prefix is shorter than its
    referrers', so a crash between two header transactions leaves no reference without its
    sample (one record per transaction here, as if every one were the last before a crash)."""
    # keys that sort against the order of their references: key order would commit referrers first
    names = {key: f"{len(PLAN) - i}-{key}" for i, (key, _, _) in enumerate(PLAN)}
    rows = {names[key]: value for key, value in _conversation().items()}
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    _write(src, rows, [(names[key], owner and names[owner], n) for key, owner, n in PLAN])
    committed = []
    real = merge.put_all

    def put_all(self, entries, header_of, batch_bytes=256 << 20, commit_records=8192):
        def spy(key):
            committed.append(key)
            return header_of(key)
        return real(self, entries, spy, batch_bytes, commit_records=1)

    monkeypatch.setattr(merge, "put_all", put_all)
    merge_stores(out, [src])
    order = {key: i for i, key in enumerate(committed)}
    assert sorted(rows) != committed
    with Store.open(out) as store, store.env.begin() as txn:
        for key in rows:
            header = decode_header(key, txn.get(key.encode(), db=store.headers_db))
            assert all(order[s.key] < order[key] for s in header.prefix or ()), (key, committed)


def test_export_and_dataset_of_a_referring_store_equal_the_whole_one(tmp_path, verifier):
    from corecap import StoreDataset

    rows = _conversation(1)
    refs, whole = str(tmp_path / "refs"), str(tmp_path / "whole")
    _write(refs, rows, meta_path=verifier)
    _whole(whole, rows, meta_path=verifier)
    for fmt in ("speculators", "specforge"):
        outs = []
        for store in (refs, whole):
            out = str(tmp_path / f"{fmt}-{os.path.basename(store)}")
            result = CliRunner().invoke(main, ["export", "--store", store, "--format", fmt, "--out", out])
            assert result.exit_code == 0, result.output
            outs.append(out)
        compare = filecmp.dircmp(*outs)
        files = ([f for f in compare.common_files if f not in ("corecap_export.json", "state.json")]
                 + [os.path.join(d, f) for d, sub in compare.subdirs.items() for f in sub.common_files])
        assert files and not compare.left_only and not compare.right_only
        _, mismatch, errors = filecmp.cmpfiles(*outs, files, shallow=False)
        assert not mismatch and not errors, (fmt, mismatch, errors)
    a, b = StoreDataset(refs), StoreDataset(whole)
    assert len(a) == len(b) == len(rows)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x["key"] == y["key"] and all(torch.equal(x[k], y[k])
                                            for k in ("input_ids", "loss_mask", "hidden_states"))
    workers = torch.utils.data.DataLoader(a, batch_size=None, num_workers=2)  # assembled into their shared memory
    loaded = {item["key"]: item["hidden_states"] for item in workers}
    assert len(loaded) == len(b) and all(torch.equal(loaded[y["key"]], y["hidden_states"]) for y in b)
