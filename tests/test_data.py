"""Input validation: every bad input is one clear error naming the input, before any model loads,
and nothing already stored is touched."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from corecap.errors import CorecapError
from corecap.config import build
from corecap.run import run
from corecap.store import FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta, encode_sample
from support.reference import write_jsonl


def _run_error(tmp_path, tiny_model, rows=None, **overrides) -> str:
    data = write_jsonl(tmp_path / "data.jsonl", rows or [{"input_ids": [1, 2, 3]}]) if rows is not False else None
    cfg = build(**{"model": tiny_model, "data": data, "store": str(tmp_path / "store"), "max_len": 64, **overrides})
    with pytest.raises(CorecapError) as e:
        run(cfg)
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "rows, expected",
    [
        (['{"input_ids": [1, 2'], "data.jsonl:1: not valid JSON"),
        ([{"input_ids": [1]}, "[1, 2]"], "data.jsonl:2: expected a JSON object"),
        ([{"id": "a", "tokens": [1]}], "data.jsonl:1: expected a field 'input_ids' or 'text'"),
        ([{"input_ids": []}], "data.jsonl:1: empty sample"),
        ([{"text": ""}], "data.jsonl:1: empty sample"),
        ([{"input_ids": [1, 512]}], "data.jsonl:1: token id 512 at position 1 is outside the vocabulary [0, 512)"),
        ([{"input_ids": [-1]}], "outside the vocabulary"),
        ([{"input_ids": [1, "2"]}], "data.jsonl:1: field 'input_ids' must be a list of integers"),
        ([{"input_ids": [1.5]}], "must be a list of integers"),
        ([{"id": "x", "input_ids": [1]}, "", {"id": "x", "input_ids": [2]}],
         "data.jsonl:3: duplicate id 'x' (first seen on line 1)"),
        ([{"id": 5, "input_ids": [1]}, {"id": "5", "input_ids": [2]}], "duplicate id '5'"),
        ([{"id": 1.5, "input_ids": [1]}], "field 'id' must be a string or an integer"),
        ([{"id": "k" * 512, "input_ids": [1]}], "field 'id' is 512 bytes, at most 511"),
        ([{"input_ids": [1] * 65}], "data.jsonl:1: sample '1' has 65 tokens, more than --max-len 64"),
        ([{"text": 3}], "field 'text' must be a string"),
    ],
)
def test_bad_rows(tmp_path, tiny_model, rows, expected):
    assert expected in _run_error(tmp_path, tiny_model, rows)
    assert not os.path.exists(tmp_path / "store")  # validated before the store is created


def test_bad_row_far_down_is_reported_up_front(tmp_path, tiny_model):
    rows = [{"input_ids": [1, 2, 3]}] * 5000 + [{"input_ids": [9999]}]
    assert "data.jsonl:5001: token id 9999" in _run_error(tmp_path, tiny_model, rows)


def test_missing_model_dir(tmp_path):
    msg = _run_error(tmp_path, str(tmp_path / "nope"), model=str(tmp_path / "nope"))
    assert msg == f"--model {tmp_path / 'nope'}: no such directory (expected a HF model directory)"


def test_model_dir_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    msg = _run_error(tmp_path, str(tmp_path / "m"))
    assert "cannot read config.json" in msg


def test_missing_data_file(tmp_path, tiny_model):
    assert "--data" in _run_error(tmp_path, tiny_model, rows=False, data=str(tmp_path / "missing.jsonl"))


def test_empty_data_file(tmp_path, tiny_model):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert "no samples" in _run_error(tmp_path, tiny_model, rows=False, data=str(tmp_path / "empty.jsonl"))


@pytest.mark.parametrize("layers, expected", [((9,), "index 9 is outside 0..8"), ((-1, 2), "index -1 is outside 0..8")])
def test_layer_out_of_range(tmp_path, tiny_model, layers, expected):
    assert expected in _run_error(tmp_path, tiny_model, layers=layers)


def test_store_path_is_a_file(tmp_path, tiny_model):
    (tmp_path / "store").write_text("precious")
    assert "not a corecap store" in _run_error(tmp_path, tiny_model)
    assert (tmp_path / "store").read_text() == "precious"


def test_store_path_is_a_foreign_directory(tmp_path, tiny_model):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "notes.txt").write_text("mine")
    assert "not a corecap store" in _run_error(tmp_path, tiny_model)
    assert os.listdir(tmp_path / "store") == ["notes.txt"]


def _store_with_one_sample(path, identity: ModelIdentity, layers) -> bytes:
    meta = StoreMeta(
        format_version=FORMAT_VERSION, model=identity, layers=layers, layer_meaning=LAYER_MEANING, dtype="float32",
        hidden_size=identity.hidden_size, corecap_version="0", vllm_version="0",
    )
    with Store.create_or_open(path, meta) as store:
        states = torch.randn(len(layers), 3, identity.hidden_size)
        store.put_many([encode_sample("kept", np.array([1, 2, 3]), states, layers)])
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        return f.read()


def test_bad_input_leaves_existing_store_untouched(tmp_path, tiny_model):
    from corecap.model import model_identity

    store = str(tmp_path / "store")
    before = _store_with_one_sample(store, model_identity(tiny_model, "auto"), (2, 4, 5, 8))
    _run_error(tmp_path, tiny_model, rows=[{"input_ids": [1]}, {"input_ids": [600]}])
    with open(os.path.join(store, "data.mdb"), "rb") as f:
        assert f.read() == before


def test_resume_with_changed_input_is_an_error(tmp_path, tiny_model):
    from corecap.model import model_identity

    store = str(tmp_path / "store")
    _store_with_one_sample(store, model_identity(tiny_model, "auto"), (2, 4, 5, 8))
    msg = _run_error(tmp_path, tiny_model, rows=[{"id": "kept", "input_ids": [1, 2, 4]}], dtype="float32")
    assert "data.jsonl:1: sample 'kept' is already stored with input fingerprint" in msg


def test_resume_with_other_layers_is_an_error(tmp_path, tiny_model):
    from corecap.model import model_identity

    store = str(tmp_path / "store")
    _store_with_one_sample(store, model_identity(tiny_model, "auto"), (1, 2))
    msg = _run_error(tmp_path, tiny_model, dtype="float32")
    assert "store has layers=(1, 2), this run has (2, 4, 5, 8, 'prenorm')" in msg


def test_default_layers():
    from corecap.config import default_layers

    assert default_layers(32) == (2, 16, 29, 32, "prenorm")
    assert default_layers(8) == (2, 4, 5, 8, "prenorm")
    assert default_layers(2) == (0, 1, 2, "prenorm")


def test_every_bad_row_in_one_run_before_vllm(tmp_path, tiny_model):
    """Three bad rows: one `corecap run` lists all three as FILE:LINE, with the option that accepts
    the chat row with only a user turn, before vLLM is imported; nothing is left
    behind (no store directory, no temporary log). vLLM not imported is the check: the time
    depends on the machine's load (most of it importing torch and transformers)."""
    import subprocess
    import sys
    import time

    rows = ['{"id": "a", "input_ids": [1, 2, 3]}', '{"id": "b", "input_ids": [1, 2', '{"id": "a", "input_ids": [4]}',
            '{"id": "c", "messages": [{"role": "user", "content": "hi"}]}', '{"id": "d", "input_ids": [5, 6]}']
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(rows) + "\n")
    script = ("import sys, corecap.cli\n"
              "try:\n    corecap.cli.main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
              "print('vllm imported:', 'vllm' in sys.modules, 'exit', code)\n")
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script, "run", "--model", tiny_model, "--data", str(data),
                        "--store", "new.lmdb"], cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)},
                       capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    lines = r.stderr.strip().splitlines()
    assert lines[0] == f"corecap: error: --data {data}: 3 rows cannot be captured " \
                       "(--invalid skip leaves out the invalid ones):", r.stderr
    assert lines[1].startswith(f"  {data}:2: not valid JSON")
    assert lines[2] == f"  {data}:3: duplicate id 'a' (first seen on line 1)"
    assert lines[3] == (f"  {data}:4: field 'messages' has no assistant turn "
                        "(nothing to train on; add --max-tokens N to let the model answer it); no store was made")
    assert r.stdout.strip() == "vllm imported: False exit 2", r.stdout
    print(f"refused in {elapsed:.1f} s")  # most of it importing torch and transformers
    assert not (tmp_path / "new.lmdb").exists() and not list(tmp_path.glob("corecap-*"))


def test_more_bad_rows_than_listed_are_counted(tmp_path):
    from corecap.data import check_rows
    from corecap.data.problems import MAX_PROBLEMS

    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 99]}] * (MAX_PROBLEMS + 5))
    with pytest.raises(CorecapError) as e:
        check_rows(data, vocab_size=10)
    lines = str(e.value).splitlines()
    assert lines[0] == f"--data {data}: {MAX_PROBLEMS + 5} rows cannot be captured " \
                       "(--invalid skip leaves out the invalid ones):"
    assert lines[1] == f"  {data}:1: token id 99 at position 1 is outside the vocabulary [0, 10)"
    assert len(lines) == 1 + MAX_PROBLEMS + 1 and lines[-1] == "  and 5 more"


def test_the_samples_to_do_come_back_as_they_were_added_and_leave_no_file(tmp_path):
    """corecap/data/todo.py: what the validation pass keeps for the step loop, in order, whole."""
    import dataclasses

    from corecap.data import read_samples
    from corecap.data.todo import TodoSamples

    rows = [{"id": f"s{i}", "input_ids": list(range(3, 3 + i + 1))} for i in range(50)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    made = list(read_samples(path, tokenizer=None, vocab_size=512, max_len=100))
    todo = TodoSamples()
    for sample in made:
        todo.add(sample)
    assert not isinstance(todo.file.name, str)  # no name in any directory: nothing to leave behind
    got = list(todo)
    todo.close()
    assert [s.key for s in got] == [s.key for s in made]
    for a, b in zip(got, made):
        assert np.array_equal(a.token_ids, b.token_ids)
        assert {f.name for f in dataclasses.fields(a)} == {f.name for f in dataclasses.fields(b)}
