"""Real datasets in: JSON Lines / JSON array / Parquet rows of input_ids, text, OpenAI messages or
ShareGPT conversations; assistant loss masks checked token by token against an independent
rendering; overflow and invalid-row policies; sharding; merging shard stores. No engine starts."""

from __future__ import annotations

import json
import os
import shutil
import sys

import msgspec
import numpy as np
import pytest
import torch

from corecap import data
from corecap.data import rows
from corecap.errors import CorecapError
from corecap.demo import build_tokenizer
from corecap.cli import merge
from corecap.store.merge import merge_stores
from corecap.model import load_tokenizer
from corecap.store import FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta, encode_sample
from support.reference import write_jsonl

VOCAB = 512
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "hidden states for a draft head are captured at chosen layers",
    "be brief and answer in one sentence; naïve café ☕ 42",
] * 20
NO_MARKERS = (  # the demo template without {% generation %}: exercises the fallback mask
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what does the quick brown fox do?"},
    {"role": "assistant", "content": "it jumps over the lazy dog"},
    {"role": "user", "content": " and then?\n"},
    {"role": "assistant", "content": "naïve café ☕, 42 draft heads"},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tokenizer"))
    build_tokenizer(path, TEXTS, vocab_size=VOCAB)
    return path


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def tok_no_markers(tokenizer_dir, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tokenizer-no-markers"))
    shutil.copytree(tokenizer_dir, path, dirs_exist_ok=True)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(NO_MARKERS)
    tokenizer = load_tokenizer(path)
    assert tokenizer.chat_template == NO_MARKERS
    return tokenizer


def expected(tok, messages) -> tuple[list[int], list[int]]:
    """The demo template by hand: <|role|> content <|end|> per turn, each piece tokenized on its
    own (special tokens split the text, so pieces tokenize alike alone and together); an
    assistant turn's content and its <|end|> are trained on, its <|assistant|> header is not."""
    ids, mask = [], []
    end = tok.convert_tokens_to_ids("<|end|>")
    for m in messages:
        content = tok(m["content"], add_special_tokens=False)["input_ids"]
        trained = int(m["role"] == "assistant")
        ids += [tok.convert_tokens_to_ids(f"<|{m['role']}|>")] + content + [end]
        mask += [0] + [trained] * (len(content) + 1)
    return ids, mask


def samples(path, tok, max_len=4096, **kw) -> list[data.Sample]:
    return list(data.read_samples(str(path), tokenizer=tok, vocab_size=VOCAB, max_len=max_len, **kw))


def summary(path, tok, max_len=4096, **kw) -> data.DatasetSummary:
    return data.validate(str(path), tokenizer=tok, vocab_size=VOCAB, max_len=max_len, **kw)


def as_lists(ss) -> list:
    return [(s.key, s.token_ids.tolist(), None if s.loss_mask is None else s.loss_mask.tolist()) for s in ss]


# ---------------------------------------------------------------------------------------------
# Conversations and their masks


@pytest.mark.parametrize("which", ["markers", "fallback"])
def test_messages_mask_token_by_token(tmp_path, tok, tok_no_markers, which):
    tokenizer = tok if which == "markers" else tok_no_markers
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "chat", "messages": CHAT}])
    [s] = samples(path, tokenizer)
    ids, mask = expected(tok, CHAT)
    assert s.token_ids.dtype == np.int32 and s.loss_mask.dtype == np.uint8
    assert s.token_ids.tolist() == ids
    assert s.loss_mask.tolist() == mask
    # And in words: the trained tokens are exactly the assistant turns and their end markers.
    trained = tok.decode([t for t, m in zip(ids, s.loss_mask) if m], skip_special_tokens=False)
    assert trained == "it jumps over the lazy dog<|end|>naïve café ☕, 42 draft heads<|end|>"


@pytest.mark.parametrize("which", ["markers", "fallback"])
def test_sharegpt_roles_are_mapped(tmp_path, tok, tok_no_markers, which):
    tokenizer = tok if which == "markers" else tok_no_markers
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    conversations = [{"from": names[m["role"]], "value": m["content"]} for m in CHAT]
    rows = [{"id": "sharegpt", "conversations": conversations},
            {"conversations": [{"from": "user", "value": "the fox?"}, {"from": "chatgpt", "value": "jumps"}]}]
    a, b = samples(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer)
    assert (a.token_ids.tolist(), a.loss_mask.tolist()) == expected(tok, CHAT)
    two = [{"role": "user", "content": "the fox?"}, {"role": "assistant", "content": "jumps"}]
    assert (b.key, b.token_ids.tolist(), b.loss_mask.tolist()) == ("2", *expected(tok, two))


def test_assistant_first_conversation(tmp_path, tok, tok_no_markers):
    rows = [{"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    [s] = samples(path, tok)  # the markers need no turn before it
    assert (s.token_ids.tolist(), s.loss_mask.tolist()) == expected(tok, rows[0]["messages"])
    with pytest.raises(CorecapError, match="d.jsonl:1: the conversation starts with an assistant turn"):
        samples(path, tok_no_markers)


def test_fallback_refuses_a_template_that_is_not_prefix_stable(tmp_path, tok):
    import copy

    tokenizer = copy.deepcopy(tok)
    # Ends every turn but the last with <|end|>: a prefix renders differently inside the whole.
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if not loop.last %}<|end|>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "x", "messages": CHAT}])
    for invalid in ("error", "skip"):  # a property of the template: never skipped row by row
        with pytest.raises(CorecapError, match="d.jsonl:1: the chat template renders .* add \\{% generation %\\}"):
            summary(path, tokenizer, invalid=invalid)


def test_conversations_need_a_tokenizer_with_a_chat_template(tmp_path, tok):
    import copy

    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}])
    with pytest.raises(CorecapError, match="d.jsonl:1: field 'messages' needs a tokenizer"):
        summary(path, None)
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(CorecapError, match="needs the tokenizer's chat template"):
        summary(path, bare, invalid="skip")


def test_text_rows_have_no_mask(tmp_path, tok):
    [s] = samples(write_jsonl(tmp_path / "d.jsonl", [{"text": "the lazy dog"}]), tok)
    assert s.token_ids.tolist() == tok("the lazy dog")["input_ids"] and s.loss_mask is None


# ---------------------------------------------------------------------------------------------
# input_ids + loss_mask


def test_input_ids_with_loss_mask_pass_through(tmp_path, tok):
    rows = [{"id": "m", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
            {"id": "b", "input_ids": [5, 6], "loss_mask": [False, True]},
            {"id": "none", "input_ids": [5, 6]}]
    assert as_lists(samples(write_jsonl(tmp_path / "d.jsonl", rows), tok)) == [
        ("m", [5, 6, 7, 8], [0, 0, 1, 1]), ("b", [5, 6], [0, 1]), ("none", [5, 6], None)]


@pytest.mark.parametrize(
    "row, message, reason",
    [
        ({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}, "field 'loss_mask' has 2 entries, 'input_ids' has 3",
         "bad loss_mask"),
        ({"input_ids": [1, 2], "loss_mask": [0, 2]}, "field 'loss_mask' must be a list of 0s and 1s", "bad loss_mask"),
        ({"input_ids": [1, 2], "loss_mask": "01"}, "field 'loss_mask' must be a list of 0s and 1s", "bad loss_mask"),
        ({"input_ids": [1, 2], "loss_mask": [0, 0]}, "the loss mask marks no token", "empty loss mask"),
        ({"text": "the dog", "loss_mask": [1, 1]}, "field 'loss_mask' goes with 'input_ids', not with 'text'",
         "bad loss_mask"),
        ({"input_ids": [1], "text": "the dog"}, "fields 'input_ids' and 'text' both given", "several input fields"),
        ({"text": "x", "messages": CHAT}, "fields 'text' and 'messages' both given", "several input fields"),
    ],
)
def test_bad_input_rows(tmp_path, tok, row, message, reason):
    _check_bad_row(tmp_path, tok, row, message, reason)


# ---------------------------------------------------------------------------------------------
# Invalid conversation rows: one clear message each; error stops, skip goes on and counts


def _check_bad_row(tmp_path, tok, row, message, reason):
    good = {"id": "good", "messages": CHAT[1:3]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, row, {**good, "id": "good-2"}])
    with pytest.raises(CorecapError) as e:
        summary(path, tok)
    assert str(e.value).startswith(f"{path}:2: ") and message in str(e.value) and "\n" not in str(e.value)
    logged = []
    s = summary(path, tok, invalid="skip", on_skip=logged.append)
    assert (s.num_samples, s.num_skipped, s.skip_reasons) == (2, 1, {reason: 1})
    assert logged == list(s.skip_examples) == [str(e.value)]
    assert [x.key for x in samples(path, tok, invalid="skip")] == ["good", "good-2"]
    assert [x.key for x in samples(path, tok, overflow="skip")] == ["good", "good-2"]  # skip policy skips both
    with pytest.raises(CorecapError):
        summary(path, tok, overflow="truncate")


@pytest.mark.parametrize(
    "row, message, reason",
    [
        ({"messages": []}, "field 'messages' is empty (no turns)", "empty conversation"),
        ({"conversations": []}, "field 'conversations' is empty (no turns)", "empty conversation"),
        ({"messages": [{"role": "user", "content": " \n"}, {"role": "assistant", "content": ""}]},
         "field 'messages' has only empty or whitespace turns", "whitespace-only conversation"),
        ({"conversations": [{"from": "human", "value": "\t"}, {"from": "gpt", "value": " "}]},
         "field 'conversations' has only empty or whitespace turns", "whitespace-only conversation"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]},
         "messages[1].role: unknown role 'bot' (expected one of 'system', 'user', 'assistant')", "unknown role"),
        ({"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]},
         "conversations[1].from: unknown role 'robot' (expected one of 'human'", "unknown role"),
        ({"messages": [{"role": 3, "content": "x"}]}, "messages[0].role: unknown role 3", "unknown role"),
        ({"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}]},
         "messages[0].content[0]: unknown content part None (expected 'text', 'image_url' or 'image')",
         "bad content part"),
        ({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]},
         "messages[0].content must be a string, got int (or a list of content parts)", "non-string content"),
        ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]},
         "conversations[1].value must be a string, got NoneType", "non-string content"),
        ({"messages": "hello"}, "field 'messages' must be a list of objects, got str", "malformed conversation"),
        ({"messages": [["user", "hi"]]}, "messages[0] must be an object, got list", "malformed conversation"),
        ({"messages": [{"content": "x"}]}, "messages[0] has no field 'role'", "malformed conversation"),
        ({"conversations": [{"from": "gpt"}]}, "conversations[0] has no field 'value'", "malformed conversation"),
        ({"messages": [{"role": "user", "content": "hi"}]},
         "no assistant turn (nothing to train on; add --max-tokens N to let the model answer it)",
         "no assistant turn"),
        ({"id": 1.5, "messages": CHAT}, "field 'id' must be a string or an integer", "bad id"),
        ("[1, 2]", "expected a JSON object, got list", "not an object"),
        ('{"messages": [', "not valid JSON", "not valid JSON"),
    ],
)
def test_bad_conversation_rows(tmp_path, tok, row, message, reason):
    _check_bad_row(tmp_path, tok, row, message, reason)


def test_bad_policy_values(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1]}])
    with pytest.raises(CorecapError, match="--overflow 'cut': expected one of error, truncate, skip"):
        summary(path, tok, overflow="cut")
    with pytest.raises(CorecapError, match="--invalid 'truncate'"):
        summary(path, tok, invalid="truncate")
    with pytest.raises(CorecapError, match="expected K/N with 0 <= K < N"):
        summary(path, tok, shard=(2, 2))


def test_all_rows_skipped_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": []}, {"input_ids": [1] * 9}])
    with pytest.raises(CorecapError, match="no samples left: 0 samples .* 2 skipped"):
        summary(path, tok, max_len=8, overflow="skip")


# ---------------------------------------------------------------------------------------------
# Overflow policies


def test_overflow_policies(tmp_path, tok):
    short_chat = [{"role": "user", "content": "the fox?"},
                  {"role": "assistant", "content": "it jumps over the lazy dog"}]
    long_chat = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 3},
                 {"role": "assistant", "content": "it does"}]
    rows = [
        {"id": "short", "input_ids": [1] * 5, "loss_mask": [1] * 5},
        {"id": "exact", "input_ids": [1] * 8},
        {"id": "long", "input_ids": list(range(3, 15)), "loss_mask": [0, 1] * 6},
        {"id": "long-chat", "messages": short_chat},
        {"id": "no-target", "messages": long_chat},  # its only assistant turn lies past --max-len
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    max_len = 8
    ids, mask = expected(tok, short_chat)
    assert len(ids) > max_len and any(mask[:max_len])
    with pytest.raises(CorecapError, match=r"d.jsonl:3: sample 'long' has 12 tokens, more than --max-len 8"):
        summary(path, tok, max_len=max_len)

    s = summary(path, tok, max_len=max_len, overflow="truncate")
    assert (s.num_samples, s.num_truncated, s.num_skipped) == (4, 2, 1)
    assert s.skip_reasons == {"no trained token within --max-len": 1}
    assert s.num_tokens == 5 + 8 + 8 + 8
    got = samples(path, tok, max_len=max_len, overflow="truncate")
    assert as_lists(got) == [
        ("short", [1] * 5, [1] * 5), ("exact", [1] * 8, None),
        ("long", list(range(3, 11)), [0, 1] * 4), ("long-chat", ids[:max_len], mask[:max_len])]
    assert as_lists(got) == as_lists(samples(path, tok, max_len=max_len, overflow="truncate"))  # two passes agree
    assert "4 samples (2 truncated to --max-len), 1 skipped (1 no trained token within --max-len)" == s.outcomes()

    s = summary(path, tok, max_len=max_len, overflow="skip")
    assert (s.num_samples, s.num_truncated, s.num_skipped, s.skip_reasons) == (2, 0, 3, {"longer than --max-len": 3})
    assert s.skip_examples[0] == f"{path}:3: sample 'long' has 12 tokens, more than --max-len 8"
    assert [x.key for x in samples(path, tok, max_len=max_len, overflow="skip")] == ["short", "exact"]


# ---------------------------------------------------------------------------------------------
# File formats


ROWS = [
    {"id": "chat", "messages": CHAT},
    {"conversations": [{"from": "human", "value": "the fox?"}, {"from": "gpt", "value": "jumps over the dog"}]},
    {"id": 7, "text": "hidden states for a draft head"},
    {"input_ids": [3, 4, 5], "loss_mask": [0, 1, 1]},
    {"id": "long-text", "text": "the quick brown fox jumps over the lazy dog, 123456789 " * 30},
]


@pytest.mark.parametrize("chunk", [1 << 20, 7])  # 7 characters: elements, strings and numbers span reads
def test_json_array_reads_like_json_lines(tmp_path, tok, monkeypatch, chunk):
    monkeypatch.setattr(rows, "_CHUNK", chunk)
    lines = write_jsonl(tmp_path / "d.jsonl", ROWS)
    array = tmp_path / "d.json"
    array.write_text("\ufeff \n" + json.dumps(ROWS, indent=2, ensure_ascii=False) + "\n")
    got = samples(array, tok)
    assert as_lists(got) == as_lists(samples(lines, tok))
    assert [s.where for s in got][1:3] == [f"{array}: element 2", f"{array}: element 3"]
    assert summary(array, tok).num_lines == len(ROWS)
    (tmp_path / "e.json").write_text("[ ]")
    with pytest.raises(CorecapError, match="no samples"):
        summary(tmp_path / "e.json", tok)


@pytest.mark.parametrize(
    "text, message",
    [
        ('[{"input_ids": [1]}, {"input_ids": [1,]}]', "d.json: element 2: not valid JSON (Expecting value, line 1)"),
        ('[{"input_ids": [1]}\n {"input_ids": [2]}]', "d.json: element 1: expected ',' or ']' after it (line 2)"),
        ('[{"input_ids": [1]}] [', "d.json: text after the closing ']' (line 1)"),
        ('[{"input_ids": [1]},', "d.json: element 2: the file ends inside the array"),
        ('[{"input_ids": [1]}, 5]', "d.json: element 2: expected a JSON object, got int"),
        ('[{"id": "a", "input_ids": [1]}, {"id": "a", "input_ids": [2]}]',
         "d.json: element 2: duplicate id 'a' (first seen at element 1)"),
    ],
)
def test_json_array_errors(tmp_path, tok, text, message):
    (tmp_path / "d.json").write_text(text)
    with pytest.raises(CorecapError) as e:
        summary(tmp_path / "d.json", tok)
    assert message in str(e.value)


def _write_parquet(path, rows) -> str:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    names = sorted({k for row in rows for k in row})
    columns = {name: [row.get(name) for row in rows] for name in names}
    if "id" in columns:
        columns["id"] = [None if v is None else str(v) for v in columns["id"]]
    pq.write_table(pa.table(columns), str(path), row_group_size=2)
    return str(path)


def test_parquet_reads_like_json_lines(tmp_path, tok):
    rows = ROWS + [{"id": "extra", "input_ids": [9, 9], "note": "columns corecap does not use are not read"}]
    got = samples(_write_parquet(tmp_path / "d.parquet", rows), tok)
    assert as_lists(got) == as_lists(samples(write_jsonl(tmp_path / "d.jsonl", rows), tok))
    assert got[1].where == f"{tmp_path / 'd.parquet'}: row 2" and got[1].key == "2"


def test_parquet_errors(tmp_path, tok):
    path = _write_parquet(tmp_path / "d.parquet", [{"input_ids": [1]}, {"input_ids": [1], "loss_mask": [1, 0]}])
    with pytest.raises(CorecapError, match="d.parquet: row 2: field 'loss_mask' has 2 entries"):
        summary(path, tok)
    other = _write_parquet(tmp_path / "o.parquet", [{"prompt": "x"}])
    with pytest.raises(CorecapError, match="o.parquet: no column 'input_ids', 'text', 'messages', 'conversations'"):
        summary(other, tok)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(CorecapError, match="junk.parquet: not a readable Parquet file"):
        summary(tmp_path / "junk.parquet", tok)


def test_parquet_without_pyarrow(tmp_path, tok, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(CorecapError,
                       match=r"d.parquet: reading Parquet needs pyarrow \(pip install 'corecap\[parquet\]'"):
        summary(tmp_path / "d.parquet", tok)


# ---------------------------------------------------------------------------------------------
# Sharding


@pytest.mark.parametrize("text, expected", [("0/1", (0, 1)), ("3/4", (3, 4)), (" 2 / 8 ", (2, 8))])
def test_parse_shard(text, expected):
    assert data.parse_shard(text) == expected


@pytest.mark.parametrize("text", ["4/4", "1", "-1/3", "a/b", "1/0", "0/0", "1/2/3", ""])
def test_parse_shard_refuses(text):
    with pytest.raises(CorecapError) as e:
        data.parse_shard(text)
    assert str(e.value) == f"--shard {text!r}: expected K/N with 0 <= K < N"


def test_shard_of_is_stable():
    # Pinned: stores sharded by one corecap must merge with shards made by another.
    assert [data.shard_of(k, 7) for k in ["0", "1", "a", "demo-000", "ключ"]] == [1, 5, 4, 1, 6]
    assert data.shard_of("a", 1 << 30) == 966719552


def test_shards_partition_the_dataset(tmp_path, tok):
    rows = [{"id": f"s{i}", "input_ids": [i % 500 + 1]} if i % 3 else {"messages": CHAT[1:3]} for i in range(120)]
    rows[50] = '{"broken'  # no readable key: belongs to the shard of its line number
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    everything = {s.key for s in samples(path, tok, invalid="skip")}
    assert len(everything) == 119
    seen: set[str] = set()
    for k in range(4):
        keys = [s.key for s in samples(path, tok, invalid="skip", shard=(k, 4))]
        assert keys == [s.key for s in samples(path, tok, invalid="skip", shard=(k, 4))]  # deterministic
        assert all(data.shard_of(key, 4) == k for key in keys)
        assert not seen & set(keys)
        seen |= set(keys)
        s = summary(path, tok, invalid="skip", shard=(k, 4))
        assert s.num_samples + s.num_skipped + s.num_other_shards == 120 and s.num_samples == len(keys)
        assert s.num_skipped == (1 if k == data.shard_of("51", 4) else 0)
    assert seen == everything


# ---------------------------------------------------------------------------------------------
# Merge

LAYERS = (2, 4)
HIDDEN = 16


def _meta(**changes) -> StoreMeta:
    model = changes.pop("model", ModelIdentity(
        path="/models/m", architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="w" * 32,
        num_layers=8, hidden_size=HIDDEN, vocab_size=VOCAB,
    ))
    meta = StoreMeta(
        format_version=FORMAT_VERSION, model=model, layers=LAYERS, layer_meaning=LAYER_MEANING, dtype="float32",
        hidden_size=HIDDEN, corecap_version="0.1.0", vllm_version="0.32.0",
    )
    return msgspec.structs.replace(meta, **changes)


def _record(key: str, seed: int | None = None):
    rng = np.random.default_rng(seed if seed is not None else int.from_bytes(key.encode()[:6], "little"))
    n = int(rng.integers(1, 40))
    states = torch.from_numpy(rng.standard_normal((len(LAYERS), n, HIDDEN)).astype(np.float32))
    mask = (rng.random(n) < 0.5).astype(np.uint8)
    return encode_sample(key, rng.integers(0, VOCAB, n), states, LAYERS, loss_mask=mask)


def _store(path, keys, meta=None, seed=None) -> str:
    with Store.create_or_open(str(path), meta or _meta()) as s:
        s.put_many([_record(k, seed) for k in keys])
    return str(path)


def _contents(path) -> dict:
    with Store.open(path) as s:
        out = {}
        for key in s.keys():
            x = s.get(key)
            out[key] = (x.input_ids.tolist(), x.loss_mask.tolist(), x.hidden_states.numpy().tobytes())
        return out


def test_merge_of_shards_equals_the_whole(tmp_path, monkeypatch):
    import corecap.store.merge

    monkeypatch.setattr(corecap.store.merge, "_BATCH_BYTES", 3000)  # several state-file writes per input
    put_all = corecap.store.merge.put_all
    monkeypatch.setattr(corecap.store.merge, "put_all",
                        lambda store, *a, **k: put_all(store, *a, commit_records=5, **k))
    keys = [f"k{i}" for i in range(40)] + ["ключ", "x" * 300]
    whole = _store(tmp_path / "whole", keys)
    shards = [_store(tmp_path / f"shard{k}", [key for key in keys if data.shard_of(key, 3) == k]) for k in range(3)]
    result = merge_stores(tmp_path / "out", shards)  # the headers in 9 transactions of at most 5
    assert (result.num_inputs, result.num_copied, result.num_duplicates, result.num_samples) == (3, 42, 0, 42)
    assert _contents(str(tmp_path / "out")) == _contents(whole)
    with Store.open(str(tmp_path / "out")) as s:
        assert s.meta == _meta()


def test_merge_into_an_existing_store_keeps_identical_duplicates_once(tmp_path):
    out = _store(tmp_path / "out", ["a", "b"])
    other = _store(tmp_path / "in1", ["b", "c"], meta=_meta(corecap_version="9.9", vllm_version="1.0",
                   model=ModelIdentity(
                       path="/elsewhere/m", architecture="LlamaForCausalLM", config_hash="c" * 32,
                       weights_fingerprint="w" * 32, num_layers=8, hidden_size=HIDDEN, vocab_size=VOCAB,
                   )))
    more = _store(tmp_path / "in2", ["c", "d"])
    before = _contents(out)
    result = merge_stores(out, [other, more])
    assert (result.num_copied, result.num_duplicates, result.num_samples) == (2, 2, 4)
    assert _contents(out) == {**before, **_contents(other), **_contents(more)}
    assert sorted(_contents(out)) == ["a", "b", "c", "d"]


def _data_mdb(path) -> bytes:
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        return f.read()


def test_merge_refuses_a_key_with_different_inputs(tmp_path):
    out = _store(tmp_path / "out", ["a"])
    one = _store(tmp_path / "one", ["b", "c"], seed=1)
    two = _store(tmp_path / "two", ["c", "d"], seed=2)
    before = _data_mdb(out)
    with pytest.raises(CorecapError) as e:
        merge_stores(out, [one, two])
    message = str(e.value)
    assert (message.startswith(f"key 'c' is in {one} (input fingerprint ")
            and f"and in {two} (input fingerprint " in message)
    assert _data_mdb(out) == before  # refused before anything was written
    with pytest.raises(CorecapError, match="key 'c' is in "):
        merge_stores(tmp_path / "new", [one, two])
    assert not os.path.exists(tmp_path / "new")


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(dtype="bfloat16"), "dtype"),
        (dict(layers=(2, 5)), "layers"),
        (dict(codec="zstd-planes"), "codec"),
        (dict(model=ModelIdentity(
            path="/models/m", architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="v" * 32,
            num_layers=8, hidden_size=HIDDEN, vocab_size=VOCAB,
        )),
         "model.weights_fingerprint"),
    ],
)
def test_merge_refuses_stores_whose_metadata_disagree(tmp_path, change, field):
    one = _store(tmp_path / "one", ["a"])
    two = _store(tmp_path / "two", ["b"], meta=_meta(**change))
    with pytest.raises(CorecapError) as e:
        merge_stores(tmp_path / "out", [one, two])
    assert str(e.value).startswith(f"{two}: metadata disagrees with {one}: {field} is ")
    assert not os.path.exists(tmp_path / "out")
    existing = _store(tmp_path / "existing", ["z"], meta=_meta(**change))
    before = _data_mdb(existing)
    with pytest.raises(CorecapError) as e:
        merge_stores(existing, [one])
    assert str(e.value).startswith(f"{one}: metadata disagrees with {existing}: {field} is ")
    assert _data_mdb(existing) == before


def test_merge_refuses_bad_arguments(tmp_path):
    one = _store(tmp_path / "one", ["a"])
    with pytest.raises(CorecapError, match="is given twice"):
        merge_stores(one, [one])
    with pytest.raises(CorecapError, match="is given twice"):
        merge_stores(tmp_path / "out", [one, os.path.join(str(tmp_path), ".", "one")])
    with pytest.raises(CorecapError, match="not a corecap store"):
        merge_stores(tmp_path / "out", [one, str(tmp_path / "missing")])
    (tmp_path / "file").write_text("precious")
    with pytest.raises(CorecapError, match="not a corecap store"):
        merge_stores(tmp_path / "file", [one])
    assert (tmp_path / "file").read_text() == "precious"


def test_merge_command(tmp_path):
    from click.testing import CliRunner

    one, two = _store(tmp_path / "one", ["a"]), _store(tmp_path / "two", ["b"])
    result = CliRunner().invoke(merge, [str(tmp_path / "out"), one, two])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"{tmp_path / 'out'}: 2 samples after merging 2 stores")
    bad = _store(tmp_path / "bad", ["c"], meta=_meta(dtype="float16"))
    result = CliRunner().invoke(merge, [str(tmp_path / "out"), bad])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"corecap: error: {bad}: metadata disagrees with {tmp_path / 'out'}: "
        f"dtype is 'float16' there, 'float32' in {tmp_path / 'out'}"]
