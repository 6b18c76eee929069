"""The sink's writer: whole samples per commit, NaN/Inf policy, a failing disk is a clear error."""

from __future__ import annotations

import errno

import lmdb
import numpy as np
import pytest
import torch

from corecap import CorecapError
from corecap.store import FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta
from corecap.writer import NonFiniteError, Writer

IDENTITY = ModelIdentity("/m", "LlamaForCausalLM", "c" * 32, "w" * 32, 8, 16, 100)


@pytest.fixture
def store(tmp_path):
    meta = StoreMeta(FORMAT_VERSION, IDENTITY, (2, 8), LAYER_MEANING, "float32", 16, "0", "0")
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
